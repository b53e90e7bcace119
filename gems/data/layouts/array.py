"""The base of a layout whose files each hold one array in C order at a byte offset, after a header of the layout's own
(a raw file, as ``.npy`` is one): :class:`ArrayLayout` and the samples it opens, :class:`ArraySamples`. A layout on
it writes :meth:`ArrayLayout.header` and :meth:`~gems.data.layouts.Layout.write`; the base does the rest of the
protocol (docs/data.md, "Adding a layout", shows one).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Sequence

import numpy as np
import torch

from gems.data import reader as preader
from gems.data.layouts import FileSamples, Layout, Options
from gems.data.samples import Counts, finished, holds_crops, native, raw_dtype, stamp, standardize
from gems.errors import ConfigError


@dataclass(frozen=True)
class ArrayHeader:
    """What a file's header says, as its layout reads it: the byte ``offset`` of the array in the file, its
    ``shape`` (C, *spatial) in C order, its ``dtype`` (numpy's, with the file's byte order: ``>u2`` is big-endian
    uint16) and the sample's ``target`` (a vector of numbers)."""

    offset: int
    shape: Sequence[int]
    dtype: Any
    target: Any


@dataclass(frozen=True)
class _Array:
    """A file's :class:`ArrayHeader`, typed, with the file and its stamp (taken before its header was read)."""

    path: Path
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype
    target: np.ndarray
    stamp: tuple[int, int, int, int]


def _typed(layout: ArrayLayout, file: Path) -> _Array:
    """File ``file``'s header as ``layout`` reads it, typed; whatever the layout's reading raises where the file is
    not one of its own (a foreign file, a header cut short) goes on up."""
    was = stamp(file)
    head = layout.header(file)
    target = np.asarray(head.target, dtype=np.float32).reshape(-1)
    return _Array(file, int(head.offset), tuple(int(n) for n in head.shape), np.dtype(head.dtype), target, was)


class ArrayLayout(Layout):
    """A layout of one array a file (docs/data.md, "Adding a layout"). A subclass sets ``name``, ``about`` and
    ``suffixes`` and writes :meth:`header` and :meth:`write`; :meth:`holds` and :meth:`open` are the base's."""

    #: whether the values are counts, made ``log(1 + x)`` where the batch is finished (before ``data.standardize``)
    log1p: ClassVar[bool] = True

    def header(self, file: Path) -> ArrayHeader:
        """File ``file``'s header (it may raise anything for a file that is not one of this layout's)."""
        raise NotImplementedError

    def holds(self, files: Sequence[Path]) -> bool:
        """Whether the first file's header reads as this layout's."""
        if not files:
            return False
        try:
            _typed(self, files[0])
        except Exception:  # a foreign file, whatever its reading raised: not this layout's
            return False
        return True

    def open(self, path: str | os.PathLike, shape: Sequence[int] | None, **options: Any) -> ArraySamples:
        return ArraySamples(self, path, shape, self.options(**options))


