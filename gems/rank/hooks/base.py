"""A hook's protocol: what it is told of each step, and how it stops the run."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gems.rank.sync import StepFigures


@dataclass(frozen=True)
class StepResult:
    """A step once its figures are read: what the step said (:class:`gems.rank.sync.StepFigures`: the loss, a stop
    request, where a value first went non-finite, fp16's verdict) and how it ran."""

    step: int
    figures: StepFigures
    seconds: float  # the step's time (a graphed step read late: its span on the device)
    data_s: float  # the time the step waited for its batch
    measured: bool  # whether its time counts (gems.rank.phases.StepPlan.measured)
    deferred: bool  # read a step late (its successor is queued already)
    terms: dict[str, float]  # its timed terms: halo, pipeline_comm, bubble_or_wait, allreduce

    @property
    def loss(self) -> float:
        return self.figures.loss


@dataclass(frozen=True)
class Stop:
    """Why a run ends after a step.

    - ``done``: it reached its target; the step's other hooks still run, then the loop ends;
    - ``requeue``: it saves a checkpoint before step ``before`` and ends to be resumed (the time limit, a preemption);
    - ``failed``: every rank raises ``error`` once rank 0 has written the failed record (``message``, ``failure``,
      and ``extra`` fields).
    """

    kind: str
    before: int = 0
    message: str = ""
    error: BaseException | None = None
    failure: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def done() -> "Stop":
        return Stop("done")

    @staticmethod
    def requeue(before: int, why: str) -> "Stop":
        return Stop("requeue", before=before, message=why)

    @staticmethod
    def failed(error: BaseException, message: str, failure: dict[str, Any], **extra: Any) -> "Stop":
        return Stop("failed", message=message, error=error, failure=failure, extra=extra)


class Run(Protocol):
    """What a hook may use of the running loop (gems.rank.loop.Loop)."""

    state: Any  # the rank's state (gems.rank.setup.RankState)
    recorder: Any  # the history and the record (gems.results.recorder.Recorder)
    stopping: bool  # a step read late asked to stop: the next one is read at once
    prefetch: Any  # the batches read ahead (gems.rank.data.Prefetcher)

    def settle(self) -> None:
        """The history's times brought up to now, before it is saved."""

    def keep(self, before: int) -> tuple[Path, Path | None]:
        """A checkpoint before step ``before`` and the trained model file, both complete (every rank)."""
        ...


class Hook:
    """Something a run does around its steps. ``before_step`` and ``after_step`` run on every rank in the same order
    (a hook may issue collectives there); either may return a :class:`Stop`."""

    def __init__(self, run: Run) -> None:
        self.run = run

    @property
    def state(self) -> Any:
        return self.run.state

    def before_step(self, step: int) -> Stop | None:
        return None

    def after_step(self, result: StepResult) -> Stop | None:
        return None
