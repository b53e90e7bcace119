"""Partitioned reading of the ExaLearn CosmoFlow layout: each rank reads its part only.

One HDF5 file per sample: dataset ``full`` shaped (C, D, H, W) (or (C, H, W)
for 2D), int16 particle counts, and ``unitPar``, the 4 normalised
cosmological parameters (the regression target). Counts become
``log(x + 1)`` in float32, as in the MLPerf HPC reference.

Under spatial parallelism a 512^3 sample is 1 GiB of int16; reading it whole
on every rank would multiply the I/O by S. :func:`read_sample` reads one
hyperslab (h5py passes the slices to HDF5 as a hyperslab selection, so only
those bytes are read), and :class:`HDF5Samples` picks the hyperslab of this
rank from its :class:`gems.spatial.SpatialContext`: the I/O is partitioned
like the sample. ``source`` may be a path or an open binary file object
(h5py reads through it), which is how the tests count the bytes read.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import numpy as np
import torch

from gems.data import augment as augmentation
from gems.errors import ConfigError

Source = str | os.PathLike | BinaryIO


def _h5() -> Any:
    import h5py

    return h5py


def _name(source: Source) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else str(getattr(source, "name", source))


def sample_shape(source: Source) -> tuple[int, ...]:
    """(C, *spatial) of the ``full`` dataset, from the file's metadata."""
    with _h5().File(source, "r") as f:
        if "full" not in f:
            raise ConfigError("data.path", _name(source), "HDF5 files with a `full` dataset (C, D, H, W) and `unitPar`")
        return tuple(int(n) for n in f["full"].shape)


#: the file dtypes a sample's counts keep until :func:`transform` (torch holds them); others become float32 at once
_RAW_DTYPES = {np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.int32, np.int64, np.float16, np.float32,
                                     np.float64)}


