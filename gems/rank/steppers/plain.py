"""The plain step: one forward and backward of the rank's whole (spatial) model, eager."""
from __future__ import annotations

from typing import Any, Callable

import torch

from gems import progress
from gems.fault import all_finite
from gems.layers import batch_context, evaluation_mode
from gems.rank.steppers.base import Parts, Stepper
from gems.replication import GradientReducer


class PlainStepper(Stepper):
    """No pipeline: the forward (``forward``: the rank's layers, or their recomputed pieces), the loss and the
    backward, the gradient sums starting at the reducer's points inside it."""

    def __init__(self, parts: Parts, reducer: GradientReducer, samples_per_step: int,
                 forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__(parts, list(parts.seq.parameters()), [parts.seq], reducer, True, True, samples_per_step)
        self.forward = forward if forward is not None else parts.seq
        self.finite: dict[int, torch.Tensor | bool] = {}  # position -> all finite? (a device flag: not read)

    def forward_backward(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int],
                         step: int) -> torch.Tensor:
        assert x is not None and y is not None
        p, finite = self.parts, self.finite
        p.mark(x)
        self.reducer.start_step()
        finite[0] = all_finite(x)
        progress.mark("forward")
        with batch_context(p.seed, step, ids):
            with p.amp():
                out = self.forward(x)
            finite[1] = all_finite(out)
            loss = p.loss_fn(out, y)
            progress.mark("backward")
            p.scaler.scale(loss).backward()
        self.reducer.finish()
        return loss.detach()  # read once, at the end of the step (gems.rank.sync)

    def first_nonfinite(self) -> int | None:
        return next((pos for pos, ok in sorted(self.finite.items()) if not bool(ok)), None)

    def evaluate(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int],
                 batch_statistics: bool = False) -> Any:
        assert x is not None and y is not None
        p = self.parts
        p.mark(x)
        with evaluation_mode([p.seq], batch_statistics), torch.no_grad(), p.amp():
            out = p.seq(x)
        return p.metric(out, y, ids)
