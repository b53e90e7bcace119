"""What the three HDF5 layouts share (gems.data.layouts.own, exalearn, lbann): one file a sample or a universe,
``full`` counts and ``unitPar`` targets, read by gems.data.hdf5.HDF5Samples; they differ in where the channels
lie, the file names and the type the published tool writes."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np

from gems.data.layouts import Layout, Samples


class HDF5Layout(Layout):
    """A layout of ``full``/``unitPar`` HDF5 files; ``channels``: ``first`` ((C, *spatial) in the file) or
    ``last`` ((*spatial, C))."""

    suffixes: ClassVar[tuple[str, ...]] = (".h5", ".hdf5")
    channels: ClassVar[str] = "first"
    extension: ClassVar[str] = ".h5"  # of the files :meth:`write` writes
    stamp: ClassVar[bool] = False  # whether :meth:`write` names the layout in a ``layout`` attribute (gems's own)
    #: the spatial edge of the files of the published set, where a file is a universe cut into crops (ExaLearn's:
    #: 512): what the planner takes a file to be where none is at hand (:meth:`fallback_rate`)
    published_edge: ClassVar[int | None] = None

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

    def broken(self, file: Path) -> str | None:
        """A ``full`` that is an external link to a missing file, named."""
        from gems.data.hdf5 import external_target

        target = external_target(file, "full")
        return f"{file.name}'s `full` is an external link to {target}, which is missing" if target else None

    def open(self, path: str | os.PathLike, shape: Sequence[int] | None, **options: Any) -> Samples:
        from gems.data.hdf5 import HDF5Samples

        o = self.options(**options)
        return HDF5Samples(path, shape, slices=o.slices, key=o.key, crop=o.crop, standardize=o.standardize,
                           augment=o.augment, readers=o.readers, layout=self)

    def fallback_rate(self, shape: Sequence[int], slices: Sequence[slice] | None = None) -> tuple[float, str]:
        """:attr:`thread_rate` (whole files) times the share of the bytes the reader reads that this rank's part of
        a sample holds (gems.data.reader.read_share: one rule with ``gems bench data``'s crop row): a sample is a
        crop of a file of :attr:`published_edge` where the model's edge is smaller and divides it (MLPerf's 128^3
        crops of ExaLearn's 512^3 universes: a crop's rows are 1 KiB runs 4 KiB apart, the reader reads 4x its
        bytes), else a file; int16 counts."""
        from gems.data.reader import read_share
        from gems.data.samples import full_slices

        channels, spatial = int(shape[0]), [int(n) for n in shape[1:]]
        edge = self.published_edge
        crop = edge is not None and all(n < edge and edge % n == 0 for n in spatial)
        files = [edge] * len(spatial) if crop and edge is not None else spatial
        part = list(full_slices(slices or (), spatial))
        if self.channels == "last":
            file_shape, sel = [*files, channels], [*part, slice(None)]
        else:
            file_shape, sel = [channels, *files], [slice(None), *part]
        share, g = read_share(file_shape, 2, sel)
        what = (f"{'x'.join(map(str, spatial))} crops of the published {'x'.join(map(str, files))} files"
                if crop else "a file a sample")
        if share < 0.999:
            what += (f": a part's rows are {g.run} B runs {g.strides[-1] if g.strides else g.run} B apart, the "
                     f"reader reads {1 / share:.2g}x its bytes")
        return self.thread_rate * share, what

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
