"""Spatial versions of the layers of a CNN trunk, each exact against its serial self.

Every layer here takes this rank's part of an activation and returns its part
of the output, split along the cut dims like the input (``np.array_split`` of
the output's global extent). It holds the *same* parameter and buffer
objects as the layer it replaces, under the same names, so the state dict and
the optimizer see the serial model.

* Convolutions and pools own the output cells in their range and read exactly
  the input window those cells need (:class:`gems.spatial.geometry.Window`),
  fetched by the halo exchange; padding at the sample's edges is applied
  explicitly, so any kernel, stride, padding, dilation and ``ceil_mode`` is
  exact, with uneven parts and halos wider than a neighbour. With
  ``SpatialContext.overlap`` the interior is computed while halos are in
  flight, then the boundary slabs.
* Convolutions and average pools that count padding (linear in the input,
  zero padding) take a cheaper, equally exact route where the cut allows it
  (symmetric padding, parts aligned with the stride): the op runs on the
  part as it is, with its own padding along the cut dims, while the halos
  travel; the boundary planes then get the op over a window of received
  halo cells added (:mod:`gems.spatial.halo`). Nothing of the part's size is
  copied, forward or backward. Measured on CosmoFlow 128^3 at S=2 (CPU), the
  window copies, zero fills and gradient scatters of the general route cost
  more than the halo exchange itself.
* Convolutions go through :func:`conv_nd`, which keeps torch off its slow
  reference kernel for slab shapes it would send there (13x slower on
  CosmoFlow's third convolution at S=2).
* Transposed convolutions gather the inputs that feed their outputs and crop.
* Upsampling uses torch's index rule and interpolates along each dim.
* BatchNorm (and GroupNorm, InstanceNorm) sum their statistics over the parts
  with a differentiable all-reduce: global statistics, exact. ``bn_stats=
  "local"`` keeps per-part BatchNorm statistics (not equal to serial).
* Element-wise layers run unchanged; :class:`SpatialSampleDropout` slices the
  mask the serial run would draw.

A rank whose part of an activation is empty (an activation smaller than the
number of parts, deep in the trunk) returns an empty part that stays in the
autograd graph, so it still sends and receives its share of halo gradients.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gems.layers import bf16_conv3d_needs_fp32, conv3d_in_fp32
from gems.spatial import halo
from gems.spatial.context import GSHAPE, SpatialContext
from gems.spatial.geometry import (
    Box,
    Resample,
    Transposed,
    Window,
    boundary_slabs,
    clip,
    intersect,
    is_empty,
    local_index,
    nest,
    shape_of,
)


class _Zeros(torch.autograd.Function):
    """Zeros of ``shape`` that depend on ``deps`` (zero gradients flow back to them)."""

    @staticmethod
    def forward(ctx: Any, shape: tuple[int, ...], *deps: torch.Tensor) -> torch.Tensor:
        ctx.metas = [(d.shape, d.dtype, d.device) for d in deps]
        return deps[0].new_zeros(shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return (None, *[torch.zeros(s, dtype=t, device=dev) for s, t, dev in ctx.metas])


def zeros_out(shape: Sequence[int], *deps: torch.Tensor | None) -> torch.Tensor:
    return _Zeros.apply(tuple(int(s) for s in shape), *[d for d in deps if d is not None])


def _tuple(v: Any, nd: int) -> tuple[int, ...]:
    return tuple(int(a) for a in v) if isinstance(v, (tuple, list)) else (int(v),) * nd


class SpatialLayer(nn.Module):
    """Base of the spatial layers: the context and a label for halo timings."""

    def __init__(self, sctx: SpatialContext, label: str) -> None:
        super().__init__()
        self.sctx = sctx
        self.label = label
        self.tag = sctx.new_tag()

    def _adopt(self, layer: nn.Module, params: Sequence[str] = (), buffers: Sequence[str] = ()) -> None:
        """Register ``layer``'s own parameter and buffer objects under the same names."""
        for name in params:
            self.register_parameter(name, getattr(layer, name, None))
        for name in buffers:
            self.register_buffer(name, getattr(layer, name, None), persistent=name not in layer._non_persistent_buffers_set)


class _WindowLayer(SpatialLayer):
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


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_PERMS: dict[tuple[Any, ...], tuple[int, ...] | None] = {}


def _backend(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Sequence[int], padding: Sequence[int],
             dilation: Sequence[int], groups: int) -> str:
    sel = getattr(torch._C, "_select_conv_backend", None)
    try:
        return str(sel(x, w, b, list(stride), list(padding), list(dilation), False, [0] * len(stride), groups, None))
    except Exception:  # a torch without it, or fake tensors: no opinion
        return ""


