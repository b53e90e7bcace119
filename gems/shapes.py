"""What every strategy agrees on about a sample's spatial extent, kept below all of them: how an extent splits into
parts (:func:`split_bounds`, :func:`largest_part`, by which decisions every rank takes alike weigh a cut layer), and
the tag an activation of a spatial part carries of the whole sample's shape (:data:`GSHAPE`), which pipeline cuts
and skip connections carry without knowing what a halo is.
"""
from __future__ import annotations

from typing import Sequence

Range = tuple[int, int]

#: the attribute an activation of a spatial part carries: the whole sample's spatial shape
GSHAPE = "_gems_gshape"


def split_bounds(n: int, parts: int) -> list[Range]:
    """``[lo, hi)`` of each of ``parts`` parts of ``n`` cells (np.array_split's rule: the first parts one cell larger)."""
    q, r = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + q + (1 if i < r else 0)
        out.append((lo, hi))
        lo = hi
    return out


def largest_part(extent: Sequence[int], parts: Sequence[int], dims: Sequence[int]) -> list[int]:
    """The extents of the largest part of ``extent`` cut into ``parts`` along ``dims``: the first along each, as
    :func:`split_bounds` makes the first part the largest. What every rank weighs a spatial layer by, so that
    decisions taken on it (pipeline balances, recomputed pieces) agree on every rank."""
    part = [int(v) for v in extent]
    for k, d in zip(parts, dims):
        lo, hi = split_bounds(part[d], int(k))[0]
        part[d] = hi - lo
    return part
