"""``gems bench data``: does the data path stay off the step's critical path? First each layout's reader alone against
the page-cache bound of its own files (:func:`bench_reader`), then CosmoFlow's steps at 64³ and 128³ on S = 1 and 2
with prefetch off, on, and the no-data bound, alternated in rounds (:func:`bench_data`; goals and figures:
docs/benchmarks.md). ``GEMS_BENCH_DATA=reader`` runs only the first part.
"""
from __future__ import annotations

import contextlib
import functools
import io
import itertools
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

from gems.bench.common import env_block, md_table, median, write

CONTENDERS = ("off", "on", "bound")
STEPS, WARM, BATCH = 6, 2, 2


def _cfg(size: int, spatial: int, data: str, path: str | None, contender: str, folder: str) -> Any:
    """One run's configuration; its record and trained model go to ``folder`` (the bench's temporary folder), never
    to the default results/ of wherever the bench was started."""
    from omegaconf import open_dict

    from gems.config import compose

    over = [f"model.size={size}", "model.width=1.0", f"parallel.spatial={spatial}", f"train.batch_size={BATCH}",
            f"train.steps={STEPS}", f"train.warmup_steps={WARM}", "train.profile=false",
            f"data.prefetch={2 if contender == 'on' else 0}", f"results.dir={folder}"]
    over += ["data=files", f"data.path={path}"] if data == "hdf5" else ["data.num_samples=64"]
    cfg = compose(over)
    with open_dict(cfg):
        cfg.run_id = f"bench-data-{size}-{spatial}-{data}-{contender}"
    return cfg


def bench_rank(rank: int, world_size: int, size: int, spatial: int, data: str, path: str | None,
               contender: str, folder: str) -> dict[str, float]:
    """One run on this rank of a gloo world (gems.launch.world.run_world), its files under ``folder``; rank 0's
    figures."""
    import torch

    from gems.bootstrap import World
    from gems.rank.loop import Loop
    from gems.rank.setup import set_up

    cfg = _cfg(size, spatial, data, path, contender, folder)
    world = World(rank, world_size, rank, "127.0.0.1", 0, "single", torch.device("cpu"), "gloo", "torch", None,
                  "localhost")

    class Bound(Loop):
        """The run without a data path: the first batch, read before the first step, every step."""

        def finisher(self) -> None:  # the batch read once, finished once: nothing of the data path in the step
            return None

        def fetch(self, step: int) -> tuple[list[int], Any, Any]:
            if not hasattr(self, "_once"):
                self._once = super().fetch(0)
            return self._once

    run = (Bound if contender == "bound" else Loop)(set_up(cfg, world, None))
    if contender == "bound":
        run.fetch(0)  # read before the clock starts
    with contextlib.redirect_stdout(io.StringIO()):  # the per-step lines
        record = run.run()
    return {"step": float(record["step_time_s"]["median"]),
            "exposed": float(record["time_breakdown_s"]["data"]),
            "reader": float(record["data_reader_s"])}


def _files(root: Path, size: int) -> str:
    from gems.data.synth import write_synthetic

    path = root / f"cosmo{size}"
    if not path.exists():
        write_synthetic(path, 16, (4, size, size, size))
    return str(path)


# ---------------------------------------------------------------------------- the reader alone
READER_SIZE, READER_BATCH, READER_PASSES = 128, 4, 3


def thread_counts(cores: int | None = None) -> list[int]:
    """1, 2, 4, ... up to the machine's cores (at least 1 and 2)."""
    top = max(2, int(cores or os.cpu_count() or 1))
    return [n for n in (2 ** i for i in range(8)) if n <= top]


def wait_for_idle_cores(wait_s: float = 2.0, idle: float = 0.9) -> None:
    """Wait up to ``wait_s`` for a moment when the machine's cores are ``idle`` (a share of 0.1 s, from
    /proc/stat; elsewhere no wait): a reader's rate on two cores halves while another process computes."""
    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v)

    try:
        end = time.perf_counter() + wait_s
        while time.perf_counter() < end:
            a = snap()
            time.sleep(0.1)
            b = snap()
            if (b[0] - a[0]) >= idle * max(1, b[1] - a[1]):
                return
    except OSError:
        return


