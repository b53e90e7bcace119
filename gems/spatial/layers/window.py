"""The window machinery of convolutions and pools: which input window each output box reads, the halo plan that
fetches it, the overlap of interior and boundary slabs, and the no-copy route of linear ops.

Padding at the sample's edges is applied explicitly, so any kernel, stride, padding, dilation and ``ceil_mode`` is
exact, with uneven parts and halos wider than a neighbour. Convolutions and average pools that count padding take the
no-copy route where the cut allows it (symmetric padding, parts aligned with the stride: gems.spatial.halo.Exchange).
"""
from __future__ import annotations

from typing import Any

import torch

from gems.spatial import halo
from gems.spatial.geometry import (
    Box,
    Window,
    boundary_slabs,
    clip,
    intersect,
    is_empty,
    local_index,
    nest,
    shape_of,
)
from gems.spatial.layers.base import SpatialLayer, zeros_out


class WindowLayer(SpatialLayer):
    """Convolution and pooling: outputs in this rank's range read input windows.

    Along cut dims (and uncut dims with asymmetric padding) windows are exact
    and padded explicitly; uncut dims keep the layer's own padding (``native``).
    """

    maps: list[Window]
    native: list[int | None]  # per dim: the padding the op applies itself, None where windows are explicit
    fill: float = 0.0

    def _op(self, xp: torch.Tensor, box: Box, gin: tuple[int, ...]) -> torch.Tensor:
        raise NotImplementedError

    def _set_native(self) -> None:
        self.native = [m.pad_lo if j not in self.sctx.dims and m.pad_lo == m.pad_hi else None
                       for j, m in enumerate(self.maps)]

    @property
    def _pad(self) -> tuple[int, ...]:
        return tuple(p or 0 for p in self.native)

    def _out_channels(self, x: torch.Tensor) -> int:
        return x.shape[1]

    def _deps(self) -> list[torch.Tensor | None]:
        return []

    def _need(self, box: Box, gin: tuple[int, ...]) -> tuple[Box, Box]:
        """Input box read by the outputs ``box``: unclipped (with padding) and clipped."""
        need = tuple(m.need(a, b) if nat is None else (0, n)
                     for m, nat, (a, b), n in zip(self.maps, self.native, box, gin))
        return need, tuple(clip(r, n) for r, n in zip(need, gin))

    def _linear(self) -> bool:
        """Whether the op is linear in its input with zero padding (the no-copy route applies)."""
        return False

    def _min_part(self, m: Window) -> int:
        """The thinnest part (cells along a cut dim) the op accepts with its own padding."""
        return max(1, m.extent - 2 * m.pad_lo)

    def _native_op(self, xp: torch.Tensor, pads: tuple[int, ...], bias: bool,
                   taps: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The op with its own zero padding ``pads`` in every dim (``bias``: add the bias, if any;
        ``taps``: the kernel taps to use per dim, where :meth:`_trims`)."""
        raise NotImplementedError

    def _setup_linear(self, p: halo.Plan, box: Box, gin: tuple[int, ...]) -> tuple[Any, ...] | None:
        """The no-copy route, when it is exact: every cut dim pads symmetrically, and the op on the
        local part with that padding yields exactly this rank's outputs. Returns the padding of the
        op on the part, the padding of the correction windows, and (window, index in the output,
        kernel taps or None) of each boundary slab whose outputs read received halo cells."""
        sctx = self.sctx
        if not self._linear() or p.quiet or is_empty(box) or is_empty(p.own):
            return None
        if any(nat is None and j not in sctx.dims for j, nat in enumerate(self.native)):
            return None
        for j in sctx.dims:
            m, (a, b), (lo, hi) = self.maps[j], box[j], p.own[j]
            if m.ceil_mode or m.pad_lo != m.pad_hi or lo != a * m.stride or hi - lo < self._min_part(m):
                return None
            if Window(m.kernel, m.stride, m.dilation, m.pad_lo, m.pad_lo).out_size(hi - lo) != b - a:
                return None
        pads = tuple(self.maps[j].pad_lo if j in sctx.dims else int(nat or 0) for j, nat in enumerate(self.native))
        inner = tuple(self.maps[j].interior(a, b, p.own[j]) if j in sctx.dims else (a, b) for j, (a, b) in enumerate(box))
        slabs = [box] if is_empty(inner) else boundary_slabs(box, inner, sorted(sctx.dims))
        fixes = []
        for s in slabs:
            need, clipped = self._need(s, gin)
            hits = [intersect(clipped, r) for _, r in p.recvs]
            hits = [h for h in hits if not is_empty(h)]
            if hits:
                win, taps = self._trim(s, need, hits) if self._trims(need) else (need, None)
                fixes.append((win, local_index(s, box), taps))
        return pads, self._pad, tuple(fixes)

    def _trims(self, window: Box) -> bool:
        """Whether the correction over ``window`` drops the kernel taps that read only zeros
        (``_native_op`` then takes ``taps``)."""
        return False

    def _trim(self, slab: Box, need: Box, hits: list[Box]) -> tuple[Box, tuple[slice, ...]]:
        """The correction window of ``slab`` cut down, along each cut dim, to the kernel taps that
        reach a received cell (the hull of them); the other taps read only zeros there. A slab one
        output thick with one halo plane then costs a third of the full window (kernel 3)."""
        win, taps = list(need), []
        for j, m in enumerate(self.maps):
            a, c = slab[j]
            r0, r1 = min(h[j][0] for h in hits), max(h[j][1] for h in hits)
            if j not in self.sctx.dims:
                taps.append(slice(None))
                continue
            ts = [t for t in range(m.kernel) if any(r0 <= o * m.stride - m.pad_lo + t * m.dilation < r1 for o in range(a, c))]
            t0, t1 = ts[0], ts[-1] + 1
            win[j] = (a * m.stride - m.pad_lo + t0 * m.dilation, (c - 1) * m.stride - m.pad_lo + (t1 - 1) * m.dilation + 1)
            taps.append(slice(t0, t1))
        return tuple(win), tuple(taps)

    def _setup(self, gin: tuple[int, ...]) -> tuple[Any, ...]:
        sctx = self.sctx
        gout = tuple(m.out_size(n) for m, n in zip(self.maps, gin))
        outs = sctx.boxes(gout)
        needs = [self._need(b, gin)[1] if not is_empty(b) else tuple((0, 0) for _ in b) for b in outs]
        p = halo.plan(sctx, gin, needs)
        box = outs[sctx.index]
        inner: Box = box
        slabs: list[Box] = []
        explicit_uncut = any(nat is None and j not in sctx.dims for j, nat in enumerate(self.native))
        if not is_empty(box) and not p.quiet and not explicit_uncut:
            inner = tuple(self.maps[j].interior(a, b, p.own[j]) if j in sctx.dims else (a, b)
                          for j, (a, b) in enumerate(box))
            if is_empty(inner):
                inner = box
            else:
                slabs = boundary_slabs(box, inner, sorted(sctx.dims))
        return gout, p, box, inner, slabs, self._setup_linear(p, box, gin)

    def _forward_linear(self, x: torch.Tensor, p: halo.Plan, route: tuple[Any, ...]) -> torch.Tensor:
        """The op on the part as it is, plus the halo corrections of the boundary slabs (no copy of the part)."""
        pads, fix_pads, fixes = route
        sctx = self.sctx
        ex = halo.Exchange(sctx, x, p, self.label, self.tag)
        xs = halo.Source.apply(x, ex) if p.sends and x.requires_grad and torch.is_grad_enabled() else x
        # the op on the part needs no halo: it runs while the halos travel (costs no memory here, so
        # on by default, CPU included; overlap=False waits first, for comparison)
        recvd = None if sctx.overlap is not False else ex.wait()
        y = self._native_op(xs, pads, True)
        if recvd is None:
            recvd = ex.wait()
        if not fixes:
            return y
        wins = halo.Shell.apply(xs, ex, tuple(w for w, _, _ in fixes), *recvd)
        parts = [self._native_op(w, fix_pads, False, taps) for w, (_, _, taps) in zip(wins, fixes)]
        return halo.AddInto.apply(y, tuple(i for _, i, _ in fixes), *parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sctx = self.sctx
        gin = sctx.global_shape(x)
        cache = self.__dict__.setdefault("_plans", {})
        if gin not in cache:
            cache[gin] = self._setup(gin)
        gout, p, box, inner, slabs, route = cache[gin]
        if route is not None:
            y = self._forward_linear(x, p, route)
        elif is_empty(box):
            (win,) = halo.windows(sctx, x, p, [p.need], self.label, tag=self.tag)
            y = zeros_out((x.shape[0], self._out_channels(x), *shape_of(box)), win, *self._deps())
        elif not slabs or not sctx.overlaps(x):
            (win,) = halo.windows(sctx, x, p, [self._need(box, gin)[0]], self.label, fill=self.fill, tag=self.tag)
            y = self._op(win, box, gin)
        else:  # the interior while the halos travel, then the boundary slabs
            pending = halo.Pending(sctx, x, p, self.label, self.tag)
            y_in = self._op(x[local_index(self._need(inner, gin)[0], p.own)], inner, gin)
            wins = halo.windows(sctx, x, p, [self._need(s, gin)[0] for s in slabs], self.label, pending, self.fill)
            y = nest(box, inner, sorted(sctx.dims), y_in, [self._op(w, s, gin) for w, s in zip(wins, slabs)])
        return sctx.mark(y, gout)