def read_sample(source: Source, slices: Sequence[slice] | None = None, log1p: bool = True,
                standardize: tuple[float, float] | None = None, raw: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Read the part ``slices`` (one per spatial dim; None: all) of one sample.

    Returns ``(x, target)``: ``x`` float32 shaped (C, *part), ``log(x+1)`` of
    the counts when ``log1p``, then ``(x - mean) / std`` with ``standardize`` (:func:`transform`); ``target`` the
    float32 ``unitPar`` vector. ``raw``: ``x`` the counts as the file holds them (int16 in the ExaLearn layout: half
    the float's bytes), for :func:`transform` to finish where the step runs.
    """
    with _h5().File(source, "r") as f:
        ds = f["full"]
        sel = (slice(None), *(slices if slices is not None else ()))
        arr = np.empty(_sel_shape(ds.shape, sel), dtype=ds.dtype)
        if arr.size:
            ds.read_direct(arr, source_sel=sel)
        target = torch.from_numpy(np.asarray(f["unitPar"][()], dtype=np.float32).reshape(-1))
    x = torch.from_numpy(arr if arr.dtype in _RAW_DTYPES else arr.astype(np.float32))
    return (x if raw else transform(x, log1p, standardize)), target


def read_into(slot: torch.Tensor, source: Source, slices: Sequence[slice] | None = None) -> torch.Tensor:
    """Read the part ``slices`` of one sample's counts straight into ``slot`` (a contiguous host tensor of the
    part's shape, say a batch's row in pinned memory; HDF5 converts the file's type to the slot's), without a
    copy in between; returns the sample's target."""
    with _h5().File(source, "r") as f:
        ds = f["full"]
        sel = (slice(None), *(slices if slices is not None else ()))
        if slot.numel():
            ds.read_direct(slot.numpy(), source_sel=sel)
        return torch.from_numpy(np.asarray(f["unitPar"][()], dtype=np.float32).reshape(-1))


def raw_dtype(dtype: np.dtype) -> torch.dtype:
    """The type a file's counts of ``dtype`` are held in until :func:`transform`: their own where torch holds
    it, else float32."""
    return torch.from_numpy(np.empty(0, dtype=dtype if dtype in _RAW_DTYPES else np.float32)).dtype


def transform(x: torch.Tensor, log1p: bool = True, standardize: tuple[float, float] | None = None) -> torch.Tensor:
    """Counts to the network's input, elementwise on whatever device ``x`` is on: float32, ``log(x+1)`` when
    ``log1p``, then ``(x - mean) / std``. The same operations in the same order on every path, so a batch
    transformed on the host after stacking equals one whose samples were transformed one by one, bit for bit."""
    x = x.to(torch.float32)
    if log1p:
        x = torch.log1p(x)
    if standardize is not None:
        mean, std = standardize
        x = (x - float(mean)) / float(std)
    return x


def read_target(source: Source) -> torch.Tensor:
    """Only the ``unitPar`` target of a sample (for ranks that compute the loss but read no input)."""
    with _h5().File(source, "r") as f:
        return torch.from_numpy(np.asarray(f["unitPar"][()], dtype=np.float32).reshape(-1))


def _sel_shape(shape: Sequence[int], sel: Sequence[slice]) -> tuple[int, ...]:
    full = list(sel) + [slice(None)] * (len(shape) - len(sel))
    return tuple(len(range(*s.indices(n))) for s, n in zip(full, shape))


class HDF5Samples:
    """The samples under ``path`` (a directory of ``*.h5``, sorted by name, or one file).

    ``expected_shape`` (C, *spatial) is the model's input. A file of that shape is one sample; a file larger by
    a whole multiple in every spatial dim (a universe) is cut into crops of that shape, each a sample read as
    its own hyperslab (sample ``i`` is crop ``i % k`` of file ``i // k``, the crops in row-major order), so under
    spatial parallelism a rank still reads only its part of its crop. ``crop`` (``data.crop``) states the crop
    edge; it must be the model's. A file that does not match is a :class:`ConfigError` naming it: the first
    here, every other when it is first read; :meth:`check_all` checks them all up front (the CLI's pre-launch
    check). With ``ctx`` each item is this rank's part; ``slices`` picks a part by hand.
    """

    def __init__(self, path: str | os.PathLike, expected_shape: Sequence[int] | None = None, ctx: Any = None,
                 slices: Sequence[slice] | None = None, log1p: bool = True, key: str = "data.path",
                 crop: int | None = None, standardize: Sequence[float] | None = None, augment: str = "none") -> None:
        p = Path(path)
        self.path, self.is_dir, self.key = str(path), p.is_dir(), key  # key: the setting that names the folder
        self.files = sorted(p.glob("*.h5")) if self.is_dir else ([p] if p.is_file() else [])
        if not self.files:
            raise ConfigError(key, str(path), "a directory of .h5 sample files (`gems data synth` writes one)")
        self.expected = tuple(int(n) for n in expected_shape) if expected_shape is not None else None
        if crop is not None and self.expected is not None and any(int(crop) != n for n in self.expected[1:]):
            raise ConfigError("data.crop", crop, f"the model's input edge ({'x'.join(map(str, self.expected[1:]))}: "
                              "a crop is one sample), or null for it")
        self.file_shape: tuple[int, ...] | None = None
        self.file_dtype = np.dtype(np.float32)  # the first file's counts' type (set by _check)
        self.file_shape = self._check(0)
        self.shape = self.expected if self.expected is not None else self.file_shape  # one sample's (C, *spatial)
        self.grid = tuple(f // s for f, s in zip(self.file_shape[1:], self.shape[1:]))  # crops per spatial dim
        self.crops = math.prod(self.grid)
        self.log1p = log1p
        self.standardize = _standardize(standardize)
        self.slices = tuple(slices) if slices is not None else (ctx.local_slices(self.shape[1:]) if ctx is not None else None)
        self._checked = {0}
        edges = self.shape[1:]
        if augment not in augmentation.KINDS:
            raise ConfigError("data.augment", augment, " | ".join(augmentation.KINDS))
        if augment == "cube" and len(set(edges)) > 1:
            raise ConfigError("data.augment", augment, f"flip or none (a sample of {'x'.join(map(str, edges))} is not "
                                                       "a cube: swapping its axes changes its shape)")
        self.symmetries = augmentation.count(augment, len(edges))  # data.augment draws among these

    def check_all(self, count: int | None = None, target_size: int | None = None) -> None:
        """Check the metadata of every file the first ``count`` samples read (all files when None),
        in order: the first bad one is a :class:`ConfigError` naming it. Only headers are read
        (the datasets' shapes and dtypes), never the samples; ``target_size``: the length
        ``unitPar`` must have (the model's outputs)."""
        n = len(self.files) if count is None else min(len(self.files), -(-max(0, int(count)) // self.crops))
        for i in range(n):
            self._check(i, target_size)
        self._checked.update(range(n))

    def _check(self, index: int, target_size: int | None = None) -> tuple[int, ...]:
        """(C, *spatial) of file ``index``, after checking its layout (headers only) against the model."""
        file = self.files[index]
        h5 = _h5()

        def bad(expected: str, found: str) -> ConfigError:
            where = f"{file.name} (file {index + 1} of {len(self.files)})" if self.is_dir else "the file"
            return ConfigError(self.key, self.path, f"{expected}; {where} has {_oneline(found)}")

        layout = "HDF5 sample files, each with a `full` dataset (C, *spatial) of counts and a `unitPar` target vector"
        try:
            with h5.File(file, "r") as f:
                meta = {k: (d.shape, d.dtype) if isinstance(d, h5.Dataset) else None
                        for k, d in (("full", f.get("full")), ("unitPar", f.get("unitPar")))}
        except OSError as e:  # not HDF5, truncated, unreadable
            raise bad(layout, f"an unreadable file ({type(e).__name__}: {e})") from None
        full, par = meta["full"], meta["unitPar"]
        if full is None or par is None:
            raise bad(layout, f"no `{'full' if full is None else 'unitPar'}` dataset")
        (shape, dtype), (pshape, pdtype) = full, par
        shape = tuple(int(n) for n in shape or ())  # shape None: an empty (null) dataspace
        if dtype.kind not in "iuf":
            raise bad("`full` of integer or float counts (int16 in the ExaLearn layout)", f"`full` of dtype {dtype}")
        if self.file_shape is None:
            self.file_dtype = np.dtype(dtype)
        if self.file_shape is not None and shape != self.file_shape:  # every file as the first
            raise bad(f"`full` shaped {list(self.file_shape)} as the first file", str(list(shape)))
        if self.expected is not None and not _holds_crops(shape, self.expected):
            raise bad(f"`full` shaped {list(self.expected)} (C, *spatial) to match the model, or a whole multiple "
                      "of it in every spatial dim (cut into crops of the model's size)", str(list(shape)))
        size = 0 if pshape is None else math.prod(pshape)
        if pdtype.kind not in "iuf" or size == 0 or (target_size is not None and size != int(target_size)):
            want = f"{int(target_size)} numbers" if target_size is not None else "numbers"
            raise bad(f"`unitPar` of {want} (the target vector, one value per model output)",
                      f"`unitPar` shaped {list(pshape or ())} of dtype {pdtype}")
        return shape

    def __len__(self) -> int:
        return len(self.files) * self.crops

    def locate(self, index: int) -> tuple[int, tuple[int, ...]]:
        """(file, the crop's origin per spatial dim) of sample ``index``."""
        i = index % len(self)
        file, crop = divmod(i, self.crops)
        origin, rest = [], crop
        for n, edge in zip(reversed(self.grid), reversed(self.shape[1:])):
            rest, k = divmod(rest, n)
            origin.append(k * edge)
        return file, tuple(reversed(origin))

    def group(self, index: int) -> int:
        """The file (universe) sample ``index`` is cut from: validation averages a file's crops."""
        return self.locate(index)[0]

    def _file(self, i: int) -> Path:
        if i not in self._checked:
            self._check(i)
            self._checked.add(i)
        return self.files[i]

    def _hyperslab(self, index: int, symmetry: int) -> tuple[Path, tuple[slice, ...] | None]:
        """(file, the hyperslab to read: None for all of it) of sample ``index``'s part under ``symmetry``
        (gems.data.augment: the part it comes from)."""
        file, origin = self.locate(index)
        edges = self.shape[1:]
        parts = self.slices if self.slices is not None else tuple(slice(0, n) for n in edges)
        if symmetry:
            parts = augmentation.source_slices(symmetry, _full_slices(parts, edges), edges)
        if self.crops > 1:
            parts = tuple(slice(o + s.start, o + s.stop) for o, s in zip(origin, _full_slices(parts, edges)))
        whole = self.crops == 1 and self.slices is None  # the symmetry of a whole sample is read from all of it
        return self._file(file), None if whole else parts

    def part_shape(self) -> tuple[int, ...]:
        """(C, *this rank's part) of every sample."""
        edges = self.shape[1:]
        return (self.shape[0], *(s.stop - s.start for s in _full_slices(self.slices or (), edges)))

    def __getitem__(self, index: int, symmetry: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``index`` (this rank's part of it), transformed by the box's ``symmetry`` (gems.data.augment:
        the part it comes from is the hyperslab read)."""
        file, hyperslab = self._hyperslab(index, symmetry)
        x, y = read_sample(file, hyperslab, self.log1p, self.standardize)
        return augmentation.apply(symmetry, x), y

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """Raw counts (``raw=True``) to the network's input, on their device (:func:`transform`)."""
        return transform(x, self.log1p, self.standardize)

    def target(self, index: int) -> torch.Tensor:
        """Only the target of sample ``index`` (a rank that computes the loss but reads no input)."""
        return read_target(self._file(self.locate(index)[0]))

    def batch(self, indices: Sequence[int], symmetries: Sequence[int] | None = None, raw: bool = False,
              pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked parts ``(N, C, *part)`` and targets ``(N, 4)`` of the samples ``indices``, each transformed by
        its symmetry in ``symmetries`` (None: none): their counts, each read straight into its row of the batch (a
        mirrored or turned one copied there once), then through :meth:`finish`; ``raw``: the counts, for
        :meth:`finish` where the step runs, in pinned memory with ``pin`` (a GPU rank's batch, which its copy to the GPU then
        takes as it is)."""
        if not raw:
            x, y = self.batch(indices, symmetries, raw=True)
            return self.finish(x), y
        syms = [int(k) for k in symmetries] if symmetries is not None else [0] * len(indices)
        out = torch.empty((len(indices), *self.part_shape()), dtype=raw_dtype(self.file_dtype), pin_memory=pin)
        targets = []
        for row, i, k in zip(out, indices, syms):
            file, hyperslab = self._hyperslab(i, k)
            if k == 0:
                targets.append(read_into(row, file, hyperslab))
            else:
                x, y = read_sample(file, hyperslab, raw=True)
                row.copy_(augmentation.apply(k, x, contiguous=False))
                targets.append(y)
        return out, torch.stack(targets)


def _standardize(value: Sequence[float] | None) -> tuple[float, float] | None:
    """``data.standardize``, checked: [mean, std] with std > 0, or None."""
    if value is None:
        return None
    try:
        mean, std = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError("data.standardize", value, "[mean, std] of log(1+counts), or null") from None
    if not std > 0:
        raise ConfigError("data.standardize", [mean, std], "[mean, std] with std > 0")
    return mean, std


def _holds_crops(shape: Sequence[int], sample: Sequence[int]) -> bool:
    """A file of ``shape`` is samples of ``sample``'s shape: the same channels, and whole multiples of it."""
    return (len(shape) == len(sample) and shape[0] == sample[0]
            and all(f >= s > 0 and f % s == 0 for f, s in zip(shape[1:], sample[1:])))


def _full_slices(parts: Sequence[slice], spatial: Sequence[int]) -> tuple[slice, ...]:
    """``parts`` with explicit bounds, one per spatial dim."""
    full = list(parts) + [slice(None)] * (len(spatial) - len(parts))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(full, spatial))


def _oneline(text: str) -> str:
    return " ".join(str(text).split())
