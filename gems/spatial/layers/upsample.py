"""Spatial upsampling (nn.Upsample): torch's source-index rule, interpolated along each dim."""
from __future__ import annotations

import torch
from torch import nn

from gems.spatial import halo
from gems.spatial.context import SpatialContext
from gems.spatial.geometry import Resample, is_empty, shape_of
from gems.spatial.layers.base import SpatialLayer, ntuple, zeros_out


class SpatialUpsample(SpatialLayer):
    """Upsample (nearest, nearest-exact, linear, bilinear, trilinear; size or scale_factor)."""

    def __init__(self, up: nn.Upsample, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        self.mode = "linear" if up.mode in ("linear", "bilinear", "trilinear") else up.mode
        self.size, self.scale_factor = up.size, up.scale_factor
        self.align_corners, self.recompute = bool(up.align_corners), bool(up.recompute_scale_factor)

    def _maps(self, nd: int) -> list[Resample]:
        size = ntuple(self.size, nd) if self.size is not None else (None,) * nd
        sf = self.scale_factor
        scales = tuple(float(v) for v in sf) if isinstance(sf, (tuple, list)) else (float(sf) if sf is not None else None,) * nd
        return [Resample(self.mode, self.align_corners, scales[j], size[j], self.recompute) for j in range(nd)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sctx = self.sctx
        gin = sctx.global_shape(x)
        cache = self.__dict__.setdefault("_plans", {})
        if gin not in cache:
            maps = self._maps(len(gin))
            gout = tuple(m.out_size(n) for m, n in zip(maps, gin))
            outs = sctx.boxes(gout)
            box = outs[sctx.index]
            with sctx.index_math():
                needs = [tuple(m.need(a, b, n) for m, (a, b), n in zip(maps, b, gin)) if not is_empty(b)
                         else tuple((0, 0) for _ in b) for b in outs]
                src = [m.sources(a, b, n) for m, (a, b), n in zip(maps, box, gin)] if not is_empty(box) else []
            cache[gin] = (gout, box, halo.plan(sctx, gin, needs), src)
        gout, box, p, src = cache[gin]
        (y,) = halo.windows(sctx, x, p, [p.need], self.label, tag=self.tag)
        if is_empty(box):
            return sctx.mark(zeros_out((x.shape[0], x.shape[1], *shape_of(box)), y), gout)
        # the source indices and weights on the output's device, copied there once (not in every forward)
        placed = self.__dict__.setdefault("_placed", {})
        key = (gin, y.device, y.dtype)
        if key not in placed:
            placed[key] = [(i0.to(y.device) - lo, i1.to(y.device) - lo,
                            lam.to(device=y.device, dtype=y.dtype).view(-1, *([1] * (len(gin) - 1 - j))))
                           for j, ((i0, i1, lam), (lo, _)) in enumerate(zip(src, p.need))]
        for j, (i0, i1, w) in enumerate(placed[key]):
            if self.mode != "linear":
                y = y.index_select(2 + j, i0)
                continue
            y = y.index_select(2 + j, i0) * (1 - w) + y.index_select(2 + j, i1) * w
        return sctx.mark(y, gout)

    def extra_repr(self) -> str:
        return f"{self.label}, mode={self.mode}, size={self.size}, scale_factor={self.scale_factor}"
