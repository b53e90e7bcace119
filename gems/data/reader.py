"""Hyperslabs of contiguous HDF5 datasets (and any array at a byte offset) read by several threads at once, past HDF5's
lock, under which a rank would read one sample at a time on one core. A hyperslab of a contiguous C-order array is a
regular grid of equal runs of bytes (:func:`grid`); :class:`Reader` reads them with ``os.preadv`` (the GIL dropped
while the kernel copies) from a pool of threads straight into the caller's buffer, h5py reading only the headers.
"""
from __future__ import annotations

import functools
import itertools
import math
import os
import threading
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

#: bytes under which a run is read with its neighbours as one block and copied out: below ~4 KiB a system call
#: a run costs more than reading the gaps between them
SMALL_RUN = 4096
#: bytes under which runs (and the gaps between them) are read by one system call for many of them, each run
#: straight to its place, each gap into a scrap buffer: a call a run of 16 KiB (a cut in height) kept two
#: threads below one, handing the GIL to each other every few microseconds
MEDIUM_RUN = 1 << 16
#: bytes one task reads at most (a longer run is cut): a sample of 16 MiB is 16 tasks the threads share
PIECE = 1 << 20
#: bytes of a gap between the planes (or rows) of a block of small runs over which a block does not reach: reading it
#: costs more than the call more it saves (a call a plane costs ~8 us here, a gap of 64 KiB about as much). 64^3
#: crops of a 256^3 universe (channels last) read 10x their bytes when a block reached over the 385 KiB between two
#: planes, 4x now (0.47 -> 0.85 GB/s a thread); 8^3 crops of 64^3 read faster over their 28 KiB gaps (0.10 GB/s
#: against 0.06 a call a plane)
GAP = 1 << 16
#: open files a reader keeps (the least recently read closed first)
OPEN_FILES = 64


@dataclass(frozen=True)
class Grid:
    """A hyperslab of a C-order array as byte runs of ``run`` bytes: run ``i`` (C order over ``counts``) starts
    ``start + sum(i_j * strides_j)`` bytes into the array and lies ``i * run`` bytes into the hyperslab's own C
    order."""

    start: int
    run: int
    counts: tuple[int, ...]
    strides: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.run * math.prod(self.counts)


def grid(shape: Sequence[int], itemsize: int, sel: Sequence[slice]) -> Grid:
    """The runs of hyperslab ``sel`` (one slice per leading dim, steps >= 1; missing ones whole) of a C-order
    array of ``shape``: the trailing dims that are whole, with the one before them taken in one step, make one
    run; the dims before those are the grid."""
    full = list(sel) + [slice(None)] * (len(shape) - len(sel))
    ranges = [range(*s.indices(int(n))) for s, n in zip(full, shape)]
    if any(r.step < 1 for r in ranges):
        raise ValueError("a hyperslab's steps must be positive")
    if any(len(r) == 0 for r in ranges):
        return Grid(0, 0, (0,), (0,))
    d = len(shape)
    elem = [math.prod(shape[j + 1:]) for j in range(d)]  # C-order strides, in elements
    k = d  # dims k.. are one run
    while k > 0 and (len(ranges[k - 1]) == 1 or ranges[k - 1].step == 1) and (k == d or len(ranges[k]) == shape[k]):
        k -= 1
    run = len(ranges[k]) * elem[k] if k < d else 1
    start = sum(r.start * e for r, e in zip(ranges, elem))
    return Grid(start * itemsize, run * itemsize, tuple(len(r) for r in ranges[:k]),
                tuple(r.step * e * itemsize for r, e in zip(ranges[:k], elem[:k])))


@dataclass(frozen=True)
class Block:
    """Runs of ``run`` bytes on a grid of ``counts`` with byte ``strides`` (C order), from byte ``at`` of the
    dataset, to byte ``to`` of the hyperslab (consecutive there); no counts: one run, read straight to its
    place; ``gather``: the block's span read by one call, each run straight to its place and each gap into a
    scrap buffer; else the span read into a buffer and the runs copied out."""

    at: int
    counts: tuple[int, ...]
    strides: tuple[int, ...]
    run: int
    to: int
    gather: bool = False

    @property
    def nbytes(self) -> int:
        return self.run * math.prod(self.counts)

    @property
    def span(self) -> int:
        return sum((c - 1) * s for c, s in zip(self.counts, self.strides)) + self.run


def _span(counts: Sequence[int], strides: Sequence[int], run: int) -> int:
    return sum((c - 1) * s for c, s in zip(counts, strides)) + run


