"""``gems eval``: a trained model evaluated on a dataset, on any mesh, with the figures of a run's validation (the
ranks set up as a training run's, the figures computed by its code), and each sample's prediction beside the record.
"""
from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from gems import progress
from gems.bootstrap import World
from gems.fault.watchdog import Watchdog
from gems.rank.data import class_names
from gems.rank.hooks.faults import agreed_error
from gems.rank.loss import described
from gems.rank.setup import set_up
from gems.rank.validation import Validation
from gems.results.recorder import Recorder


def evaluate_model(cfg: DictConfig, world: World, wd: Watchdog | None = None) -> dict[str, Any]:
    """Evaluate ``cfg.eval.path`` on this rank's share; returns the record (complete on rank 0)."""
    import torch.distributed as dist

    from gems.rank.data import unstage
    from gems.results import record as rec

    t0 = time.time()
    state = set_up(cfg, world, wd)  # the model's weights from eval.path (gems.rank.setup.resume)
    metric = state.stepper.metric
    keep = bool(cfg.eval.predictions)
    metric.keep = [] if keep else None
    progress.mark("evaluate")
    t_eval = time.perf_counter()
    validation = Validation(state)
    try:
        figures, recalibrated = validation.figures()
        if figures is None:  # a bad file on some rank: every rank stops, naming it
            raise agreed_error(world, validation.met)[0]
    except BaseException:
        if state.staged is not None:  # data.stage=node: the node's copies go with a failure too
            state.staged.discard(world)
        raise
    seconds = time.perf_counter() - t_eval

    def barrier() -> None:
        if world.size > 1:
            dist.barrier()

    unstage(state.staged, world, barrier)
    rows = metric.keep or []
    metric.keep = None
    gathered: list[Any] = [rows]
    if world.size > 1:
        gathered = [None] * world.size if world.rank == 0 else []
        dist.gather_object(rows, gathered if world.rank == 0 else None, dst=0)
    peaks, hosts, _, machines, _, _ = Recorder(state.history).gather(world, state.meter, None, 0)
    if world.rank != 0:
        return {}
    record = rec.build_record(cfg, world, state.mesh, losses=[], step_times=[], global_batch=int(cfg.train.batch_size),
                              breakdown={}, peaks=peaks, hosts=hosts, wall_s=time.time() - t0, machines=machines)
    entry = {**figures, "seconds": seconds}
    if cfg.train.bn_recalibrate:
        entry["bn_recalibrate_batches"] = recalibrated
    record["kind"] = "eval"
    record["model_path"] = str(cfg.eval.path)
    record["evaluation"] = entry
    record["validation"] = [entry]
    if keep:
        path = rec.record_path(cfg).with_suffix(".predictions.csv")
        record["predictions_file"] = str(write_predictions(path, gathered, metric))
    names = class_names(state.val, metric)
    if names:
        record["classes"] = names
    print(f"gems: eval {cfg.eval.path}: {described(figures, names)}", flush=True)
    return record


def write_predictions(path: Path, parts: list[Any], metric: Any) -> Path:
    """Every counted sample's row, in sample order: a vector model's predictions and targets, a classifier's scores'
    argmax and target, a dense model's loss and error over the sample's cells (its parts' sums added up)."""
    by_id: dict[int, list[float]] = {}
    kind = "dense" if metric.spec.target == "dense" else "classes" if metric.classes else "vector"
    for rows in parts:
        for ids, a, b in rows or []:
            for k, i in enumerate(ids):
                if kind == "dense":  # the parts' sums of one sample add up
                    got = by_id.setdefault(int(i), [0.0, 0.0, 0.0])
                    for j in range(3):
                        got[j] += float(a[k, j])
                elif kind == "classes":
                    by_id[int(i)] = [int(torch.argmax(a[k])), int(b[k])]
                else:
                    by_id[int(i)] = [float(v) for v in a[k]] + [float(v) for v in b[k]]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        t = int(metric.spec.num_outputs)
        if kind == "dense":
            second = "accuracy" if metric.classes else "mae"
            w.writerow(["sample", "loss", second, "cells"])
            for i in sorted(by_id):
                loss, err, cells = by_id[i]
                w.writerow([i, loss / max(cells, 1.0), err / max(cells, 1.0), int(cells)])
        elif kind == "classes":
            w.writerow(["sample", "predicted", "target"])
            for i in sorted(by_id):
                w.writerow([i, *by_id[i]])
        else:
            w.writerow(["sample", *(f"prediction_{j}" for j in range(t)), *(f"target_{j}" for j in range(t))])
            for i in sorted(by_id):
                w.writerow([i, *by_id[i]])
    return path
