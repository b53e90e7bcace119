"""A run's faults met between steps: a non-finite loss, a CPU rank past its memory cap, a bad file, and the faults
``fault.*`` injects."""
from __future__ import annotations

import math
import sys
from typing import Any

import torch

from gems.errors import ConfigError, RunError
from gems.fault import inject
from gems.memory import over_cap, rank_cap_bytes
from gems.rank.data import replica_indices
from gems.rank.hooks.base import Hook, Run, StepResult, Stop
from gems.storage import StorageFailed


class Stopped(RunError):
    """Every rank stopped at one step for one reason, and rank 0 wrote the failed record saying why: the rank ends
    with that one line and exit status 1, no traceback (the record holds it all)."""


class NonFiniteLoss(Stopped):
    """The global loss of a step was NaN or Inf and ``train.on_nonfinite=stop``: every rank stops at that step."""


class StorageStopped(Stopped):
    """A write every rank agreed had failed for the storage's reason (a full disk or quota, an I/O error, a folder
    removed): the run stopped with its last whole checkpoint kept."""


class OverMemoryCap(Stopped):
    """A CPU rank's tensors took more than ``cluster.rank_memory_gb`` in the profiled steps: every rank stops there,
    as a GPU of that memory would have run out."""


class NonFinite(Hook):
    """A step whose global loss is NaN or Inf: kept in the history; ``train.on_nonfinite=stop`` stops every rank
    there, naming where the first non-finite value appeared; ``warn`` says so and goes on."""

    def after_step(self, result: StepResult) -> Stop | None:
        s, step, loss = self.state, result.step, result.loss
        if math.isfinite(loss):
            return None
        self.run.recorder.history["nonfinite_steps"].append(step)
        if str(s.cfg.train.on_nonfinite) != "stop":
            if s.world.rank == 0:
                print(f"gems: warning: the loss of step {step} is {loss} (train.on_nonfinite=warn: training goes on; "
                      f"the record says so)", file=sys.stderr, flush=True)
            return None
        first = result.figures.first_bad
        pos = s.stepper.first_nonfinite() if first is False else first
        where, failure = locate_nonfinite(pos, s.world, s.mesh, step, s.B, s.R)
        msg = (f"the loss of step {step} is {loss} (train.on_nonfinite=stop); the first non-finite value was in "
               f"{where}")
        failure.update(kind="nonfinite", step=step, loss=str(loss))
        return Stop.failed(NonFiniteLoss(msg), msg, failure, nonfinite_steps=[step])