@functools.lru_cache(maxsize=512)
def pieces(g: Grid, piece: int, small: int, medium: int, gap: int) -> tuple[tuple[Block, ...], ...]:
    """The tasks that read grid ``g``, each about ``piece`` bytes: runs under ``small`` bytes in blocks spanning
    about ``piece`` bytes (the grid's last dims whole, a share of the one before; never over a gap of more than
    ``gap`` bytes between them), copied out of a buffer; runs
    under ``medium`` bytes with gaps under ``medium`` gathered by one call a share of the grid's last dim (at
    most ``piece`` bytes, 512 runs); longer ones one by one (those over ``piece`` cut). Cached by the grid's
    shape (its ``start`` is added to every block's), so the crops of a universe share the plans of a rank's
    part under each symmetry. Each thread holds the GIL between its system calls, so the reads are few and large:
    a long run is cut in pieces that let the threads share even one sample, a row's part of a cut in width is read
    in blocks and copied out, the runs of a cut in height gathered, a call for many."""
    if g.nbytes == 0:
        return ()
    k, counts, strides, run = len(g.counts), g.counts, g.strides, g.run
    blocks: list[Block] = []
    to = 0
    if k and small <= run < medium and strides[-1] - run < medium and counts[-1] > 1:
        c, s = counts[-1], strides[-1]
        q = min(c, 512, max(1, 1 + (piece - run) // s))
        for index in np.ndindex(*counts[:-1]):
            at = g.start + sum(i * t for i, t in zip(index, strides))
            for j in range(0, c, q):
                b = Block(at + j * s, (min(q, c - j),), (s,), run, to, gather=True)
                blocks.append(b)
                to += b.nbytes
    elif k == 0 or run >= small:
        for index in np.ndindex(*counts):
            at = g.start + sum(i * s for i, s in zip(index, strides))
            blocks += [Block(at + off, (), (), min(piece, run - off), to + off) for off in range(0, run, piece)]
            to += run
    else:
        m = 1  # the last m dims whole in each block (none whose gap to the next index is over GAP)
        while (m < k and _span(counts[k - m - 1:], strides[k - m - 1:], run) <= piece
               and strides[k - m - 1] - _span(counts[k - m:], strides[k - m:], run) <= gap):
            m += 1
        inner = (counts[k - m:], strides[k - m:])
        if m == k:
            blocks.append(Block(g.start, *inner, run, 0))
        else:  # q indices of dim k - m - 1 a block
            c, s = counts[k - m - 1], strides[k - m - 1]
            q = min(c, 1 + max(0, piece - _span(*inner, run)) // s) if s - _span(*inner, run) <= gap else 1
            for index in np.ndindex(*counts[:k - m - 1]):
                at = g.start + sum(i * t for i, t in zip(index, strides))
                for j in range(0, c, q):
                    b = Block(at + j * s, (min(q, c - j), *inner[0]), (s, *inner[1]), run, to)
                    blocks.append(b)
                    to += b.nbytes
    tasks: list[tuple[Block, ...]] = []
    group: list[Block] = []
    size = 0
    for b in blocks:
        group.append(b)
        size += b.span
        if size >= piece:
            tasks.append(tuple(group))
            group, size = [], 0
    if group:
        tasks.append(tuple(group))
    return tuple(tasks)


def read_share(shape: Sequence[int], itemsize: int, sel: Sequence[slice]) -> tuple[float, Grid]:
    """(the share of the bytes the reader reads for hyperslab ``sel`` of a C-order array of ``shape`` that the
    hyperslab holds, its :class:`Grid`): :func:`pieces` read runs under ``MEDIUM_RUN`` bytes with the gaps between
    them, so a crop whose rows are short runs far apart (MLPerf's 128^3 crops of a 512^3 universe, channels last:
    1 KiB runs 4 KiB apart) costs several times its bytes; 1 for one run. What a rate measured on whole files is
    scaled by where no file is at hand (gems.data.layouts.Layout.fallback_rate), and what ``gems bench data``'s
    crop row measures against."""
    g = grid(shape, itemsize, sel)
    if not g.nbytes:
        return 1.0, g
    read = sum(b.span for blocks in pieces(Grid(0, g.run, g.counts, g.strides), PIECE, SMALL_RUN, MEDIUM_RUN, GAP)
               for b in blocks)
    return g.nbytes / read, g


def pread_full(fd: int, buf: memoryview, offset: int, name: str) -> None:
    """Fill ``buf`` from byte ``offset`` of ``fd`` (a positional read may return less than asked)."""
    while buf.nbytes:
        n = os.preadv(fd, [buf], offset)
        if n <= 0:
            raise OSError(f"{name}: ends at byte {offset}, inside the dataset it holds (a truncated file?)")
        buf, offset = buf[n:], offset + n


def preadv_full(fd: int, bufs: list[memoryview], offset: int, name: str) -> None:
    """Fill ``bufs`` one after another from byte ``offset`` of ``fd`` (a positional read may return less)."""
    while bufs:
        n = os.preadv(fd, bufs, offset)
        if n <= 0:
            raise OSError(f"{name}: ends at byte {offset}, inside the dataset it holds (a truncated file?)")
        offset += n
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs = bufs[1:]
        if n:
            bufs = [bufs[0][n:], *bufs[1:]]


class _Files:
    """Open files by path, the least recently read closed first beyond ``capacity`` (a file being read is never
    closed: a batch holds its files until it is read)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.lock = threading.Lock()
        self.open: OrderedDict[str, list[int]] = OrderedDict()  # path -> [fd, readers holding it]

    def acquire(self, path: str) -> int:
        with self.lock:
            held = self.open.get(path)
            if held is None:
                held = self.open[path] = [os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), 0]
            self.open.move_to_end(path)
            held[1] += 1
            fd = held[0]
            self._trim()
            return fd

    def release(self, path: str) -> None:
        with self.lock:
            held = self.open.get(path)
            if held is not None:
                held[1] -= 1
            self._trim()

    def _trim(self) -> None:
        extra = len(self.open) - self.capacity
        for path in [p for p, (_, users) in self.open.items() if users == 0][:max(0, extra)]:
            os.close(self.open.pop(path)[0])

    def close(self) -> None:
        with self.lock:
            for fd, _ in self.open.values():
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.open.clear()


class _State:
    """What a :class:`Reader` holds in one process: its threads and its open files."""

    def __init__(self, threads: int, capacity: int) -> None:
        self.pid = os.getpid()
        self.files = _Files(capacity)
        self.pool = ThreadPoolExecutor(threads - 1, thread_name_prefix="gems-read") if threads > 1 else None

    def close(self) -> None:
        if os.getpid() != self.pid:  # a forked child: none of the parent's threads are here, and a lock the
            # parent held at the fork stays held, so only this process's copies of the files are closed
            for fd, _ in list(self.files.open.values()):
                try:
                    os.close(fd)
                except OSError:
                    pass
            self.files.open.clear()
            self.pool = None
            return
        if self.pool is not None:  # not waited for from one of its own threads (the reader collected there)
            self.pool.shutdown(wait=threading.current_thread() not in getattr(self.pool, "_threads", ()))
            self.pool = None
        self.files.close()


@dataclass(frozen=True)
class Task:
    """Read ``blocks`` of the dataset at byte ``base`` of file ``path`` into ``out`` (a writable byte array:
    the hyperslab's row of a batch), then swap their bytes to native order when ``swap`` (a dtype)."""

    path: str
    base: int
    blocks: tuple[Block, ...]
    out: np.ndarray
    swap: np.dtype | None = None


class Reader:
    """Reads :class:`Task` s on ``threads`` threads (the caller's and ``threads - 1`` of its own), through at
    most ``capacity`` open files; other work (a read through h5py) may share the threads (:meth:`run`). The
    threads and files are made at the first read, again in a forked child, and closed by :meth:`close` or when
    the reader is collected."""

    def __init__(self, threads: int = 4, capacity: int = OPEN_FILES) -> None:
        self.threads, self.capacity = max(1, int(threads)), max(1, int(capacity))
        self._state: _State | None = None
        self._finalizer: Any = None
        self._scratch = threading.local()

    def _ready(self) -> _State:
        state = self._state
        if state is None or state.pid != os.getpid():
            if state is not None:
                state.close()  # the parent's threads are gone here; its files are this process's copies
            state = self._state = _State(self.threads, self.capacity)
            if self._finalizer is not None:
                self._finalizer.detach()
            self._finalizer = weakref.finalize(self, state.close)
        return state

    def open_files(self) -> int:
        """Files held open now (0 before the first read and after :meth:`close`)."""
        state = self._state
        return len(state.files.open) if state is not None and state.pid == os.getpid() else 0

    def run(self, tasks: Sequence[Task], others: Sequence[Callable[[], None]] = ()) -> None:
        """Do every task (and every call in ``others``) on the threads; return when all are done, raising the
        first failure. A batch of more files than the reader may hold open (:func:`file_budget`) is read in
        waves of that many files, so that no batch runs into the process's limit on open files."""
        budget = file_budget(self.capacity)
        self._ready().files.capacity = budget  # (the least recently read closed beyond it)
        files = list(dict.fromkeys(t.path for t in tasks))
        if len(files) <= budget:
            return self._run(tasks, others)
        wave_of = {p: i // budget for i, p in enumerate(files)}
        waves: list[list[Task]] = [[] for _ in range(-(-len(files) // budget))]
        for t in tasks:
            waves[wave_of[t.path]].append(t)
        for w, wave in enumerate(waves):
            self._run(wave, others if w == 0 else ())

    def _run(self, tasks: Sequence[Task], others: Sequence[Callable[[], None]] = ()) -> None:
        state = self._ready()
        paths = [t.path for t in tasks]
        fds: dict[str, int] = {}
        try:
            for p in paths:
                if p not in fds:
                    fds[p] = state.files.acquire(p)
            # h5py's reads first: each holds its lock throughout, the positional reads go on beside it
            jobs: list[Callable[[], None]] = list(others)
            jobs += [functools.partial(self._read, fds[t.path], t) for t in tasks]
            if state.pool is None or len(jobs) == 1:
                for job in jobs:
                    job()
                return
            order, errors = itertools.count(), []

            def drain() -> None:  # the next job not taken, until none is left (not a future a job: ~20 us each)
                while (i := next(order)) < len(jobs):
                    try:
                        jobs[i]()
                    except BaseException as e:  # the others still run: nothing writes into the batch after
                        errors.append(e)

            helpers = [state.pool.submit(drain) for _ in range(min(self.threads, len(jobs)) - 1)]
            drain()  # the caller is one of the threads
            for h in helpers:
                h.result()
            if errors:
                raise errors[0]
        finally:
            for p in fds:
                state.files.release(p)

    def _buffer(self, nbytes: int, name: str = "buf") -> np.ndarray:
        """The calling thread's buffer ``name``, of ``nbytes`` at least."""
        buf = getattr(self._scratch, name, None)
        if buf is None or buf.nbytes < nbytes:
            buf = np.empty(nbytes, np.uint8)
            setattr(self._scratch, name, buf)
        return buf

    def _read(self, fd: int, task: Task) -> None:
        out = task.out
        for b in task.blocks:
            dst = out[b.to:b.to + b.nbytes]
            if not b.counts:
                pread_full(fd, dst.data, task.base + b.at, task.path)
            elif b.gather:
                gap = b.strides[0] - b.run
                scrap = self._buffer(gap, "scrap")[:gap].data  # every gap read into it, over and over
                parts: list[memoryview] = []
                for r in range(b.counts[0]):
                    parts += [dst[r * b.run:(r + 1) * b.run].data, scrap] if gap else [dst[r * b.run:(r + 1) * b.run].data]
                preadv_full(fd, parts[:-1] if gap else parts, task.base + b.at, task.path)
            else:
                buf = self._buffer(b.span)
                pread_full(fd, buf[:b.span].data, task.base + b.at, task.path)
                runs = np.lib.stride_tricks.as_strided(buf, (*b.counts, b.run), (*b.strides, 1))
                np.copyto(dst.reshape(*b.counts, b.run), runs)
            if task.swap is not None:
                dst.view(task.swap).byteswap(inplace=True)

    def close(self) -> None:
        """Stop the threads and close the files (a later read opens them again)."""
        state, self._state = self._state, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if state is not None:
            state.close()


def file_budget(capacity: int = OPEN_FILES) -> int:
    """Files a reader holds open at most: its ``capacity``, and at most a quarter of the files the process may
    open (``RLIMIT_NOFILE``'s soft limit: the rest for h5py's headers, the step's and torch's own)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        soft = -1 if soft == resource.RLIM_INFINITY else soft
    except (ImportError, OSError, ValueError):
        soft = -1
    return max(1, min(int(capacity), soft // 4 if soft > 0 else int(capacity)))


def tasks(path: str, base: int, g: Grid, out: np.ndarray, swap: np.dtype | None = None) -> Iterator[Task]:
    """The tasks that read grid ``g`` of the dataset at byte ``base`` of ``path`` into ``out`` (its bytes)."""
    for blocks in pieces(Grid(0, g.run, g.counts, g.strides), PIECE, SMALL_RUN, MEDIUM_RUN, GAP):
        yield Task(path, base + g.start, blocks, out, swap)


def array_reads(path: str | os.PathLike, offset: int, dtype: Any, shape: Sequence[int], sel: Sequence[slice],
                out: np.ndarray) -> list[Task]:
    """The one way a layout reads an array that lies at byte ``offset`` of file ``path`` (C order, ``shape``, of
    ``dtype`` in either byte order): the tasks that read its hyperslab ``sel`` (one slice per leading dim, the
    rest whole) by position into ``out`` (a C-contiguous array of the hyperslab's shape, or its bytes), each
    value swapped to this machine's byte order where the file's is the other. Never a mapping of the file
    (gems.data.layouts: the readers' rules)."""
    stored = np.dtype(dtype)
    native = stored.newbyteorder("=") if stored.byteorder in "<>" else stored
    swap = native if not stored.isnative and native.itemsize > 1 else None
    into = out.reshape(-1).view(np.uint8)
    return list(tasks(str(path), int(offset), grid(shape, native.itemsize, sel), into, swap))
