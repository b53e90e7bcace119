"""One case of the tiled layout as its file holds it (gems.data.layouts.tiles, which reads it): the writer, and the
mark detection reads. It lies below both the NIfTI layouts, whose ``convert`` writes cases (``data.tile=T``), and
the tiled layout, which extends them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gems.paths import commit

#: the mark the writer leaves (an attribute of the file) and detection reads
MARK = "tiles"


def write_case(path: Path, image: np.ndarray, label: np.ndarray, tile: int, slope: float = 1.0, inter: float = 0.0,
               affine: Any = None, classes: Sequence[str] | None = None, sync: bool = False) -> Path:
    """One case as the layout stores it (gems.data.layouts.tiles): ``image`` (z, y, x) as stored, ``label`` (z, y,
    x) on its voxels, chunked in tiles of ``tile`` voxels an edge (each edge at most the volume's), written to a
    hidden name and renamed when whole."""
    import h5py

    if image.shape != label.shape or image.ndim != 3:
        raise ValueError(f"a 3D image and labels of its shape, not {image.shape} and {label.shape}")
    chunks = tuple(min(int(tile), int(n)) for n in image.shape)
    tmp = path.with_name(f".{path.name}.tmp")
    with h5py.File(tmp, "w") as f:
        f.attrs["layout"] = MARK
        f.attrs["tile"] = int(tile)
        f.attrs["affine"] = np.asarray(affine if affine is not None else np.eye(4), dtype=np.float64)
        if classes:
            f.attrs["classes"] = json.dumps(list(classes))
        img = f.create_dataset("image", data=image, chunks=chunks)
        img.attrs["scl_slope"], img.attrs["scl_inter"] = float(slope), float(inter)
        f.create_dataset("label", data=label, chunks=chunks)
    commit(tmp, path, sync)
    return path
