"""The step's sync over every rank, and its figures on the host: read at once, or a step late.

A step ends with one small all-reduce (:func:`step_sync`): the weighted local losses summed into the global loss
(docs/design.md), and whether any rank was asked to stop, as float64 on the device. The host needs these values
only to print, keep and check them, to stop for a checkpoint and for the record. Reading them right after the
step would leave the GPU idle through all the host's work before the next step (gems's own host work, the reader's
hand-over, the next step's launches); so the figures go to the host by one asynchronous copy (:class:`Readout`:
pinned host memory on a GPU, an event after the copy), and the loop reads a step's figures during the next step,
once that one's work is queued (gems.rank.loop: a graphed run's steps; those a checkpoint, an evaluation, the
last step or a stop need read at once).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gems import capture
from gems.progress import waiting


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

        capture.launch(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM))


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
