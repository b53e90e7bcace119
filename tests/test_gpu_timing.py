"""Communication waits measured on the clock of the device they hold up (gems.timers).

On CPU ranks the host's clock (gloo's wait blocks the host). On GPU ranks NCCL's wait only orders streams,
so the span is a pair of CUDA events on the current stream, read after the step's synchronisation. No GPU
is at hand here: the CUDA branch runs against a stand-in event class (what it must record, and when it is
read); that real events on a real stream measure the stall is what only a GPU run can show."""
from __future__ import annotations

import time

import torch

from gems import timers


def test_host_waits_are_added_at_once() -> None:
    into: dict[str, float] = {}
    t0 = timers.now(torch.device("cpu"))
    time.sleep(0.01)
    timers.add_since(into, "halo", t0)
    assert 0.009 < into["halo"] < 1.0


class _Event:
    made: list["_Event"] = []

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing, "elapsed_time needs timing events"
        self.at: float | None = None
        self.synced = False
        _Event.made.append(self)

    def record(self, stream=None) -> None:
        self.at = float(len(_Event.made))  # the order of recording stands for the stream's time

    def synchronize(self) -> None:
        self.synced = True

    def elapsed_time(self, end: "_Event") -> float:
        assert self.at is not None and end.at is not None and end.synced
        return 1000.0 * (end.at - self.at)  # milliseconds


def test_gpu_waits_are_event_pairs_read_at_the_step_end(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    _Event.made.clear()
    into: dict[str, float] = {"halo": 0.5}
    t0 = timers.now(torch.device("cuda", 0))
    assert isinstance(t0, _Event) and t0.at is not None  # recorded on the current stream at the start
    _Event(enable_timing=True).record()  # something else queued while the wait is in flight
    timers.add_since(into, "halo", t0)
    assert into["halo"] == 0.5, "nothing is read (no synchronisation) inside the step"
    timers.settle()
    assert into["halo"] == 0.5 + 2.0 and all(e.synced for e in _Event.made[-1:])
    timers.settle()  # read once
    assert into["halo"] == 2.5
