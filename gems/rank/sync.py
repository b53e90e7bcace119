"""The step's sync over every rank, and its figures on the host: read at once, or a step late.

A step ends with one small all-reduce (:func:`step_sync`): the global loss and the stop requests of every rank, as
float64 on the device, copied to the host without waiting (:class:`Readout`) and read as a :class:`StepFigures`. How
the figures are packed into one tensor is this module's alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from gems import capture
from gems.progress import waiting

#: a rank's stop request for a bad file met ahead, over any count of ranks asking for a checkpoint (summed)
_BAD_DATA = 1 << 20


def stop_request(checkpoint: bool, bad_data: bool) -> int:
    """This rank's stop request in the step's sync (summed over the ranks): a checkpoint before the time limit or a
    preemption, and a bad file met in a batch ahead (:class:`StepFigures` reads the sum)."""
    return int(checkpoint) + (_BAD_DATA if bad_data else 0)


@dataclass(frozen=True)
class StepFigures:
    """A step's figures as the host reads them, the same on every rank.

    - ``loss``: the global loss (the weighted local losses summed over every rank);
    - ``stop``: some rank asked to stop after this step (a checkpoint before the time limit, a bad file);
    - ``bad_data``: some rank met a bad file in a batch ahead;
    - ``first_bad``: where a graphed step says this rank first saw a non-finite value (0 its input, 1 its output,
      None neither); False where the step holds no such flags (the stepper is asked);
    - ``overflow``: fp16's verdict where the device decided the step's skip (None where the host did).
    """

    loss: float
    stop: bool
    bad_data: bool
    first_bad: int | None | bool
    overflow: bool | None

    @staticmethod
    def read(values: Sequence[float], verdict: bool) -> "StepFigures":
        """From the vector :func:`step_sync` (or a graphed step) made, with fp16's verdict last where ``verdict``."""
        overflow = values[-1] > 0 if verdict else None
        flags = list(values[:-1] if verdict else values)
        first_bad: int | None | bool = False
        if len(flags) >= 4:
            first_bad = 0 if flags[2] < 1 else 1 if flags[3] < 1 else None
        return StepFigures(values[0], values[1] > 0, values[1] >= _BAD_DATA, first_bad, overflow)


def with_flags(pair: torch.Tensor, ok_in: torch.Tensor, ok_out: torch.Tensor) -> torch.Tensor:
    """A graphed step's figures: :func:`step_sync`'s pair, then whether this rank's input and output were finite
    (float64 flags of one element)."""
    return torch.cat([pair, ok_in, ok_out])


def with_verdict(figures: torch.Tensor, verdict: torch.Tensor | None) -> torch.Tensor:
    """The figures with fp16's overflow verdict last, where the device decided it."""
    return figures if verdict is None else torch.cat([figures, verdict])


def step_sync(local_loss: Any, stop: int, world: Any) -> torch.Tensor:
    """The global loss of the step (the weighted local losses summed over every rank, docs/design.md) and
    whether any rank was asked to stop, as one float64 pair on the rank's device: one small all-reduce, the same
    result on every rank, nothing read on the host. The stop flag is filled on the device: a host value copied
    to a GPU would synchronise it."""
    loss = local_loss.detach().reshape(()).to(device=world.device, dtype=torch.float64) \
        if isinstance(local_loss, torch.Tensor) else torch.full((), float(local_loss), dtype=torch.float64,
                                                                 device=world.device)
    t = torch.stack([loss, torch.full((), float(stop), dtype=torch.float64, device=world.device)])
    all_reduce_sum(t, world)
    return t


def all_reduce_sum(t: torch.Tensor, world: Any) -> None:
    """The step sync's collective: ``t`` summed over the world (nothing on one rank)."""
    if world.size > 1:
        import torch.distributed as dist

        capture.launch(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM), None)


@dataclass
class Posted:
    """A step's figures on their way to the host: the slot they are copied into, how many, and the event after the
    copy (None on a CPU, where the copy is done when posted)."""

    slot: torch.Tensor
    n: int
    event: Any = None


class Readout:
    """Two host slots used in turn (pinned on a GPU rank): a step's figures are copied into one without waiting, and
    read from it (:meth:`read`) before the step two later posts into it again; the loop reads every step's figures
    within one step, so a slot is free when its turn comes."""

    SIZE = 8

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.slots = [torch.zeros(self.SIZE, dtype=torch.float64, pin_memory=self.cuda) for _ in range(2)]
        self.turn = 0

    def post(self, figures: torch.Tensor) -> Posted:
        """Start the copy of ``figures`` (a float64 vector on the device) to the host."""
        from gems.fake import is_fake

        n = int(figures.numel())
        slot = self.slots[self.turn]
        self.turn ^= 1
        if is_fake(figures):  # the dry run computes shapes, not values
            slot.zero_()
            return Posted(slot, n)
        slot[:n].copy_(figures.reshape(-1), non_blocking=True)
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return Posted(slot, n, event)

    @staticmethod
    def read(posted: Posted) -> list[float]:
        """The figures, once the device has copied them (the one wait of the step on a GPU: for work already
        queued, the device busy with the next step meanwhile where the loop reads late)."""
        if posted.event is not None:
            with waiting("gpu queue"):  # a hang on the GPU shows as this wait in a stall report
                posted.event.synchronize()
        return [float(v) for v in posted.slot.numpy()[:posted.n]]


@dataclass
class Queued:
    """A step whose work is queued, its figures posted but not yet read (a graphed run reads them during the next
    step)."""

    step: int
    begun: float  # the step's start on the host (the stall allowance)
    t0: float  # after its hooks' start: its timed span starts here
    data_s: float
    posted: Posted
    verdict: bool  # its figures end with fp16's overflow verdict, decided on the device
    start: Any = None  # a GPU rank's event at t0, where its time is read late (the device's span, not the host's)
    host_s: float = 0.0  # the host's time from t0 to the step's end (a CPU rank's step is done when queued)
    terms: dict[str, float] | None = None  # its timed terms, taken when it was queued (read late)
    deferred: bool = False


def took(queued: Queued, dt: float, now: float) -> float:
    """What step ``queued`` took, for the watchdog's allowance: read at once, its wall time on the host; read late (a
    graphed step), the longer of the device's span ``dt`` and the host's time to queue it (the host's alone is its
    launches, about a millisecond, where the device may take far longer)."""
    return max(dt, queued.host_s) if queued.deferred else now - queued.begun


def event() -> Any:
    """A timing event recorded now on the current CUDA stream."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev
