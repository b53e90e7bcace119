"""CT volumes with per-voxel labels in NIfTI files, LiTS's layout (layout ``nifti``), for ``model=unet3d``.

A folder holds ``volume-N.nii`` with ``segmentation-N.nii`` beside each (labels 0 background, 1 liver, 2 tumour),
as the liver-tumour set LiTS publishes them; volumes differ in their shape (LiTS: 512 x 512 in-plane, 75-987
slices). The files are read through nibabel's headers (the voxels' type, their byte offset ``vox_offset``, the
scaling ``scl_slope``/``scl_inter``) and then by positional reads (gems.data.reader), as contiguous HDF5 is: the
voxels of an uncompressed NIfTI file are one block in Fortran order, so a volume of (x, y, z) voxels lies on disk
as a C-order array (z, y, x). gems takes it in that order: depth is the slices (z), height y, width x, so a
spatial rank's depth slab is one contiguous run of bytes. Voxels are read as stored: neither reoriented by the
affine nor resampled to another spacing (do that beforehand where a study needs it).

**Samples.** Each volume is cut into tiles of the model's input edge (``model.size``), row-major over (z, y, x);
the tiles at a volume's far edges are padded to the full edge: the network's input with 0 after windowing (the
window's low end: air, whatever the file's type and scaling), labels with :data:`gems.data.layouts.IGNORE`
(255), which the loss, accuracy and Dice leave out (gems.rank.loss). So every voxel of every volume is in exactly
one sample and counts once, training sees every part of each volume, and validation's figures are those of the
whole volumes' voxels, no padding among them (a sliding window without overlap, as nnU-Net and MONAI infer; the
last partial batch is evaluated too, filled with samples of ignored labels alone).

**CT windowing** (:func:`window`): each voxel's Hounsfield value (the stored value times ``scl_slope`` plus
``scl_inter``) is clipped to the window ``data.window`` (default [-200, 250] HU, the soft-tissue window liver
studies on LiTS use) and scaled to [0, 1]: the network's input, one channel. It runs where the batch is
finished (on a GPU rank after the copy: the stored int16 voxels cross, half a float's bytes).

``volume-N.nii.gz`` is gzip-compressed: it cannot be read by position, so ``gems data convert`` writes the
uncompressed ``.nii`` (the same bytes: a ``.nii.gz`` is the ``.nii`` gzip-compressed) first. Volumes of mixed types
(int16 among uint8, say) are read as float32 (exact for integers of up to 16 bits and for float32; the run says
so). A volume without its labels, labels of another shape or of a class at or over ``model.num_classes``, a
corrupt gzip stream, or a volume or its labels changed while the run reads them (replaced, rewritten, cut short:
each file's identity is taken with its header and looked at every batch) are bad input naming the file.
"""
from __future__ import annotations

import gzip
import math
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterable, Sequence

import numpy as np
import torch

from gems.data.layouts import IGNORE, FileSamples, Layout, Options, register
from gems.data.layouts._case import write_case
from gems.data.samples import native as _native
from gems.data.samples import stamp
from gems.errors import ConfigError
from gems.paths import commit

#: the CT window of liver studies on LiTS, in Hounsfield units: clipped to it and scaled to [0, 1]
WINDOW = (-200.0, 250.0)
_VOLUME = re.compile(r"^volume-(\d+)\.nii(\.gz)?$")


def label_name(volume: Path) -> Path:
    """The labels beside ``volume`` (LiTS: ``volume-N.nii`` -> ``segmentation-N.nii``, the same compression)."""
    return volume.with_name("segmentation-" + volume.name[len("volume-"):])


#: LiTS's classes (and gems data synth's segmentation volumes')
LITS_CLASSES = ("background", "liver", "tumour")


def missing_labels(volume: Path, labels: Path, key: str, how: str) -> ConfigError:
    """A volume whose labels are not where the layout puts them (``how``: where that is): bad input naming both,
    and the labels' other compression where that is there instead."""
    other = labels.with_name(labels.name[:-3]) if labels.name.endswith(".gz") else labels.with_name(labels.name + ".gz")
    there = (f" ({other.name} is there: `gems data convert` writes volumes and labels alike, uncompressed)"
             if other.is_file() else "")
    return ConfigError(key, str(volume.parent), f"labels for every volume ({how}); {labels.name} is missing for "
                       f"{volume.name}{there}")


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
    """What reading one NIfTI file needs, from nibabel's header: the voxels' ``shape`` as a C-order array
    (z, y, x), their ``dtype`` (the file's byte order), the byte ``offset`` of the block (None: compressed),
    the scaling ``slope`` and ``inter``, and the file's ``stamp`` (gems.data.samples.stamp, taken before the header
    was read: a file replaced or rewritten since is named, not read at its old offset and scaling)."""

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


def header(path: Path, key: str) -> Header:
    """File ``path``'s :class:`Header`; a file nibabel cannot read, or not a 3D volume, is bad input naming it."""
    import nibabel as nib

    try:
        was = stamp(path)
        img: Any = nib.load(str(path))
        proxy = img.dataobj
        shape = tuple(int(n) for n in img.shape)
    except Exception as e:  # nibabel's ImageFileError, a truncated header, a corrupt gzip stream
        raise ConfigError(key, str(path.parent), f"NIfTI volumes nibabel reads; {path.name} is not one "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:160]})") from None
    while len(shape) > 3 and shape[-1] == 1:
        shape = shape[:-1]
    if len(shape) != 3:
        raise ConfigError(key, str(path.parent), f"3D NIfTI volumes; {path.name} holds {list(shape)} voxels")
    slope, inter = float(getattr(proxy, "slope", 1.0)), float(getattr(proxy, "inter", 0.0))
    offset = None if path.name.endswith(".gz") else int(proxy.offset)
    dtype = np.dtype(proxy.dtype)
    if dtype.kind not in "iuf":
        raise ConfigError(key, str(path.parent), f"NIfTI voxels of integers or floats; {path.name} holds {dtype}")
    if offset is not None:  # the voxels the header promises, against the bytes the file holds
        need = offset + math.prod(shape) * dtype.itemsize
        if was[2] < need:
            raise ConfigError(key, str(path.parent), f"whole NIfTI files; {path.name} is cut short: its header puts "
                              f"{math.prod(shape) * dtype.itemsize} bytes of voxels from byte {offset} ({need} in "
                              f"all), the file holds {was[2]}")
    affine = tuple(tuple(float(v) for v in row) for row in np.asarray(img.affine, dtype=np.float64))
    return Header(path, (shape[2], shape[1], shape[0]), dtype, offset, slope, inter, was, affine)


# ---------------------------------------------------------------------------- grids: a file against the sample's
#: how far (in voxels) two affines may differ and still be one grid: NIfTI stores them as float32, whose rounding of
#: an origin 500 mm out is 3e-5 mm
ALIGN_TOL = 1e-3


