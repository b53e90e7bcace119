"""Per-step time accounting shared by the strategies (halo, pipeline_comm, bubble_or_wait).

Strategies add the seconds they spend waiting on communication with
``timers.add(name, seconds)`` or ``with timers.timed(name):``; the worker
reads and resets the counters once per step and puts them in the record's
``time_breakdown_s``. On GPU the times are host-side waits (after the event
or handle completes), which is what a rank loses to communication.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

_T: dict[str, float] = defaultdict(float)


def add(name: str, seconds: float) -> None:
    _T[name] += seconds


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _T[name] += time.perf_counter() - t0


def snapshot() -> dict[str, float]:
    return dict(_T)


def reset() -> None:
    _T.clear()