def locate_nonfinite(pos: int | None, world: Any, mesh: Any, step: int, B: int, R: int) -> tuple[str, dict[str, Any]]:
    """Where the first non-finite value of this step appeared: the earliest position (input, then the output of each
    pipeline partition, then the loss; ``pos``: this rank's first) and, there, the lowest rank. A collective."""
    D = max(1, mesh.pipeline)
    key = float("inf") if pos is None else float(pos * world.size + world.rank)
    if world.size > 1:
        import torch.distributed as dist

        t = torch.tensor([key], dtype=torch.float64, device=world.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        key = float(t.item())
    if not math.isfinite(key):
        return "the loss itself (every input and partition output was finite)", {"where": "loss"}
    pos, rank = divmod(int(key), world.size)
    c = mesh.coord(rank)
    if pos == 0:
        ids = replica_indices(step, B, R, c.replica)
        part = f", spatial part {c.spatial}" if mesh.spatial > 1 else ""
        return (f"the input of rank {rank} (samples {ids[0]}-{ids[-1]}{part})",
                {"where": "input", "rank": rank, "samples": [ids[0], ids[-1]]})
    if pos <= D:
        s = pos - 1
        what = f"the output of pipeline partition {s}" if D > 1 else "the model's output"
        return f"{what} on rank {rank}", {"where": "output", "rank": rank, "partition": s}
    return f"the loss computed on rank {rank}", {"where": "loss", "rank": rank}


class MemoryCap(Hook):
    """CPU ranks under ``cluster.rank_memory_gb``, after the steps profiled for their tensors: every rank's tensor
    peak gathered (one collective of every rank), and where one went past the cap every rank stops, as a device of
    that memory would have run out. A GPU rank's allocator holds to the cap itself (gems.memory.limit_gpu)."""

    def after_step(self, result: StepResult) -> Stop | None:
        import torch.distributed as dist

        s, step = self.state, result.step
        if not s.plan.last_profiled(step):
            return None
        cap = rank_cap_bytes(s.cfg)
        if cap is None:
            return None
        peaks = torch.zeros(s.world.size, dtype=torch.float64, device=s.world.device)
        peaks[s.world.rank] = float(max(self.run.recorder.history["tensor_peaks"], default=0))
        if s.world.size > 1:
            dist.all_reduce(peaks)
        over = over_cap(cap, [int(v) for v in peaks.tolist()])
        if over is None:
            return None
        rank, peak = over
        msg = (f"rank {rank}'s tensors took {peak / 2.0 ** 30:.3f} GiB in the steps profiled for them (to step {step}), "
               f"past cluster.rank_memory_gb={float(s.cfg.cluster.rank_memory_gb):g}: a device of that memory "
               "would have run out (gems plan parallel=auto finds a mesh that fits it)")
        return Stop.failed(OverMemoryCap(msg), msg, {"kind": "memory", "rank": rank, "step": step,
                                                     "tensor_peak_bytes": peak, "cap_bytes": cap})


class BadData(Hook):
    """A bad file met after training started: nothing trained is lost. A rank's reader that meets one ahead of the
    step says so in a step's sync (:meth:`ahead`); every rank then stops after the same step with a checkpoint and
    the trained model (:meth:`stop`), and the same command goes on once the file is mended."""

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.met: BaseException | None = None  # what this rank's reader met
        self.said = False  # a step's figures said that some rank met one

    def ahead(self, step: int) -> bool:
        """Whether this rank's reader met a bad file in a batch the run will need after step ``step``, asked before
        the step's sync: the batch after it, or the one after that where the step's figures are read a step late
        (a graphed step: the next is queued before they are read). A one-rank run stops where the read fails; with
        ``data.prefetch`` under what is needed, no reader runs that far ahead and a bad file ends the run where a
        rank reads it, as a failed rank does."""
        s = self.state
        if s.world.size == 1:
            return False
        if self.met is None:
            self.met = self.run.prefetch.failed_ahead(step, 2 if s.stepper.graph is not None else 1)
        return self.met is not None and isinstance(self.met, ConfigError)

    def after_step(self, result: StepResult) -> Stop | None:
        self.said = self.said or result.figures.bad_data
        if self.said and result.figures.stop and not self.state.plan.last(result.step) and not result.deferred:
            return self.stop(result.step + 1)
        return None

    def stop(self, step: int, during: str = "training") -> Stop:
        """Every rank is here, before step ``step``, and some rank met a bad file: the run keeps what it trained (a
        checkpoint before ``step``, the trained model file) and stops with the file's ConfigError (exit 2) once
        rank 0 has written the failed record naming the step and the file; ``during``: training or validation."""
        error, found = self.agreed()
        key = error.key if isinstance(error, ConfigError) else None
        folder, model_file = self.run.keep(step)
        message = (f"{error} (met by rank {found} during {during} after step {step}: the run stopped there and kept "
                   f"its checkpoint, {folder}, and its trained model, {model_file}; mend the file and run the same "
                   "command again to resume from the checkpoint)")
        raised: BaseException = error
        if isinstance(error, ConfigError):
            raised = ConfigError(error.key, error.value, f"{error.expected} (the run stopped after step {step}, its "
                                 "checkpoint and trained model kept: mend the file and run the same command again)")
        return Stop.failed(raised, message, {"kind": "bad_data", "exception": type(error).__name__, "rank": found,
                                             "step": step, "during": during, "key": key, "checkpoint": str(folder)},
                           model_file=str(model_file) if model_file is not None else None,
                           validation=self.run.recorder.history["validation"])

    def agreed(self) -> tuple[Exception, int]:
        return agreed_error(self.state.world, self.met)


def agreed_error(world: Any, mine: BaseException | None) -> tuple[Exception, int]:
    """(the bad file's error, the rank that met it), the same on every rank: the first rank's that met one (``mine``
    on this rank), gathered from every rank (one collective; every rank is here)."""
    import torch.distributed as dist

    said = None if mine is None else ((mine.key, mine.value, mine.expected) if isinstance(mine, ConfigError)
                                      else (None, None, str(mine)))
    gathered: list[Any] = [said]
    if world.size > 1:
        gathered = [None] * world.size
        dist.all_gather_object(gathered, said)
    found = next((r for r, g in enumerate(gathered) if g is not None), 0)
    key, value, expected = gathered[found] or ("data.path", None, "readable files")
    return (ConfigError(key, value, expected) if key is not None else RunError(expected)), found


class FaultInjection(Hook):
    """``fault.*``: the faults injected before a step (a rank that fails, stalls or exits; a job preempted once)."""

    def before_step(self, step: int) -> Stop | None:
        s = self.state
        inject.before_step(s.fault, s.world.rank, step, s.restarts)
        if s.fault.preempt_at_step == step and s.restarts == 0:
            return Stop.requeue(step, "fault injection: preempting the job")
        return None



def storage_stop(run: Run, failed: StorageFailed, before: int) -> Stop:
    """The storage failed under a write every rank took part in, before step ``before`` (gems.storage): the partial
    checkpoint is gone already (gems.checkpoint), the last whole one is kept, the trained model is written where
    there is room, and the line says what was being written and where, why it failed, what is kept and how the
    same command goes on."""
    from gems import checkpoint as ckpt
    from gems.rank.report import export_model

    s = run.state
    root = ckpt.ckpt_dir(s.cfg)
    step = ckpt.latest_step(root)
    kept = root / f"step{step:08d}" if step is not None else None
    model_file = None
    if failed.what != "the trained model file":
        try:
            model_file = export_model(s, len(run.recorder.history["losses"]))
        except StorageFailed:
            model_file = None
    if kept is not None:
        then = (f"its last whole checkpoint, {kept} (before step {step}), is kept: once there is room, the same "
                "command goes on from it (train.resume_stopped)")
    else:
        then = "no whole checkpoint was kept: the same command starts over"
    if model_file is not None:
        then += f"; the trained model: {model_file}"
    message = f"{failed.line()}; {then}"
    failure = {**failed.as_dict(), "step": before, "checkpoint": str(kept) if kept is not None else None}
    return Stop.failed(StorageStopped(message), message, failure,
                       model_file=str(model_file) if model_file is not None else None)
