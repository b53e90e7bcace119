"""MLPerf HPC's log of a run trained to a target (``train.target_mae``), through the ``mlperf-logging`` package: rank 0
writes ``{results.dir}/{run_id}.mlperf.log`` as the run goes, in mllog's format, in the ``open`` division with status
``research``, for MLCommons's compliance checker (docs/training.md). A resumed run appends to the same log without a
second init or run start, so the log stays one run's.
"""
from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any


class MLPerfLog:
    """The log of one run (rank 0 of a run with a target; elsewhere every call does nothing)."""

    def __init__(self, cfg: Any, rank: int) -> None:
        self.cfg, self.resumed = cfg, False
        self.log: Any = None
        self.path: Path | None = None
        if cfg.train.target_mae is None or rank != 0:
            return
        from mlperf_logging import mllog
        from mlperf_logging.mllog.mllog import MLLogger

        self.c = mllog.constants
        self.path = Path(str(cfg.results.dir)) / f"{cfg.run_id or 'gems'}.mlperf.log"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a requeued job goes on with the log its run started (it holds the one init and run start)
        self.resumed = self.path.exists() and ":::MLLOG" in self.path.read_text(errors="replace")
        logger = logging.getLogger(f"gems.mlperf.{cfg.run_id}")
        logger.propagate, logger.handlers = False, []
        logger.setLevel(logging.INFO)
        handler = logging.FileHandler(self.path, mode="a", delay=True)  # a requeued run appends
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        self.handler = handler
        self.log = MLLogger(logger=logger, default_stack_offset=2)

    def close(self) -> None:
        if self.log is not None:
            self.handler.close()
            self.log.logger.removeHandler(self.handler)
            self.log = None

    # ---- the events, in the order a run makes them --------------------------------------------------------------
    def init_start(self, device_name: str, ranks: int, benchmark: str) -> None:
        if self.log is None or self.resumed:
            return
        c, cfg = self.c, self.cfg
        nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or cfg.cluster.nodes or 1)
        per_node = max(1, ranks // nodes)
        self.log.event(key=c.SUBMISSION_BENCHMARK, value=benchmark)
        self.log.event(key=c.SUBMISSION_ORG, value="gems")
        self.log.event(key=c.SUBMISSION_DIVISION, value="open")
        self.log.event(key=c.SUBMISSION_STATUS, value="research")
        self.log.event(key=c.SUBMISSION_PLATFORM, value=f"{nodes}x{per_node}x{device_name}")
        self.log.event(key=c.CACHE_CLEAR, value=False)
        self.log.start(key=c.INIT_START)
        self.log.event(key="number_of_nodes", value=int(nodes))
        self.log.event(key="accelerators_per_node", value=int(per_node) if device_name != "cpu" else 0)

    def staging(self, start: bool, when: bool = True) -> None:
        if when and self.log is not None and not self.resumed:
            (self.log.start if start else self.log.end)(key=self.c.STAGING_START if start else self.c.STAGING_STOP)

    def init_stop(self, global_batch: int, base_lr: float, train_samples: int, eval_samples: int) -> None:
        """The hyperparameters (their epochs as ``train.epochs`` counts them) and the end of the set-up."""
        if self.log is None or self.resumed:
            return
        c, t = self.c, self.cfg.train
        in_epochs = t.epochs is not None  # else the schedule's boundaries are steps: logged as they are
        self.log.event(key=c.GLOBAL_BATCH_SIZE, value=int(global_batch))
        self.log.event(key=c.TRAIN_SAMPLES, value=int(train_samples))
        self.log.event(key=c.EVAL_SAMPLES, value=int(eval_samples))
        self.log.event(key=c.GRADIENT_ACCUMULATION_STEPS, value=1)
        self.log.event(key=c.OPT_NAME, value=str(t.optimizer))
        self.log.event(key=c.OPT_BASE_LR, value=float(base_lr))
        self.log.event(key=c.OPT_LR_WARMUP_EPOCHS, value=float(t.lr_warmup), metadata={"in_epochs": in_epochs})
        self.log.event(key=c.OPT_LR_WARMUP_FACTOR, value=0.0 if float(t.lr_warmup) > 0 else 1.0)
        self.log.event(key=c.OPT_LR_DECAY_BOUNDARY_EPOCHS, value=[float(b) for b in (t.lr_decay_boundaries or [])],
                       metadata={"in_epochs": in_epochs, "schedule": str(t.lr_schedule)})
        self.log.event(key=c.OPT_LR_DECAY_FACTOR, value=[float(f) for f in (t.lr_decay_factors or [])])
        self.log.event(key=c.OPT_WEIGHT_DECAY, value=float(t.weight_decay))
        dropout = float(self.cfg.model.dropout)
        self.log.event(key="dropout", value=dropout)
        self.log.end(key=c.INIT_STOP)

    def run_start(self) -> None:
        if self.log is not None and not self.resumed:
            self.log.start(key=self.c.RUN_START)

    def epoch(self, start: bool, epoch: int) -> None:
        """Epoch ``epoch`` (0-based) starts or stops; MLPerf numbers them from 1."""
        if self.log is not None:
            (self.log.start if start else self.log.end)(key=self.c.EPOCH_START if start else self.c.EPOCH_STOP,
                                                       metadata={"epoch_num": epoch + 1})

    def evaluation(self, epochs_done: float, value: float | None, start: bool) -> None:
        """An evaluation after ``epochs_done`` epochs; at its end, its error (the target's metric)."""
        if self.log is None:
            return
        meta = {"epoch_num": max(1, math.ceil(epochs_done - 1e-9))}
        if start:
            self.log.start(key=self.c.EVAL_START, metadata=meta)
            return
        self.log.end(key=self.c.EVAL_STOP, metadata=meta)
        if value is not None:
            self.log.event(key="eval_error", value=float(value), metadata=meta)

    def run_stop(self, reached: bool) -> None:
        if self.log is not None:
            self.log.end(key=self.c.RUN_STOP, metadata={"status": "success" if reached else "aborted"})
        self.close()

    def pause(self) -> None:
        """The job stops here to be requeued (a checkpoint was written): the log goes on in the next job."""
        self.close()
