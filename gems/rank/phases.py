"""The plan of a run's steps, made once: each step's phase, and what follows it (a read, an evaluation, a checkpoint).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from gems.errors import ConfigError


class Phase(enum.Enum):
    """What a step is for. Only measured steps are timed; the others make the timed ones honest."""

    WARMUP = "warm-up"
    PROFILED = "profiled for tensor memory"  # a CPU rank's steps whose tensors are counted (gems.memory)
    GRAPH_WARMUP = "the graph's warm-up"  # a graph's eager step, its capture, a counted replay; a pipeline's connect
    MEASURED = "measured"


@dataclass(frozen=True)
class StepPlan:
    """The steps ``start``..``steps - 1`` of this process, in phases:

    - ``[0, warm)`` warm-up;
    - ``[warm, profiled_to)`` profiled for tensor memory (CPU ranks profile their warm-up steps too);
    - ``[profiled_to, measure_from)`` a graph's eager step, capture and counted replay, or a pipeline's first
      exchanges;
    - ``[measure_from, steps)`` measured, but the one step run under ``train.profile``'s profiler (``traced_at``).

    ``counted_at``: the step whose device ops are counted (gems.rank.graphs.DeviceOps), never timed.
    """

    start: int
    steps: int
    warm: int
    profiled_to: int
    measure_from: int
    counted_at: int | None
    traced_at: int | None
    cpu: bool
    graphed: bool
    first_step_connects: bool
    steps_per_epoch: int
    eval_every: int
    checkpoint_every: int
    validates: bool

    def phase(self, step: int) -> Phase:
        if step < self.warm:
            return Phase.WARMUP
        if step < self.profiled_to:
            return Phase.PROFILED
        if step < self.measure_from:
            return Phase.GRAPH_WARMUP
        return Phase.MEASURED

    def measured(self, step: int) -> bool:
        """Whether step ``step``'s time counts (a measured step that no profiler slowed)."""
        return step >= self.measure_from and step != self.traced_at

    def profiles_memory(self, step: int) -> bool:
        """Whether step ``step`` runs under the tensor-memory profiler (gems.memory.step_peak_bytes)."""
        return self.cpu and step < self.profiled_to

    def last_profiled(self, step: int) -> bool:
        return self.cpu and step == self.profiled_to - 1

    def last_warm(self, step: int) -> bool:
        """The last warm-up step, or this process's first: the pipeline's rounds are placed after it."""
        return step == max(self.start, self.warm - 1)

    def ends_epoch(self, step: int) -> bool:
        return (step + 1) % self.steps_per_epoch == 0

    def last(self, step: int) -> bool:
        return step + 1 >= self.steps

    def evaluates(self, step: int) -> bool:
        """An evaluation after step ``step``: every ``train.eval_every`` steps (with epochs: once an epoch by
        default) and after the last."""
        if not self.validates:
            return False
        done = step + 1
        return done == self.steps or (self.eval_every > 0 and done % self.eval_every == 0)

    def checkpoints(self, step: int) -> bool:
        """A checkpoint after step ``step`` (the last step too, where ``train.checkpoint_every`` divides it)."""
        return self.checkpoint_every > 0 and (step + 1) % self.checkpoint_every == 0

    def reads_now(self, step: int) -> bool:
        """Whether step ``step``'s figures are read before the next step starts: what follows it needs them (an
        evaluation, a checkpoint, the end of the run or of an epoch, the last warm-up step whose times place the
        pipeline's rounds, the steps before the measured ones)."""
        return (self.last(step) or self.evaluates(step) or step < self.measure_from or self.checkpoints(step)
                or self.ends_epoch(step) or self.last_warm(step))

    def watchdog_warm_until(self) -> int:
        """Steps below this get the watchdog's warm-up allowance: warm-up, profiled, the first after a restart."""
        return max(self.measure_from, self.start + 1)

    def notes(self, measured: int) -> list[str]:
        """What the record says about how its figures were measured."""
        out = []
        warm, start = self.warm, self.profiled_to
        if self.graphed and self.measure_from > max(warm, start):
            out.append(f"step(s) {max(warm, start, self.start)}-{self.measure_from - 1} ran the graph's eager step(s), "
                       "its capture and a replay whose device ops were counted (gems.rank.graphs) and were left out "
                       "of the timings")
        if self.first_step_connects and warm == 0 and start >= 1:
            out.append("step 0 made the pipeline's first exchanges at the sizes of its messages (the cut shapes "
                       "are learnt from headers where partitions cannot be traced) and was left out of the timings")
        if start > warm:
            after = " (after the first optimizer step, so the optimizer's state counts)" if start >= 2 else ""
            out.append(f"step(s) {warm}-{start - 1} were profiled for tensor memory{after} and left out of the "
                       "timings; train.warmup_steps>=2 makes them warm-up steps")
        if self.cpu and 0 < start < 2:
            out.append("the tensor memory was measured on step 0 only, before the optimizer's state exists: it "
                       "leaves that state out; train.steps>=3 profiles a step after the first update too")
        if measured < 3:
            out.append(f"the throughput rests on {measured} measured step(s) (train.steps - train.warmup_steps"
                       f"{' - the profiled ones' if self.measure_from > warm else ''}): one step's time is one sample of a "
                       "noisy machine; 3 or more give a median worth comparing")
        return out


def plan_steps(train: Any, steps: int, start: int, steps_per_epoch: int, *, cpu: bool, graphed: bool,
               first_step_connects: bool, validates: bool) -> StepPlan:
    """The plan of a run of ``steps`` steps resumed at ``start`` (``train``: the train section). Steps before the
    measured ones: the warm-up; on CPU ranks the steps profiled for tensor memory, which include one after the first
    optimizer step (its state exists from then on); a pipeline's first step where it connects; a graphed run's eager
    step, capture and a replay whose device ops are counted. GPU ranks read torch.cuda's peak over the whole run."""
    warm = int(train.warmup_steps)
    if warm >= steps:
        raise ConfigError("train.warmup_steps", warm, f"fewer than the run's {steps} steps")
    measure_from = max(warm, min(2, steps - 1)) if cpu else warm
    if first_step_connects:  # the pipeline's first exchanges: no timed step makes one
        measure_from = max(measure_from, min(1, steps - 1))
    profiled_to = measure_from
    graphed_from = None
    if graphed:  # the graphs' eager step, their capture and a replay whose device ops are counted: untimed
        graphed_from = min(start + 2, steps - 1)
        measure_from = max(measure_from, min(graphed_from + 1, steps - 1))
    # the step whose device ops are counted: the last before the timed ones (a dispatch mode slows it), a replay in a
    # graphed run; none where there is no such step
    counted_at: int | None = measure_from - 1 if measure_from > start else None
    if graphed_from is not None and counted_at is not None and counted_at < graphed_from:
        counted_at = None
    traced_at = measure_from if bool(train.profile) and steps - measure_from > 1 else None
    every = train.eval_every if train.eval_every is not None else (steps_per_epoch if train.epochs else 0)
    return StepPlan(start, steps, warm, profiled_to, measure_from, counted_at, traced_at, cpu, graphed,
                    first_step_connects, steps_per_epoch, int(every), int(train.checkpoint_every or 0), validates)
