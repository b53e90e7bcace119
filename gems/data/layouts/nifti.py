"""CT volumes with per-voxel labels in NIfTI files, LiTS's layout (layout ``nifti``), for ``model=unet3d``; the base of
the other NIfTI layouts (a Decathlon task, nnU-Net's raw dataset, the tiled cases).

A case's channels and labels are read by position from nibabel's headers, lined up onto the first channel's grid by
their affines, cut into tiles of the model's edge (the far edges padded and ignored) and windowed where the batch is
finished (docs/data.md, "LiTS's CT volumes with labels").
"""
from __future__ import annotations

import gzip
import math
import os
import re
import shutil
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Sequence

import numpy as np
import torch

from gems.data.layouts import IGNORE, FileSamples, Layout, Options, register
from gems.data.layouts._case import write_case
from gems.data.layouts._grids import Grid, canonical, lined_up
from gems.data.samples import native as _native
from gems.data.samples import stamp
from gems.errors import ConfigError
from gems.paths import commit

__all__ = ["Grid", "Header", "Case", "NiftiLayout", "NiftiSamples", "header", "streamed", "uncompressed", "window"]

#: the CT window of liver studies on LiTS, in Hounsfield units: clipped to it and scaled to [0, 1]
WINDOW = (-200.0, 250.0)
_VOLUME = re.compile(r"^volume-(\d+)\.nii(\.gz)?$")


def label_name(volume: Path) -> Path:
    """The labels beside ``volume`` (LiTS: ``volume-N.nii`` -> ``segmentation-N.nii``, the same compression)."""
    return volume.with_name("segmentation-" + volume.name[len("volume-"):])


#: LiTS's classes (and gems data synth's segmentation volumes')
LITS_CLASSES = ("background", "liver", "tumour")


def missing_labels(volume: Path, labels: Path, key: str, how: str,
                   shown: Callable[[Path], str] = lambda p: p.name) -> ConfigError:
    """A volume whose labels are not where the layout puts them (``how``: where that is): bad input naming both
    (``shown``: a file in a message), and the labels' other compression where that is there instead."""
    other = labels.with_name(labels.name[:-3]) if labels.name.endswith(".gz") else labels.with_name(labels.name + ".gz")
    there = (f" ({shown(other)} is there: `gems data convert` writes volumes and labels alike, uncompressed)"
             if other.is_file() else "")
    return ConfigError(key, str(volume.parent), f"labels for every volume ({how}); {shown(labels)} is missing for "
                       f"{shown(volume)}{there}")


def window(value: Sequence[float] | None) -> tuple[float, float]:
    """``data.window``, checked: [low, high] Hounsfield units with low < high (None: :data:`WINDOW`)."""
    if value is None:
        return WINDOW
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError("data.window", value, "[low, high] in Hounsfield units, e.g. [-200, 250]") from None
    if not lo < hi:
        raise ConfigError("data.window", [lo, hi], "[low, high] with low < high")
    return lo, hi


@dataclass(frozen=True)
class Header:
    """What reading one NIfTI file (or one channel of it) needs, from nibabel's header: the voxels' ``shape`` as a
    C-order array (z, y, x), their ``dtype`` (the file's byte order), the byte ``offset`` of the block (None:
    compressed), the scaling ``slope`` and ``inter``, and the file's ``stamp`` (gems.data.samples.stamp, taken
    before the header was read: a file replaced or rewritten since is named, not read at its old offset and
    scaling)."""

    path: Path
    shape: tuple[int, int, int]
    dtype: np.dtype
    offset: int | None
    slope: float
    inter: float
    stamp: tuple[int, int, int, int] = (0, 0, 0, 0)
    #: the voxel-to-world affine nibabel gives (the sform where set, else the qform): index (x, y, z) to mm
    affine: tuple[tuple[float, ...], ...] = ((1.0, 0.0, 0.0, 0.0), (0.0, 1.0, 0.0, 0.0), (0.0, 0.0, 1.0, 0.0),
                                             (0.0, 0.0, 0.0, 1.0))
    #: the voxels stored in chunks (gems.data.hdf5.Chunks: the tiled layout's), each read by position, where
    #: ``offset`` is None
    chunks: Any = None
    #: the volumes the file holds one after the other (a 4D file: a channel each)
    channels: int = 1
    #: the byte offset of the voxels in the file's uncompressed bytes (a ``.nii.gz``'s too: its stream's)
    vox_offset: int = 0

    def channel(self, c: int) -> Header:
        """The header of channel ``c`` alone: the ``c``-th volume of the file's block."""
        step = c * math.prod(self.shape) * self.dtype.itemsize
        return replace(self, offset=None if self.offset is None else self.offset + step, channels=1,
                       vox_offset=self.vox_offset + step)


def _extent(shape: Sequence[int]) -> tuple[tuple[int, int, int] | None, int]:
    """(the (x, y, z) voxels, the channels) of a NIfTI file's shape: 3D, or 4D of channels (a 5D one of one time
    point too, as NIfTI's vectors lie); None for any other."""
    s = tuple(int(n) for n in shape)
    while len(s) > 4 and s[-1] == 1:
        s = s[:-1]
    if len(s) == 5 and s[3] == 1:
        s = (*s[:3], s[4])
    if len(s) == 4:
        return (s[0], s[1], s[2]), s[3]
    return ((s[0], s[1], s[2]), 1) if len(s) == 3 else (None, 0)


