"""Element-wise spatial layers: activations and other cell-by-cell layers run as they are, PReLU with its
weight, and SampleDropout with this part's slice of the serial mask.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gems.shapes import GSHAPE
from gems.spatial.context import SpatialContext
from gems.spatial.geometry import local_index
from gems.spatial.layers.base import SpatialLayer


class SpatialPointwise(SpatialLayer):
    """A layer that works cell by cell (activations, skip stash/concat/add): run as is.

    ``layer`` must hold no parameters (it is kept out of the module tree so the
    state dict is unchanged); PReLU is :class:`SpatialPReLU`.
    """

    def __init__(self, layer: nn.Module, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        object.__setattr__(self, "inner", layer)

    def forward(self, *args: Any) -> Any:
        g = getattr(args[0], GSHAPE, None) if args else None
        self.inner.training = self.training  # the hidden layer follows train()/eval() of this one
        y = self.inner(*args)
        if g is not None and isinstance(y, torch.Tensor) and y is not args[0]:
            self.sctx.mark(y, g)
        return y

    def extra_repr(self) -> str:
        return repr(self.inner)


class SpatialPReLU(SpatialLayer):
    def __init__(self, layer: nn.PReLU, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        self._adopt(layer, ("weight",))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = getattr(x, GSHAPE, None)
        y = F.prelu(x, self.weight)
        return self.sctx.mark(y, g) if g is not None else y


class SpatialSampleDropout(SpatialLayer):
    """SampleDropout on a part: this rank's slice of the mask the serial run draws
    (the mask is drawn whole, one sample at a time, as the serial layer does)."""

    def __init__(self, layer: nn.Module, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        object.__setattr__(self, "inner", layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.inner.p == 0.0:
            return x
        gin = self.sctx.global_shape(x)
        mode = self.inner.training
        self.inner.train(True)
        try:
            # the whole sample's masks, drawn on the device as the serial run draws them (SampleDropout), then
            # this part's slice: the same values on every cut
            scale = self.inner(torch.ones((x.shape[0], x.shape[1], *gin), dtype=x.dtype, device=x.device))
        finally:
            self.inner.train(mode)
        part = scale[local_index(self.sctx.box(gin), tuple((0, n) for n in gin))]
        return self.sctx.mark(x * part, gin)
