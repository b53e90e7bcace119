"""Index arithmetic of spatial partitioning, pure and exact: every activation is split along each cut dim by
:func:`gems.shapes.split_bounds`, a layer's rank owns the output cells in its range, and :class:`Window`,
:class:`Transposed` and :class:`Resample` map an output range to the input range it reads, per dim. The halo is
whatever of that range another rank owns, however wide, edges and corners included. Nothing here touches a tensor or
a process group, so it is tested directly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gems.shapes import Range

Box = tuple[Range, ...]


def is_empty(box: Box) -> bool:
    return any(hi <= lo for lo, hi in box)


def intersect(a: Box, b: Box) -> Box:
    return tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))


def shape_of(box: Box) -> tuple[int, ...]:
    return tuple(max(0, hi - lo) for lo, hi in box)


def local_index(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Index (over N, C and the spatial dims) of ``inner`` inside a tensor covering ``outer``."""
    return (slice(None), slice(None),
            *(slice(lo - o0, hi - o0) if hi > lo else slice(0, 0) for (lo, hi), (o0, _) in zip(inner, outer)))


def clip(r: Range, n: int) -> Range:
    lo, hi = max(r[0], 0), min(r[1], n)
    return (lo, max(lo, hi))


@dataclass(frozen=True)
class Window:
    """Convolution or pooling along one dim: output ``o`` reads inputs
    ``o*stride - pad_lo + j*dilation`` for ``j < kernel``; cells outside
    ``[0, n)`` are padding (zeros, or -inf for max pooling)."""

    kernel: int
    stride: int = 1
    dilation: int = 1
    pad_lo: int = 0
    pad_hi: int = 0
    ceil_mode: bool = False

    @property
    def extent(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, n: int) -> int:
        span = n + self.pad_lo + self.pad_hi - self.extent
        if not self.ceil_mode:
            return span // self.stride + 1
        out = -(-span // self.stride) + 1
        if (out - 1) * self.stride >= n + self.pad_lo:  # torch: the last window must start inside
            out -= 1
        return out

    def need(self, a: int, b: int) -> Range:
        """Input range (unclipped: may reach into padding) read by outputs ``[a, b)``."""
        if b <= a:
            return (0, 0)
        return (a * self.stride - self.pad_lo, (b - 1) * self.stride - self.pad_lo + self.extent)

    def interior(self, a: int, b: int, own: Range) -> Range:
        """Outputs in ``[a, b)`` whose inputs all lie in ``own`` (padding excluded):
        computable from the local part alone, before halos arrive."""
        s, p = self.stride, self.pad_lo
        c = max(a, -(-(own[0] + p) // s))
        e = min(b, (own[1] + p - self.extent) // s + 1)
        return (c, max(c, e))

    def avg_count(self, a: int, b: int, n: int, include_pad: bool) -> np.ndarray:
        """Divisor of each output of an average pool over ``[a, b)`` (torch's rule).

        Plain numpy: it depends on shapes only, so it also runs where tensors are fake (gems plan)."""
        o = np.arange(a, b, dtype=np.int64)
        start = o * self.stride - self.pad_lo
        end = np.minimum(start + self.kernel, n + self.pad_hi)
        if not include_pad:
            start, end = np.maximum(start, 0), np.minimum(end, n)
        return (end - start).astype(np.float64)


@dataclass(frozen=True)
class Transposed:
    """Transposed convolution along one dim: input ``i`` feeds outputs
    ``i*stride - padding + j*dilation`` for ``j < kernel``."""

    kernel: int
    stride: int = 1
    dilation: int = 1
    padding: int = 0
    output_padding: int = 0

    @property
    def extent(self) -> int:
        return self.dilation * (self.kernel - 1) + 1

    def out_size(self, n: int) -> int:
        return (n - 1) * self.stride - 2 * self.padding + self.extent + self.output_padding

    def need(self, a: int, b: int, n: int) -> Range:
        """Inputs (clipped to ``[0, n)``) that feed any output in ``[a, b)``; may be empty."""
        if b <= a:
            return (0, 0)
        lo = -(-(a + self.padding - self.extent + 1) // self.stride)
        hi = (b - 1 + self.padding) // self.stride + 1
        return clip((lo, hi), n)

    def span(self, lo: int, hi: int) -> Range:
        """Global outputs produced by a padding-free transposed conv over inputs ``[lo, hi)``."""
        start = lo * self.stride - self.padding
        return (start, start + (hi - lo - 1) * self.stride + self.extent)


@dataclass(frozen=True)
class Resample:
    """Upsampling along one dim: output ``o`` reads one input (nearest modes)
    or two with weights (linear), with torch's index rule."""

    mode: str  # "nearest" | "nearest-exact" | "linear"
    align_corners: bool = False
    scale_factor: float | None = None  # given scale
    size: int | None = None  # given output size
    recompute: bool = False  # recompute_scale_factor: the index rule uses n / out

    def out_size(self, n: int) -> int:
        if self.size is not None:
            return int(self.size)
        assert self.scale_factor is not None
        return int(math.floor(float(n) * self.scale_factor))

    def _scale(self, n: int, out: int) -> float:
        if self.mode == "linear" and self.align_corners:
            return (n - 1) / (out - 1) if out > 1 else 0.0
        if self.size is None and not self.recompute and self.scale_factor is not None and self.scale_factor > 0:
            return 1.0 / self.scale_factor
        return n / out

    def sources(self, a: int, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Global input indices ``i0``, ``i1`` and weight of ``i1`` for outputs ``[a, b)``."""
        out = self.out_size(n)
        o = torch.arange(a, b, dtype=torch.int64)
        # torch computes these in float32 (the op math type of a float32 input)
        scale = torch.tensor(self._scale(n, out), dtype=torch.float32)
        if self.mode in ("nearest", "nearest-exact"):
            if out == n:
                i0 = o
            elif out == 2 * n and self.mode == "nearest":
                i0 = o // 2
            elif self.mode == "nearest":
                i0 = torch.floor(o.to(torch.float32) * scale).to(torch.int64)
            else:
                # (o + 0.5) * scale in double, rounded to float, then floored (as floorf does)
                i0 = torch.floor(((o.to(torch.float64) + 0.5) * scale.to(torch.float64)).to(torch.float32)).to(torch.int64)
            i0 = i0.clamp(max=n - 1)
            return i0, i0, torch.zeros(b - a)
        if self.align_corners:
            real = scale * o.to(torch.float32)
        else:
            real = (scale * (o.to(torch.float32) + 0.5) - 0.5).clamp(min=0.0)
        i0 = torch.floor(real).to(torch.int64).clamp(max=n - 1)
        lam = (real - i0.to(torch.float32)).clamp(0.0, 1.0)
        i1 = torch.where(i0 < n - 1, i0 + 1, i0)
        return i0, i1, lam

    def need(self, a: int, b: int, n: int) -> Range:
        if b <= a:
            return (0, 0)
        i0, i1, _ = self.sources(a, b, n)
        return (int(i0.min()), int(i1.max()) + 1)


def boundary_slabs(out: Box, inner: Box, cut: Sequence[int]) -> list[Box]:
    """The slabs of ``out`` around ``inner``: along the first cut dim the low
    slab, then (recursively, along the next cut dims) the slabs of the middle,
    then the high slab. Empty slabs are left out; :func:`nest` puts the pieces
    back together in this order."""
    slabs: list[Box] = []

    def rec(box: Box, k: int) -> None:
        if k == len(cut):
            return
        j = cut[k]
        (a, b), (c, e) = box[j], inner[j]
        if c > a:
            slabs.append(tuple((a, c) if i == j else r for i, r in enumerate(box)))
        rec(tuple((c, e) if i == j else r for i, r in enumerate(box)), k + 1)
        if b > e:
            slabs.append(tuple((e, b) if i == j else r for i, r in enumerate(box)))

    rec(out, 0)
    return slabs


def nest(out: Box, inner: Box, cut: Sequence[int], inner_t: torch.Tensor, slab_ts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate ``inner_t`` and the slab tensors (in :func:`boundary_slabs` order) into ``out``."""
    it = iter(slab_ts)

    def rec(box: Box, k: int) -> torch.Tensor:
        if k == len(cut):
            return inner_t
        j = cut[k]
        (a, b), (c, e) = box[j], inner[j]
        parts = []
        if c > a:
            parts.append(next(it))
        parts.append(rec(tuple((c, e) if i == j else r for i, r in enumerate(box)), k + 1))
        if b > e:
            parts.append(next(it))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2 + j)

    return rec(out, 0)