def _drain(jobs: Sequence[Callable[[], None]], threads: int, pool: Any) -> None:
    """Every job done by the caller and ``threads - 1`` pool threads, each taking the next job left (as
    gems.data.reader does)."""
    order = itertools.count()

    def drain() -> None:
        while (i := next(order)) < len(jobs):
            jobs[i]()

    helpers = [pool.submit(drain) for _ in range(threads - 1)]
    drain()
    for h in helpers:
        h.result()


def _values(size: int, n: int) -> list[tuple[Any, Any]]:
    """``n`` samples of 4 x ``size``^3 int16 counts and their targets (gems data synth's generator)."""
    from gems.data.synth import make_sample

    return [make_sample(0, i, (4, size, size, size)) for i in range(n)]


class Source(NamedTuple):
    """A row's files: ``layout``'s, in ``folder``, read as samples of 4 x ``edge``^3 (crops where a file is
    larger), or with ``dense``, CT volumes of 1 x ``edge``^3 with a class a voxel (their labels read beside
    them)."""

    layout: str
    folder: Path
    edge: int
    dense: bool = False


#: the classes of the CT volumes' labels (background, liver, tumour: gems.data.segmentation)
CT_CLASSES = 3


def _volumes(size: int, n: int) -> list[tuple[Any, Any]]:
    """``n`` CT volumes of ``size``^3 int16 Hounsfield units with their uint8 labels (gems data synth
    data.kind=segmentation's, their slices filled to ``size`` with air)."""
    import numpy as np

    from gems.data.segmentation import AIR, make_volume

    out = []
    for i in range(n):
        hu, labels = make_volume(0, i, size)
        fill = size - hu.shape[0]
        out.append((np.pad(hu, ((0, fill), (0, 0), (0, 0)), constant_values=int(AIR)),
                    np.pad(labels, ((0, fill), (0, 0), (0, 0)))))
    return out


def converted_row(name: str) -> str:
    """The name of the row of a layout's files after ``gems data convert`` (:func:`layout_folders`)."""
    return f"{name}, converted"


def crop_row(size: int) -> str:
    """The name of the row of crops of a larger universe (:func:`layout_folders`)."""
    return f"exalearn, {size // 2}^3 crops of {2 * size}^3"


#: the in-plane edge of a CT volume as LiTS publishes them (its rows: :func:`inplane_rows`)
INPLANE = 512


def inplane_rows(size: int) -> tuple[str, str]:
    """The rows of one CT volume of 512^2 in-plane (LiTS's) and ``size`` slices read as tiles of ``size``^3: as
    NIfTI stores it, and as ``gems data convert data.tile=size`` stores it (:func:`layout_folders`)."""
    return (f"nifti, {size}^3 tiles of {INPLANE}^2 x {size}", f"tiles, {size}^3 tiles of {INPLANE}^2 x {size}")


