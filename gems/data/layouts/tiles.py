"""Labelled volumes stored tile by tile (layout ``tiles``): what ``gems data convert data.tile=T`` writes of NIfTI cases,
one HDF5 file a case, its ``image`` and ``label`` (lined up at conversion) chunked in unfiltered T³ tiles, so that a
tile of the model's edge is one block read by position at the page cache's rate (docs/data.md, "Tiles that read at
the reader's rate"). The samples are the NIfTI reader's; a tile of another edge is read chunk by chunk, not fast.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from gems.data.layouts import Layout, Options, listing, register
from gems.data.layouts._case import MARK, write_case
from gems.data.layouts._grids import Grid
from gems.data.layouts.nifti import Case, Header, NiftiLayout, NiftiSamples
from gems.errors import ConfigError


def _headers(path: Path, key: str) -> tuple[Header, Header, list[str] | None, int]:
    """(the image's :class:`Header`, the labels', the classes' names, the tile edge) of one case file; a file that
    is not one is bad input naming it."""
    import h5py

    from gems.data.hdf5 import chunks_of
    from gems.data.samples import stamp

    try:
        was = stamp(path)
        with h5py.File(path, "r") as f:
            if f.attrs.get("layout") != MARK or "image" not in f or "label" not in f:
                raise ConfigError(key, str(path.parent), f"cases gems data convert data.tile=T wrote (an `image` and "
                                  f"a `label` a file); {path.name} is not one")
            heads = []
            for name in ("image", "label"):
                ds = f[name]
                chunks = chunks_of(ds)
                if chunks is None or chunks.filters or ds.ndim != 3:
                    raise ConfigError(key, str(path.parent), f"cases of unfiltered 3D tiles; {path.name}'s `{name}` is "
                                      "stored otherwise (write it again with gems data convert)")
                attrs = ds.attrs
                heads.append(Header(path, tuple(int(n) for n in ds.shape), np.dtype(ds.dtype), None,  # type: ignore[arg-type]
                                    float(attrs.get("scl_slope", 1.0)), float(attrs.get("scl_inter", 0.0)), was,
                                    tuple(tuple(float(v) for v in row) for row in np.asarray(f.attrs["affine"])),
                                    chunks))
            classes = json.loads(f.attrs["classes"]) if "classes" in f.attrs else None
            tile = int(f.attrs.get("tile", 0))
    except OSError as e:
        raise ConfigError(key, str(path.parent), f"HDF5 files h5py reads; {path.name} is not one "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
    return heads[0], heads[1], classes, tile


@register
class TilesLayout(NiftiLayout):
    name: ClassVar[str] = "tiles"
    about: ClassVar[str] = ("labelled volumes stored tile by tile, one HDF5 file a case (what gems data convert "
                            "data.tile=T writes of NIfTI volumes), for model=unet3d")
    suffixes: ClassVar[tuple[str, ...]] = (".h5",)
    fast: ClassVar[bool] = True
    thread_rate: ClassVar[float] = 4.4e9  # a tile one block: as the contiguous layouts (gems.data.layouts)
    labels_where: ClassVar[str] = "a case's `label` beside its `image`"

    def files(self, path: str | os.PathLike) -> list[Path]:
        p = Path(path)
        if p.is_dir():
            return [p / n for n in listing(p) if n.endswith(".h5")]
        return [p] if p.is_file() and p.name.endswith(".h5") else []

    def companions(self, file: Path) -> list[Path]:
        return []  # (a case's labels lie in its own file)

    #: read where they lie: nothing for gems data convert to do (the protocol's own, not the NIfTI layout's)
    converted_name = Layout.converted_name
    convert = Layout.convert

    def holds(self, files: Sequence[Path]) -> bool:
        import h5py

        if not files:
            return False
        try:
            with h5py.File(files[0], "r") as f:
                return bool(f.attrs.get("layout") == MARK)
        except OSError:
            return False

    def case(self, volume: Path, key: str, path: str, tolerance: float | None = None, whole: bool = False) -> Case:
        v, g, _, _ = _headers(volume, key)
        if g.shape != v.shape:
            raise ConfigError(key, path, f"labels of their image's shape; {volume.name}'s `label` holds "
                              f"{list(g.shape)}, its `image` {list(v.shape)} (z, y, x)")
        return Case(((v, Grid()),), (g, Grid()))  # lined up when written

    def class_names(self, path: str | os.PathLike) -> list[str] | None:
        files = self.files(path)
        return _headers(files[0], "data.path")[2] if files else None

    def declared(self, path: str | os.PathLike) -> dict[str, list[str]]:
        """The classes the cases name (what their conversion kept of the task's)."""
        names = self.class_names(path)
        return {"model.num_classes": names} if names else {}

    def folder_notes(self, path: str | os.PathLike, key: str) -> list[str]:
        return []

    def open(self, path: str | os.PathLike, shape: Sequence[int] | None, **options: Any) -> NiftiSamples:
        samples = NiftiSamples(self, path, shape, Options(**options))
        tiles = {_headers(f, samples.key)[3] for f in samples.files[:1]}
        edge = samples.shape[1:]
        if tiles and any(t != e for t in tiles for e in edge):
            samples._notes.append(f"{samples.key}: cases stored in tiles of {sorted(tiles)[0]} read as tiles of "
                                  f"{'x'.join(map(str, edge))}: chunk by chunk, each chunk's part copied into place "
                                  f"(gems data convert data.tile={edge[0]} stores them as they are read)")
        return samples

    def write(self, folder: str | os.PathLike, samples: Iterable[tuple[np.ndarray, np.ndarray]],
              name: str = "case_{:04d}", tile: int | None = None, spacing: Sequence[float] = (0.8, 0.8, 1.5), *,
              sync: bool = False) -> list[Path]:
        """Cases from (voxels (1, z, y, x) or (z, y, x) in Hounsfield units, labels (z, y, x)) pairs: int16 voxels,
        uint8 labels, tiles of ``tile`` (None: a case one tile)."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        affine = np.diag([*(float(s) for s in spacing), 1.0])
        files = []
        for i, (voxels, labels) in enumerate(samples):
            vol = np.asarray(voxels)
            vol = vol.reshape(vol.shape[-3:])
            files.append(write_case(out / f"{name.format(i)}.h5", vol.astype(np.int16),
                                    np.asarray(labels, dtype=np.uint8), tile or max(vol.shape), affine=affine,
                                    classes=("background", "liver", "tumour"), sync=sync))
        return files