def _perm_for(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Sequence[int], padding: Sequence[int],
              dilation: Sequence[int], groups: int) -> tuple[int, ...] | None:
    """A permutation of the spatial dims under which torch picks oneDNN where it would pick its slow
    reference kernel for this shape, or None.

    torch's CPU heuristic takes the reference kernel ("Slow3d") when N*C*D*H is small, so a part
    cut along depth (D halved) can fall on it where the whole sample did not: CosmoFlow's third
    conv at S=2 (1x32x16x32x32) ran 13x slower forward + backward. Permuting the spatial dims of
    the input and the kernel alike computes the same convolution (up to summation order) and lets
    torch see a shape it sends to oneDNN."""
    nd = x.dim() - 2
    if nd < 2 or x.device.type != "cpu":
        return None
    key = (tuple(x.shape), tuple(w.shape), b is not None, tuple(stride), tuple(padding), tuple(dilation), groups, x.dtype)
    if key not in _PERMS:
        _PERMS[key] = None
        if "Slow" in _backend(x, w, b, stride, padding, dilation, groups):
            for perm in itertools.permutations(range(nd)):
                full = (0, 1, *[2 + q for q in perm])
                if "Mkldnn" in _backend(x.permute(full), w.permute(full), b, [stride[q] for q in perm],
                                        [padding[q] for q in perm], [dilation[q] for q in perm], groups):
                    _PERMS[key] = perm
                    break
    return _PERMS[key]


def conv_nd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Sequence[int], padding: Sequence[int],
            dilation: Sequence[int], groups: int) -> torch.Tensor:
    """``F.convNd``, through a permutation of the spatial dims where that avoids torch's slow kernel
    (and in fp32 where torch's bf16 CPU kernel is wrong: :func:`gems.layers.bf16_conv3d_needs_fp32`)."""
    nd = x.dim() - 2
    perm = _perm_for(x, w, b, stride, padding, dilation, groups)
    if nd == 3 and bf16_conv3d_needs_fp32(x, 0 if perm is None else perm[0]):
        return conv3d_in_fp32(x, w, b, tuple(stride), tuple(padding), tuple(dilation), groups)
    if perm is None:
        return _CONV[nd](x, w, b, tuple(stride), tuple(padding), tuple(dilation), groups)
    full = (0, 1, *[2 + q for q in perm])
    inv = tuple(full.index(i) for i in range(nd + 2))
    y = _CONV[nd](x.permute(full), w.permute(full), b, [stride[q] for q in perm], [padding[q] for q in perm],
                  [dilation[q] for q in perm], groups)
    out = y.permute(inv)
    # a fresh tensor either way: the no-copy route adds its halo corrections into it in place
    return out.contiguous() if not out.is_contiguous() else out.clone()


_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_MAXP = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


