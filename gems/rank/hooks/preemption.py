"""Slurm's signal before the time limit (or a preemption notice): a checkpoint, then the job requeued."""
from __future__ import annotations

import os
import sys
import time
from typing import Any

from gems import capture, progress
from gems import checkpoint as ckpt
from gems.rank.hooks.base import Hook, StepResult, Stop


class Preemption(Hook):
    """A step whose sync says some rank was asked to stop: every rank saves before the next step and ends, to be
    resumed. A step read late (its successor already queued) leaves it to that successor, read at once."""

    def after_step(self, result: StepResult) -> Stop | None:
        if not result.figures.stop or self.state.plan.last(result.step):
            return None
        if result.deferred:  # the next step is queued already: it is read at once, and saved after
            self.run.stopping = True
            return None
        return Stop.requeue(result.step + 1, "the time limit is near: checkpointing and requeueing")


def preempt(state: Any, step: int, history: dict[str, Any], why: str) -> None:
    """Save before ``step`` (complete before it returns), then stop as a preempted job does; Slurm or the local
    launcher resumes it (the node's staged copies removed: the job may resume on other nodes)."""
    world, wd = state.world, state.wd
    progress.mark("checkpoint")
    state.saver.save(step, state.hold, history, wait=True)
    if state.staged is not None:
        state.staged.discard(world)
    if world.rank == 0:
        print(f"gems: {why} (checkpoint before step {step})", file=sys.stderr, flush=True)
    # its CUDA graphs released, as every way a rank ends does (gems.capture; gems.worker.end_rank): the watchdog
    # still watches the device's queue
    capture.release(world.device, waiting=lambda: progress.waiting("gpu queue"))
    if wd is not None:
        wd.stop()  # waiting to be ended is no stall
    if world.source == "slurm" or os.environ.get("SLURM_JOB_ID"):
        if world.rank == 0 and not ckpt.request_requeue():
            raise RuntimeError("`scontrol requeue` failed: the checkpoint is saved, but the job was not requeued")
        time.sleep(600)  # Slurm ends every task of a requeued job; this never returns in practice
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(ckpt.PREEMPTED_EXIT)
