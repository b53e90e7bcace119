"""What every strategy agrees on about a sample's spatial extent, kept below all of them.

* How an extent is split into parts (:func:`split_bounds`: ``np.array_split``'s rule, the first parts one cell
  larger) and the largest part a cut makes (:func:`largest_part`): the spatial strategy cuts by them, and
  decisions that every rank must take alike (a pipeline's balance, the recomputed pieces) weigh a cut layer
  by the largest part.
* The tag an activation of a spatial part carries of the whole sample's spatial shape (:data:`GSHAPE`), which
  the pipeline carries across its cuts and the skip connections carry across theirs, without knowing what a
  halo is.

Nothing here imports gems; :mod:`gems.spatial.geometry` builds the rest of the cut's index arithmetic on it.
"""
from __future__ import annotations

from typing import Sequence

Range = tuple[int, int]

#: the attribute an activation of a spatial part carries: the whole sample's spatial shape
GSHAPE = "_gems_gshape"


def split_bounds(n: int, parts: int) -> list[Range]:
    """``[lo, hi)`` of each of ``parts`` parts of ``n`` cells (np.array_split's rule)."""
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