@dataclass(frozen=True)
class Grid:
    """How a file's voxels lie against the sample's grid (both as C-order (z, y, x) arrays): ``axes[a]`` is the
    file's axis that the sample's axis ``a`` runs along, ``flips[a]`` whether it runs the other way. The identity
    for a volume read as stored; a segmentation saved with an axis flipped or its axes permuted (and its affine to
    match: the same labels in the same place) is read through its grid onto its volume's, exactly."""

    axes: tuple[int, int, int] = (0, 1, 2)
    flips: tuple[bool, bool, bool] = (False, False, False)

    @property
    def identity(self) -> bool:
        return self.axes == (0, 1, 2) and not any(self.flips)

    def shape(self, file_shape: Sequence[int]) -> tuple[int, int, int]:
        """The sample grid's shape of a file of (C-order) ``file_shape``."""
        return tuple(int(file_shape[a]) for a in self.axes)  # type: ignore[return-value]

    def box(self, src: Sequence[slice], file_shape: Sequence[int]) -> tuple[slice, ...]:
        """The file's box (C order) that holds the sample's box ``src``."""
        out: list[slice] = [slice(0, 0)] * 3
        for a, s in enumerate(src):
            f, n = self.axes[a], int(file_shape[self.axes[a]])
            out[f] = slice(n - s.stop, n - s.start) if self.flips[a] else slice(s.start, s.stop)
        return tuple(out)

    def orient(self, block: np.ndarray) -> np.ndarray:
        """A block read from the file's box as the sample's (a view: transposed, then flipped)."""
        view = block.transpose(self.axes)
        flipped = tuple(a for a in range(3) if self.flips[a])
        return np.flip(view, flipped) if flipped else view

    def then(self, other: "Grid") -> "Grid":
        """This grid (sample -> file A) followed by ``other`` (file A's grid -> file B): sample -> file B."""
        return Grid(tuple(other.axes[self.axes[a]] for a in range(3)),  # type: ignore[arg-type]
                    tuple(self.flips[a] != other.flips[self.axes[a]] for a in range(3)))  # type: ignore[arg-type]

    def describe(self) -> str:
        names = "zyx"
        parts = []
        if self.axes != (0, 1, 2):
            parts.append("axes (z, y, x) read from its (" + ", ".join(names[a] for a in self.axes) + ")")
        flipped = [names[a] for a in range(3) if self.flips[a]]
        if flipped:
            parts.append(" and ".join(flipped) + " flipped")
        return "; ".join(parts) or "as stored"


def _affine_text(affine: Any) -> str:
    return "[" + "; ".join(" ".join(f"{v:.4g}" for v in row) for row in np.asarray(affine)[:3]) + "]"


def lined_up(volume: Header, labels: Header, key: str) -> Grid:
    """The grid that reads ``labels`` onto ``volume``'s voxels: where their affines differ by flips and
    permutations of the axes only (within :data:`ALIGN_TOL` voxels), the labels lie on the same grid in another
    order and are read in the volume's, exactly; any other difference (spacing, origin, shear, shape) is bad input
    naming both files and both affines: labels trained against voxels they do not belong to, silently, are worse
    than a refusal."""
    av, al = np.asarray(volume.affine, dtype=np.float64), np.asarray(labels.affine, dtype=np.float64)
    nv = np.array(volume.shape[::-1])  # (x, y, z): NIfTI's index order, the affine's
    try:
        m = np.linalg.solve(al, av)  # a volume index (x, y, z, 1) -> the labels' index
    except np.linalg.LinAlgError:
        m = np.full((4, 4), np.nan)
    rot, shift = m[:3, :3], m[:3, 3]
    perm = np.round(rot)
    ok = bool(np.all(np.isfinite(m)) and np.allclose(rot, perm, atol=ALIGN_TOL)
              and all(sorted(np.abs(perm[:, a]).tolist()) == [0, 0, 1] for a in range(3))
              and all(sorted(np.abs(perm[b, :]).tolist()) == [0, 0, 1] for b in range(3)))
    why = "more than a flip or permutation of the axes (other spacing, a rotation or a shear)"
    if ok:
        src = [int(np.argmax(np.abs(perm[b]))) for b in range(3)]  # the labels' axis b runs along the volume's src[b]
        back = [bool(perm[b, src[b]] < 0) for b in range(3)]
        want = np.array([nv[src[b]] - 1 if back[b] else 0 for b in range(3)], dtype=np.float64)
        nl = np.array(labels.shape[::-1])
        if not np.allclose(shift, want, atol=10 * ALIGN_TOL):
            ok, why = False, f"another origin: the labels' grid is shifted by {_affine_vec(shift - want)} voxels"
        elif any(int(nl[b]) != int(nv[src[b]]) for b in range(3)):
            ok, why = False, "another shape once the axes are lined up"
    if not ok:
        raise ConfigError(key, str(volume.path.parent), f"labels on their volume's voxel grid (the same affine, or one "
                          f"that flips or permutes its axes); {labels.path.name}'s affine {_affine_text(al)} and "
                          f"{volume.path.name}'s {_affine_text(av)} differ by {why}: resample the labels onto the "
                          "volume's grid")
    # in C order (z, y, x): the sample's axis a is NIfTI's 2 - a
    axes = tuple(2 - next(b for b in range(3) if src[b] == 2 - a) for a in range(3))
    flips = tuple(back[2 - axes[a]] for a in range(3))
    return Grid(axes, flips)  # type: ignore[arg-type]


