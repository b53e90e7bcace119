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

A run reads its batches with :meth:`HDF5Samples.read`: each file's headers once (h5py: the dataset's shape,
type and byte offset, the target), then the counts of a contiguous dataset by positional reads on the
rank's ``data.readers`` threads (gems.data.reader: h5py's lock would keep them to one), straight into the
batch's rows, through open files it keeps; a chunked or compressed file through h5py, as before. A sample's
symmetry (``data.augment``) is applied after the read, where the batch is finished (:class:`Counts`).
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import numpy as np
import torch

from gems.data import augment as augmentation
from gems.data import reader as preader
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


@dataclass(frozen=True)
class Layout:
    """What reading a file needs from its headers, read once: the byte ``offset`` of ``full``'s data (None where
    they are not one contiguous, unfiltered block in the file: chunked, compressed, compact, external or
    unwritten, read through h5py), its ``shape`` and ``dtype``, and the sample's ``target`` (``unitPar``)."""

    offset: int | None
    shape: tuple[int, ...]
    dtype: np.dtype
    target: np.ndarray


def _offset(ds: Any) -> int | None:
    """Where dataset ``ds``'s data lie in its file, if they are one plain block there (module docstring)."""
    h5 = _h5()
    plist = ds.id.get_create_plist()
    if plist.get_layout() != h5.h5d.CONTIGUOUS or plist.get_external_count() or plist.get_nfilters():
        return None
    offset = ds.id.get_offset()
    if offset is None or ds.id.get_storage_size() != ds.size * ds.dtype.itemsize:
        return None
    return int(offset)


class Counts:
    """A batch of counts as :meth:`HDF5Samples.read` leaves it: row ``i`` of ``data`` (N, C, *part) holds
    sample ``i``'s counts as read, from the hyperslab its symmetry ``symmetries[i]`` takes them from
    (gems.data.augment.source_slices), in that hyperslab's own shape ``shapes[i]`` and C order. The symmetries
    are applied by :meth:`oriented`, where the batch is finished: on a GPU rank after the copy to its device
    (a permutation and mirrors move values without changing them, so it equals the host's batch bit for bit).
    It moves as a tensor does (``is_cuda``, ``pin_memory``, ``to``: what gems.rank.data.Prefetcher asks of a
    batch it copies to the device)."""

    def __init__(self, data: torch.Tensor, symmetries: Sequence[int], shapes: Sequence[tuple[int, ...]]) -> None:
        self.data, self.symmetries, self.shapes = data, tuple(int(k) for k in symmetries), tuple(shapes)

    @property
    def is_cuda(self) -> bool:
        return bool(self.data.is_cuda)

    def pin_memory(self) -> Counts:
        return self if self.data.is_pinned() else Counts(self.data.pin_memory(), self.symmetries, self.shapes)

    def to(self, device: Any, non_blocking: bool = False) -> Counts:
        return Counts(self.data.to(device, non_blocking=non_blocking), self.symmetries, self.shapes)

    def oriented(self) -> torch.Tensor:
        """The counts of each sample transformed by its symmetry (N, C, *part), on ``data``'s device."""
        if not any(self.symmetries):
            return self.data
        out = torch.empty_like(self.data)
        for row, dst, k, shape in zip(self.data, out, self.symmetries, self.shapes):
            dst.copy_(augmentation.apply(k, row.view(shape), contiguous=False))
        return out


