"""The convolution backend choice: ``F.convNd`` through a permutation of the spatial dims where that keeps
torch off its slow reference kernel (the spatial convolutions, the planner's timings and the benchmarks
use it).
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from gems.layers import bf16_conv3d_needs_fp32, conv3d_in_fp32

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_PERMS: dict[tuple[Any, ...], tuple[int, ...] | None] = {}


def _backend(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Sequence[int], padding: Sequence[int],
             dilation: Sequence[int], groups: int) -> str:
    sel: Any = getattr(torch._C, "_select_conv_backend", None)
    try:
        return str(sel(x, w, b, list(stride), list(padding), list(dilation), False, [0] * len(stride), groups, None))
    except Exception:  # a torch without it, or fake tensors: no opinion
        return ""


def perm_for(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Sequence[int], padding: Sequence[int],
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
    perm = perm_for(x, w, b, stride, padding, dilation, groups)
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