def _inplane(root: Path, size: int) -> tuple[Path, Path]:
    """One CT volume of 512 x 512 in-plane and ``size`` slices (gems data synth's organs at ``size``^3, repeated) as
    nibabel writes it, and what gems data convert data.tile=``size`` writes of it."""
    from gems.data import layouts
    from gems.data.segmentation import make_volume

    nii, tiles = root / f"inplane{size}", root / f"inplane{size}-tiles"
    if not nii.exists():  # a size^3 volume's organs, 4 x 4 of them in-plane (what lies there does not change a read)
        import numpy as np

        hu, labels = make_volume(0, 0, size)
        depth = hu.shape[0]
        reps = (-(-size // depth), INPLANE // size, INPLANE // size)
        layouts.get("nifti").write(nii, [(np.tile(hu, reps)[:size], np.tile(labels, reps)[:size])])
    if not tiles.exists():
        for f in layouts.get("nifti").files(nii):
            layouts.get("nifti").convert(f, tiles, tile=size)
    return nii, tiles


def layout_folders(root: Path, size: int, n: int = 16) -> tuple[dict[str, Source], dict[str, str]]:
    """The same ``n`` samples written in every registered layout that writes them (gems.data.layouts: each as its
    published tool writes them) under ``root``, a folder each; and why a layout has none (it writes no such
    samples, or does not read them back as 4 x ``size``^3 counts with a target vector). Beside them, the row
    :func:`crop_row`: one ExaLearn universe of (2 ``size``)^3 read as crops of (``size`` / 2)^3, the same bytes
    as ``n`` / 2 samples, whose rows lie as MLPerf's 128^3 crops of a 512^3 universe do (channels last: runs a
    quarter of their stride apart, 512 B in 2 KiB at ``size`` 128, 1 KiB in 4 KiB there): the path crops of a
    universe take, which a file a sample does not."""
    from gems.data import layouts
    from gems.errors import ConfigError

    values = _values(size, n)
    folders, skipped = {}, {}
    for name, layout in layouts.registered().items():
        folder = root / f"{name}{size}"
        try:
            if not folder.exists():
                layout.write(folder, values)
            layout.open(folder, (4, size, size, size)).close()
            folders[name] = Source(name, folder, size)
        except (NotImplementedError, ConfigError, ValueError, TypeError) as e:  # no such samples in this layout
            try:  # CT volumes with a class a voxel (NIfTI's)
                shutil.rmtree(folder, ignore_errors=True)
                layout.write(folder, _volumes(size, n))
                dense = (1, size, size, size)
                try:
                    layout.open(folder, dense, target="dense", classes=CT_CLASSES).close()
                    folders[name] = Source(name, folder, size, dense=True)
                except ConfigError:  # as published they are read only once converted (the Decathlon's .nii.gz)
                    out = root / f"{name}-converted{size}"
                    if not out.exists():
                        for f in layout.files(folder):
                            layout.convert(f, out)
                    layout.open(out, dense, target="dense", classes=CT_CLASSES).close()
                    folders[converted_row(name)] = Source(name, out, size, dense=True)
                    continue
            except (NotImplementedError, ConfigError, ValueError, TypeError):
                skipped[name] = _oneline(str(e)) or "writes no such samples"
                continue
        if not layout.fast:  # what gems data convert writes of them, read as a run reads it
            out = root / f"{name}-converted{size}"
            if not out.exists():
                for f in layout.files(folder):
                    layout.convert(f, out)
            fast = layouts.detect(out)
            folders[converted_row(name)] = Source(fast.name, out, size, dense=folders[name].dense)
    folder = root / f"universe{2 * size}"
    if not folder.exists():
        from gems.data.synth import make_sample

        layouts.get("exalearn").write(folder, [make_sample(0, 0, (4, 2 * size, 2 * size, 2 * size))])
    folders[crop_row(size)] = Source("exalearn", folder, size // 2)
    nii, tiles = _inplane(root, size)
    slow, fast = inplane_rows(size)
    folders[slow], folders[fast] = Source("nifti", nii, size, dense=True), Source("tiles", tiles, size, dense=True)
    return folders, skipped


def _oneline(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 160 else text[:157] + "..."


#: the bound's ways to move a batch's bytes from the page cache: positional reads, as every reader of gems's reads
READS = ("whole file", "runs")
#: the rows whose files a run reads by position, which the reader's goals are for
GOAL_ROWS = ("exalearn", "gems", "lbann", converted_row("tfrecord"), inplane_rows(READER_SIZE)[1])
#: every way timed: the reads, and a copy out of the files mapped (faster here, but a way no reader of gems takes:
#: a file cut under a mapping kills the process with SIGBUS, where a read fails and names the file)
WAYS = (*READS, "mapped")


def _two(x: float) -> str:
    """A figure of the reader's table: two decimals, or two significant digits below 0.01 (a measured figure never
    printed as 0.00: a 32^3 TFRecord read at 0.04 GB/s beside a mapped copy at 9 is 0.0044 of it)."""
    return f"{x:.2f}" if x >= 0.01 or x == 0 else f"{x:.2g}"


class _ReaderBench:
    """The contenders of :func:`bench_reader` on one layout's files in ``folder``, each a pass over every batch:
    the reader (``samples.read`` into a batch made once), a rank's half (under ``data.augment=cube`` where the
    layout has the cube's symmetries), the ways to move the same bytes from the page cache into a pre-touched
    buffer (:data:`WAYS`), with the files held open (the reader holds its own open too): each whole file by one
    ``os.preadv`` (with its companions: a CT volume's labels); the byte ranges the reader reads (``samples.runs``:
    its pieces), each by one ``os.preadv`` straight to its place; each file mapped (``mmap``, populated) and copied
    by numpy (a memory copy out of the page cache); beside them a plain memory copy of the batch's bytes in memory
    (no page cache: a ceiling). ``dense``: CT volumes of one channel with their labels (a class a voxel)."""

    def __init__(self, layout: Any, folder: Path, threads: Sequence[int], size: int, dense: bool = False) -> None:
        import mmap
        from concurrent.futures import ThreadPoolExecutor

        import numpy as np
        import torch

        self.layout = layout
        self.files = layout.files(folder)
        self.groups = [[f, *layout.companions(f)] for f in self.files]  # a sample's files: a volume and its labels
        self.shape = (1 if dense else 4, size, size, size)
        opts: dict[str, Any] = dict(target="dense", classes=CT_CLASSES) if dense else {}
        for f in (g for group in self.groups for g in group):  # into the page cache
            with open(f, "rb") as h:
                while h.read(1 << 24):
                    pass
        self.sets = {t: layout.open(folder, self.shape, readers=t, **opts) for t in threads}
        self.parts = {t: layout.open(folder, self.shape, readers=t, augment="none" if dense else "cube",
                                     slices=(slice(0, size // 2),), **opts) for t in threads}
        first = self.sets[threads[0]]
        self.whole = len(first) == len(self.files)  # a file a sample (else crops of a universe: no whole file)
        self.n = len(first) - len(first) % READER_BATCH
        self.batches = [list(range(b, b + READER_BATCH)) for b in range(0, self.n, READER_BATCH)]
        raw, labels = first.read(self.batches[0])
        self.out = raw.data  # the reader's batch, made once (and touched)
        self.half = self.parts[threads[0]].read(self.batches[0])[0].data
        # the bytes of a sample the reader moves: its values, and its labels where they are a class a voxel
        self.sample = self.out[0].numel() * self.out.element_size() + (labels[0].numel() * labels.element_size()
                                                                       if dense else 0)
        self.sizes = [sum(g.stat().st_size for g in group) for group in self.groups]
        self.slot = max(self.sizes) if self.whole else self.sample
        self.dtype = str(np.dtype(first.dtype)) + (" + uint8 labels" if dense else "")
        self.symmetric = not dense
        gen = torch.Generator().manual_seed(0)
        self.syms = [torch.randint(0, 48, (READER_BATCH,), generator=gen).tolist() if self.symmetric else None
                     for _ in self.batches]
        self.fds = {str(g): os.open(g, os.O_RDONLY) for group in self.groups for g in group}
        self.runs: list[list[tuple[int, int, int, int]]] = []  # per batch: (fd, offset, bytes, to) the reader reads
        for b in self.batches:
            got = first.runs(b) or []
            for path, _, _ in got:
                if path not in self.fds:
                    self.fds[path] = os.open(path, os.O_RDONLY)
            to, plan = 0, []
            for path, off, nbytes in got:
                plan.append((self.fds[path], off, nbytes, to))
                to += nbytes
            self.runs.append(plan)
        self.run_bytes = sum(n for p in self.runs for _, _, n, _ in p)
        self.positional = bool(self.run_bytes)
        # the bound's batch, made once and touched: a batch's files, or the spans its runs read (a crop's: with the
        # gaps between its rows, several times its bytes)
        spans = max((sum(n for _, _, n, _ in p) for p in self.runs), default=0)
        self.buffer = np.ones(max(READER_BATCH * self.slot, spans), np.uint8)
        self.maps: list[list[tuple[Any, Any]]] = []  # a sample's files, each mapped
        for group in self.groups:
            maps = []
            for g in group:
                with open(g, "rb") as h:
                    mm = mmap.mmap(h.fileno(), 0, prot=mmap.PROT_READ,
                                   flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                maps.append((mm, np.frombuffer(mm, np.uint8)))
            self.maps.append(maps)
        self.crops: list[Any] = []  # (crops) each sample's cells in its mapped universe, a strided view
        if not self.whole and hasattr(first, "_header"):  # (HDF5 universes; a CT volume's tiles have no mapped row)
            for i in range(self.n):
                f, origin = first.locate(i)
                head = first._header(f)
                full = self.maps[f][0][1][head.offset:head.offset + math.prod(head.shape) * head.dtype.itemsize]
                cells = full.view(head.dtype).reshape(head.shape)
                self.crops.append(cells[tuple(slice(o, o + size) for o in origin)])
        self.source = np.ones_like(self.buffer)  # the plain copy's source, in memory
        self.pool = ThreadPoolExecutor(max(threads))

    def _whole_file(self, i: int) -> None:
        at = (i % READER_BATCH) * self.slot
        for g, (_, arr) in zip(self.groups[i], self.maps[i]):
            os.preadv(self.fds[str(g)], [self.buffer[at:at + arr.size]], 0)
            at += arr.size

    def _run(self, fd: int, off: int, nbytes: int, to: int) -> None:
        os.preadv(fd, [self.buffer[to:to + nbytes]], off)

    def _mapped(self, i: int) -> None:
        import numpy as np

        k = i % READER_BATCH
        if not self.whole:  # the crop's cells copied out of the mapped universe
            crop = self.crops[i]
            np.copyto(self.buffer[k * self.slot:(k + 1) * self.slot].view(crop.dtype).reshape(crop.shape), crop)
            return
        at = k * self.slot
        for _, arr in self.maps[i]:
            np.copyto(self.buffer[at:at + arr.size], arr)
            at += arr.size

    def _copy(self, k: int) -> None:
        import numpy as np

        np.copyto(self.buffer[k * self.sample:(k + 1) * self.sample], self.source[k * self.sample:(k + 1) * self.sample])

    def gbs(self, threads: int, contender: str) -> float:
        """GB/s of one pass of ``contender`` on ``threads`` threads."""
        t0 = time.perf_counter()
        for _ in range(READER_PASSES):
            for b, plan, syms in zip(self.batches, self.runs, self.syms):
                if contender == "whole file":
                    _drain([functools.partial(self._whole_file, i) for i in b], threads, self.pool)
                elif contender == "runs":
                    _drain([functools.partial(self._run, *r) for r in plan], threads, self.pool)
                elif contender == "mapped":
                    _drain([functools.partial(self._mapped, i) for i in b], threads, self.pool)
                elif contender == "memcpy":
                    _drain([functools.partial(self._copy, k) for k in range(len(b))], threads, self.pool)
                elif contender == "part":
                    self.parts[threads].read(b, syms, out=self.half)
                else:
                    self.sets[threads].read(b, out=self.out)
        files = sum(self.sizes[:self.n]) if self.whole else self.n * self.sample
        nbytes = {"whole file": files, "mapped": files,  # (the runs: the samples' bytes, not the gaps read too)
                  "part": self.n * self.sample // 2}.get(contender, self.n * self.sample)
        return READER_PASSES * nbytes / 1e9 / (time.perf_counter() - t0)

    def contenders(self) -> tuple[str, ...]:
        return (*(b for b in WAYS if (b != "runs" or self.positional) and (b != "whole file" or self.whole)
                  and (b != "mapped" or self.whole or self.crops)), "memcpy", "reader", "part")

    def close(self) -> None:
        for ds in (*self.sets.values(), *self.parts.values()):
            ds.close()
        for fd in self.fds.values():
            os.close(fd)
        self.crops.clear()
        self.maps.clear()  # (each map closes once no view of it is left)
        self.pool.shutdown()


def bench_reader(folders: dict[str, Source], threads: Sequence[int] | None = None, rounds: int = 7,
                 size: int = READER_SIZE, quiet_s: float = 2.0,
                 skipped: dict[str, str] | None = None) -> tuple[list[list[Any]], str]:
    """Each layout's reader (every registered layout, its files written as its published tool writes them, and a
    row for what ``gems data convert`` writes of a layout not read fast where it lies) against the page-cache bound
    of its own files at the same thread count: the faster of two positional reads of those bytes into a pre-touched
    buffer (each whole file by one read, and the reader's own byte runs by one read each), the files held open as the
    reader holds its own; beside it a copy out of the files mapped (no reader of gems maps a file: one cut under a
    mapping kills the process with SIGBUS) and a plain memory copy (a ceiling). ``folders``: a
    row's name -> its files (:func:`layout_folders`: 4 x ``size``^3 samples, and crops of a universe): the
    table's rows and its text; ``quiet_s``: the most each round waits for idle cores first. Every contender of
    every row is measured in each round (alternated, each round in the other order), so that the ratios are each
    round's, side by side. The crop row is set beside the planner's rule for crops where no file is at hand (a
    whole file's rate times the share of the bytes read that a crop holds: gems.data.reader.read_share)."""
    from statistics import median as med

    from gems.data import layouts

    threads = list(threads or thread_counts())
    benches = {name: _ReaderBench(layouts.get(src.layout), src.folder, threads, src.edge, src.dense)
               for name, src in folders.items()}
    names = [(lay, t, c) for lay, b in benches.items() for t in threads for c in b.contenders()]
    got: dict[tuple[str, int, str], list[float]] = {k: [] for k in names}
    try:
        for r in range(rounds + 1):  # round 0 warms (threads started, files opened), not counted
            wait_for_idle_cores(quiet_s)
            for lay, t, c in (names if r % 2 else names[::-1]):
                rate = benches[lay].gbs(t, c)
                if r:
                    got[(lay, t, c)].append(rate)
    finally:
        for b in benches.values():
            b.close()

    def best_of(lay: str, t: int, ways: Sequence[str]) -> list[float]:  # each round's best of these ways
        return [max(xs) for xs in zip(*(got[(lay, t, c)] for c in ways if (lay, t, c) in got))]

    def ratio(xs: Sequence[float], ys: Sequence[float]) -> float:  # the median of each round's ratio
        return med([x / y for x, y in zip(xs, ys)])

    rows = []
    for lay, b in benches.items():
        for t in threads:
            best, reader = best_of(lay, t, READS), got[(lay, t, "reader")]
            share, speedup = ratio(reader, best), ratio(reader, got[(lay, 1, "reader")])
            goal = (f"reader >= 0.7 of the bound: {'yes' if share >= 0.7 else 'no'}" if t == 1 and lay in GOAL_ROWS
                    else f"2 threads >= 1.6x 1: {'yes' if speedup >= 1.6 else 'no'}" if t == 2 and lay in GOAL_ROWS
                    else "")
            which = max(READS, key=lambda c: med(got[(lay, t, c)]) if (lay, t, c) in got else 0.0)
            mapped = got.get((lay, t, "mapped"))
            rows.append([lay, b.dtype, t, *(_two(med(got[(lay, t, c)])) if (lay, t, c) in got else "-"
                                            for c in WAYS),
                         f"{_two(med(best))} ({which})", _two(med(got[(lay, t, 'memcpy')])), _two(med(reader)),
                         _two(share), _two(ratio(reader, mapped)) if mapped else "-", _two(speedup), goal,
                         _two(med(got[(lay, t, 'part')])), _two(ratio(got[(lay, t, 'part')], best))])
    first = next(iter(benches.values()))
    text = ("### The reader alone, a row a layout\n\n"
            f"The same {first.n} samples of `gems data synth` (4 x {size}^3 counts, int16 where the layout's tool "
            "keeps them, float32 in LBANN's default; for NIfTI, CT volumes of 1 x "
            f"{size}^3 int16 Hounsfield units with their uint8 labels, `gems data synth data.kind=segmentation`'s) "
            "written in each layout as its published tool writes it "
            "(gems.data.layouts: h5py, contiguous; tfrecord's writer, gzip; nibabel), in the page cache, read in "
            f"batches of {READER_BATCH} by the layout's `read` on `data.readers` threads into a batch made once (as "
            f"a rank's are in effect), {READER_PASSES} passes a measurement, median of {rounds} rounds, every "
            "contender of every layout in each round, alternated (each round in the other order; each round after "
            f"up to {quiet_s:g} s of waiting for idle cores). *bound*: the faster of two positional reads of the "
            "same files' bytes from the page cache into a pre-touched buffer on as many threads, the files held "
            "open: each *whole file* by one `os.preadv` (a volume's labels too); the byte *runs* the reader reads "
            "(its pieces), each by one `os.preadv` to its place. Beside it, *mapped*: each file mapped (`mmap`, "
            "populated) and copied out by numpy, faster than any read system call here but a way no reader of "
            "gems takes (a file cut under a mapping kills the process with SIGBUS, where a read fails and the run "
            "names the file, exit 2); and *memcpy*: the batch's bytes copied in memory, no page cache (a ceiling "
            "no read reaches). Ratios are each round's, side by side: reader / bound, reader / mapped, and reader / "
            "its own one thread. The goals (issues 59 and 65) are those of the files a run reads by position "
            f"({', '.join(GOAL_ROWS)}): the reader at 0.7 of the bound or more on one thread, two threads 1.6x one "
            "or more. *S=2 half, cube*: a rank's depth half under `data.augment=cube` (NIfTI: no symmetry), each "
            "sample's symmetry drawn (the half read from a slab cut in depth, height or width), symmetries and the "
            f"channels' move applied later (on a GPU rank's device); GB/s of the half's bytes. *{crop_row(size)}*: "
            f"one ExaLearn universe of {2 * size}^3 x 4 read as crops of {size // 2}^3, the path MLPerf's 128^3 "
            "crops of a 512^3 universe take (a crop's rows are runs a quarter of their stride apart, as there), "
            "which a file a sample never takes; it has no *whole file* (a file is no sample), its *mapped* copies "
            f"each crop's cells out of the mapped universe. *{converted_row('tfrecord')}*: the TFRecords after "
            "`gems data convert` (ExaLearn's layout, a file a sample). "
            f"*{inplane_rows(size)[0]}*: one CT volume of {INPLANE} x {INPLANE} in-plane (LiTS's) and {size} slices "
            f"with its labels, as nibabel writes it, read as tiles of {size}^3 (a tile's rows are {2 * size} B runs "
            f"{2 * INPLANE} B apart); *{inplane_rows(size)[1]}*: the same volume after `gems data convert "
            f"data.tile={size}` (layout tiles: a case's image and labels in unfiltered {size}^3 chunks, a tile one "
            "block each), the issue-71 goal's row (0.7 of the bound on one thread). Neither has a *whole file* or a "
            "*mapped* copy (a volume is many samples).\n\n")
    if skipped:
        text += "Not measured: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) + ".\n\n"
    text += md_table(["layout", "type", "threads", *(f"{c} GB/s" for c in WAYS), "bound GB/s", "memcpy GB/s",
                      "reader GB/s", "reader / bound", "reader / mapped", "reader / 1 thread", "goal",
                      "S=2 half, cube: GB/s", "its / bound"], rows)
    conv = converted_row("tfrecord")
    if conv in benches and "gems" in benches:
        said = ", ".join(f"{t} thread(s) {ratio(got[(conv, t, 'reader')], got[('gems', t, 'reader')]):.2f}"
                         for t in threads)
        text += (f"\nConverted TFRecords against `gems data synth`'s files (the same samples; goal: their rate), "
                 f"the reader's GB/s, each round's ratio: {said}.\n")
    crops = crop_row(size)
    if crops in benches and "exalearn" in benches:
        text += "\n" + _crop_rule(benches[crops], [got[("exalearn", 1, "reader")], got[(crops, 1, "reader")]])
    return rows, text


def _crop_rule(bench: _ReaderBench, rates: Sequence[Sequence[float]]) -> str:
    """The crop row against the planner's rule (:func:`bench_reader`): ``rates`` each round's one-thread reader on
    whole ExaLearn files and on the crops."""
    from statistics import median as med

    from gems.data import layouts
    from gems.data.reader import read_share

    first = bench.sets[min(bench.sets)]
    head = first._header(0)
    share, g = read_share(head.shape, head.dtype.itemsize, [slice(0, n) for n in bench.shape[1:]])
    whole, crops = rates
    ratio = med([c / (w * share) for w, c in zip(whole, crops)])
    exa = layouts.get("exalearn")
    mlperf, said = exa.fallback_rate((4, 128, 128, 128))
    return (f"*{crop_row(bench.shape[1] * 2)}*: one universe's {bench.n} crops, whose rows are {g.run} B runs "
            f"{g.strides[-1]} B apart; the reader reads {1 / share:.2f}x a crop's bytes (gems.data.reader.read_share). "
            "The planner's rule where no file is at hand (gems.data.layouts' fallback_rate: a whole file's rate "
            f"times that share) gives {med(whole) * share:.2f} GB/s a thread from this run's whole ExaLearn files, "
            f"against {med(crops):.2f} measured: measured / rule {ratio:.2f} (each round's). For MLPerf's 128^3 crops "
            f"of 512^3 universes ({said}) the plan takes {mlperf / 1e9:.2f} GB/s a thread from "
            f"{exa.thread_rate / 1e9:.2g}.\n")


def bench_data(out_dir: Path, sizes: tuple[int, ...] = (64, 128), spatials: tuple[int, ...] = (1, 2),
               rounds: int = 2, parts: str | None = None, reader_size: int = READER_SIZE,
               reader_rounds: int = 7, quiet_s: float = 2.0) -> str:
    """The reader alone (``reader_size``^3 samples, ``reader_rounds`` rounds), then the steps; ``parts``
    (default ``GEMS_BENCH_DATA``, else both): ``reader`` runs the first only, writing ``data-reader.md``.

    The steps: with synthetic samples and with ``gems data synth``'s HDF5 files, three contenders alternated in
    rounds: ``data.prefetch=0`` (every step reads first), ``data.prefetch=2`` (a reader two steps ahead), and the
    bound (every step trains on the batch read once before the first step). Each row gives the step's exposed data
    time, the reader's own time, the step times and on / bound. They are gems's own loop on real gloo ranks, one
    compute thread a rank; on a 2-core machine an S = 2 run's ranks take both cores, so the reader competes with the
    compute, and the table says so."""
    from gems.launch.world import run_world

    parts = parts if parts is not None else os.environ.get("GEMS_BENCH_DATA", "all")
    if parts not in ("all", "reader"):
        from gems.errors import ConfigError

        raise ConfigError("GEMS_BENCH_DATA", parts, "reader (the reader alone), or unset for everything")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gems-bench-data-") as tmp:
        folders, skipped = layout_folders(Path(tmp), reader_size)
        _, reader_text = bench_reader(folders, rounds=reader_rounds, size=reader_size, quiet_s=quiet_s,
                                      skipped=skipped)
        if parts == "reader":
            text = "## gems bench data\n\n" + reader_text + "\n" + env_block("GEMS_BENCH_DATA=reader gems bench data")
            write(out_dir, "data-reader", text)
            return text
        for size in sizes:
            for spatial in spatials:
                for data in ("synthetic", "hdf5"):
                    path = _files(Path(tmp), size) if data == "hdf5" else None
                    got: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS}
                    for _ in range(rounds):  # alternated: every contender sees the same noise
                        for c in CONTENDERS:
                            got[c].append(run_world(bench_rank, spatial, size, spatial, data, path, c,
                                                    str(Path(tmp) / "runs"), timeout=1800)[0])
                    fig = {c: {k: median([g[k] for g in got[c]]) for k in ("step", "exposed", "reader")}
                           for c in CONTENDERS}
                    reader = fig["off"]["reader"]
                    bound = fig["bound"]["step"]
                    ratio = fig["on"]["step"] / bound
                    applies = reader < bound
                    met = ("yes" if ratio <= 1.05 else "no") if applies else "n/a (reader slower than compute)"
                    rows.append([f"{size}^3", spatial, data, f"{reader:.3f}", f"{bound:.3f}",
                                 f"{fig['off']['step']:.3f}", f"{fig['off']['exposed']:.3f}",
                                 f"{fig['on']['step']:.3f}", f"{fig['on']['exposed']:.3f}",
                                 f"{fig['on']['exposed'] / bound:.4f}", f"{fig['off']['step'] / bound:.3f}",
                                 f"{ratio:.3f}", met])
    text = "## gems bench data\n\n" + reader_text + "\n### The step\n\n"
    text += (f"CosmoFlow (paper layers), global batch {BATCH}, fp32, Adam, one compute thread per rank, S spatial "
             f"ranks over gloo; median step time of {STEPS - WARM} measured steps, median of {rounds} alternated "
             "rounds. Synthetic: gems's generator (on the host here; on GPU ranks it draws on the GPU). HDF5: 16 "
             "files of `gems data synth` (int16 counts, 4 channels), each rank reading its hyperslab. "
             "*reader*: the reader's own seconds per step (prefetch off: all of it is exposed); *bound*: the same "
             "run training every step on one batch read before the first (no data path). Goal: with prefetch, "
             "the step within 5% of its bound where the reader alone is faster than the compute. *exposed / bound*: "
             "what the step still waits for with prefetch, as a share of the bound (the part of the goal machine "
             "noise cannot blur: the step times of separate runs move by several percent here). On this 2-core "
             "machine an S=2 run's two ranks take both cores, so its reader thread competes with the compute "
             "rather than using an idle core: on a GPU node the compute is on the GPU and the reader has the "
             "host.\n\n")
    text += md_table(["sample", "S", "data", "reader s/step", "bound s/step", "off: step", "off: exposed data",
                      "on: step", "on: exposed data", "on: exposed / bound", "off / bound", "on / bound", "within 5%"],
                     rows)
    text += "\n" + env_block("gems bench data")
    write(out_dir, "data", text)
    return text


if __name__ == "__main__":
    from gems.bench.common import out_dir_from_argv

    print(bench_data(Path(out_dir_from_argv(sys.argv, "python -m gems.bench.data [OUT_DIR]"))))
