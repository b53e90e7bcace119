"""Spatial transposed convolutions (ConvTranspose1d/2d/3d): gather the inputs that feed this part's outputs, crop."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gems.spatial import halo
from gems.spatial.context import SpatialContext
from gems.spatial.geometry import Transposed, is_empty, shape_of
from gems.spatial.layers.base import SpatialLayer, ntuple, zeros_out

_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class SpatialConvTranspose(SpatialLayer):
    """ConvTranspose1d/2d/3d: any kernel, stride, padding, output_padding, dilation, groups."""

    def __init__(self, conv: nn.modules.conv._ConvTransposeNd, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        self._adopt(conv, ("weight", "bias"))
        nd = conv.weight.dim() - 2
        k, s, d = ntuple(conv.kernel_size, nd), ntuple(conv.stride, nd), ntuple(conv.dilation, nd)
        p, op = ntuple(conv.padding, nd), ntuple(conv.output_padding, nd)
        self.maps = [Transposed(k[j], s[j], d[j], p[j], op[j]) for j in range(nd)]
        self.stride, self.dilation, self.groups, self.nd = s, d, conv.groups, nd
        self.out_channels = conv.out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sctx = self.sctx
        gin = sctx.global_shape(x)
        cache = self.__dict__.setdefault("_plans", {})
        if gin not in cache:
            gout = tuple(m.out_size(n) for m, n in zip(self.maps, gin))
            outs = sctx.boxes(gout)
            needs = [tuple(m.need(a, b, n) for m, (a, b), n in zip(self.maps, b, gin)) for b in outs]
            cache[gin] = (gout, outs[sctx.index], halo.plan(sctx, gin, needs))
        gout, box, p = cache[gin]
        (win,) = halo.windows(sctx, x, p, [p.need], self.label, tag=self.tag)
        shape = (x.shape[0], self.out_channels, *shape_of(box))
        if is_empty(box):
            return sctx.mark(zeros_out(shape, win, self.weight, self.bias), gout)
        if is_empty(p.need):  # outputs that no input reaches: the bias alone
            y = zeros_out(shape, win, self.weight)
        else:
            y = _CONVT[self.nd](win, self.weight, None, self.stride, 0, 0, self.groups, self.dilation)
            pads: list[int] = []
            for m, (a, b), (lo, hi) in reversed(list(zip(self.maps, box, p.need))):
                s0, s1 = m.span(lo, hi)
                pads += [s0 - a, b - s1]  # negative: crop
            if any(pads):
                y = F.pad(y, pads)
        if self.bias is not None:
            y = y + self.bias.view(1, -1, *([1] * self.nd))
        return sctx.mark(y, gout)

    def extra_repr(self) -> str:
        return f"{self.label}, weight={tuple(self.weight.shape)}, maps={self.maps}"