class ArraySamples(FileSamples):
    """The samples of a folder of an :class:`ArrayLayout` as one rank reads them: a file a sample, or a file cut
    into crops of the model's input where it is a whole multiple of it in every spatial dim (``data.crop``); every
    file of the first file's shape and type (its byte order aside)."""

    def __init__(self, layout: ArrayLayout, path: str | os.PathLike, shape: Sequence[int] | None,
                 options: Options) -> None:
        super().__init__(layout, path, options.key, options.readers, f"a folder of {layout.about}")
        for key, value, kept in (("data.window", options.window, None), ("data.orientation", options.orientation,
                                                                         "stored")):
            if value != kept:
                raise ConfigError(key, value, f"{kept or 'null'} for {layout.name} files ({key} is CT volumes')")
        self._heads: dict[int, _Array] = {}
        first = self._check(0)
        self.dtype = native(first.dtype)  # every file's type (its byte order aside: swapped as it is read)
        self.file_shape = first.shape
        self.shape = tuple(int(n) for n in shape) if shape is not None else first.shape
        self.crop(options.crop)
        if not holds_crops(first.shape, self.shape):
            raise ConfigError(self.key, self.path, f"arrays shaped {list(self.shape)} (C, *spatial) to match the model, "
                              "or a whole multiple of it in every spatial dim (cut into crops of the model's size); "
                              f"{self.where(0)} holds {list(first.shape)}")
        self.grid = tuple(f // s for f, s in zip(first.shape[1:], self.shape[1:]))
        self.crops = math.prod(self.grid)
        self.slices = tuple(options.slices) if options.slices is not None else None
        self.log1p = bool(layout.log1p)
        self.standardize = standardize(options.standardize)
        self.symmetries = self.augmenting(options.augment)

    # -- the headers
    def _check(self, index: int, target_size: int | None = None) -> _Array:
        """File ``index``'s header, read and checked (against the first file's, the bytes the file holds and
        ``target_size``, the model's outputs, where given), kept, and the file stamped; else bad input naming it."""
        file = self.files[index]

        def bad(expected: str, found: str) -> ConfigError:
            return ConfigError(self.key, self.path, f"{expected}; {self.where(index)} {found}")

        try:
            head = _typed(self.layout, file)
        except Exception as e:  # the layout's reading failed: not a file of it, or cut short
            raise bad(f"files of {self.layout.about}", f"has no header that reads as one ({type(e).__name__}: "
                      f"{' '.join(str(e).split())[:160]})") from None
        first = self._heads.get(0, head)
        if head.dtype.kind not in "iuf":
            raise bad("arrays of integers or floats (of any width, in either byte order)",
                      f"holds {head.dtype.name} ({head.dtype.str})")
        if native(head.dtype) != native(first.dtype):  # a batch holds one type
            raise bad(f"arrays of the first file's type, {native(first.dtype)}", f"holds {head.dtype.name}")
        if len(head.shape) < 2 or head.shape != first.shape:
            raise bad(f"arrays (C, *spatial) shaped {list(first.shape)} as the first file", f"holds {list(head.shape)}")
        need = head.offset + math.prod(head.shape) * head.dtype.itemsize
        if head.offset < 0 or head.stamp[2] < need:
            raise bad("whole files", f"is cut short: its header puts {need - head.offset} bytes of values from byte "
                      f"{head.offset}, the file holds {head.stamp[2]}")
        if head.target.size == 0 or (target_size is not None and head.target.size != int(target_size)):
            want = f"{int(target_size)} numbers" if target_size is not None else "numbers"
            raise bad(f"a target of {want} (one per model output)", f"has {head.target.size}")
        self.remember(index, [(file, head.stamp)])
        self._heads[index] = head
        return head

    def _header(self, index: int) -> _Array:
        return self._heads[index] if index in self._heads else self._check(index)

    def check_file(self, index: int, target_size: int | None) -> None:
        """File ``index``'s header against the set's and the model's outputs ``target_size`` (check_all)."""
        self._check(index, target_size)

    # -- reading
    def _reads(self, indices: Sequence[int], syms: Sequence[int], rows: np.ndarray | None) -> tuple[list, list, list, list]:
        """(the positional reads, (row, values read) pairs to copy over after them, each sample's part's shape as
        read, each sample's target) of ``indices`` under ``syms`` into ``rows`` (a batch; None: into scratch
        buffers). A row of the file's type is read into where it lies; of another (the batch's float32), into a
        buffer of the file's type, converted in the copy."""
        tasks: list = []
        posts: list = []
        shapes, targets = [], []
        sources = [self.source(i, k) for i, k in zip(indices, syms)]
        for f in dict.fromkeys(f for f, _ in sources):  # each file looked at once a batch (a header not read yet
            self.still(f)  # is read below): one cut, deleted or replaced since its header was read is named
        for r, (f, parts) in enumerate(sources):
            head = self._header(f)
            shape = (head.shape[0], *(p.stop - p.start for p in parts))
            shapes.append(shape)
            targets.append(head.target)
            row = rows[r].reshape(shape) if rows is not None else None
            into = row if row is not None and row.dtype == native(head.dtype) else np.empty(shape, native(head.dtype))
            if row is not None and into is not row:
                posts.append((row, into))
            if into.size:
                tasks += preader.array_reads(head.path, head.offset, head.dtype, head.shape, (slice(None), *parts), into)
        return tasks, posts, shapes, targets

    def read(self, indices: Sequence[int], symmetries: Sequence[int] | None = None, pin: bool = False,
             out: torch.Tensor | None = None) -> tuple[Counts, torch.Tensor]:
        """This rank's part of each sample as stored (:class:`~gems.data.samples.Counts`: a type torch holds as it
        is, any other as float32), each from the part its symmetry takes it from, and the targets (N, outputs)."""
        syms = [int(k) for k in symmetries] if symmetries is not None else [0] * len(indices)
        out = self.batch_buffer((len(indices), *self.part_shape()), raw_dtype(self.dtype), pin, out)
        tasks, posts, shapes, targets = self._reads(indices, syms, out.numpy())
        self.run(tasks)  # on the reader's threads; a file that fails its read: named
        for row, values in posts:
            row[...] = values
        return Counts(out, syms, shapes), torch.from_numpy(np.stack(targets)) if targets else torch.empty(0, 0)

    def finish(self, x: Any) -> torch.Tensor:
        """The network's input: float32, ``log(1 + x)`` where the layout's values are counts, then
        ``data.standardize`` (gems.data.samples.finished)."""
        return finished(x, self.log1p, self.standardize)

    def target(self, index: int) -> torch.Tensor:
        return torch.from_numpy(self._header(self.locate(index)[0]).target.copy())

    def runs(self, indices: Sequence[int], symmetries: Sequence[int] | None = None) -> list[tuple[str, int, int]]:
        """The byte ranges (file, offset, bytes) :meth:`read` reads by position for ``indices``."""
        syms = [int(k) for k in symmetries] if symmetries is not None else [0] * len(indices)
        return [(t.path, t.base + b.at, b.span) for t in self._reads(indices, syms, None)[0] for b in t.blocks]
