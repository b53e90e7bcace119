"""Partitioned reading of the HDF5 sample layouts (gems's own, ExaLearn's universes, LBANN's crops): each rank reads its
part only. A 512³ sample is 1 GiB of int16, so reading it whole on every rank would multiply the I/O by S: a rank
reads its hyperslab (:class:`HDF5Samples` picks it from the spatial context), a contiguous dataset by positional reads
on its reader threads, a chunked one chunk by chunk (docs/data.md, "Chunked and compressed HDF5 files").
"""
from __future__ import annotations

import functools
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import numpy as np
import torch

from gems.data import augment as augmentation
from gems.data import reader as preader
from gems.data.layouts import FileSamples
from gems.data.samples import RAW_DTYPES as _RAW_DTYPES
from gems.data.samples import Counts, change, finished, holds_crops, raw_dtype, stamp, transform
from gems.data.samples import native as _native
from gems.data.samples import standardize as _standardize
from gems.errors import ConfigError

__all__ = ["Counts", "HDF5Samples", "change", "raw_dtype", "read_sample", "sample_shape", "stamp", "transform"]

Source = str | os.PathLike | BinaryIO


def _h5() -> Any:
    import h5py

    return h5py


def _name(source: Source) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else str(getattr(source, "name", source))



def _spatial(channels: str, slices: Sequence[slice] | None, ndim: int) -> tuple[slice, ...]:
    """The file's selection of spatial ``slices`` (None: all) with every channel, in the file's order."""
    sp = tuple(slices) if slices is not None else ()
    if channels == "last":
        sp = sp + (slice(None),) * (ndim - 1 - len(sp))
        return (*sp, slice(None))
    return (slice(None), *sp)


def canonical(shape: Sequence[int], channels: str) -> tuple[int, ...]:
    """(C, *spatial) of a ``full`` shaped ``shape`` with its channels ``first`` or ``last``."""
    shape = tuple(int(n) for n in shape)
    return (shape[-1], *shape[:-1]) if channels == "last" and shape else shape


def sample_shape(source: Source, channels: str = "first") -> tuple[int, ...]:
    """(C, *spatial) of the ``full`` dataset, from the file's metadata."""
    with _h5().File(source, "r") as f:
        if "full" not in f:
            raise ConfigError("data.path", _name(source), "HDF5 files with a `full` dataset of counts and `unitPar`")
        return canonical(f["full"].shape, channels)


def read_sample(source: Source, slices: Sequence[slice] | None = None, log1p: bool = True,
                standardize: tuple[float, float] | None = None, raw: bool = False,
                channels: str = "first") -> tuple[torch.Tensor, torch.Tensor]:
    """Read the part ``slices`` (one per spatial dim; None: all) of one sample.

    Returns ``(x, target)``: ``x`` float32 shaped (C, *part) whatever the file's order (``channels``: where
    its channels lie), ``log(x+1)`` of the counts when ``log1p``, then ``(x - mean) / std`` with
    ``standardize`` (:func:`transform`); ``target`` the float32 ``unitPar`` vector. ``raw``: ``x`` the counts as
    the file holds them (int16 in ExaLearn's files: half the float's bytes), channels first, for
    :func:`transform` to finish where the step runs.
    """
    with _h5().File(source, "r") as f:
        ds = f["full"]
        sel = _spatial(channels, slices, len(ds.shape))
        arr = np.empty(_sel_shape(ds.shape, sel), dtype=_native(ds.dtype))
        if arr.size:
            ds.read_direct(arr, source_sel=sel)
        target = torch.from_numpy(np.asarray(f["unitPar"][()], dtype=np.float32).reshape(-1))
    x = torch.from_numpy(arr if arr.dtype in _RAW_DTYPES else arr.astype(np.float32))
    if channels == "last":
        x = x.movedim(-1, 0).contiguous()
    return (x if raw else transform(x, log1p, standardize)), target


def read_into(slot: torch.Tensor, source: Source, slices: Sequence[slice] | None = None,
              channels: str = "first") -> torch.Tensor:
    """Read the part ``slices`` of one sample's counts straight into ``slot`` (a contiguous host tensor of the
    part's shape in the file's order, say a batch's row in pinned memory; HDF5 converts the file's type to the
    slot's), without a copy in between; returns the sample's target."""
    with _h5().File(source, "r") as f:
        ds = f["full"]
        if slot.numel():
            ds.read_direct(slot.numpy(), source_sel=_spatial(channels, slices, len(ds.shape)))
        return torch.from_numpy(np.asarray(f["unitPar"][()], dtype=np.float32).reshape(-1))


