"""What every layout's samples share, below gems.data.layouts (the protocol and :class:`~gems.data.layouts.FileSamples`):
a batch as read (:class:`Counts`), finished where the batch is; the stamps that tell a file changed under a run
(:func:`stamp`, :func:`change`); counts to the network's input (:func:`transform`, :func:`finished`).
"""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch

from gems.data import augment as augmentation
from gems.errors import ConfigError

#: the file dtypes values keep until :func:`transform` (torch holds them, in either byte order); others become
#: float32 at once
RAW_DTYPES = {np.dtype(t) for t in (np.int8, np.uint8, np.int16, np.int32, np.int64, np.float16, np.float32,
                                    np.float64)}


def native(dtype: Any) -> np.dtype:
    """``dtype`` in this machine's byte order (the values a file of either order holds are the same)."""
    dt = np.dtype(dtype)
    return dt.newbyteorder("=") if dt.byteorder in "<>" else dt


def raw_dtype(dtype: np.dtype) -> torch.dtype:
    """The type a file's values of ``dtype`` are held in until :func:`transform`: their own (in this machine's
    byte order) where torch holds it, else float32."""
    kind = native(dtype)
    return torch.from_numpy(np.empty(0, dtype=kind if kind in RAW_DTYPES else np.float32)).dtype


def full_slices(parts: Sequence[slice], spatial: Sequence[int]) -> tuple[slice, ...]:
    """``parts`` with explicit bounds, one per spatial dim."""
    full = list(parts) + [slice(None)] * (len(spatial) - len(parts))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(full, spatial))


def holds_crops(shape: Sequence[int], sample: Sequence[int]) -> bool:
    """A file's array of (C, *spatial) ``shape`` is samples of ``sample``'s shape: the same channels, and a whole
    multiple of it in every spatial dim."""
    return (len(shape) == len(sample) and shape[0] == sample[0]
            and all(f >= s > 0 and f % s == 0 for f, s in zip(shape[1:], sample[1:])))


def standardize(value: Sequence[float] | None) -> tuple[float, float] | None:
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


def transform(x: torch.Tensor, log1p: bool = True, standardize: tuple[float, float] | None = None,
              inplace: bool = False) -> torch.Tensor:
    """Counts to the network's input, elementwise on whatever device ``x`` is on: float32, ``log(x+1)`` when
    ``log1p``, then ``(x - mean) / std``. The same operations in the same order on every path, so a batch
    transformed on the host after stacking equals one whose samples were transformed one by one, bit for bit.
    One full-size tensor at most, the result (``inplace`` and float32 ``x``: none, ``x`` becomes it)."""
    x = x.to(torch.float32, copy=not inplace)
    if log1p:
        x.log1p_()
    if standardize is not None:
        mean, std = standardize
        x.sub_(float(mean)).div_(float(std))
    return x


def finished(x: Any, log1p: bool = True, standardize: tuple[float, float] | None = None) -> torch.Tensor:
    """A batch of counts as read (:class:`Counts`: its symmetries and channel order applied in the same pass as the
    conversion to float32) or a tensor of them, to the network's input on its device (:func:`transform`, in place
    on the one new tensor)."""
    if isinstance(x, Counts):
        return transform(x.oriented(torch.float32), log1p, standardize, inplace=True)
    return transform(x, log1p, standardize)


Stamp = tuple[int, int, int, int]


def stamp(path: str | os.PathLike) -> Stamp:
    """(device, inode, size, mtime in ns) of ``path``: what tells that a file was replaced, cut or rewritten."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def change(path: str | os.PathLike, was: Stamp) -> str | None:
    """How file ``path`` changed since its :func:`stamp` was ``was`` ("is gone", "was cut short", "grew", "was
    replaced by another file", "was rewritten"), None where it did not."""
    try:
        now = stamp(path)
    except OSError:
        return "is gone (deleted or moved)"
    if now == was:
        return None
    if now[2] != was[2]:
        return "was cut short" if now[2] < was[2] else "grew"
    return "was replaced by another file" if now[:2] != was[:2] else "was rewritten"


class Counts:
    """A batch of values as a reader leaves it: row ``i`` of ``data`` holds sample ``i``'s values as read, from
    the part its symmetry ``symmetries[i]`` takes them from (gems.data.augment.source_slices), in that part's own
    shape ``shapes[i]`` and the file's C order (``channels_last``: the channels last). The symmetries, and the
    move of the channels to the front, are applied by :meth:`oriented`, where the batch is finished: on a GPU
    rank after the copy to its device (a permutation and mirrors move values without changing them, so it equals
    the host's batch bit for bit). It moves as a tensor does (``is_cuda``, ``pin_memory``, ``to``: what
    gems.rank.data.Prefetcher asks of a batch it copies to the device)."""

    def __init__(self, data: torch.Tensor, symmetries: Sequence[int], shapes: Sequence[tuple[int, ...]],
                 channels_last: bool = False) -> None:
        self.data, self.symmetries, self.shapes = data, tuple(int(k) for k in symmetries), tuple(shapes)
        self.channels_last = bool(channels_last)

    @property
    def is_cuda(self) -> bool:
        return bool(self.data.is_cuda)

    def pin_memory(self) -> Counts:
        return self if self.data.is_pinned() else Counts(self.data.pin_memory(), self.symmetries, self.shapes,
                                                         self.channels_last)

    def to(self, device: Any, non_blocking: bool = False) -> Counts:
        return Counts(self.data.to(device, non_blocking=non_blocking), self.symmetries, self.shapes,
                      self.channels_last)

    def oriented(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values of each sample transformed by its symmetry, channels first (N, C, *part), on ``data``'s
        device; ``dtype``: a new tensor of that type (one pass: the conversion is the copy), else ``data``
        itself where there is nothing to move."""
        if dtype is None and not any(self.symmetries) and not self.channels_last:
            return self.data
        n = self.data.shape[0]
        if self.channels_last:  # the row holds (*part, C): the batch's shape is (C, *part)
            shape = (n, self.data.shape[-1], *self.data.shape[1:-1])
        else:
            shape = tuple(self.data.shape)
        out = torch.empty(shape, dtype=dtype or self.data.dtype, device=self.data.device)
        for row, dst, k, sh in zip(self.data, out, self.symmetries, self.shapes):
            v = row.view(sh)
            if self.channels_last:
                v = v.movedim(-1, 0)
            dst.copy_(augmentation.apply(k, v, contiguous=False))
        return out