def _affine_vec(v: Any) -> str:
    return "(" + ", ".join(f"{float(x):.3g}" for x in v) + ")"


def canonical(volume: Header) -> Grid:
    """The grid that reads ``volume`` in RAS+ orientation (``data.orientation=RAS``, as MONAI's ``Orientationd``
    and nibabel's ``as_closest_canonical``): x towards the right, y anterior, z superior, each axis of the sample
    the file's axis nearest to it (nibabel's ``io_orientation``)."""
    import nibabel as nib

    ornt = nib.orientations.io_orientation(np.asarray(volume.affine))  # per file axis (x, y, z): world axis, sign
    axes, flips = [0, 0, 0], [False, False, False]
    for f in range(3):
        w, sign = int(ornt[f, 0]), float(ornt[f, 1])
        a = 2 - w  # the sample's C-order axis of world axis w (R, A, S -> x, y, z -> C axes 2, 1, 0)
        axes[a], flips[a] = 2 - f, sign < 0
    return Grid(tuple(axes), tuple(flips))  # type: ignore[arg-type]


Box = tuple[tuple[int, int], ...]


class Voxels:
    """A batch of CT voxels as :meth:`NiftiSamples.read` leaves them: ``data`` (N, *part) as stored, ``slope`` and
    ``inter`` (N) each sample's scaling to Hounsfield units, ``boxes`` (row, the volume's part of it: [lo, hi) a
    dim) of each row that holds padding (0 where stored; 0 in the network's input: :meth:`NiftiSamples.finish`).
    Moves as a tensor does (what gems.rank.data.Prefetcher asks of a batch it copies to the device)."""

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
        """The voxels as stored, channels first (N, 1, *part): a batch's ``raw`` form."""
        return self.data.unsqueeze(1)


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


def windowed(x: torch.Tensor, slope: torch.Tensor, inter: torch.Tensor, win: tuple[float, float]) -> torch.Tensor:
    """Stored voxels (N, *part) to the network's input (N, 1, *part), on their device: Hounsfield units (``x *
    slope + inter``, per sample), clipped to the window ``win`` and scaled to [0, 1]; elementwise, so any cut of a
    sample gives the same values."""
    lo, hi = win
    shape = (-1,) + (1,) * (x.dim() - 1)
    hu = x.to(torch.float32) * slope.to(torch.float32).view(shape) + inter.to(torch.float32).view(shape)
    return hu.clamp_(lo, hi).sub_(lo).div_(hi - lo).unsqueeze(1)


