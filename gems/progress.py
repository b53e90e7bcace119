"""Where each rank is: the step and the phase of its work, kept for the watchdog (gems.fault.watchdog).

The loop marks a step's phases, the strategies their waits for peers (:func:`waiting`). Every mark is progress; the
phase a stalled rank is stuck in says whether it is the cause or waits for a peer that is. A mark is a few attribute
writes, cheap enough for every layer's halo wait.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

#: every phase a rank can be in, in the order a step goes through them
PHASES = ("setup", "staging", "staged copies", "data", "forward", "backward", "halo", "spatial collective",
          "pipeline transfer", "gradient sum", "optimizer", "step sync", "checkpoint", "record")
#: phases in which a rank waits for its peers: a rank stuck here is waiting for the cause, not the cause
WAITS = frozenset({"halo", "spatial collective", "pipeline transfer", "gradient sum", "step sync",
                   # data.stage=node: a rank that copied its share waits for the others' (gems.rank.data.stage)
                   "staged copies",
                   # a GPU rank's host waits for its GPU's queue, which holds NCCL's communication with peers
                   "gpu queue"})
#: phases that get the long (warm-up) allowance at any step: building, saving, gathering the record
SLOW = frozenset({"setup", "staging", "checkpoint", "record", "evaluate"})


class Progress:
    """The step and phase of this rank, and when either last changed (``time.monotonic()``). The watchdog's thread
    reads the fields without a lock: each is one atomic attribute read in CPython, and a read that mixes two marks
    is still a mark."""

    __slots__ = ("step", "phase", "marks", "since")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.step = -1  # -1: before the first step
        self.phase = "setup"
        self.marks = 0
        self.since = time.monotonic()

    def mark(self, phase: str, step: int | None = None) -> None:
        """This rank entered ``phase`` (of ``step``, when given): progress."""
        if step is not None:
            self.step = step
        self.phase = phase
        self.marks += 1
        self.since = time.monotonic()

    def age(self) -> float:
        """Seconds since the last mark."""
        return time.monotonic() - self.since


#: this process's progress (one rank per process)
PROGRESS = Progress()


def mark(phase: str, step: int | None = None) -> None:
    PROGRESS.mark(phase, step)


@contextlib.contextmanager
def waiting(phase: str) -> Iterator[None]:
    """Mark a wait for peers (``phase`` in :data:`WAITS`), then return to the phase around it."""
    before = PROGRESS.phase
    PROGRESS.mark(phase)
    try:
        yield
    finally:
        PROGRESS.mark(before)
