"""How one NIfTI file's voxel grid lies against another's, from their affines: :func:`lined_up`, the grid that reads
a volume's labels (or a case's other channel files) onto its voxels where the two differ by flips and permutations
of the axes alone, within ``data.affine_tolerance`` voxels at every corner of the volume, and the refusal naming
what differs otherwise (spacing, a rotation in degrees, the origin, the shape); :func:`canonical`, the grid that
reads a volume in RAS+ orientation. The NIfTI layouts (gems.data.layouts.nifti and those extending it) read through
it.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from gems.errors import ConfigError


def tolerance_of(value: float | None) -> float:
    """``data.affine_tolerance`` in voxels (None: its default, gems.config's)."""
    from gems.config import DataConf

    return float(DataConf.affine_tolerance if value is None else value)


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


def affine_text(affine: Any) -> str:
    return "[" + "; ".join(" ".join(f"{v:.4g}" for v in row) for row in np.asarray(affine)[:3]) + "]"


def _vector(v: Any, digits: int = 3) -> str:
    return "(" + ", ".join(f"{float(x):.{digits}g}" for x in v) + ")"


def _nearest_axes(m: np.ndarray) -> tuple[list[int], list[bool]]:
    """(for each axis b of the other file, the volume's axis it runs nearest to; whether it runs the other way) of
    ``m`` (a volume index -> the other's): a signed permutation, taken greedily by the largest entries."""
    src, free = [-1, -1, -1], {0, 1, 2}
    for _, b, a in sorted(((abs(m[b, a]), b, a) for b in range(3) for a in range(3)), reverse=True):
        if src[b] < 0 and a in free:
            src[b] = a
            free.discard(a)
    return src, [bool(m[b, src[b]] < 0) for b in range(3)]


def _differences(av: np.ndarray, al: np.ndarray, nv: np.ndarray, src: list[int], back: list[bool],
                 shift: np.ndarray, tolerance: float, noun: str) -> list[str]:
    """What makes the other grid not the volume's, each part that moves a corner by a tenth of the tolerance or
    more: the spacing, a rotation (degrees), the origin (``shift``: where the volume's first voxel lands, in the
    other's voxels, against where it should)."""
    far = np.maximum(nv - 1, 0).astype(np.float64)
    sv, sl = np.linalg.norm(av[:3, :3], axis=0), np.linalg.norm(al[:3, :3], axis=0)
    on = [next(b for b in range(3) if src[b] == a) for a in range(3)]  # the other's axis along the volume's a
    sl_on = np.array([sl[on[a]] for a in range(3)])
    out = []
    if float(np.max(np.abs(sv / sl_on - 1) * far)) * 10 >= tolerance:
        out.append(f"spacing: {_vector(sl_on, 5)} mm against the volume's {_vector(sv, 5)} (x, y, z)")
    dv = av[:3, :3] / sv
    dl = np.stack([(-1.0 if back[on[a]] else 1.0) * al[:3, on[a]] / sl[on[a]] for a in range(3)], axis=1)
    cos = (float(np.trace(dl @ dv.T)) - 1) / 2
    degrees = math.degrees(math.acos(min(1.0, max(-1.0, cos))))
    if math.radians(degrees) * float(np.linalg.norm(far * sv)) / float(sl.min()) * 10 >= tolerance:
        out.append(f"a rotation of {degrees:.3g} degrees")
    if float(np.linalg.norm(shift)) * 10 >= tolerance:
        out.append(f"another origin: the {noun}' grid is shifted by {_vector(shift)} voxels")
    return out


def lined_up(volume: Any, other: Any, key: str, tolerance: float | None = None,
             shown: Callable[[Path], str] = lambda p: p.name, noun: str = "labels") -> Grid:
    """The grid that reads ``other`` (a volume's labels, or another channel of its case: each a NIfTI layout's
    header, with ``path``, ``shape`` (z, y, x) and ``affine``) onto ``volume``'s voxels: where the two affines
    differ by flips and permutations of the axes alone (module docstring: every corner within ``tolerance`` voxels,
    ``data.affine_tolerance``), the other file lies on the same grid in another order and is read in the volume's,
    exactly. Any other difference (spacing, a rotation, the origin, the shape) is bad input naming both files,
    both affines and what differs (``shown``: a file in a message; ``noun``: what ``other`` is): labels trained
    against voxels they do not belong to, silently, are worse than a refusal."""
    tol = tolerance_of(tolerance)
    av, al = np.asarray(volume.affine, dtype=np.float64), np.asarray(other.affine, dtype=np.float64)
    nv, nl = np.array(volume.shape[::-1]), np.array(other.shape[::-1])  # (x, y, z): NIfTI's index order, the affine's
    try:
        m = np.linalg.solve(al, av)  # a volume index (x, y, z, 1) -> the other's index
    except np.linalg.LinAlgError:
        m = np.full((4, 4), np.nan)
    if not np.all(np.isfinite(m)):
        why, err = ["an affine that maps no voxel (it cannot be inverted)"], math.inf
    else:
        src, back = _nearest_axes(m[:3, :3])
        perm = np.zeros((3, 3))
        for b in range(3):
            perm[b, src[b]] = -1.0 if back[b] else 1.0
        want = np.array([nv[src[b]] - 1 if back[b] else 0 for b in range(3)], dtype=np.float64)
        corners = np.array(list(itertools.product(*[(0, max(int(n) - 1, 0)) for n in nv])), dtype=np.float64)
        off = corners @ m[:3, :3].T + m[:3, 3] - (corners @ perm.T + want)
        err = float(np.max(np.linalg.norm(off, axis=1)))
        why = _differences(av, al, nv, src, back, off[0], tol, noun) if err >= tol else []
        if any(int(nl[b]) != int(nv[src[b]]) for b in range(3)):
            why.append(f"another shape once the axes are lined up ({_vector(nl[np.argsort(src)], 6)} voxels (x, y, z) "
                       f"against {_vector(nv, 6)})")
        elif err >= tol and not why:
            why = ["a shear, or several differences each within the tolerance"]
    if why:
        off_by = f": a corner lies {err:.3g} voxels off, over data.affine_tolerance={tol:g}" if math.isfinite(err) else ""
        raise ConfigError(key, str(volume.path.parent), f"{noun} on their volume's voxel grid (the same affine, or one "
                          f"that flips or permutes its axes); {shown(other.path)}'s affine {affine_text(al)} and "
                          f"{shown(volume.path)}'s {affine_text(av)} differ by {'; '.join(why)}{off_by}: resample the "
                          f"{noun} onto the volume's grid")
    # in C order (z, y, x): the sample's axis a is NIfTI's 2 - a
    axes = tuple(2 - next(b for b in range(3) if src[b] == 2 - a) for a in range(3))
    flips = tuple(back[2 - axes[a]] for a in range(3))
    return Grid(axes, flips)  # type: ignore[arg-type]


def canonical(volume: Any) -> Grid:
    """The grid that reads ``volume`` (a header with an ``affine``) in RAS+ orientation (``data.orientation=RAS``,
    as MONAI's ``Orientationd`` and nibabel's ``as_closest_canonical``): x towards the right, y anterior, z
    superior, each axis of the sample the file's axis nearest to it (nibabel's ``io_orientation``)."""
    import nibabel as nib

    ornt = nib.orientations.io_orientation(np.asarray(volume.affine))  # per file axis (x, y, z): world axis, sign
    axes, flips = [0, 0, 0], [False, False, False]
    for f in range(3):
        w, sign = int(ornt[f, 0]), float(ornt[f, 1])
        a = 2 - w  # the sample's C-order axis of world axis w (R, A, S -> x, y, z -> C axes 2, 1, 0)
        axes[a], flips[a] = 2 - f, sign < 0
    return Grid(tuple(axes), tuple(flips))  # type: ignore[arg-type]
