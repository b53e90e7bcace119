"""What the three HDF5 layouts share (gems.data.layouts.own, exalearn, lbann): one file a sample or a universe,
``full`` counts and ``unitPar`` targets, read by gems.data.hdf5.HDF5Samples; they differ in where the channels
lie, the file names and the type the published tool writes."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from gems.data.layouts import Layout, Options, Samples
from gems.errors import ConfigError


class HDF5Layout(Layout):
    """A layout of ``full``/``unitPar`` HDF5 files; ``channels``: ``first`` ((C, *spatial) in the file) or
    ``last`` ((*spatial, C))."""

    suffixes: ClassVar[tuple[str, ...]] = (".h5", ".hdf5")
    channels: ClassVar[str] = "first"
    extension: ClassVar[str] = ".h5"  # of the files :meth:`write` writes
    stamp: ClassVar[bool] = False  # whether :meth:`write` names the layout in a ``layout`` attribute (gems's own)

    def headers(self, files: Sequence[Path]) -> dict[str, Any] | None:
        """The first file's ``full`` (shape, dtype), whether it has ``unitPar``, its attributes and where its
        channels lie (gems.data.hdf5.channels_of); None where it is no such file."""
        import h5py

        if not files:
            return None
        try:
            with h5py.File(files[0], "r") as f:
                full, par = f.get("full"), f.get("unitPar")
                if not isinstance(full, h5py.Dataset) or not isinstance(par, h5py.Dataset):
                    return None
                shape = tuple(int(n) for n in full.shape or ())
                attrs = {k: f.attrs[k] for k in f.attrs}
        except (OSError, KeyError, ValueError):
            return None
        order = None
        if len(shape) >= 3:
            order = ("first" if shape[0] < min(shape[1:]) else "last" if shape[-1] < min(shape[:-1]) else None)
        return {"shape": shape, "attrs": attrs, "channels": order, "name": files[0].name}

    def holds(self, files: Sequence[Path]) -> bool:
        """The first file's headers are this layout's: its ``layout`` attribute where it has one (gems's writers
        set it), else a file gems wrote before it did (its ``generator`` attribute) is gems's own, else the
        channels lie where this layout's do (or cannot be told) and the name is one the layout's tool writes
        (:meth:`named`)."""
        h = self.headers(files)
        if h is None:
            return False
        mark = h["attrs"].get("layout")
        if mark is not None:
            return _text(mark) == self.name
        if _text(h["attrs"].get("generator", "")).startswith("gems."):
            return self.name == "gems"
        return h["channels"] in (self.channels, None) and self.named(h["name"])

    def named(self, name: str) -> bool:
        """Whether the published tool writes files of this name."""
        return True

    def open(self, path: str | os.PathLike, shape: Sequence[int] | None, **options: Any) -> Samples:
        from gems.data.hdf5 import HDF5Samples

        o = Options(**options)
        if o.target != "vector":
            raise ConfigError("data.layout", self.name, "a layout with a class per voxel for a model of dense targets "
                              "(these files carry one target vector per sample), or data=synthetic")
        return HDF5Samples(path, shape, slices=o.slices, key=o.key, crop=o.crop, standardize=o.standardize,
                           augment=o.augment, readers=o.readers, layout=self)

    def arrange(self, counts: np.ndarray) -> np.ndarray:
        """A sample's counts (C, *spatial) as this layout's ``full`` holds them."""
        return counts if self.channels == "first" else np.moveaxis(counts, 0, -1)

    def write(self, folder: str | os.PathLike, samples: Iterable[tuple[np.ndarray, np.ndarray]],
              name: str = "sample_{:05d}", dtype: Any = None, *, sync: bool = False) -> list[Path]:
        """One file a sample, as h5py writes a numpy array (contiguous, unfiltered, little-endian), each written
        to a hidden name and renamed (a file is whole or not there; ``sync``: whole on the disk too, through a
        crash: gems.paths.commit, what ``gems data convert`` writes); ``dtype``: the counts' type (default:
        theirs)."""
        import h5py

        from gems.paths import commit

        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        files = []
        for i, (counts, target) in enumerate(samples):
            final = out / (name.format(i) + self.extension)
            tmp = out / f".{final.name}.tmp"
            with h5py.File(tmp, "w") as f:
                f["full"] = np.ascontiguousarray(self.arrange(np.asarray(counts, dtype=dtype)))
                f["unitPar"] = np.asarray(target)
                if self.stamp:
                    f.attrs["layout"] = self.name
            commit(tmp, final, sync)
            files.append(final)
        return files


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
