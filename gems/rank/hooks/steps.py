"""What every step is followed by: its line and time, the pipeline's rounds placed after the warm-up, MLPerf's
epochs, and the host memory policy decided after the first step."""
from __future__ import annotations

import sys
from typing import Any

import torch

from gems.bootstrap import KEEP_GROWTH, keep_host_memory, keeps_host_memory_within, node_memory_bytes, ranks_on_this_node
from gems.memory import peak_rss_bytes
from gems.rank.hooks.base import Hook, StepResult, Stop


class StepLine(Hook):
    """The step's line on rank 0 and its time and terms in the history (gems.results.recorder)."""

    def after_step(self, result: StepResult) -> Stop | None:
        s, step = self.state, result.step
        if s.world.rank == 0:
            phase = s.plan.phase(step)
            what = "" if phase.name == "MEASURED" else f" ({phase.value})"
            print(f"gems: step {step + 1}/{s.plan.steps} {result.seconds:.3f} s loss {result.loss:.6g}{what}", flush=True)
        self.run.recorder.account(result.seconds, result.data_s, result.measured, result.terms, s.stepper.transfers)
        return None


class PipelineRounds(Hook):
    """After the last warm-up step (or this process's first), every rank places the pipeline's rounds by what its
    actions took so far (``parallel.rounds_by=time``; a collective)."""

    def after_step(self, result: StepResult) -> Stop | None:
        if self.state.plan.last_warm(result.step):
            self.state.stepper.place_rounds()
        return None


class MLPerfEpochs(Hook):
    """MLPerf HPC's log of a run with a target: each epoch's start and stop."""

    def before_step(self, step: int) -> Stop | None:
        s = self.state
        spe = s.plan.steps_per_epoch
        if step % spe == 0:
            s.mlperf.epoch(start=True, epoch=step // spe)
        return None

    def after_step(self, result: StepResult) -> Stop | None:
        s = self.state
        if s.plan.ends_epoch(result.step):
            s.mlperf.epoch(start=False, epoch=result.step // s.plan.steps_per_epoch)
        return None


class HostMemory(Hook):
    """``train.host_memory`` on this rank. ``keep`` keeps freed host memory in the process from the start (faster CPU
    steps, more resident memory: :func:`gems.bootstrap.keep_host_memory`); ``release`` never; ``auto`` on CPU ranks
    runs the first step with glibc's defaults, measures its peak, and keeps freed memory from then on only if every
    rank of the node still fits in its memory at what keeping costs: a run that fits without kept memory is never
    killed for it."""

    def __init__(self, policy: str, device: torch.device, rank: int) -> None:
        self.rank = rank  # (made at the rank's start, before its run: ``keep`` applies from there)
        self.policy = policy if device.type == "cpu" or policy == "keep" else "release"
        self.budget = node_memory_bytes()
        self.ranks = ranks_on_this_node()
        self.decided = self.policy != "auto"
        self.summary: dict[str, Any] = {"policy": self.policy, "kept": self.policy == "keep"}
        if self.policy == "keep":
            keep_host_memory()

    def after_step(self, result: StepResult) -> Stop | None:
        if self.decided:
            return None
        self.decided = True
        peak = peak_rss_bytes()  # since the meter's reset before the rank's set-up: the model, the data, a step
        kept = keeps_host_memory_within(peak, self.budget, self.ranks)
        if kept:
            keep_host_memory()
        self.summary.update(kept=kept, first_step_peak_rss=peak, node_budget=self.budget, ranks_on_node=self.ranks)
        if not kept and self.rank == 0:
            print(f"gems: train.host_memory=auto: freed host memory is released (glibc's defaults): {self.ranks} "
                  f"rank(s) x {peak / 2**30:.2f} GiB x {KEEP_GROWTH} would not fit in "
                  f"{(self.budget or 0) / 2**30:.1f} GiB", file=sys.stderr, flush=True)
        return None
