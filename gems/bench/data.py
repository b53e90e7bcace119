"""``gems bench data``: does the data path stay off the step's critical path?

For CosmoFlow at 64^3 and 128^3, on S = 1 and 2 spatial ranks, with synthetic samples and with HDF5 files
(``gems data synth``'s ExaLearn layout), three contenders run side by side, alternated in rounds so that each
sees the same machine noise:

* **off**: ``data.prefetch=0``, every step reads (or generates) its samples first, as gems did before;
* **on**: ``data.prefetch=2``, a background reader works two steps ahead (gems.rank.data.Prefetcher);
* **bound**: the same run with no data path at all: every step trains on the batch read once before the
  first step (the no-data step time, the best any reader can give).

Each row gives the exposed data time per step (what the step waited for), the reader's own time per step, the
step times, and on / bound. Goal: with prefetch on, the step within 5% of its bound wherever the reader alone
is faster than the compute (reader time < bound). The runs are gems's own training loop (gems.rank.loop.Run)
on real gloo ranks, one compute thread per rank; on this 2-core machine an S = 2 run's ranks take both cores,
so the reader's thread there competes with the compute instead of using an idle core, and the table says so.

First, the reader alone (:func:`bench_reader`): CosmoFlow's 128^3 x 4 int16 samples read in batches of 4 by
``HDF5Samples.read`` on 1, 2, ... threads (``data.readers``), in GB/s, beside the page-cache bound of the same
files at the same thread count (each whole file read by one ``os.preadv`` into its place of a batch-sized
buffer made once, the files in the page cache), alternated in rounds; the ratios are each round's, side by
side. Goal (issue 59): the reader at >= 0.7 of the bound with one thread, and two threads >= 1.6x one.
``GEMS_BENCH_DATA=reader`` runs only this part (written to ``data-reader.md``).
"""
from __future__ import annotations

import contextlib
import functools
import io
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from gems.bench.common import env_block, md_table, median, write

CONTENDERS = ("off", "on", "bound")
STEPS, WARM, BATCH = 6, 2, 2


def _cfg(size: int, spatial: int, data: str, path: str | None, contender: str) -> Any:
    from omegaconf import open_dict

    from gems.config import compose

    over = [f"model.size={size}", "model.width=1.0", f"parallel.spatial={spatial}", f"train.batch_size={BATCH}",
            f"train.steps={STEPS}", f"train.warmup_steps={WARM}", "train.profile=false",
            f"data.prefetch={2 if contender == 'on' else 0}"]
    over += ["data=hdf5", f"data.path={path}"] if data == "hdf5" else ["data.num_samples=64"]
    cfg = compose(over)
    with open_dict(cfg):
        cfg.run_id = f"bench-data-{size}-{spatial}-{data}-{contender}"
    return cfg


def bench_rank(rank: int, world_size: int, size: int, spatial: int, data: str, path: str | None,
               contender: str) -> dict[str, float]:
    """One run on this rank of a gloo world (gems.launch.world.run_world); rank 0's figures."""
    import torch

    from gems.bootstrap import World
    from gems.rank.loop import Run

    cfg = _cfg(size, spatial, data, path, contender)
    world = World(rank, world_size, rank, "127.0.0.1", 0, "single", torch.device("cpu"), "gloo", "torch", None,
                  "localhost")

    class Bound(Run):
        """The run without a data path: the first batch, read before the first step, every step."""

        def finisher(self) -> None:  # the batch read once, finished once: nothing of the data path in the step
            return None

        def fetch(self, step: int) -> tuple[list[int], Any, Any]:
            if not hasattr(self, "_once"):
                self._once = super().fetch(0)
            return self._once

    run = (Bound if contender == "bound" else Run)(cfg, world, None)
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


def quiet(wait_s: float = 2.0, idle: float = 0.9) -> None:
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