def header(path: Path, key: str) -> Header:
    """File ``path``'s :class:`Header`; a file nibabel cannot read, not a 3D volume (or a 4D one of channels), or
    shorter than its header says is bad input naming it."""
    import nibabel as nib

    try:
        was = stamp(path)
        img: Any = nib.load(str(path))
        proxy = img.dataobj
        shape = tuple(int(n) for n in img.shape)
    except Exception as e:  # nibabel's ImageFileError, a truncated header, a corrupt gzip stream
        raise ConfigError(key, str(path.parent), f"NIfTI volumes nibabel reads; {path.name} is not one "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
    xyz, channels = _extent(shape)
    if xyz is None:
        raise ConfigError(key, str(path.parent), f"3D NIfTI volumes, or 4D ones of a volume a channel (the Decathlon's "
                          f"multi-modal tasks); {path.name} holds {list(shape)} voxels")
    slope, inter = float(getattr(proxy, "slope", 1.0)), float(getattr(proxy, "inter", 0.0))
    vox = int(proxy.offset)
    offset = None if path.name.endswith(".gz") else vox
    dtype = np.dtype(proxy.dtype)
    if dtype.kind not in "iuf":
        raise ConfigError(key, str(path.parent), f"NIfTI voxels of integers or floats; {path.name} holds {dtype}")
    voxels = math.prod(xyz) * channels * dtype.itemsize
    if offset is not None and was[2] < offset + voxels:  # the voxels the header promises, against the file's bytes
        raise ConfigError(key, str(path.parent), f"whole NIfTI files; {path.name} is cut short: its header puts "
                          f"{voxels} bytes of voxels from byte {offset} ({offset + voxels} in all), the file holds "
                          f"{was[2]}")
    affine = tuple(tuple(float(v) for v in row) for row in np.asarray(img.affine, dtype=np.float64))
    return Header(path, (xyz[2], xyz[1], xyz[0]), dtype, offset, slope, inter, was, affine, channels=channels,
                  vox_offset=vox)


def not_a_class(values: np.ndarray, top: int) -> Any:
    """The first of ``values`` (labels, scaled as their file says) that is no class below ``top`` (a whole number
    from 0), else None."""
    if not values.size:
        return None
    if ((values.dtype.kind != "u" and values.min() < 0) or values.max() >= top
            or (values.dtype.kind == "f" and not np.array_equal(values, np.round(values)))):
        return values[(values < 0) | (values >= top) | (values != np.round(values))].flat[0]
    return None


def outside(key: str, where: str, shown: str, bad: Any, top: int, names: Sequence[str] | None) -> ConfigError:
    """The refusal of a label file ``shown`` that holds ``bad``, not a class below ``top`` (``names``: theirs)."""
    named = f" ({', '.join(names)})" if names and len(names) == top else ""
    return ConfigError(key, where, f"labels 0 .. {top - 1}{named}: model.num_classes; {shown} holds {bad}")


def _scaled(values: np.ndarray, head: Header) -> np.ndarray:
    return values if (head.slope, head.inter) == (1.0, 0.0) else values * head.slope + head.inter


def streamed(head: Header, key: str, top: int | None = None, shown: str | None = None,
             names: Sequence[str] | None = None) -> None:
    """File ``head`` (a whole file's header) read whole as a stream, the way ``gems data check`` reads a volume a run
    reads only once converted: a ``.nii.gz`` decompressed (its gzip CRC and length checked at its end), the bytes of
    voxels its header promises all there, and with ``top`` every voxel a class below it (labels: ``names``, the
    classes' names); else bad input naming the file (``shown``) and what is wrong."""
    name = shown or head.path.name
    where = str(head.path.parent)
    need = head.vox_offset + math.prod(head.shape) * head.channels * head.dtype.itemsize
    size, got, carry = head.dtype.itemsize, 0, b""
    try:
        with (gzip.open(head.path, "rb") if head.path.name.endswith(".gz") else open(head.path, "rb")) as f:
            while block := f.read(1 << 22):
                lo, hi = max(head.vox_offset - got, 0), min(len(block), need - got)  # the block's voxels
                if top is not None and hi > lo:
                    buf = carry + block[lo:hi]
                    whole = len(buf) // size * size
                    bad = not_a_class(_scaled(np.frombuffer(buf[:whole], dtype=head.dtype), head), top)
                    if bad is not None:
                        raise outside(key, where, name, bad, top, names)
                    carry = buf[whole:]
                got += len(block)
    except EOFError as e:
        raise ConfigError(key, where, f"whole NIfTI files; {name} is cut short: its gzip stream ends before its end "
                          f"({e})") from None
    except (zlib.error, gzip.BadGzipFile) as e:
        raise ConfigError(key, where, f"whole NIfTI files; {name} is a corrupt gzip stream ({type(e).__name__}: "
                          f"{e})") from None
    if got < need:
        raise ConfigError(key, where, f"whole NIfTI files; {name} is cut short: its header puts {need - head.vox_offset} "
                          f"bytes of voxels from byte {head.vox_offset} ({need} in all), it holds {got}")


@dataclass(frozen=True)
class Case:
    """One sample file's voxels as a run reads them: each channel (a 3D :class:`Header` and the :class:`Grid` that
    reads it onto the first channel's voxels) and the labels (likewise)."""

    channels: tuple[tuple[Header, Grid], ...]
    labels: tuple[Header, Grid]

    @property
    def volume(self) -> Header:
        """The first channel: the case's grid."""
        return self.channels[0][0]

    def stamps(self) -> list[tuple[Path, tuple[int, int, int, int]]]:
        """Each file of the case once, with its stamp (what :meth:`FileSamples.still` looks at)."""
        return list({h.path: (h.path, h.stamp) for h, _ in (*self.channels, self.labels)}.values())


Box = tuple[tuple[int, int], ...]


class Voxels:
    """A batch of CT voxels as :meth:`NiftiSamples.read` leaves them: ``data`` (N, C, *part) as stored, ``slope``
    and ``inter`` (N, C) each sample's channels' scaling to Hounsfield units, ``boxes`` (row, the volume's part of
    it: [lo, hi) a dim) of each row that holds padding (0 where stored; 0 in the network's input:
    :meth:`NiftiSamples.finish`). Moves as a tensor does (what gems.rank.data.Prefetcher asks of a batch it copies
    to the device)."""

    def __init__(self, data: torch.Tensor, slope: torch.Tensor, inter: torch.Tensor,
                 boxes: Sequence[tuple[int, Box]] = ()) -> None:
        self.data, self.slope, self.inter, self.boxes = data, slope, inter, tuple(boxes)

    @property
    def is_cuda(self) -> bool:
        return bool(self.data.is_cuda)

    def pin_memory(self) -> Voxels:
        return self if self.data.is_pinned() else Voxels(self.data.pin_memory(), self.slope, self.inter, self.boxes)

    def to(self, device: Any, non_blocking: bool = False) -> Voxels:
        return Voxels(self.data.to(device, non_blocking=non_blocking), self.slope.to(device), self.inter.to(device),
                      self.boxes)

    def oriented(self) -> torch.Tensor:
        """The voxels as stored, channels first (N, C, *part): a batch's ``raw`` form."""
        return self.data


def _box_key(src: Sequence[slice]) -> tuple[tuple[int, int], ...]:
    return tuple((int(s.start), int(s.stop)) for s in src)


def padded(x: torch.Tensor, boxes: Sequence[tuple[int, Box]], value: float = 0.0) -> torch.Tensor:
    """``x`` (N, C, *part) with every voxel of row ``r`` outside its box set to ``value``, for each (r, box) of
    ``boxes``; in place."""
    for r, box in boxes:
        row = x[r]
        for d, (lo, hi) in enumerate(box):
            cut: list[Any] = [slice(None)] * row.dim()
            cut[1 + d] = slice(0, lo)
            row[tuple(cut)] = value
            cut[1 + d] = slice(hi, None)
            row[tuple(cut)] = value
    return x


def windowed(x: torch.Tensor, slope: torch.Tensor, inter: torch.Tensor, win: tuple[float, float],
             ct: Sequence[bool] = (True,)) -> torch.Tensor:
    """Stored voxels (N, C, *part) to the network's input (N, C, *part), on their device: each channel's values
    scaled (``x * slope + inter``, per sample and channel: Hounsfield units); a CT channel's (``ct``) clipped to the
    window ``win`` and scaled to [0, 1]. Elementwise, so any cut of a sample gives the same values."""
    lo, hi = win
    shape = (x.shape[0], x.shape[1]) + (1,) * (x.dim() - 2)
    hu = x.to(torch.float32) * slope.to(torch.float32).view(shape) + inter.to(torch.float32).view(shape)
    if all(ct):
        return hu.clamp_(lo, hi).sub_(lo).div_(hi - lo)
    for c in (c for c, is_ct in enumerate(ct) if is_ct):
        hu[:, c].clamp_(lo, hi).sub_(lo).div_(hi - lo)
    return hu


class NiftiSamples(FileSamples):
    """The tiles of a folder of LiTS volumes (or of a NIfTI layout's cases) as one rank reads them
    (gems.data.layouts' ``Samples``): raw voxels (:class:`Voxels`) and per-voxel classes, this rank's part of each.

    An uncompressed NIfTI file's voxels are one block in Fortran order (x, y, z), that is a C-order array (z, y, x):
    depth is the slices, so a spatial rank's depth slab is one run of bytes. Voxels are read as stored (or in RAS+
    with ``data.orientation``), never resampled. Each volume is cut into tiles of the model's edge, row-major over
    (z, y, x), those at the far edges padded: the input with 0 after windowing, the labels with
    :data:`gems.data.layouts.IGNORE`, which the loss and the figures leave out, so every voxel counts once. Volumes
    of mixed types are read as float32 (exact up to 16-bit integers and float32; the run says so)."""

    def __init__(self, layout: NiftiLayout, path: str | os.PathLike, shape: Sequence[int] | None,
                 options: Options) -> None:
        from gems.data.samples import full_slices

        super().__init__(layout, path, options.key, options.readers, f"a folder of {layout.about} (`gems data synth "
                         "data.kind=segmentation` writes LiTS's)")
        if options.target != "dense":
            raise ConfigError(self.key, self.path, "samples with a target vector each, as this model's loss takes "
                              "them; these are NIfTI volumes with a class a voxel, for model=unet3d (or another model "
                              "of one class a voxel)")
        if options.augment != "none":
            raise ConfigError("data.augment", options.augment, "none for NIfTI volumes (a CT scan's axes are not "
                              "interchangeable)")
        self.window = window(options.window)
        self.cases: list[Case] = []
        #: (each channel's grid, the labels') against the sample's
        self.grids_of: list[tuple[list[Grid], Grid]] = []
        self._notes: list[str] = []
        self._open(options)
        self._notes += layout.folder_notes(path, self.key)
        if options.orientation == "RAS":
            self._notes.append(f"{self.key}: volumes and labels read in RAS+ orientation (data.orientation=RAS)")
        #: each volume's shape (z, y, x) on the sample's grid (as stored, or RAS+)
        self.shapes = [vg[0].shape(c.volume.shape) for c, (vg, _) in zip(self.cases, self.grids_of)]
        channels = len(self.cases[0].channels)
        edge = int(shape[1]) if shape is not None else max(max(h) for h in self.shapes)
        self.shape = (channels, edge, edge, edge) if shape is None else tuple(int(n) for n in shape)
        named = layout.channel_names(path)
        if len(self.shape) != 4 or self.shape[0] != channels:
            raise ConfigError("model.in_channels", self.shape[0], f"{channels} for these volumes (a value a voxel a "
                              f"channel{': ' + ', '.join(named) if named else ''})")
        self.crop(options.crop)
        self.grids = [tuple(-(-n // e) for n, e in zip(h, self.shape[1:])) for h in self.shapes]
        self.starts = np.cumsum([0] + [math.prod(g) for g in self.grids])
        self._types()
        self.slices = full_slices(options.slices or (), self.shape[1:])
        self.symmetries = 1
        self.classes: int | None = int(options.classes) if options.classes is not None else None
        #: each class's name, by its label (the Dice columns'): the layout's (LiTS's, a Decathlon task's
        #: dataset.json), where it names as many as the model has
        self.class_names: list[str] | None = layout.class_names(path)
        #: the channels windowed as CT (a channel the set names otherwise: scaled only)
        self.ct = tuple(str(n).upper() == "CT" for n in named) if named else (True,) * channels
        self.ignore = IGNORE  # the label of padding: the loss, accuracy and Dice leave it out (gems.rank.loss)
        self._chunk_maps: dict[Any, dict[tuple[int, ...], int]] = {}
        #: (volume, the part of it) whose labels were checked against the classes: the files are the same ones for
        #: the run (their stamps are looked at every batch), so a part read again is not checked again
        self._checked: set[tuple[int, tuple[tuple[int, int], ...]]] = set()

    def _open(self, options: Options) -> None:
        """Every case's headers, lined up (``options.orientation``: as stored or RAS+), each file stamped; cases of
        another number of channels than the first's are bad input naming the file."""
        turned: list[str] = []
        for i, f in enumerate(self.files):
            case = self.layout.case(f, self.key, self.path, options.affine_tolerance)
            if len(case.channels) != len(self.cases[0].channels if self.cases else case.channels):
                raise ConfigError(self.key, self.path, f"cases of {len(self.cases[0].channels)} channel(s) each, as "
                                  f"the first; {self.layout.shown(f)} has {len(case.channels)}")
            self.remember(i, case.stamps())
            vgrid = canonical(case.volume) if options.orientation == "RAS" else Grid()
            self.cases.append(case)
            self.grids_of.append(([vgrid.then(g) for _, g in case.channels], vgrid.then(case.labels[1])))
            turned += [f"{self.layout.shown(h.path)} ({g.describe()})"
                       for h, g in (*case.channels[1:], case.labels) if not g.identity]
        if turned:
            self._notes.append(f"{self.key}: labels reoriented onto their volume's voxel grid by their affines, "
                               f"exactly: {', '.join(dict.fromkeys(turned[:4]))}"
                               + (f" and {len(turned) - 4} more" if len(turned) > 4 else ""))

    def _types(self) -> None:
        """The batch's one type: the volumes', or float32 where they differ (said)."""
        from gems.data.samples import raw_dtype

        types = sorted({_native(h.dtype) for c in self.cases for h, _ in c.channels}, key=str)
        self.dtype = types[0] if len(types) == 1 else np.dtype(np.float32)  # a batch holds one type
        self._notes += [] if len(types) == 1 else [
            f"{self.key}: volumes of {len(types)} types ({', '.join(map(str, types))}) read as float32 (a batch holds "
            "one type): exact for integers of up to 16 bits and for float32"
            + ("" if all(t.itemsize <= 2 or t == np.float32 for t in types) else
               f", rounded to float32's 24 bits for {', '.join(str(t) for t in types if t.itemsize > 2 and t != np.float32)}")]
        self.raw = raw_dtype(self.dtype)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def where(self, index: int) -> str:
        """Volume ``index`` in a message: its name (a volume is many samples, not a file of the folder's count)."""
        return self.layout.shown(self.files[index])

    def check_targets(self, target_size: int | None) -> None:
        """Every volume's headers were checked when the set was opened (its tiles need its shape); ``target_size``
        (the model's classes, as ``classes`` the set was opened with: the run's own set has them) is kept: labels
        at or over it are named when read."""
        if target_size is not None:
            self.classes = int(target_size)

    def locate(self, index: int) -> tuple[int, tuple[int, int, int]]:
        """(volume, the tile's origin (z, y, x)) of sample ``index``."""
        i = index % len(self)
        v = int(np.searchsorted(self.starts, i, side="right")) - 1
        tile = np.unravel_index(i - int(self.starts[v]), self.grids[v])
        return v, tuple(int(t) * e for t, e in zip(tile, self.shape[1:]))  # type: ignore[return-value]

    def _box(self, index: int) -> tuple[int, tuple[slice, ...], tuple[slice, ...]]:
        """(volume, the part of it this rank's part of sample ``index`` holds, where that lies in the part): the
        part clipped to the volume (the rest is padding)."""
        v, origin = self.locate(index)
        src, dst = [], []
        for o, s, n in zip(origin, self.slices or (), self.shapes[v]):
            lo, hi = min(n, o + s.start), min(n, o + s.stop)
            src.append(slice(lo, hi))
            dst.append(slice(lo - o - s.start, hi - o - s.start))
        return v, tuple(src), tuple(dst)

    def _read(self, head: Header, src: tuple[slice, ...], into: np.ndarray, tasks: list, posts: list,
              grid: Grid = Grid()) -> None:
        """Queue the positional reads of ``src`` (the sample's grid) of file ``head`` into ``into`` (a C-order part
        of a row): straight there where it is contiguous, of the file's type and the file lies on the sample's
        grid, else into a buffer of the file's box (:meth:`Grid.box`) copied over, oriented, after the reads."""
        from gems.data import reader as preader

        if not into.size:
            return
        native = _native(head.dtype)
        direct = into.flags.c_contiguous and into.dtype == native and grid.identity
        box = src if grid.identity else grid.box(src, head.shape)
        buf = into if direct else np.empty(tuple(b.stop - b.start for b in box), dtype=native)
        if head.chunks is not None:
            self._chunked(head, box, buf, tasks, posts)
        else:
            assert head.offset is not None
            tasks += preader.array_reads(head.path, head.offset, head.dtype, head.shape, box, buf)
        if not direct:
            posts.append((into, grid.orient(buf)))

    def _chunked(self, head: Header, box: tuple[slice, ...], buf: np.ndarray, tasks: list, posts: list) -> None:
        """Queue the reads of ``box`` of a file stored in chunks (the tiled layout) into ``buf``: each chunk's part
        by position, straight there where one chunk holds the whole box (a tile of the chunks' edge: one block, or
        a rank's part of it), else into a buffer of the chunk's part copied over after the reads. Chunks the
        writer compressed are not the tiled layout's; a chunk not written reads as the fill value."""
        from gems.data import reader as preader

        chunks = head.chunks
        native = buf.dtype
        where = self._chunk_index(head)
        firsts = [range(b.start // c * c, b.stop, c) for b, c in zip(box, chunks.shape)]
        for origin in np.ndindex(*(len(r) for r in firsts)):
            at = tuple(r[i] for r, i in zip(firsts, origin))
            local = tuple(slice(max(b.start, o) - o, min(b.stop, o + c) - o) for b, o, c in zip(box, at, chunks.shape))
            to = tuple(slice(o + s.start - b.start, o + s.stop - b.start) for b, o, s in zip(box, at, local))
            k = where.get(at)
            if k is None:
                buf[to] = chunks.fill
                continue
            _, byte, _, _ = chunks.index[k]
            whole = all(t.stop - t.start == n for t, n in zip(to, buf.shape))
            into = buf if whole else np.empty(tuple(s.stop - s.start for s in local), dtype=native)
            tasks += preader.array_reads(head.path, byte, native, chunks.shape, local, into)
            if not whole:
                posts.append((buf[to], into))

    def _chunk_index(self, head: Header) -> dict[tuple[int, ...], int]:
        """Each written chunk's place in ``head.chunks.index``, by its origin (made once a file)."""
        key = str(head.path), id(head.chunks)
        if key not in self._chunk_maps:
            self._chunk_maps[key] = {tuple(o): k for k, (o, _, _, _) in enumerate(head.chunks.index)}
        return self._chunk_maps[key]

    def runs(self, indices: Sequence[int], symmetries: Sequence[int] | None = None) -> list[tuple[str, int, int]]:
        """The byte ranges (file, offset, bytes) :meth:`read` reads by position for ``indices``, volumes and labels
        (the gaps its gathered or buffered blocks read too): what gems bench data's per-run bound reads."""
        tasks: list = []
        for i in indices:
            v, src, _ = self._box(i)
            shape = tuple(s.stop - s.start for s in src)
            case, (grids, lgrid) = self.cases[v], self.grids_of[v]
            for head, grid in (*zip((h for h, _ in case.channels), grids), (case.labels[0], lgrid)):
                self._read(head, src, np.empty(shape, dtype=_native(head.dtype)), tasks, [], grid)
        return [(t.path, t.base + b.at, b.span) for t in tasks for b in t.blocks]

    def read(self, indices: Sequence[int], symmetries: Sequence[int] | None = None, pin: bool = False,
             out: torch.Tensor | None = None, want_input: bool = True) -> tuple[Any, torch.Tensor]:
        """This rank's part of each sample's voxels as stored (:class:`Voxels`; padding 0 and its box, for
        :meth:`finish`) and of its labels (uint8 classes, padding :data:`~gems.data.layouts.IGNORE`; the loss takes
        them as they are), by positional reads on the reader's threads, each file looked at first (:meth:`FileSamples.still`)."""
        part = self.part_shape()
        shape = (len(indices), *part[1:])
        if want_input or out is not None:
            out = self.batch_buffer((len(indices), *part), self.raw, pin, out)
        labels = np.empty(shape, dtype=np.uint8)  # classes; made long where the loss takes them
        tasks: list = []
        posts: list = []
        lab_bufs: list[tuple[int, int, tuple[slice, ...], np.ndarray | None]] = []
        boxes: list[tuple[int, Box]] = []
        slope, inter = np.ones((len(indices), part[0])), np.zeros((len(indices), part[0]))
        seen: set[int] = set()
        for r, i in enumerate(indices):
            v, src, dst = self._box(i)
            if v not in seen:
                self.still(v)
                seen.add(v)
            padded_row = any(d.stop - d.start != n for d, n in zip(dst, part[1:]))
            if out is not None:
                row = out.numpy()[r]
                if padded_row:
                    row[...] = 0
                    boxes.append((r, tuple((d.start, d.stop) for d in dst)))
                for c, ((head, _), grid) in enumerate(zip(self.cases[v].channels, self.grids_of[v][0])):
                    self._read(head, src, row[c][dst], tasks, posts, grid)
                    slope[r, c], inter[r, c] = head.slope, head.inter
            if padded_row:
                labels[r] = IGNORE
            g, lgrid = self.cases[v].labels[0], self.grids_of[v][1]
            if _native(g.dtype) == np.uint8 and (g.slope, g.inter) == (1.0, 0.0):  # classes as they lie: read in place
                self._read(g, src, labels[r][dst], tasks, posts, lgrid)
                if (v, _box_key(src)) not in self._checked:  # (a part's labels checked once: a change is named anyway)
                    lab_bufs.append((r, v, dst, None))
            else:
                buf = np.empty(tuple(s.stop - s.start for s in src), dtype=_native(g.dtype))
                self._read(g, src, buf, tasks, posts, lgrid)
                lab_bufs.append((r, v, dst, buf))
        self.run(tasks)  # (a file cut short, deleted or replaced since its header was read: named)
        for into, buf in posts:
            into[...] = buf
        for r, v, dst, stored in lab_bufs:
            if stored is None:
                self._classes(labels[r][dst], v)  # (checked where they were read)
                self._checked.add((v, _box_key(self._box(indices[r])[1])))
            else:
                labels[r][dst] = self._classes(stored, v)
        raw = Voxels(out, torch.from_numpy(slope), torch.from_numpy(inter), boxes) if out is not None else None
        return raw, torch.from_numpy(labels)

    def _classes(self, stored: np.ndarray, v: int) -> np.ndarray:
        """Labels as classes (uint8): the stored values scaled as the file says, whole numbers from 0 below the
        model's classes (where known; below :data:`~gems.data.layouts.IGNORE` at most), else bad input naming the
        file."""
        g = self.cases[v].labels[0]
        values = _scaled(stored, g)
        top = min(self.classes or IGNORE, IGNORE)
        bad = not_a_class(values, top)
        if bad is not None:
            raise outside(self.key, self.path, self.layout.shown(g.path), bad, top, self.class_names)
        return values.astype(np.uint8, copy=False)

    def finish(self, x: Any) -> torch.Tensor:
        """The network's input (:func:`windowed`), each row's padding 0 (the window's low end)."""
        if isinstance(x, Voxels):
            return padded(windowed(x.data, x.slope, x.inter, self.window, self.ct), x.boxes)
        ones = torch.ones(x.shape[:2])
        return windowed(x, ones, torch.zeros(x.shape[:2]), self.window, self.ct)

    def target(self, index: int) -> torch.Tensor:
        return self.read([index], want_input=False)[1][0]


def uncompressed(source: Path, target: Path, key: str = "data.path") -> None:
    """Write ``source`` uncompressed to ``target`` (a hidden name, then renamed: gems.paths.commit): a ``.nii.gz``
    decompressed, any other file copied as it is; a corrupt gzip stream is bad input naming the file."""
    tmp = target.with_name(f".{target.name}.tmp")
    if not source.name.endswith(".gz"):
        shutil.copyfile(source, tmp)
        commit(tmp, target)
        return
    try:
        with gzip.open(source, "rb") as src, open(tmp, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 22)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        tmp.unlink(missing_ok=True)
        how = "cut short: its gzip stream ends before its end" if isinstance(e, EOFError) else "a corrupt gzip stream"
        raise ConfigError(key, str(source.parent), f".nii.gz files that are whole gzip streams; {source.name} is "
                          f"{how} ({type(e).__name__}: {e})") from None
    commit(tmp, target)


@register
class NiftiLayout(Layout):
    name: ClassVar[str] = "nifti"
    about: ClassVar[str] = ("LiTS's CT volumes with labels: volume-N.nii and segmentation-N.nii (NIfTI; .nii.gz "
                            "through gems data convert), for model=unet3d")
    suffixes: ClassVar[tuple[str, ...]] = (".nii", ".nii.gz")
    target: ClassVar[str] = "dense"
    #: bytes of voxels a second one thread reads into a batch (labels beside them) where no file is at hand: 128^3
    #: tiles of 512 x 512 x 128 int16 volumes from the page cache here, 0.14-0.24 GB/s on this loaded 2-core machine
    #: (a tile's rows are 256-byte runs of a 1 KiB row: the reader reads the rows' span and copies them out)
    thread_rate: ClassVar[float] = 0.2e9

    def files(self, path: str | os.PathLike) -> list[Path]:
        """The volumes at ``path`` (``volume-N.nii[.gz]``; their labels are not samples), by N."""
        p = Path(path)
        found = [f for f in (p.iterdir() if p.is_dir() else [p]) if _VOLUME.match(f.name) and f.is_file()]
        return sorted(found, key=lambda f: (int(_VOLUME.match(f.name).group(1)), f.name))  # type: ignore[union-attr]

    #: where a volume's labels lie, for messages
    labels_where: ClassVar[str] = "LiTS: segmentation-N.nii beside volume-N.nii"

    def root(self, path: str | os.PathLike) -> Path:
        """The folder a set of ``path`` (the folder, or one of its sample files) is: what ``gems data convert``
        takes."""
        p = Path(path)
        return p.parent if p.is_file() else p

    def shown(self, file: Path) -> str:
        """A file of the set in a message: its name."""
        return file.name

    def convert_command(self, path: str | os.PathLike) -> str:
        """The command that writes the set at ``path`` uncompressed, as it runs (the set's folder and one beside
        it)."""
        root = self.root(path)
        return f"gems data convert data.path={root} data.out={root.with_name(root.name + '_nii')}"

    def channel_files(self, volume: Path) -> list[Path]:
        """The files that hold a case's channels, in order (here: the volume, whose 4th dim holds any)."""
        return [volume]

    def channel_names(self, path: str | os.PathLike) -> list[str] | None:
        """The channels' names, in order, where the set names them (else None: one CT channel a case)."""
        return None

    def case(self, volume: Path, key: str, path: str, tolerance: float | None = None, whole: bool = False) -> Case:
        """Sample file ``volume``'s :class:`Case`: its channels' files and its labels uncompressed NIfTI files (or,
        ``whole``, compressed too: gems data check reads them whole), the labels there, of one value a voxel and
        of the first channel's shape; every file lined up onto the first channel's grid by the affines
        (gems.data.layouts._grids.lined_up, ``tolerance``: data.affine_tolerance); else bad input naming the
        file."""
        heads = []
        for f in self.channel_files(volume):
            if not f.is_file():
                raise ConfigError(key, path, f"every channel of a case ({self.shown(volume)}: {len(self.channel_files(volume))} "
                                  f"files); {self.shown(f)} is missing")
            heads.append(header(f, key))
            if heads[-1].offset is None and not whole:
                raise ConfigError(key, path, f"uncompressed .nii volumes, read by slab; {self.shown(f)} is "
                                  f"gzip-compressed: `{self.convert_command(path)}` writes them uncompressed")
        lab = self.companions(volume)[0]
        if not lab.is_file():
            raise missing_labels(volume, lab, key, self.labels_where, self.shown)
        g = header(lab, key)
        if g.offset is None and not whole:
            raise ConfigError(key, path, f"uncompressed .nii labels; {self.shown(lab)} is gzip-compressed "
                              f"(`{self.convert_command(path)}` writes them uncompressed)")
        if g.channels != 1:
            raise ConfigError(key, path, f"labels of one value a voxel; {self.shown(lab)} holds {g.channels} volumes")
        ref = heads[0].channel(0)
        channels: list[tuple[Header, Grid]] = []
        for h in heads:
            grid = Grid() if h is heads[0] else self._on(ref, h, key, path, tolerance, "channel files")
            channels += [(h.channel(c), grid) for c in range(h.channels)]
        names = self.channel_names(path)
        if names and len(channels) != len(names):
            raise ConfigError(key, path, f"cases of {len(names)} channel(s) ({', '.join(names)}: dataset.json); "
                              f"{self.shown(volume)} has {len(channels)}")
        return Case(tuple(channels), (g, self._on(ref, g, key, path, tolerance, "labels")))

    def _on(self, ref: Header, other: Header, key: str, path: str, tolerance: float | None, noun: str) -> Grid:
        """The grid that reads ``other`` onto ``ref``'s voxels: of its shape once the axes are lined up, by the
        affines (:func:`lined_up`)."""
        if sorted(other.shape) != sorted(ref.shape):
            raise ConfigError(key, path, f"{noun} of their volume's shape; {self.shown(other.path)} holds "
                              f"{list(other.shape[::-1])} voxels (x, y, z), {self.shown(ref.path)} {list(ref.shape[::-1])}")
        return lined_up(ref, other, key, tolerance, self.shown, noun)  # refused where not on the volume's grid

    def companions(self, file: Path) -> list[Path]:
        """The volume's labels (always the first: NiftiSamples reads them), then its other channels' files."""
        return [label_name(file), *self.channel_files(file)[1:]]

    def class_names(self, path: str | os.PathLike) -> list[str] | None:
        """The classes' names by label: LiTS's."""
        return list(LITS_CLASSES)

    def folder_notes(self, path: str | os.PathLike, key: str) -> list[str]:
        """What a run over the folder says of it beyond its volumes (a Decathlon task's test volumes left out)."""
        return []

    def check_whole(self, file: Path, key: str, classes: int | None = None, tolerance: float | None = None) -> bool:
        """``gems data check`` of a case whose files are compressed (a run reads it only once converted): its
        headers checked as a run's are, then every file read whole as a stream (:func:`streamed`: its bytes
        against its header, its gzip CRC, its labels against ``classes`` or the set's own); False for a case a run
        reads where it lies (the run's reader checks it)."""
        file = Path(file)
        if not any(f.name.endswith(".gz") for f in (*self.channel_files(file), *self.companions(file)[:1])):
            return False
        root = str(self.root(file))
        case = self.case(file, key, root, tolerance, whole=True)
        names = self.class_names(file)
        top = min(int(classes) if classes is not None else len(names) if names else IGNORE, IGNORE)
        for f, _ in case.stamps():
            labels = f == case.labels[0].path
            streamed(header(f, key), key, top if labels else None, self.shown(f), names if labels else None)
        return True

    def convert_hint(self, path: str | os.PathLike, files: Sequence[Path]) -> str | None:
        """What ``gems data check`` says once of a set of compressed volumes (None where none is): that a run reads
        them only once converted, and the command."""
        gz = sum(1 for f in files if f.name.endswith(".gz"))
        if not gz:
            return None
        return (f"{gz} of {len(files)} case(s) compressed (.nii.gz), read whole here as streams: a run reads them once "
                f"converted, by slab (`{self.convert_command(path)}`)")

    def _tiled(self, source: Path, folder: Path, tile: int, key: str, tolerance: float | None = None) -> Path:
        """Case ``source`` (either compression) as one case of the tiled layout in ``folder``: the voxels as stored
        with their scaling, the labels read onto their grid by the affines (:func:`lined_up`, refused where they
        are on another grid) as classes (whole numbers from 0, under 255)."""
        import nibabel as nib

        case = self.case(source, key, str(self.root(source)), tolerance, whole=True)
        if len(case.channels) != 1:
            raise ConfigError("data.tile", tile, f"null for cases of several channels ({self.shown(source)} has "
                              f"{len(case.channels)}): they convert uncompressed")
        v, (g, on_volume) = case.volume, case.labels
        try:
            img: Any = nib.load(str(v.path))
            seg: Any = nib.load(str(g.path))
            voxels = np.asarray(img.dataobj.get_unscaled())
            labels = np.asarray(seg.dataobj)
        except (EOFError, zlib.error, OSError) as e:  # a corrupt gzip stream, a file cut short
            raise ConfigError(key, str(source.parent), f"whole NIfTI files; {self.shown(v.path)} or {self.shown(g.path)} "
                              f"cannot be read ({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
        voxels = voxels.reshape(voxels.shape[:3]).T  # (x, y, z) in F order: (z, y, x) in C
        labels = on_volume.orient(labels.reshape(labels.shape[:3]).T)
        bad = not_a_class(labels, IGNORE)
        if bad is not None:
            raise outside(key, str(source.parent), self.shown(g.path), bad, IGNORE, None)
        names = self.class_names(source)
        out = folder / self.converted_name(source, tile)
        write_case(out, np.ascontiguousarray(voxels), np.ascontiguousarray(labels, dtype=np.uint8), tile,
                   v.slope, v.inter, np.asarray(v.affine), names)
        return out

    def holds(self, files: Sequence[Path]) -> bool:
        return bool(files) and all(_VOLUME.match(f.name) for f in files)

    def open(self, path: str | os.PathLike, shape: Sequence[int] | None, **options: Any) -> NiftiSamples:
        return NiftiSamples(self, path, shape, Options(**options))

    def write(self, folder: str | os.PathLike, samples: Iterable[tuple[np.ndarray, np.ndarray]],
              name: str = "volume-{}", compress: bool = False, spacing: Sequence[float] = (0.8, 0.8, 1.5), *,
              sync: bool = False) -> list[Path]:
        """``volume-N.nii`` and ``segmentation-N.nii`` (``.nii.gz`` with ``compress``) through nibabel, N counting
        from 0, from (voxels (1, z, y, x) or (z, y, x) in Hounsfield units, labels (z, y, x)) pairs: int16
        voxels and uint8 labels, a diagonal affine of ``spacing`` (x, y, z) mm; returns the volumes' paths."""
        import nibabel as nib

        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        affine = np.diag([*(float(s) for s in spacing), 1.0])
        ext = ".nii.gz" if compress else ".nii"
        files = []
        for i, (voxels, labels) in enumerate(samples):
            vol, lab = np.asarray(voxels), np.asarray(labels)
            if vol.ndim not in (3, 4) or vol.ndim == 4 and vol.shape[0] != 1 or lab.shape != vol.shape[-3:]:
                raise ValueError(f"CT volumes of one channel with a class a voxel, not values {list(vol.shape)} with "
                                 f"targets {list(lab.shape)}")
            vol = vol.reshape(vol.shape[-3:])
            for kind, arr, dt in (("volume", vol, np.int16), ("segmentation", lab, np.uint8)):
                final = out / f"{kind}-{i}{ext}"
                tmp = out / f".{final.name}.tmp{ext}"
                img = nib.Nifti1Image(np.asarray(arr, dtype=dt).T, affine)  # (z, y, x) in C order is (x, y, z) in F
                img.header.set_xyzt_units("mm")
                nib.save(img, str(tmp))
                commit(tmp, final, sync)
            files.append(out / f"volume-{i}{ext}")
        return files

    def converted_name(self, source: Path, tile: int | None = None) -> str:
        if tile:  # one case of the tiled layout (gems.data.layouts.tiles)
            return re.sub(r"\.nii(\.gz)?$", ".h5", source.name)
        return source.name[:-3] if source.name.endswith(".gz") else source.name

    def convert(self, source: Path, folder: Path, channels: int | None = None, key: str = "data.path",
                tile: int | None = None, tolerance: float | None = None) -> Path:
        """A ``.nii.gz`` volume and its labels written uncompressed into ``folder`` (a ``.nii`` as is: copied);
        with ``tile``, one case of the tiled layout (gems.data.layouts.tiles: the stored voxels, the labels lined
        up onto them, tiles of that edge); returns the volume's path (written last: once it is there, so are its
        labels)."""
        folder.mkdir(parents=True, exist_ok=True)
        lab = self.companions(source)[0]
        if not lab.is_file():
            raise missing_labels(source, lab, key, self.labels_where, self.shown)
        if tile:
            return self._tiled(source, folder, int(tile), key, tolerance)
        for src in (lab, source):
            uncompressed(src, folder / self.converted_name(src), key)
        return folder / self.converted_name(source)