def read_target(source: Source) -> torch.Tensor:
    """Only the ``unitPar`` target of a sample (for ranks that compute the loss but read no input)."""
    with _h5().File(source, "r") as f:
        return torch.from_numpy(np.asarray(f["unitPar"][()], dtype=np.float32).reshape(-1))


def _full_sel(sel: Sequence[slice], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(sel) + (slice(None),) * (len(shape) - len(sel))


def _sel_shape(shape: Sequence[int], sel: Sequence[slice]) -> tuple[int, ...]:
    full = list(sel) + [slice(None)] * (len(shape) - len(sel))
    return tuple(len(range(*s.indices(n))) for s, n in zip(full, shape))


@dataclass(frozen=True)
class Header:
    """What reading a file needs from its headers, read once: the byte ``offset`` of ``full``'s data in the file
    ``source`` that holds them (the file itself, or the one an external link leads to), None where they are not
    one contiguous, unfiltered block (``why``: chunked, compressed, external, virtual or unwritten: read through
    h5py), its ``shape`` (the file's order) and ``dtype``, and the sample's ``target`` (``unitPar``). The files
    read are stamped by the samples (gems.data.layouts.FileSamples.remember): a file that changes under the run
    is named, not read at its old offset."""

    offset: int | None
    shape: tuple[int, ...]
    dtype: np.dtype
    target: np.ndarray
    source: str = ""
    why: str | None = None
    chunks: Chunks | None = None


@dataclass(frozen=True)
class Chunks:
    """A chunked dataset's chunks, each read by position and its filters undone here (deflate, shuffle), on the
    reader's threads (zlib and numpy let the GIL go): ``shape`` a chunk's, ``filters`` in the order they were
    applied when written, ``index`` each written chunk's (logical offset, byte offset, bytes, filter mask),
    ``fill`` the dataset's fill value (what HDF5 reads where no chunk was written)."""

    shape: tuple[int, ...]
    filters: tuple[int, ...]
    index: tuple[tuple[tuple[int, ...], int, int, int], ...]
    fill: Any = 0

    def complete(self, shape: Sequence[int]) -> bool:
        """Whether every chunk of a dataset of ``shape`` is written (else the others hold :attr:`fill`)."""
        return len(self.index) == math.prod(-(-int(n) // c) for n, c in zip(shape, self.shape))


#: HDF5's filters the reader undoes itself (h5py.h5z's FILTER_DEFLATE and FILTER_SHUFFLE); a file of any other
#: is read through h5py
DEFLATE, SHUFFLE = 1, 2


def chunks_of(ds: Any) -> Chunks | None:
    """The chunks of dataset ``ds`` where the reader can read them itself (no filter but deflate and shuffle, undone
    here on the reader threads: zlib lets the GIL go), else None (h5py reads it, one file at a time)."""
    h5 = _h5()
    plist = ds.id.get_create_plist()
    if plist.get_layout() != h5.h5d.CHUNKED or plist.get_external_count():
        return None
    filters = tuple(int(plist.get_filter(i)[0]) for i in range(plist.get_nfilters()))
    if any(f not in (DEFLATE, SHUFFLE) for f in filters) or not hasattr(ds.id, "get_chunk_info"):
        return None
    index = []
    for i in range(ds.id.get_num_chunks()):
        info = ds.id.get_chunk_info(i)
        index.append((tuple(int(o) for o in info.chunk_offset), int(info.byte_offset), int(info.size),
                      int(info.filter_mask)))
    fill = ds.fillvalue  # (a scalar of the dataset's type; 0 unless the writer set one)
    return Chunks(tuple(int(c) for c in ds.chunks), filters, tuple(index), fill.item() if hasattr(fill, "item") else fill)


def read_chunk(path: str, chunks: Chunks, k: int, dtype: np.dtype, ranges: Sequence[range], dst: np.ndarray) -> None:
    """Chunk ``k`` of a dataset of type ``dtype`` in file ``path``: its bytes read by position, its filters undone,
    its part inside the hyperslab ``ranges`` (the file's order, unit steps) copied to its place in ``dst`` (the
    hyperslab's array, converted to its type)."""
    offset, at, size, mask = chunks.index[k]
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        raw = bytearray(size)
        preader.pread_full(fd, memoryview(raw), at, path)
    finally:
        os.close(fd)
    data: bytes | bytearray = raw
    for i in reversed(range(len(chunks.filters))):  # undone in the reverse order of their writing
        if mask >> i & 1:
            continue
        if chunks.filters[i] == DEFLATE:
            try:
                data = zlib.decompress(data)
            except zlib.error as e:
                raise OSError(f"{path}: a chunk at byte {at} does not inflate ({e})") from None
        else:
            data = np.frombuffer(data, np.uint8).reshape(dtype.itemsize, -1).T.tobytes()
    if len(data) != math.prod(chunks.shape) * dtype.itemsize:
        raise OSError(f"{path}: a chunk at byte {at} holds {len(data)} bytes, not a chunk's")
    arr = np.frombuffer(data, dtype).reshape(chunks.shape)
    src, to = [], []
    for r, o, c in zip(ranges, offset, chunks.shape):
        lo, hi = max(r.start, o), min(r.stop, o + c)
        src.append(slice(lo - o, hi - o))
        to.append(slice(lo - r.start, hi - r.start))
    dst[tuple(to)] = arr[tuple(src)]


def _source(file: Path, opened: str, holder: str) -> str:
    """The file ``full``'s bytes lie in: ``file`` itself, or the one an external link led HDF5 to (``holder``, the
    name HDF5 opened it by: relative to this process's folder, or else to the linking file's)."""
    if holder == opened:
        return os.path.realpath(file)
    if os.path.isabs(holder) or os.path.exists(holder):
        return os.path.realpath(holder)
    return os.path.realpath(os.path.join(os.path.dirname(str(file)), holder))


def absent(file: str | os.PathLike, name: str) -> str:
    """Why dataset ``name`` of HDF5 file ``file`` is not there, for a message: an external link to a file that is
    missing (named), or no such dataset."""
    broken = external_target(file, name)
    return f"`{name}` as an external link to {broken}, which is missing" if broken else f"no `{name}` dataset"


def external_target(file: str | os.PathLike, name: str) -> str | None:
    """Where ``name`` in HDF5 file ``file`` links to when it is an external link whose file is missing
    (``other.h5:/path``), else None."""
    h5 = _h5()
    try:
        with h5.File(file, "r") as f:
            link = f.get(name, getlink=True)
    except OSError:
        return None
    if not isinstance(link, h5.ExternalLink):
        return None
    target = Path(link.filename)
    if not target.is_absolute():
        target = Path(file).parent / target
    return None if target.exists() else f"{link.filename}:{link.path}"


def _offset(ds: Any) -> tuple[int | None, str | None]:
    """Where dataset ``ds``'s data lie in its file, if they are one plain block there, else why not (module
    docstring)."""
    h5 = _h5()
    plist = ds.id.get_create_plist()
    layout = plist.get_layout()
    if layout != h5.h5d.CONTIGUOUS:
        kind = {h5.h5d.CHUNKED: "chunked", h5.h5d.COMPACT: "compact"}.get(layout, "virtual")
        if layout == h5.h5d.CHUNKED and plist.get_nfilters():
            kind = "compressed (" + ", ".join(_filter_name(plist.get_filter(i)) for i in range(plist.get_nfilters())) + ")"
        return None, kind
    if plist.get_external_count():
        return None, "stored in external raw files"
    if plist.get_nfilters():
        return None, "filtered"
    offset = ds.id.get_offset()
    if offset is None or ds.id.get_storage_size() != ds.size * ds.dtype.itemsize:
        return None, "not written"
    return int(offset), None


def _filter_name(info: Any) -> str:
    name = info[3] if len(info) > 3 else b""
    text = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
    return text.split()[0].lower() if text.strip() else f"filter {info[0]}"


class HDF5Samples(FileSamples):
    """The samples under ``path`` (a directory of sample files, sorted by name, or one file).

    ``expected_shape`` (C, *spatial) is the model's input. A file of that shape is one sample; a file larger by
    a whole multiple in every spatial dim (a universe) is cut into crops of that shape, each a sample read as
    its own hyperslab (sample ``i`` is crop ``i % k`` of file ``i // k``, the crops in row-major order), so under
    spatial parallelism a rank still reads only its part of its crop. ``crop`` (``data.crop``) states the crop
    edge; it must be the model's. A file that does not match is a :class:`ConfigError` naming it: the first
    here, every other when it is first read; :meth:`check_all` checks them all up front (the CLI's pre-launch
    check). With ``ctx`` each item is this rank's part; ``slices`` picks a part by hand. ``readers``
    (``data.readers``): the threads :meth:`read` reads on; the files it reads stay open (a bounded number) until
    :meth:`close`, or until the set is collected. ``layout``: the layout's name (gems.data.layouts: ``gems``,
    ``exalearn``, ``lbann``), None to detect it; it says where the files' channels lie.
    """

    def __init__(self, path: str | os.PathLike, expected_shape: Sequence[int] | None = None, ctx: Any = None,
                 slices: Sequence[slice] | None = None, log1p: bool = True, key: str = "data.path",
                 crop: int | None = None, standardize: Sequence[float] | None = None, augment: str = "none",
                 readers: int = 4, layout: Any = None) -> None:
        from gems.data import layouts

        found = layout if isinstance(layout, layouts.Layout) else layouts.detect(path, layout, key)
        super().__init__(found, path, key, readers, "a directory of HDF5 sample files (`gems data synth` writes one)")
        self.channels = str(getattr(self.layout, "channels", "first"))
        self.expected = tuple(int(n) for n in expected_shape) if expected_shape is not None else None
        if self.expected is not None:
            self.shape = self.expected
            self.crop(crop)
        self.file_shape: tuple[int, ...] | None = None
        self.dtype = np.dtype(np.float32)  # the first file's counts' type, native order (set by _check)
        self.file_shape = self._check(0)  # (C, *spatial) of a file, whatever its order
        self.shape = self.expected if self.expected is not None else self.file_shape  # one sample's (C, *spatial)
        self.grid = tuple(f // s for f, s in zip(self.file_shape[1:], self.shape[1:]))  # crops per spatial dim
        self.crops = math.prod(self.grid)
        self.log1p = log1p
        self.standardize = _standardize(standardize)
        self.slices = tuple(slices) if slices is not None else (ctx.local_slices(self.shape[1:]) if ctx is not None else None)
        self._checked = {0}
        self.symmetries = self.augmenting(augment)  # data.augment draws among these
        self._headers: dict[int, Header] = {}
        self._slow: dict[tuple[str, str], int] = {}  # (why, how) -> files not read by one positional read (notes)

    @property
    def file_dtype(self) -> np.dtype:
        """:attr:`dtype` by its older name (the counts' type as read)."""
        return self.dtype

    def notes(self) -> list[str]:
        """What the run and the plan say of this set: files read through h5py, one at a time, and why."""
        out = []
        for (why, how), n in sorted(self._slow.items()):
            if how == "h5py":
                out.append(f"{self.key}: {n} file(s) {why}, read through h5py one at a time (its lock), not by "
                           "positional reads on data.readers threads; HDF5's `h5repack -l CONTI` rewrites a file "
                           "contiguous")
            else:
                out.append(f"{self.key}: {n} file(s) {why}, read chunk by chunk on data.readers threads (each "
                           "chunk's bytes by position, inflated or unshuffled here); contiguous files need none of "
                           "that (HDF5's `h5repack -l CONTI` rewrites a file so)")
        return out

    def check_file(self, index: int, target_size: int | None) -> None:
        """File ``index``'s headers (the datasets' shapes and dtypes, never the samples) against the set's
        (:meth:`FileSamples.check_all`); ``target_size``: the length ``unitPar`` must have (the model's outputs)."""
        self._check(index, target_size)
        self._checked.add(index)

    def _check(self, index: int, target_size: int | None = None, keep: bool = False) -> tuple[int, ...]:
        """(C, *spatial) of file ``index``, after checking its layout (headers only) against the model;
        ``keep``: also keep what reading it needs (:class:`Header`: its offset and its target, read here once)."""
        file = self.files[index]
        h5 = _h5()

        def bad(expected: str, found: str) -> ConfigError:
            return ConfigError(self.key, self.path, f"{expected}; {self.where(index)} has {_oneline(found)}")

        order = "(*spatial, C)" if self.channels == "last" else "(C, *spatial)"
        layout = f"HDF5 sample files, each with a `full` dataset {order} of counts and a `unitPar` target vector"
        try:
            with h5.File(file, "r") as f:
                meta = {k: (d.shape, d.dtype) if isinstance(d, h5.Dataset) else None
                        for k, d in (("full", f.get("full")), ("unitPar", f.get("unitPar")))}
                found = None
                if keep and meta["full"] is not None and meta["unitPar"] is not None:
                    ds = f["full"]
                    source = _source(file, f.filename, ds.file.filename)
                    offset, why = _offset(ds)
                    found = (offset, why, f["unitPar"][()], source, None if offset is not None else chunks_of(ds))
        except OSError as e:  # not HDF5, truncated, unreadable
            raise bad(layout, f"an unreadable file ({type(e).__name__}: {e})") from None
        full, par = meta["full"], meta["unitPar"]
        if full is None or par is None:
            raise bad(layout, absent(file, "full" if full is None else "unitPar"))
        (raw_shape, dtype), (pshape, pdtype) = full, par
        raw_shape = tuple(int(n) for n in raw_shape or ())  # shape None: an empty (null) dataspace
        shape = canonical(raw_shape, self.channels)
        if dtype.kind not in "iuf":
            raise bad("`full` of integer or float counts (int16 in ExaLearn's files)", f"`full` of dtype {dtype}")
        if self.file_shape is None:
            self.dtype = _native(dtype)
        elif _native(dtype) != self.dtype:  # every file as the first: a type converted would change values
            raise bad(f"`full` of the first file's type, {self.dtype} (mixed types would be converted: "
                      "2.7 read into an int16 batch is 2)", f"`full` of dtype {dtype}")
        if self.file_shape is not None and shape != self.file_shape:  # every file as the first
            raise bad(f"`full` shaped {list(self.file_shape)} as the first file", str(list(shape)))
        if self.expected is not None and not holds_crops(shape, self.expected):
            raise bad(f"`full` shaped {list(self.expected)} (C, *spatial) to match the model, or a whole multiple "
                      "of it in every spatial dim (cut into crops of the model's size)", str(list(shape)))
        size = 0 if pshape is None else math.prod(pshape)
        if pdtype.kind not in "iuf" or size == 0 or (target_size is not None and size != int(target_size)):
            want = f"{int(target_size)} numbers" if target_size is not None else "numbers"
            raise bad(f"`unitPar` of {want} (the target vector, one value per model output)",
                      f"`unitPar` shaped {list(pshape or ())} of dtype {pdtype}")
        if found is not None:
            offset, why, par_values, source, chunks = found
            own = os.path.realpath(file)
            paths = {own, source} if offset is not None or chunks is not None else {own}
            try:
                self.remember(index, sorted(paths))
            except OSError as e:
                raise bad(layout, f"an unreadable file ({type(e).__name__}: {e})") from None
            if not raw_shape:
                offset, why = None, "empty"
            self._headers[index] = Header(offset, raw_shape, np.dtype(dtype),
                                          np.asarray(par_values, dtype=np.float32).reshape(-1), source, why, chunks)
            if why is not None:
                how = "by chunk" if chunks is not None else "h5py"
                self._slow[(why, how)] = self._slow.get((why, how), 0) + 1
        return shape

    def _header(self, i: int) -> Header:
        """File ``i``'s :class:`Header`, from its headers the first time (checked then, if it was not yet)."""
        if i not in self._headers:
            self._check(i, keep=True)
            self._checked.add(i)
        return self._headers[i]

    def _file(self, i: int) -> Path:
        if i not in self._checked:
            self._check(i)
            self._checked.add(i)
        return self.files[i]

    def _hyperslab(self, index: int, symmetry: int) -> tuple[int, tuple[slice, ...] | None]:
        """(file, the spatial hyperslab to read: None for all of it) of sample ``index``'s part under
        ``symmetry`` (gems.data.augment: the part it comes from)."""
        file, parts = self.source(index, symmetry)
        whole = self.crops == 1 and self.slices is None  # the symmetry of a whole sample is read from all of it
        return file, None if whole else parts

    def __getitem__(self, index: int, symmetry: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``index`` (this rank's part of it), transformed by the box's ``symmetry`` (gems.data.augment:
        the part it comes from is the hyperslab read)."""
        file, hyperslab = self._hyperslab(index, symmetry)
        x, y = read_sample(self._file(file), hyperslab, self.log1p, self.standardize, channels=self.channels)
        return augmentation.apply(symmetry, x), y

    def finish(self, x: torch.Tensor | Counts) -> torch.Tensor:
        """Raw counts (``raw=True``, or :meth:`read`'s, whose symmetries and channel order are applied first, in
        the same pass as the conversion to float32) to the network's input, on their device (:func:`transform`,
        in place on that one new tensor)."""
        return finished(x, self.log1p, self.standardize)

    def target(self, index: int) -> torch.Tensor:
        """Only the target of sample ``index`` (a rank that computes the loss but reads no input)."""
        return torch.from_numpy(self._header(self.locate(index)[0]).target.copy())

    def read(self, indices: Sequence[int], symmetries: Sequence[int] | None = None, pin: bool = False,
             out: torch.Tensor | None = None) -> tuple[Counts, torch.Tensor]:
        """The counts of the samples ``indices`` (this rank's part of each) as :class:`Counts`, and their targets
        (N, 4). Each sample is read straight into its row of one batch (pinned with ``pin``: a GPU rank's, which
        its copy to the device takes as it is; ``out``: that batch, contiguous, of the counts' type), in the
        file's order, from the hyperslab its symmetry in ``symmetries`` (None: none) takes it from; the
        symmetries are applied where the batch is finished (:meth:`finish`). A contiguous dataset is read by
        positional reads on the ``readers`` threads (gems.data.reader), a chunked one chunk by chunk on the same
        threads (:func:`read_chunk`), any other through h5py (one at a time: h5py's lock) beside them; the
        targets come from the files' headers, read once. A file that changed since its headers were read (cut
        short, deleted, replaced) is a ConfigError naming it."""
        syms = [int(k) for k in symmetries] if symmetries is not None else [0] * len(indices)
        part = self.part_shape()
        shape = (len(indices), *(part[1:] + part[:1] if self.channels == "last" else part))
        out = self.batch_buffer(shape, raw_dtype(self.dtype), pin, out)
        flat = out.numpy().reshape(-1).view(np.uint8)
        kind = out.numpy().dtype
        row_bytes = flat.nbytes // max(1, len(indices))
        tasks: list[preader.Task] = []
        others: list[Any] = []
        shapes, targets = [], []
        seen: set[int] = set()
        for r, (i, k) in enumerate(zip(indices, syms)):
            f, hyperslab = self._hyperslab(i, k)
            head = self._header(f)
            if f not in seen:
                self.still(f)
                seen.add(f)
            sel = _spatial(self.channels, hyperslab, len(head.shape))
            shapes.append(_sel_shape(head.shape, sel))
            targets.append(torch.from_numpy(head.target))
            if not row_bytes:
                continue
            if head.offset is not None and _native(head.dtype) == kind:
                tasks += preader.array_reads(head.source, head.offset, head.dtype, head.shape, sel,
                                             flat[r * row_bytes:(r + 1) * row_bytes])
            elif head.chunks is not None and _native(head.dtype) == kind:  # chunk by chunk, on the threads
                ranges = [range(*s.indices(n)) for s, n in zip(_full_sel(sel, head.shape), head.shape)]
                dst = out[r].view(shapes[-1]).numpy()
                if not head.chunks.complete(head.shape):
                    dst[...] = head.chunks.fill  # (what chunks never written hold)
                others += [functools.partial(read_chunk, head.source, head.chunks, k, head.dtype, ranges, dst)
                           for k, (o, _, _, _) in enumerate(head.chunks.index)
                           if all(g.start < a + c and a < g.stop for g, a, c in zip(ranges, o, head.chunks.shape))]
            else:  # through h5py
                others.append(functools.partial(read_into, out[r].view(shapes[-1]), self.files[f], hyperslab,
                                                self.channels))
        self.run(tasks, others)  # (a file cut short or gone between the look above and the read: named)
        return (Counts(out, syms, shapes, self.channels == "last"),
                torch.stack(targets) if targets else torch.empty(0, 0))

    def runs(self, indices: Sequence[int], symmetries: Sequence[int] | None = None) -> list[tuple[str, int, int]]:
        """The byte ranges (file, offset, bytes) :meth:`read` reads by position for ``indices`` (the gaps its
        gathered or buffered blocks read too): what gems bench data's per-run bound reads, with no reader
        around it; none for a file read through h5py."""
        syms = [int(k) for k in symmetries] if symmetries is not None else [0] * len(indices)
        itemsize = self.dtype.itemsize
        out: list[tuple[str, int, int]] = []
        for i, k in zip(indices, syms):
            f, hyperslab = self._hyperslab(i, k)
            head = self._header(f)
            if head.offset is None:
                continue
            g = preader.grid(head.shape, itemsize, _spatial(self.channels, hyperslab, len(head.shape)))
            for blocks in preader.pieces(preader.Grid(0, g.run, g.counts, g.strides), preader.PIECE,
                                         preader.SMALL_RUN, preader.MEDIUM_RUN, preader.GAP):
                out += [(head.source, head.offset + g.start + b.at, b.span) for b in blocks]
        return out


def _oneline(text: str) -> str:
    return " ".join(str(text).split())
