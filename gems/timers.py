"""Per-step time accounting shared by the strategies (halos, pipeline transfers, gradient sums).

A wait is timed on the clock of the device it holds up: the host's on CPU ranks; on GPU ranks, where NCCL's
``wait()`` only orders streams, CUDA events on the current stream around it, read once a step at :func:`settle`
(docs/gpu.md, "Timing"). Named totals (:func:`add`, :func:`timed`) are read and reset by the loop every step.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any, Iterator, MutableMapping

import torch

_T: dict[str, float] = defaultdict(float)
_PENDING: list[tuple[MutableMapping[str, float], str, Any, Any]] = []  # (into, key, start event, end event)


def now(device: torch.device | None) -> Any:
    """The start of a span on ``device``'s clock: the host's time, or an event on the current CUDA stream; None
    while that stream is being captured into a CUDA graph (gems.rank.graphs: no event may be timed inside a
    capture, and a replay runs no Python to time it: its spans are the graph's, timed whole by the loop)."""
    if device is not None and device.type == "cuda":
        if _capturing():
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured (never in a build of torch without CUDA, which raises)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError):
        return False


def add_since(into: MutableMapping[str, float], key: str, start: Any) -> None:
    """Add the seconds since ``start`` (:func:`now`) to ``into[key]``: at once on the host's clock; at
    :func:`settle` for a CUDA event (an end event is recorded on the current stream now); nothing for a span
    begun inside a capture (None)."""
    if start is None:
        return
    if isinstance(start, float):
        into[key] = into.get(key, 0.0) + time.perf_counter() - start
        return
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    _PENDING.append((into, key, start, end))


def settle() -> None:
    """Read the spans measured by CUDA events into their totals (after the step's device synchronisation)."""
    for into, key, start, end in _PENDING:
        end.synchronize()
        into[key] = into.get(key, 0.0) + start.elapsed_time(end) / 1000.0
    _PENDING.clear()


def pending() -> bool:
    """Whether spans measured by CUDA events wait to be read (:func:`settle`)."""
    return bool(_PENDING)


def add(name: str, seconds: float) -> None:
    """Add ``seconds`` to this step's total ``name``."""
    _T[name] += seconds


@contextlib.contextmanager
def timed(name: str) -> Iterator[None]:
    """Add the host seconds of the block to this step's total ``name``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _T[name] += time.perf_counter() - t0


def snapshot() -> dict[str, float]:
    """This step's named totals so far."""
    return dict(_T)


def reset() -> None:
    _T.clear()
