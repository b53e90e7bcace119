"""The stepper protocol: a rank's forward, backward, gradient sums and the step's sync, its evaluation, its timed
terms and its quiet end; and the parts of the composed model every stepper runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from gems import progress
from gems.precision import LossScaler
from gems.rank.sync import step_sync
from gems.replication import GradientReducer


@dataclass
class Parts:
    """What the composition (gems.rank.compose) made of one rank's model, which its stepper runs."""

    world: Any
    seq: nn.Sequential  # the rank's layers (spatial where the sample is cut); a pipeline's runner holds its own
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # the weighted local loss (docs/design.md)
    scaler: LossScaler  # fp16's loss scaling (gems.precision)
    metric: Any  # the validation metric's sums (gems.rank.loss.Metric)
    amp: Callable[[], Any]  # the step's autocast context
    seed: int
    ctx: Any = None  # the spatial context (S > 1), else None
    input_shape: tuple[int, ...] = ()  # a sample's spatial extent
    input_slices: tuple[slice, ...] | None = None  # this rank's spatial part of a sample
    notes: list[str] = field(default_factory=list)  # what the composition decided on its own (the record says)

    def mark(self, x: torch.Tensor | None) -> None:
        """The input's global shape, for the spatial layers (S > 1)."""
        if self.ctx is not None and x is not None:
            self.ctx.mark(x, self.input_shape)

    def halo_stats(self) -> dict[str, float]:
        """The halo exchanges' time since the last call."""
        if self.ctx is None:
            return {}
        out = {"halo": float(sum(self.ctx.halo_seconds.values()))}
        self.ctx.halo_seconds.clear()
        return out

    def quiesce(self) -> None:
        if self.ctx is not None:
            self.ctx.drain_sends()


class Stepper:
    """What one rank trains (its parameters and modules, under the whole model's names) and how a step of it runs.

    :meth:`step` is the training step up to the optimizer: the forward, the loss, the backward with the gradient sums
    over every copy, and the step's sync (gems.rank.sync), its figures left on the device. The loop runs the
    optimizer after it (unless :attr:`optimizer_in_step`)."""

    #: the step replayed from a CUDA graph (gems.rank.graphs.StepGraph), or a pipeline's pieces (gems.rank.pieces)
    graph: Any = None
    pieces: Any = None
    #: whether the step averages the floating buffers (BatchNorm's statistics) over the copies itself, and which
    averages_buffers: bool = False
    buffers: list[torch.Tensor]
    #: whether the step runs the optimizer's update itself (train.graph_optimizer)
    optimizer_in_step: bool = False
    #: when the pipeline sent and waited for each message (gems.pipeline.runtime.Transfers); None without one
    transfers: Any = None
    #: the first step makes the pipeline's first exchanges (cut shapes learnt from headers): never timed
    first_step_connects: bool = False
    balance: list[int] | None = None  # layers per pipeline partition (None without a pipeline)

    def __init__(self, parts: Parts, params: list[nn.Parameter], modules: list[nn.Module], reducer: GradientReducer,
                 needs_input: bool, needs_target: bool, samples_per_step: int) -> None:
        self.parts = parts
        self.world = parts.world
        self.params, self.modules, self.reducer = params, modules, reducer
        self.input_slices = parts.input_slices
        self.needs_input, self.needs_target = needs_input, needs_target
        self.samples_per_step = samples_per_step  # samples this rank's replica line trains per step
        self.scaler, self.metric, self.notes = parts.scaler, parts.metric, parts.notes
        self.buffers = []
        #: what this rank holds under the whole model's names, the keys of the serial model's ``state_dict``:
        #: {name: (module, attribute)} (gems.checkpoint saves and loads them)
        self.names: dict[str, tuple[nn.Module, str]] = {}

    # ---- the protocol ------------------------------------------------------------------------------------------
    def forward_backward(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int],
                         step: int) -> torch.Tensor:
        """The forward, the loss and the backward, the gradient sums started inside it: this rank's weighted loss
        on its device (not read)."""
        raise NotImplementedError

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int], step: int,
             stop: Callable[[], int], quiesce: bool = False) -> torch.Tensor:
        """The step up to the optimizer, its figures on the device (gems.rank.sync): ``stop()`` is this rank's stop
        request, asked after the backward (the reader had the step to make the next batch); ``quiesce``: the step
        ends with none of this rank's messages in flight (a step under a profiler)."""
        local = self.forward_backward(x, y, ids, step)
        if quiesce:
            self.quiesce()
        request = stop()
        with progress.waiting("step sync"):
            return step_sync(local, request, self.world)

    def evaluate(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int],
                 batch_statistics: bool = False) -> torch.Tensor | None:
        """A forward of one batch without gradients, in evaluation mode: this rank's metric sums over the outputs
        it computed, or None where it computes none; ``batch_statistics``: the normalisation layers stay in training
        mode (BatchNorm's recalibration)."""
        raise NotImplementedError

    def stats(self) -> dict[str, float]:
        """The step's timed terms the stepper kept (halo, bubble_or_wait), read and reset."""
        return self.parts.halo_stats()

    def quiesce(self) -> None:
        """Wait for this rank's messages still in flight."""
        self.parts.quiesce()

    def first_nonfinite(self) -> int | None:
        """Where this rank first saw a non-finite value in the last step: 0 its input, 1 + s the output of partition
        s; None where all was finite (asked only after a non-finite loss: it may synchronise a GPU)."""
        return None

    def place_rounds(self) -> None:
        """A pipeline's rounds placed by its actions' measured times (collective; once, after the same step)."""

    def adopt(self, optimizer: Any) -> None:
        """The optimizer, once made (a step that runs the update itself needs it)."""

    def replay_note(self) -> str | None:
        """What the record says the replay covered, where a step was replayed from a graph."""
        return None
