"""Spatial convolutions (Conv1d/2d/3d) on the window machinery, through :func:`gems.spatial.conv_backend.conv_nd`."""
from __future__ import annotations

import math

import torch
from torch import nn

from gems.spatial.context import SpatialContext
from gems.spatial.conv_backend import conv_nd
from gems.spatial.geometry import Box, Window, shape_of
from gems.spatial.layers.base import ntuple
from gems.spatial.layers.window import WindowLayer


class SpatialConv(WindowLayer):
    """Conv1d/2d/3d: any kernel, stride, padding (int, tuple, 'same', 'valid'), dilation, groups."""

    def __init__(self, conv: nn.modules.conv._ConvNd, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        self._adopt(conv, ("weight", "bias"))
        nd = conv.weight.dim() - 2
        k, s, d = ntuple(conv.kernel_size, nd), ntuple(conv.stride, nd), ntuple(conv.dilation, nd)
        if isinstance(conv.padding, str):
            tot = [0 if conv.padding == "valid" else d[j] * (k[j] - 1) for j in range(nd)]
            pads = [(t // 2, t - t // 2) for t in tot]
        else:
            pads = [(p, p) for p in ntuple(conv.padding, nd)]
        self.maps = [Window(k[j], s[j], d[j], *pads[j]) for j in range(nd)]
        self._set_native()
        self.stride, self.dilation, self.groups, self.nd = s, d, conv.groups, nd
        self.out_channels = conv.out_channels

    def _out_channels(self, x: torch.Tensor) -> int:
        return self.out_channels

    def _deps(self) -> list[torch.Tensor | None]:
        return [self.weight, self.bias]

    def _op(self, xp: torch.Tensor, box: Box, gin: tuple[int, ...]) -> torch.Tensor:
        return conv_nd(xp, self.weight, self.bias, self.stride, self._pad, self.dilation, self.groups)

    def _linear(self) -> bool:
        return True

    def _trims(self, window: Box) -> bool:
        # a kernel slice costs a weight-sized zero fill and copy in the backward: worth it where
        # the window is larger than the kernel (the wide shallow layers), not in the deep ones
        return math.prod(shape_of(window)) * self.weight.shape[1] > self.weight.numel()

    def _native_op(self, xp: torch.Tensor, pads: tuple[int, ...], bias: bool,
                   taps: tuple[slice, ...] | None = None) -> torch.Tensor:
        w = self.weight if taps is None else self.weight[(slice(None), slice(None), *taps)]
        return conv_nd(xp, w, self.bias if bias else None, self.stride, pads, self.dilation, self.groups)

    def extra_repr(self) -> str:
        return f"{self.label}, weight={tuple(self.weight.shape)}, maps={self.maps}"
