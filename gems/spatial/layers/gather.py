"""The gather where the spatial trunk ends: every part gets the full activation."""
from __future__ import annotations

import torch

from gems.spatial.context import SpatialContext
from gems.spatial.layers.base import WHOLE, SpatialLayer


class SpatialGather(SpatialLayer):
    """Where the spatial trunk ends: every part gets the full activation. After a global pooling
    (``whole=True``) the activation is already whole on every part and passes as it is, also when a
    pipeline cut between the two delivered it without its tag."""

    def __init__(self, sctx: SpatialContext, label: str, whole: bool = False) -> None:
        super().__init__(sctx, label)
        self.whole = whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.whole or getattr(x, WHOLE, False):
            return x
        return self.sctx.gather(x)
