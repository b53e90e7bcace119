"""LBANN's split CosmoFlow crops (``split_cosmoflow_sample.py``, what LBANN's DistConv reads): one ``.hdf5`` file a crop,
``<universe>_<i>_<j>_<k>.hdf5``, whose ``full`` (C, W, H, D) is the universe's array fully transposed, its spatial
axes reversed; read as they lie, as LBANN does (docs/data.md, "LBANN's crops: the reversed axes").
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from gems.data.layouts import register
from gems.data.layouts._h5 import HDF5Layout


@register
class LBANN(HDF5Layout):
    name = "lbann"
    about = "LBANN's split crops: .hdf5 files, `full` (C, W, H, D) channels first, spatial axes reversed"
    channels = "first"
    extension = ".hdf5"

    def named(self, name: str) -> bool:
        return name.endswith(".hdf5")

    def arrange(self, counts: np.ndarray) -> np.ndarray:
        """A universe's crop (C, D, H, W) as the split script leaves it: the (D, H, W, C) array transposed."""
        return np.moveaxis(counts, 0, -1).transpose()

    def write(self, folder: str | os.PathLike, samples: Iterable[tuple[np.ndarray, np.ndarray]],
              name: str = "universe_{:05d}_0_0_0", dtype: Any = np.float32, *, sync: bool = False) -> list[Path]:
        """As the split script: float32 by default (``dtype=np.int16`` as ``--datatype int16``)."""
        return super().write(folder, samples, name, dtype, sync=sync)