class SpatialConv(_WindowLayer):
    """Conv1d/2d/3d: any kernel, stride, padding (int, tuple, 'same', 'valid'), dilation, groups."""

    def __init__(self, conv: nn.modules.conv._ConvNd, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        self._adopt(conv, ("weight", "bias"))
        nd = conv.weight.dim() - 2
        k, s, d = _tuple(conv.kernel_size, nd), _tuple(conv.stride, nd), _tuple(conv.dilation, nd)
        if isinstance(conv.padding, str):
            tot = [0 if conv.padding == "valid" else d[j] * (k[j] - 1) for j in range(nd)]
            pads = [(t // 2, t - t // 2) for t in tot]
        else:
            pads = [(p, p) for p in _tuple(conv.padding, nd)]
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


class SpatialMaxPool(_WindowLayer):
    """MaxPool1d/2d/3d: any kernel, stride, padding, dilation, ceil_mode."""

    fill = -math.inf

    def __init__(self, pool: nn.Module, sctx: SpatialContext, label: str, nd: int) -> None:
        super().__init__(sctx, label)
        k = _tuple(pool.kernel_size, nd)
        s = _tuple(pool.stride if pool.stride is not None else pool.kernel_size, nd)
        p, d = _tuple(pool.padding, nd), _tuple(pool.dilation, nd)
        self.maps = [Window(k[j], s[j], d[j], p[j], p[j], bool(pool.ceil_mode)) for j in range(nd)]
        self._set_native()
        self.k, self.s, self.d, self.nd, self.ceil = k, s, d, nd, bool(pool.ceil_mode)

    def _op(self, xp: torch.Tensor, box: Box, gin: tuple[int, ...]) -> torch.Tensor:
        return _MAXP[self.nd](xp, self.k, self.s, self._pad, self.d, self.ceil)

    def extra_repr(self) -> str:
        return f"{self.label}, maps={self.maps}"


class SpatialAvgPool(_WindowLayer):
    """AvgPool1d/2d/3d: any kernel, stride, padding, ceil_mode, count_include_pad, divisor_override."""

    def __init__(self, pool: nn.Module, sctx: SpatialContext, label: str, nd: int) -> None:
        super().__init__(sctx, label)
        k = _tuple(pool.kernel_size, nd)
        s = _tuple(pool.stride if pool.stride is not None else pool.kernel_size, nd)
        p = _tuple(pool.padding, nd)
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


class SpatialConvTranspose(SpatialLayer):
    """ConvTranspose1d/2d/3d: any kernel, stride, padding, output_padding, dilation, groups."""

    def __init__(self, conv: nn.modules.conv._ConvTransposeNd, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        self._adopt(conv, ("weight", "bias"))
        nd = conv.weight.dim() - 2
        k, s, d = _tuple(conv.kernel_size, nd), _tuple(conv.stride, nd), _tuple(conv.dilation, nd)
        p, op = _tuple(conv.padding, nd), _tuple(conv.output_padding, nd)
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


class SpatialUpsample(SpatialLayer):
    """Upsample (nearest, nearest-exact, linear, bilinear, trilinear; size or scale_factor)."""

    def __init__(self, up: nn.Upsample, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        self.mode = "linear" if up.mode in ("linear", "bilinear", "trilinear") else up.mode
        self.size, self.scale_factor = up.size, up.scale_factor
        self.align_corners, self.recompute = bool(up.align_corners), bool(up.recompute_scale_factor)

    def _maps(self, nd: int) -> list[Resample]:
        size = _tuple(self.size, nd) if self.size is not None else (None,) * nd
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


class SpatialNorm(SpatialLayer):
    """BatchNorm, GroupNorm and InstanceNorm with statistics over the whole sample.

    Per-channel (BatchNorm: over the batch too) or per-(sample, group) sums are
    all-reduced over the parts, differentiably; the running statistics of
    BatchNorm are updated from the global ones, exactly as the serial layer does.
    """

    def __init__(self, norm: nn.Module, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        self._adopt(norm, ("weight", "bias"), ("running_mean", "running_var", "num_batches_tracked")
                    if not isinstance(norm, nn.GroupNorm) else ())
        instance = isinstance(norm, nn.modules.instancenorm._InstanceNorm)
        self.kind = "group" if isinstance(norm, nn.GroupNorm) else ("instance" if instance else "batch")
        self.eps = norm.eps
        self.momentum = getattr(norm, "momentum", None)
        self.track = bool(getattr(norm, "track_running_stats", False))
        self.groups = norm.num_groups if isinstance(norm, nn.GroupNorm) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sctx = self.sctx
        gin = sctx.global_shape(x)
        n, c = x.shape[:2]
        sp = [1] * (x.dim() - 2)
        if self.kind == "batch" and not self.training and self.track:
            y = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
            return sctx.mark(y, gin)
        if self.kind == "batch":
            xs, dims, count = x, [0, *range(2, x.dim())], n * math.prod(gin)
            stat_shape = (1, c, *sp)
        else:
            g = self.groups if self.kind == "group" else c
            xs = x.reshape(n, g, c // g, *x.shape[2:])
            dims, count = list(range(2, xs.dim())), (c // g) * math.prod(gin)
            stat_shape = (n, g, 1, *sp)
        mean = sctx.all_reduce(xs.sum(dims)) / count
        d = xs - mean.view(stat_shape)
        var = sctx.all_reduce((d * d).sum(dims)) / count
        y = (d * torch.rsqrt(var + self.eps).view(stat_shape)).reshape(x.shape)
        if self.weight is not None:
            y = y * self.weight.view(1, c, *sp) + self.bias.view(1, c, *sp)
        if self.training and self.track and self.running_mean is not None:
            with torch.no_grad():
                if self.kind == "instance":
                    mean, var = mean.mean(0), var.mean(0)
                self.num_batches_tracked += 1
                f = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var * (count / max(count - 1, 1))
                self.running_mean.mul_(1 - f).add_(mean.detach().reshape(-1), alpha=f)
                self.running_var.mul_(1 - f).add_(unbiased.detach().reshape(-1), alpha=f)
        return sctx.mark(y, gin)

    def extra_repr(self) -> str:
        return f"{self.label}, {self.kind}, global statistics"


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


#: the attribute that says an activation is complete and the same on every part (after a global pooling)
WHOLE = "_gems_whole"


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


def tag_output(sctx: SpatialContext, cache: dict[tuple[int, ...], tuple[int, ...]], module: nn.Module,
               args: tuple[Any, ...], out: Any) -> None:
    """Forward hook of converted containers: tag the output with its global shape.

    The global output shape is a function of the global input shape, the same
    on every rank, so the one all-reduce that finds it happens on every rank
    at the same call and never again.
    """
    if not isinstance(out, torch.Tensor) or getattr(out, GSHAPE, None) is not None or not args:
        return
    gin = getattr(args[0], GSHAPE, None)
    if gin is None:
        return
    if gin in cache:
        sctx.mark(out, cache[gin])
    else:
        cache[gin] = sctx.global_shape(out)


tag_output.shape_neutral = True  # type: ignore[attr-defined]  # it tags, never reshapes: shape memos may replay it


LayerFactory = Callable[[nn.Module, SpatialContext, str], nn.Module]
