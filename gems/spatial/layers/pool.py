"""Spatial pools: max and average pools on the window machinery, and the global (output size 1) pools whose
output is whole on every part.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gems.spatial.context import SpatialContext
from gems.spatial.geometry import Box, Window
from gems.spatial.layers.base import WHOLE, SpatialLayer, ntuple
from gems.spatial.layers.window import WindowLayer

_MAXP = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


class SpatialMaxPool(WindowLayer):
    """MaxPool1d/2d/3d: any kernel, stride, padding, dilation, ceil_mode."""

    fill = -math.inf

    def __init__(self, pool: nn.Module, sctx: SpatialContext, label: str, nd: int) -> None:
        super().__init__(sctx, label)
        k = ntuple(pool.kernel_size, nd)
        s = ntuple(pool.stride if pool.stride is not None else pool.kernel_size, nd)
        p, d = ntuple(pool.padding, nd), ntuple(pool.dilation, nd)
        self.maps = [Window(k[j], s[j], d[j], p[j], p[j], bool(pool.ceil_mode)) for j in range(nd)]
        self._set_native()
        self.k, self.s, self.d, self.nd, self.ceil = k, s, d, nd, bool(pool.ceil_mode)

    def _op(self, xp: torch.Tensor, box: Box, gin: tuple[int, ...]) -> torch.Tensor:
        return _MAXP[self.nd](xp, self.k, self.s, self._pad, self.d, self.ceil)

    def extra_repr(self) -> str:
        return f"{self.label}, maps={self.maps}"


class SpatialAvgPool(WindowLayer):
    """AvgPool1d/2d/3d: any kernel, stride, padding, ceil_mode, count_include_pad, divisor_override."""

    def __init__(self, pool: nn.Module, sctx: SpatialContext, label: str, nd: int) -> None:
        super().__init__(sctx, label)
        k = ntuple(pool.kernel_size, nd)
        s = ntuple(pool.stride if pool.stride is not None else pool.kernel_size, nd)
        p = ntuple(pool.padding, nd)
        self.maps = [Window(k[j], s[j], 1, p[j], p[j], bool(pool.ceil_mode)) for j in range(nd)]
        self._set_native()
        self.k, self.s, self.nd, self.ceil = k, s, nd, bool(pool.ceil_mode)
        self.include_pad = bool(getattr(pool, "count_include_pad", True))
        self.divisor = getattr(pool, "divisor_override", None)

    def _min_part(self, m: Window) -> int:
        return m.extent  # torch's pools refuse inputs thinner than the kernel, padding or not

    def _linear(self) -> bool:
        # with count_include_pad (or a fixed divisor) torch divides by the same count whether a
        # padded cell is the op's own padding or an explicit zero; without it, it does not
        return not self.ceil and (self.include_pad or bool(self.divisor))

    def _native_op(self, xp: torch.Tensor, pads: tuple[int, ...], bias: bool,
                   taps: tuple[slice, ...] | None = None) -> torch.Tensor:
        if self.nd == 1:
            y = F.avg_pool1d(xp, self.k, self.s, pads, False, self.include_pad)
            return y * (self.k[0] / self.divisor) if self.divisor else y
        return self.sctx.avg_pool(self.nd)(xp, self.k, self.s, pads, False, self.include_pad, self.divisor)

    def _op(self, xp: torch.Tensor, box: Box, gin: tuple[int, ...]) -> torch.Tensor:
        # the op counts explicit (cut-dim) padding as cells; torch's rule may not: rescale per cut dim
        if self.nd == 1:
            y = F.avg_pool1d(xp, self.k, self.s, self._pad, self.ceil, self.include_pad)
            return y * (self.k[0] / self.divisor) if self.divisor else y
        y = self.sctx.avg_pool(self.nd)(xp, self.k, self.s, self._pad, self.ceil, self.include_pad, self.divisor)
        if self.divisor:
            return y
        fix = self._fix(box, gin, y)
        return y if fix is None else y * fix

    def _fix(self, box: Box, gin: tuple[int, ...], y: torch.Tensor) -> torch.Tensor | None:
        """The per-cut-dim rescaling of this part's outputs, made once per (part, input shape, device, dtype)
        and kept on the output's device (no host tensor meets a device one, no copy in each forward)."""
        cache = self.__dict__.setdefault("_fixes", {})
        key = (box, gin, y.device, y.dtype)
        if key not in cache:
            fix = None
            for j, (m, (a, b), n) in enumerate(zip(self.maps, box, gin)):
                if self.native[j] is not None:
                    continue
                c = m.avg_count(a, b, n, self.include_pad)
                if (c == self.k[j]).all():
                    continue
                f = torch.from_numpy(self.k[j] / c).view(-1, *([1] * (self.nd - 1 - j)))
                fix = f if fix is None else fix * f
            cache[key] = None if fix is None else fix.to(device=y.device, dtype=y.dtype)
        return cache[key]

    def extra_repr(self) -> str:
        return f"{self.label}, maps={self.maps}"


class SpatialGlobalAvgPool(SpatialLayer):
    """``AdaptiveAvgPool{1,2,3}d(1)`` over the whole sample: the local sums, summed over the parts, divided
    by the global cell count. The output is whole on every part; its backward sums the parts' gradients
    (the adjoint of that replication) and spreads them evenly, as the serial layer does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gin = self.sctx.global_shape(x)
        dims = tuple(range(2, x.dim()))
        y = self.sctx.all_reduce(x.sum(dims, keepdim=True)) / math.prod(gin)
        setattr(y, WHOLE, True)
        return y


class _GlobalMax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sctx: SpatialContext) -> torch.Tensor:
        n, c = x.shape[:2]
        flat = x.detach().reshape(n, c, -1)
        vals, idx = flat.max(dim=2)
        best = sctx.all_reduce_max(vals)
        # ties across parts: the lowest spatial index holds the maximum (one element gets the gradient)
        here = vals == best
        who = torch.where(here, torch.full_like(vals, float(sctx.index)), torch.full_like(vals, float("inf")))
        mine = here & (sctx.all_reduce_min(who) == float(sctx.index))
        ctx.save_for_backward(idx, mine)
        ctx.sctx, ctx.shape = sctx, x.shape
        return best.reshape(n, c, *([1] * (x.dim() - 2))).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        idx, mine = ctx.saved_tensors
        n, c = ctx.shape[:2]
        total = ctx.sctx.all_reduce_sum_grad(g.reshape(n, c))  # every part used the replicated output
        gx = torch.zeros((n, c, math.prod(ctx.shape[2:])), dtype=g.dtype, device=g.device)
        gx.scatter_(2, idx.unsqueeze(2), (total * mine.to(total.dtype)).unsqueeze(2))
        return gx.reshape(ctx.shape), None


class SpatialGlobalMaxPool(SpatialLayer):
    """``AdaptiveMaxPool{1,2,3}d(1)`` over the whole sample: the local maxima, maximised over the parts; the
    gradient goes to the one cell that holds the maximum (on the lowest part where several parts tie)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _GlobalMax.apply(x, self.sctx)
        setattr(y, WHOLE, True)
        return y
