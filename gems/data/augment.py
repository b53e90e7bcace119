"""Augmentation by the symmetries of the sample's box (``data.augment``: ``flip`` any subset of the spatial dims, ``cube``
also their permutations, 48 for a 3D cube), exact under spatial parallelism: a sample's symmetry is drawn from
(train.seed, epoch, sample), the same on every rank, and a rank reads the part of the untransformed sample its part
comes from (:func:`source_slices`) and transforms it locally (:func:`apply`). Symmetry 0 is the identity.
"""
from __future__ import annotations

import itertools
import math
from typing import Sequence

import torch

from gems.config import owned

KINDS = ("none", "flip", "cube")
owned("data.augment", lambda: KINDS)  # the configuration checks and prints them (gems.config.owned)


def count(kind: str, ndim: int) -> int:
    """How many symmetries ``kind`` draws from for ``ndim`` spatial dims (1: none)."""
    if kind == "none":
        return 1
    return (math.factorial(ndim) if kind == "cube" else 1) * 2 ** ndim


def _parts(k: int, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(permutation of the spatial dims, the dims flipped after it) of symmetry ``k``: ``permutations[k // 2^d]``,
    then flips by the bits of ``k % 2^d``, so the transformed sample is ``y = flip(x.permute(0, 1 + p[0], ..,
    1 + p[d-1]), dims whose bit is set)``."""
    perms = list(itertools.permutations(range(ndim)))
    p, bits = divmod(int(k), 2 ** ndim)
    if not 0 <= p < len(perms):
        raise ValueError(f"symmetry {k} of a {ndim}D box: at most {len(perms) * 2 ** ndim - 1}")
    return perms[p], tuple(d for d in range(ndim) if bits >> d & 1)


def source_slices(k: int, slices: Sequence[slice], edges: Sequence[int]) -> tuple[slice, ...]:
    """The part of the untransformed sample (edges ``edges``) that part ``slices`` (explicit bounds, one per
    spatial dim) of the sample transformed by symmetry ``k`` comes from."""
    perm, flips = _parts(k, len(edges))
    out: list[slice] = [slice(0, 0)] * len(edges)
    for d, s in enumerate(slices):
        n = edges[perm[d]]
        out[perm[d]] = slice(n - s.stop, n - s.start) if d in flips else slice(s.start, s.stop)
    return tuple(out)


def apply(k: int, part: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    """The part read at :func:`source_slices` (C, *spatial), transformed by symmetry ``k``; ``contiguous=False``:
    in whatever layout the permutation leaves (for a copy into a batch's row, which lays it out once)."""
    if k == 0:
        return part
    perm, flips = _parts(k, part.dim() - 1)
    y = part.permute(0, *(1 + p for p in perm))
    y = torch.flip(y, [1 + d for d in flips]) if flips else y
    return y.contiguous() if contiguous else y


def draw(symmetries: int, n: int, generator: torch.Generator) -> list[int] | None:
    """Symmetry of each of ``n`` samples, among ``symmetries`` (:func:`count`; None for 1), drawn from
    ``generator`` (the sampler seeds it from (train.seed, epoch))."""
    if symmetries <= 1:
        return None
    return torch.randint(0, int(symmetries), (int(n),), generator=generator).tolist()
