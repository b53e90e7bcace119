"""Deliberate failures, so that tests (and users) can see gems survive or report them: a rank killed (at a step, or
inside its checkpoint), stalled, or fed NaN; slow saves and slow steps (docs/faults.md). ``fault.preempt_at_step`` is
the loop's own. Steps count from 0, as the record's ``loss`` list does.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch
from torch import nn

from gems.config import FaultConf
from gems.progress import PROGRESS


def _say(text: str) -> None:
    print(f"gems: fault injection: {text}", file=sys.stderr, flush=True)


def arm(f: FaultConf, rank: int, modules: list[nn.Module]) -> None:
    """Install what must sit inside the model: the stall of ``fault.stall_rank``."""
    if f.stall_rank != rank or not modules:
        return
    at = f.at_step

    def stall(module: nn.Module, args: Any) -> None:
        if PROGRESS.step == at:
            _say(f"rank {rank} stalls in the forward of step {at} (it sleeps)")
            while True:
                time.sleep(3600)

    modules[0].register_forward_pre_hook(stall)


def before_step(f: FaultConf, rank: int, step: int, restarts: int = 0) -> None:
    """``fault.kill_rank`` at ``fault.at_step``, and ``fault.step_delay_s`` (before the first restart only, with
    ``fault.step_delay_once``)."""
    if f.kill_rank == rank and f.at_step == step and not f.kill_in_save:
        _say(f"killing rank {rank} at step {step}")
        os.kill(os.getpid(), signal.SIGKILL)
    if f.step_delay_s > 0 and not (f.step_delay_once and restarts > 0):
        time.sleep(f.step_delay_s)


def in_save(f: FaultConf, rank: int, step: int, restarts: int = 0) -> None:
    """``fault.kill_in_save``: ``fault.kill_rank`` dies in the checkpoint of ``fault.at_step`` (saved before that
    step), once its own files are written, in the job's first attempt (gems.checkpoint calls it)."""
    if f.kill_in_save and f.kill_rank == rank and f.at_step == step and restarts == 0:
        _say(f"killing rank {rank} in the checkpoint of step {step}")
        os.kill(os.getpid(), signal.SIGKILL)


def poison(f: FaultConf, rank: int, step: int, x: torch.Tensor | None) -> torch.Tensor | None:
    """``fault.nan_rank``: this rank's input of ``fault.at_step`` becomes NaN."""
    if x is None or f.nan_rank != rank or f.at_step != step:
        return x
    _say(f"rank {rank} reads NaN as its input of step {step}")
    return torch.full_like(x, float("nan")) if x.is_floating_point() else x
