"""How a tensor's memory is laid out, for what hands it to a transport: whether it covers its memory densely in
some order of its dims (a collective sums it in place), and its memory seen as a row-major tensor (a view: what
MPI and gloo's point-to-point messages take; a channels-last tensor is the (N, *spatial, C) block it lies in).
"""
from __future__ import annotations

import torch


def dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its memory exactly once in some order of its dims (contiguous in some memory format:
    row-major, channels-last, or any other permutation), as a collective sums it in place."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expect = 1
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


def row_major(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a row-major tensor (a view, its dims permuted by their strides): itself when row-major,
    the (N, *spatial, C) view of a channels-last tensor."""
    if t.is_contiguous():
        return t
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    v = t.permute(order)
    return v if v.is_contiguous() else t


def format_for(fmt: torch.memory_format, ndim: int) -> torch.memory_format:
    """The memory format a tensor of ``ndim`` dims takes where the layers compute in ``fmt``: channels-last for the
    4-D (5-D) tensors it applies to, row-major for the rest."""
    if (fmt is torch.channels_last and ndim == 4) or (fmt is torch.channels_last_3d and ndim == 5):
        return fmt
    return torch.contiguous_format
