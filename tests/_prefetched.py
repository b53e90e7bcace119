"""What the Prefetcher hands the step, read with and without a reader ahead (tests/test_hdf5.py, test_reader.py)."""
from __future__ import annotations

from typing import Any, Sequence

import torch


def prefetched(data: Any, ids: Sequence[int], syms: Sequence[int]) -> list[torch.Tensor]:
    """The input of steps 0 and 1 a Prefetcher of ``data`` (a rank's set: gems.rank.data._HDF5Batches) gives, reading
    in the step (depth 0) and on its thread (depth 1), each batch read raw and finished (gems.rank.data.finisher)."""
    from gems.rank.data import Prefetcher, finisher

    out = []
    for depth in (0, 1):
        pf = Prefetcher(lambda step: ([step], data.batch(list(ids), symmetries=list(syms), raw=True)[0], None),
                        [0, 1], depth, torch.device("cpu"), finisher(data))
        try:
            for step in (0, 1):
                (_, got, _), _ = pf.get(step)
                out.append(got)
        finally:
            pf.close()
    return out