class NiftiSamples(FileSamples):
    """The tiles of a folder of LiTS volumes as one rank reads them (gems.data.layouts' ``Samples``; module
    docstring): raw voxels (:class:`Voxels`) and per-voxel classes, this rank's part of each."""

    def __init__(self, layout: NiftiLayout, path: str | os.PathLike, shape: Sequence[int] | None,
                 options: Options) -> None:
        from gems.data.samples import full_slices, raw_dtype

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
        self.heads: list[Header] = []
        self.labels: list[Header] = []
        self.grids_of: list[tuple[Grid, Grid]] = []  # (the volume's, its labels') grid against the sample's
        self._notes: list[str] = []
        turned: list[str] = []
        for f in self.files:
            v, g, on_volume = layout.pair(f, self.key, self.path)
            self.remember(len(self.heads), [(v.path, v.stamp), (g.path, g.stamp)])
            vgrid = canonical(v) if options.orientation == "RAS" else Grid()
            self.heads.append(v)
            self.labels.append(g)
            self.grids_of.append((vgrid, vgrid.then(on_volume)))
            if not on_volume.identity:
                turned.append(f"{g.path.name} ({on_volume.describe()})")
        if turned:
            self._notes.append(f"{self.key}: labels reoriented onto their volume's voxel grid by their affines, "
                               f"exactly: {', '.join(turned[:4])}" + (f" and {len(turned) - 4} more" if len(turned) > 4
                                                                      else ""))
        self._notes += layout.folder_notes(path, self.key)
        if options.orientation == "RAS":
            self._notes.append(f"{self.key}: volumes and labels read in RAS+ orientation (data.orientation=RAS)")
        #: each volume's shape (z, y, x) on the sample's grid (as stored, or RAS+)
        self.shapes = [vg.shape(h.shape) for h, (vg, _) in zip(self.heads, self.grids_of)]
        edge = int(shape[1]) if shape is not None else max(max(h) for h in self.shapes)
        self.shape = (1, edge, edge, edge) if shape is None else tuple(int(n) for n in shape)
        if len(self.shape) != 4 or self.shape[0] != 1:
            raise ConfigError("model.in_channels", self.shape[0], "1 for CT volumes (one value a voxel)")
        self.crop(options.crop)
        self.grids = [tuple(-(-n // e) for n, e in zip(h, self.shape[1:])) for h in self.shapes]
        self.starts = np.cumsum([0] + [math.prod(g) for g in self.grids])
        types = sorted({_native(h.dtype) for h in self.heads}, key=str)
        self.dtype = types[0] if len(types) == 1 else np.dtype(np.float32)  # a batch holds one type
        self._notes += [] if len(types) == 1 else [
            f"{self.key}: volumes of {len(types)} types ({', '.join(map(str, types))}) read as float32 (a batch holds "
            "one type): exact for integers of up to 16 bits and for float32"
            + ("" if all(t.itemsize <= 2 or t == np.float32 for t in types) else
               f", rounded to float32's 24 bits for {', '.join(str(t) for t in types if t.itemsize > 2 and t != np.float32)}")]
        self.raw = raw_dtype(self.dtype)
        self.slices = full_slices(options.slices or (), self.shape[1:])
        self.symmetries = 1
        self.classes: int | None = int(options.classes) if options.classes is not None else None
        #: each class's name, by its label (the Dice columns'): the layout's (LiTS's, a Decathlon task's
        #: dataset.json), where it names as many as the model has
        self.class_names: list[str] | None = layout.class_names(path)
        self.ignore = IGNORE  # the label of padding: the loss, accuracy and Dice leave it out (gems.rank.loss)
        self._chunk_maps: dict[Any, dict[tuple[int, ...], int]] = {}
        #: (volume, the part of it) whose labels were checked against the classes: the files are the same ones for
        #: the run (their stamps are looked at every batch), so a part read again is not checked again
        self._checked: set[tuple[int, tuple[tuple[int, int], ...]]] = set()

    def __len__(self) -> int:
        return int(self.starts[-1])

    def where(self, index: int) -> str:
        """Volume ``index`` in a message: its name (a volume is many samples, not a file of the folder's count)."""
        return self.files[index].name

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
            for head, grid in zip((self.heads[v], self.labels[v]), self.grids_of[v]):
                self._read(head, src, np.empty(shape, dtype=_native(head.dtype)), tasks, [], grid)
        return [(t.path, t.base + b.at, b.span) for t in tasks for b in t.blocks]

    def read(self, indices: Sequence[int], symmetries: Sequence[int] | None = None, pin: bool = False,
             out: torch.Tensor | None = None, want_input: bool = True) -> tuple[Any, torch.Tensor]:
        """This rank's part of each sample's voxels as stored (:class:`Voxels`; padding 0 and its box, for
        :meth:`finish`) and of its labels (uint8 classes, padding :data:`~gems.data.layouts.IGNORE`; the loss takes
        them as they are), by positional reads on the reader's threads, each file looked at first (:meth:`FileSamples.still`)."""
        part = self.part_shape()[1:]
        shape = (len(indices), *part)
        if want_input or out is not None:
            out = self.batch_buffer(shape, self.raw, pin, out)
        labels = np.empty(shape, dtype=np.uint8)  # classes; made long where the loss takes them
        tasks: list = []
        posts: list = []
        lab_bufs: list[tuple[int, int, tuple[slice, ...], np.ndarray | None]] = []
        boxes: list[tuple[int, Box]] = []
        slope, inter = np.ones(len(indices)), np.zeros(len(indices))
        seen: set[int] = set()
        for r, i in enumerate(indices):
            v, src, dst = self._box(i)
            if v not in seen:
                self.still(v)
                seen.add(v)
            padded_row = any(d.stop - d.start != n for d, n in zip(dst, part))
            if out is not None:
                row = out.numpy()[r]
                if padded_row:
                    row[...] = 0
                    boxes.append((r, tuple((d.start, d.stop) for d in dst)))
                self._read(self.heads[v], src, row[dst], tasks, posts, self.grids_of[v][0])
                slope[r], inter[r] = self.heads[v].slope, self.heads[v].inter
            if padded_row:
                labels[r] = IGNORE
            g = self.labels[v]
            if _native(g.dtype) == np.uint8 and (g.slope, g.inter) == (1.0, 0.0):  # classes as they lie: read in place
                self._read(g, src, labels[r][dst], tasks, posts, self.grids_of[v][1])
                if (v, _box_key(src)) not in self._checked:  # (a part's labels checked once: a change is named anyway)
                    lab_bufs.append((r, v, dst, None))
            else:
                buf = np.empty(tuple(s.stop - s.start for s in src), dtype=_native(g.dtype))
                self._read(g, src, buf, tasks, posts, self.grids_of[v][1])
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
        g = self.labels[v]
        values = stored if (g.slope, g.inter) == (1.0, 0.0) else stored * g.slope + g.inter
        top = min(self.classes or IGNORE, IGNORE)
        if values.size and ((values.dtype.kind != "u" and values.min() < 0) or values.max() >= top
                            or (values.dtype.kind == "f" and not np.array_equal(values, np.round(values)))):
            bad = values[(values < 0) | (values >= top) | (values != np.round(values))]
            named = f" ({', '.join(self.class_names)})" if self.class_names else ""
            raise ConfigError(self.key, self.path, f"labels 0 .. {(self.classes or 3) - 1}{named}: model.num_classes; "
                              f"{g.path.name} holds {bad.flat[0]}")
        return values.astype(np.uint8, copy=False)

    def finish(self, x: Any) -> torch.Tensor:
        """The network's input (:func:`windowed`), each row's padding 0 (the window's low end)."""
        if isinstance(x, Voxels):
            return padded(windowed(x.data, x.slope, x.inter, self.window), x.boxes)
        return windowed(x, torch.ones(x.shape[0]), torch.zeros(x.shape[0]), self.window)

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
        raise ConfigError(key, str(source.parent), f".nii.gz files that are whole gzip streams; {source.name} is a "
                          f"corrupt gzip stream ({type(e).__name__}: {e})") from None
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

    def pair(self, volume: Path, key: str, path: str) -> tuple[Header, Header, Grid]:
        """(the volume's :class:`Header`, its labels', the grid that reads the labels onto the volume's voxels):
        both uncompressed NIfTI files, the labels there and of the volume's shape, lined up by their affines
        (:func:`lined_up`); else bad input naming the file."""
        v = header(volume, key)
        if v.offset is None:
            raise ConfigError(key, path, f"uncompressed .nii volumes, read by slab; {volume.name} is gzip-compressed: "
                              f"`gems data convert data.path={path} data.out=DIR` writes them uncompressed")
        lab = self.companions(volume)[0]
        if not lab.is_file():
            raise missing_labels(volume, lab, key, self.labels_where)
        g = header(lab, key)
        if g.offset is None:
            raise ConfigError(key, path, f"uncompressed .nii labels; {lab.name} is gzip-compressed (`gems data "
                              "convert` writes them uncompressed)")
        if sorted(g.shape) != sorted(v.shape):
            raise ConfigError(key, path, f"labels of their volume's shape; {lab.name} holds {list(g.shape[::-1])} "
                              f"voxels (x, y, z), {volume.name} {list(v.shape[::-1])}")
        return v, g, lined_up(v, g, key)  # refused where the labels are not on the volume's grid

    def companions(self, file: Path) -> list[Path]:
        """The volume's labels (always the first: NiftiSamples reads them)."""
        return [label_name(file)]

    def class_names(self, path: str | os.PathLike) -> list[str] | None:
        """The classes' names by label: LiTS's."""
        return list(LITS_CLASSES)

    def folder_notes(self, path: str | os.PathLike, key: str) -> list[str]:
        """What a run over the folder says of it beyond its volumes (a Decathlon task's test volumes left out)."""
        return []

    def _tiled(self, source: Path, lab: Path, folder: Path, tile: int, key: str) -> Path:
        """``source`` and its labels ``lab`` (either compression) as one case of the tiled layout in ``folder``:
        the voxels as stored with their scaling, the labels read onto their grid by the affines (:func:`lined_up`,
        refused where they are on another grid) as classes (whole numbers from 0, under 255)."""
        import nibabel as nib

        v, g = header(source, key), header(lab, key)
        on_volume = lined_up(v, g, key)
        try:
            img: Any = nib.load(str(source))
            seg: Any = nib.load(str(lab))
            voxels = np.asarray(img.dataobj.get_unscaled())
            labels = np.asarray(seg.dataobj)
        except (EOFError, zlib.error, OSError) as e:  # a corrupt gzip stream, a file cut short
            raise ConfigError(key, str(source.parent), f"whole NIfTI files; {source.name} or {lab.name} cannot be read "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:120]})") from None
        voxels = voxels.reshape(voxels.shape[:3]).T  # (x, y, z) in F order: (z, y, x) in C
        labels = on_volume.orient(labels.reshape(labels.shape[:3]).T)
        if labels.size and (labels.min() < 0 or labels.max() >= IGNORE or not np.array_equal(labels, np.round(labels))):
            bad = labels[(labels < 0) | (labels >= IGNORE) | (labels != np.round(labels))]
            raise ConfigError(key, str(source.parent), f"labels that are classes 0 .. {IGNORE - 1}; {lab.name} holds "
                              f"{bad.flat[0]}")
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
                tile: int | None = None) -> Path:
        """A ``.nii.gz`` volume and its labels written uncompressed into ``folder`` (a ``.nii`` as is: copied);
        with ``tile``, one case of the tiled layout (gems.data.layouts.tiles: the stored voxels, the labels lined
        up onto them, tiles of that edge); returns the volume's path (written last: once it is there, so are its
        labels)."""
        folder.mkdir(parents=True, exist_ok=True)
        lab = self.companions(source)[0]
        if not lab.is_file():
            raise missing_labels(source, lab, key, self.labels_where)
        if tile:
            return self._tiled(source, lab, folder, int(tile), key)
        for src in (lab, source):
            uncompressed(src, folder / self.converted_name(src), key)
        return folder / self.converted_name(source)