class _ReaderBench:
    """The contenders of :func:`bench_reader` on the files of ``folder``, each a pass over every batch."""

    def __init__(self, folder: Path, threads: Sequence[int], size: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import numpy as np
        import torch

        from gems.data.hdf5 import HDF5Samples

        self.files = sorted(folder.glob("*.h5"))
        self.shape = (4, size, size, size)
        self.sample = int(np.prod(self.shape)) * 2
        self.n = len(self.files) - len(self.files) % READER_BATCH
        self.batches = [list(range(b, b + READER_BATCH)) for b in range(0, self.n, READER_BATCH)]
        for f in self.files:  # into the page cache
            with open(f, "rb") as h:
                while h.read(1 << 24):
                    pass
        self.sizes = [f.stat().st_size for f in self.files]
        self.slot = max(self.sizes)
        self.buffer = np.empty(READER_BATCH * self.slot, np.uint8)  # the bound's batch, made once
        self.out = torch.empty((READER_BATCH, *self.shape), dtype=torch.int16)  # the reader's, made once
        self.half = torch.empty((READER_BATCH, 4, size // 2, size, size), dtype=torch.int16)
        self.sets = {t: HDF5Samples(folder, self.shape, readers=t) for t in threads}
        self.parts = {t: HDF5Samples(folder, self.shape, readers=t, augment="cube",
                                     slices=(slice(0, size // 2),)) for t in threads}
        gen = torch.Generator().manual_seed(0)
        self.syms = [torch.randint(0, 48, (READER_BATCH,), generator=gen).tolist() for _ in self.batches]
        self.contiguous = all(self.sets[threads[0]]._header(i).offset is not None for i in range(len(self.files)))
        self.pool = ThreadPoolExecutor(max(threads))

    def _whole_file(self, i: int) -> None:
        fd = os.open(self.files[i], os.O_RDONLY)
        try:
            k = i % READER_BATCH
            os.preadv(fd, [self.buffer[k * self.slot:k * self.slot + self.sizes[i]]], 0)
        finally:
            os.close(fd)

    def gbs(self, threads: int, contender: str) -> float:
        """GB/s of one pass of ``contender`` on ``threads`` threads."""
        from gems.data.hdf5 import read_into

        t0 = time.perf_counter()
        for _ in range(READER_PASSES):
            for b, syms in zip(self.batches, self.syms):
                if contender == "bound":
                    _drain([functools.partial(self._whole_file, i) for i in b], threads, self.pool)
                elif contender == "h5py":  # the reader this one replaced: h5py, a sample after another, one thread
                    for row, i in zip(self.out, b):
                        read_into(row, self.files[i])
                elif contender == "part":
                    self.parts[threads].read(b, syms, out=self.half)
                else:
                    self.sets[threads].read(b, out=self.out)
        nbytes = (sum(self.sizes[:self.n]) if contender == "bound" else
                  self.n * self.sample // (2 if contender == "part" else 1))
        return READER_PASSES * nbytes / 1e9 / (time.perf_counter() - t0)

    def close(self) -> None:
        for ds in (*self.sets.values(), *self.parts.values()):
            ds.close()
        self.pool.shutdown()


def bench_reader(folder: Path, threads: Sequence[int] | None = None, rounds: int = 7,
                 size: int = READER_SIZE, quiet_s: float = 2.0) -> tuple[list[list[Any]], str]:
    """The reader against the page-cache bound (module docstring) on the files in ``folder`` (4 x ``size``^3
    int16 samples): the table's rows and its text; ``quiet_s``: the most each measurement waits for idle cores."""
    from statistics import median as med

    threads = list(threads or thread_counts())
    bench = _ReaderBench(folder, threads, size)
    names = [(t, c) for t in threads for c in ("bound", "reader", "part")] + [(1, "h5py")]
    got: dict[tuple[int, str], list[float]] = {k: [] for k in names}
    try:
        for r in range(rounds + 1):  # round 0 warms (threads started, files opened), not counted
            for t, c in (names if r % 2 else names[::-1]):  # alternated, each round in the other order
                quiet(quiet_s)
                rate = bench.gbs(t, c)
                if r:
                    got[(t, c)].append(rate)
    finally:
        bench.close()

    def ratio(a: tuple[int, str], b: tuple[int, str]) -> float:  # the median of each round's ratio
        return med([x / y for x, y in zip(got[a], got[b])])

    rows = []
    for t in threads:
        share, speedup = ratio((t, "reader"), (t, "bound")), ratio((t, "reader"), (1, "reader"))
        goal = (f"reader >= 0.7 of the bound: {'yes' if share >= 0.7 else 'no'}" if t == 1 else
                f"2 threads >= 1.6x 1: {'yes' if speedup >= 1.6 else 'no'}" if t == 2 else "")
        rows.append([t, f"{med(got[(t, 'bound')]):.2f}", f"{med(got[(t, 'reader')]):.2f}", f"{share:.2f}",
                     f"{speedup:.2f}", goal, f"{med(got[(t, 'part')]):.2f}", f"{ratio((t, 'part'), (t, 'bound')):.2f}"])
    text = ("### The reader alone\n\n"
            f"{bench.n} files of `gems data synth` (4 x {size}^3 int16 counts, {bench.sample / 2**20:.0f} MiB "
            f"a sample; {'contiguous' if bench.contiguous else 'NOT all contiguous'} `full` datasets, as the "
            f"ExaLearn files), in the page cache, read in batches of {READER_BATCH} by `HDF5Samples.read` on "
            f"`data.readers` threads, {READER_PASSES} passes a measurement, median of {rounds} rounds alternated "
            "with the bound (each round in the other order than the one before; each measurement after up to 2 s "
            "of waiting for the cores to be idle). *bound*: each whole file read by "
            "one `os.preadv` into its place of a batch-sized buffer made once, on as many threads; *reader*: a "
            "whole sample into a batch made once, as a rank's are in effect (a GPU rank's pinned batches come from "
            "the pinned allocator's cache, a CPU rank keeps freed host memory: `train.host_memory`), so that "
            "neither pays for faulting in new pages. Ratios are each round's, side by side. *S=2 half, cube*: a "
            "rank's depth half under `data.augment=cube`, each sample's symmetry drawn, so that the half is read "
            "from a slab cut in depth, height or width (runs of 2 MiB, 16 KiB or 128 B), symmetries applied "
            "later (on a GPU rank's device); GB/s of the half's bytes. The reader before this one (h5py, one "
            f"sample after another under its lock, whatever the threads): {med(got[(1, 'h5py')]):.2f} GB/s.\n\n")
    text += md_table(["threads", "bound GB/s", "reader GB/s", "reader / bound", "reader / 1 thread", "goal",
                      "S=2 half, cube: GB/s", "its / bound"], rows)
    return rows, text


def bench_data(out_dir: Path, sizes: tuple[int, ...] = (64, 128), spatials: tuple[int, ...] = (1, 2),
               rounds: int = 2, parts: str | None = None, reader_size: int = READER_SIZE,
               reader_rounds: int = 7, quiet_s: float = 2.0) -> str:
    """The reader alone (``reader_size``^3 samples, ``reader_rounds`` rounds), then the steps; ``parts``
    (default ``GEMS_BENCH_DATA``, else both): ``reader`` runs the first only, writing ``data-reader.md``."""
    from gems.launch.world import run_world

    parts = parts if parts is not None else os.environ.get("GEMS_BENCH_DATA", "all")
    if parts not in ("all", "reader"):
        from gems.errors import ConfigError

        raise ConfigError("GEMS_BENCH_DATA", parts, "reader (the reader alone), or unset for everything")
    rows = []
    with tempfile.TemporaryDirectory(prefix="gems-bench-data-") as tmp:
        _, reader_text = bench_reader(Path(_files(Path(tmp), reader_size)), rounds=reader_rounds, size=reader_size,
                                      quiet_s=quiet_s)
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
                                                    timeout=1800)[0])
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