class HDF5Samples:
    """The samples under ``path`` (a directory of ``*.h5``, sorted by name, or one file).

    ``expected_shape`` (C, *spatial) is the model's input. A file of that shape is one sample; a file larger by
    a whole multiple in every spatial dim (a universe) is cut into crops of that shape, each a sample read as
    its own hyperslab (sample ``i`` is crop ``i % k`` of file ``i // k``, the crops in row-major order), so under
    spatial parallelism a rank still reads only its part of its crop. ``crop`` (``data.crop``) states the crop
    edge; it must be the model's. A file that does not match is a :class:`ConfigError` naming it: the first
    here, every other when it is first read; :meth:`check_all` checks them all up front (the CLI's pre-launch
    check). With ``ctx`` each item is this rank's part; ``slices`` picks a part by hand. ``readers``
    (``data.readers``): the threads :meth:`read` reads on; the files it reads stay open (a bounded number) until
    :meth:`close`, or until the set is collected.
    """

    def __init__(self, path: str | os.PathLike, expected_shape: Sequence[int] | None = None, ctx: Any = None,
                 slices: Sequence[slice] | None = None, log1p: bool = True, key: str = "data.path",
                 crop: int | None = None, standardize: Sequence[float] | None = None, augment: str = "none",
                 readers: int = 4) -> None:
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
        if isinstance(readers, bool) or not isinstance(readers, int) or readers < 1:
            raise ConfigError("data.readers", readers, "a positive number of threads reading a rank's samples")
        self.reader = preader.Reader(readers)  # no thread or open file before the first read
        self._layouts: dict[int, Layout] = {}

    def check_all(self, count: int | None = None, target_size: int | None = None) -> None:
        """Check the metadata of every file the first ``count`` samples read (all files when None),
        in order: the first bad one is a :class:`ConfigError` naming it. Only headers are read
        (the datasets' shapes and dtypes), never the samples; ``target_size``: the length
        ``unitPar`` must have (the model's outputs)."""
        n = len(self.files) if count is None else min(len(self.files), -(-max(0, int(count)) // self.crops))
        for i in range(n):
            self._check(i, target_size)
        self._checked.update(range(n))

    def _check(self, index: int, target_size: int | None = None, keep: bool = False) -> tuple[int, ...]:
        """(C, *spatial) of file ``index``, after checking its layout (headers only) against the model;
        ``keep``: also keep what reading it needs (:class:`Layout`: its offset and its target, read here once)."""
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
                found = ((_offset(f["full"]), f["unitPar"][()])
                         if keep and meta["full"] is not None and meta["unitPar"] is not None else None)
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
        if found is not None:
            offset, par_values = found
            self._layouts[index] = Layout(offset if shape else None, shape, np.dtype(dtype),
                                          np.asarray(par_values, dtype=np.float32).reshape(-1))
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

    def _layout(self, i: int) -> Layout:
        """File ``i``'s :class:`Layout`, from its headers the first time (checked then, if it was not yet)."""
        if i not in self._layouts:
            self._check(i, keep=True)
            self._checked.add(i)
        return self._layouts[i]

    def _file(self, i: int) -> Path:
        if i not in self._checked:
            self._check(i)
            self._checked.add(i)
        return self.files[i]

    def _hyperslab(self, index: int, symmetry: int) -> tuple[int, tuple[slice, ...] | None]:
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
        return file, None if whole else parts

    def part_shape(self) -> tuple[int, ...]:
        """(C, *this rank's part) of every sample."""
        edges = self.shape[1:]
        return (self.shape[0], *(s.stop - s.start for s in _full_slices(self.slices or (), edges)))

    def __getitem__(self, index: int, symmetry: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``index`` (this rank's part of it), transformed by the box's ``symmetry`` (gems.data.augment:
        the part it comes from is the hyperslab read)."""
        file, hyperslab = self._hyperslab(index, symmetry)
        x, y = read_sample(self._file(file), hyperslab, self.log1p, self.standardize)
        return augmentation.apply(symmetry, x), y

    def finish(self, x: torch.Tensor | Counts) -> torch.Tensor:
        """Raw counts (``raw=True``, or :meth:`read`'s, whose symmetries are applied first) to the network's
        input, on their device (:func:`transform`)."""
        return transform(x.oriented() if isinstance(x, Counts) else x, self.log1p, self.standardize)

    def target(self, index: int) -> torch.Tensor:
        """Only the target of sample ``index`` (a rank that computes the loss but reads no input)."""
        return torch.from_numpy(self._layout(self.locate(index)[0]).target.copy())

    def read(self, indices: Sequence[int], symmetries: Sequence[int] | None = None, pin: bool = False,
             out: torch.Tensor | None = None) -> tuple[Counts, torch.Tensor]:
        """The counts of the samples ``indices`` (this rank's part of each) as :class:`Counts`, and their targets
        (N, 4). Each sample is read straight into its row of one batch (pinned with ``pin``: a GPU rank's, which
        its copy to the device takes as it is; ``out``: that batch, contiguous, of the counts' type), from the
        hyperslab its symmetry in ``symmetries`` (None: none) takes it from; the symmetries are applied where
        the batch is finished (:meth:`finish`). A contiguous dataset is read by positional reads on the
        ``readers`` threads (gems.data.reader), any other through h5py (one at a time: h5py's lock) beside
        them; the targets come from the files' headers, read once."""
        syms = [int(k) for k in symmetries] if symmetries is not None else [0] * len(indices)
        shape = (len(indices), *self.part_shape())
        dtype = raw_dtype(self.file_dtype)
        if out is None:
            out = torch.empty(shape, dtype=dtype, pin_memory=pin)
        elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"out: a contiguous host tensor of {shape} {dtype}, not {tuple(out.shape)} {out.dtype}")
        flat = out.numpy().reshape(-1).view(np.uint8)
        kind = out.numpy().dtype
        row_bytes = flat.nbytes // max(1, len(indices))
        tasks: list[preader.Task] = []
        others: list[Any] = []
        shapes, targets = [], []
        for r, (i, k) in enumerate(zip(indices, syms)):
            f, hyperslab = self._hyperslab(i, k)
            lay = self._layout(f)
            sel = (slice(None), *(hyperslab if hyperslab is not None else ()))
            shapes.append(_sel_shape(lay.shape, sel))
            targets.append(torch.from_numpy(lay.target))
            if not row_bytes:
                continue
            if lay.offset is not None and lay.dtype.newbyteorder("=") == kind:
                swap = kind if not lay.dtype.isnative and kind.itemsize > 1 else None
                tasks += preader.tasks(str(self.files[f]), lay.offset, preader.grid(lay.shape, kind.itemsize, sel),
                                       flat[r * row_bytes:(r + 1) * row_bytes], swap)
            else:  # through h5py, which converts another type to the row's
                others.append(functools.partial(read_into, out[r].view(shapes[-1]), self.files[f], hyperslab))
        self.reader.run(tasks, others)
        return Counts(out, syms, shapes), torch.stack(targets) if targets else torch.empty(0, 0)

    def batch(self, indices: Sequence[int], symmetries: Sequence[int] | None = None, raw: bool = False,
              pin: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked parts ``(N, C, *part)`` and targets ``(N, 4)`` of the samples ``indices``, each transformed by
        its symmetry in ``symmetries`` (None: none): :meth:`read` (into pinned memory with ``pin``), then
        :meth:`finish` on the host; ``raw``: the counts, each sample's symmetry applied (:meth:`Counts.oriented`)."""
        counts, targets = self.read(indices, symmetries, pin)
        return (counts.oriented() if raw else self.finish(counts)), targets

    def close(self) -> None:
        """Stop the reader's threads and close its files (a later read opens them again)."""
        self.reader.close()


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
