"""``gems data synth data.kind=cosmology``: a data set of universes (:mod:`gems.data.cosmology`) written in ExaLearn's
layout as NERSC publishes it, so the sample-size study and the real universes take one code path: training and
validation sets split by universe (:data:`VAL_BASE`), one file a universe, on ``data.workers`` processes or one Slurm
job's tasks, resumable (a universe written with the same settings is skipped; nothing is overwritten).
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gems.data.cosmology import PARAMETERS, RANGES, REDSHIFTS, Universes, make_universe, memory_bytes
from gems.errors import ConfigError

NAME = "universe_{:05d}.hdf5"
#: the names of sample files a folder of universes may hold only of its own
SUFFIXES = (".h5", ".hdf5")
#: validation universe j is universe VAL_BASE + j: the same universes whatever the training set's size
VAL_BASE = 1 << 20


@dataclass(frozen=True)
class Plan:
    """What to write: the universes' shared settings, the two folders and their index ranges, the processes."""

    universes: Universes
    train: Path
    val: Path
    n_train: int
    n_val: int
    workers: int

    def targets(self) -> list[tuple[Path, int]]:
        """Every (folder, universe index) of the data set, training first."""
        return [(self.train, i) for i in range(self.n_train)] + [(self.val, VAL_BASE + i) for i in range(self.n_val)]


def ranges_of(value: Any) -> tuple[tuple[float, float], ...]:
    """``data.param_ranges`` (a mapping of :data:`PARAMETERS` to [low, high]; null: :data:`RANGES`), checked."""
    if value is None:
        return tuple(RANGES.values())
    got = dict(value) if hasattr(value, "items") else None
    if got is None or set(got) - set(PARAMETERS):
        unknown = sorted(set(got) - set(PARAMETERS)) if got is not None else value
        raise ConfigError("data.param_ranges", unknown, "a mapping of " + ", ".join(PARAMETERS) + " to [low, high]")
    out = []
    for name in PARAMETERS:
        pair = got.get(name, RANGES[name])
        try:
            lo, hi = (float(x) for x in pair)
        except (TypeError, ValueError):
            raise ConfigError(f"data.param_ranges.{name}", pair, "two numbers [low, high]") from None
        if not lo < hi:
            raise ConfigError(f"data.param_ranges.{name}", [lo, hi], "[low, high] with low < high")
        if name != "n_s" and lo <= 0:
            raise ConfigError(f"data.param_ranges.{name}", [lo, hi], "positive values")
        if name == "Omega_m" and not (lo > 0.049 and hi < 1.0):  # more matter than baryons, less than all
            raise ConfigError(f"data.param_ranges.{name}", [lo, hi], "values between Omega_b = 0.049 and 1 (flat)")
        out.append((lo, hi))
    return tuple(out)


def plan_of(cfg: Any) -> Plan:
    """The data set ``cfg`` asks for, every key checked (bad input: a ConfigError naming it)."""
    from gems.paths import writable_dir

    d = cfg.data
    for key in ("path", "val_path"):
        if d.get(key) in (None, "", "???"):
            raise ConfigError(f"data.{key}", d.get(key), "a folder for the " + ("training" if key == "path" else
                              "validation") + " universes (they are split by universe: data.path and "
                              "data.val_path, e.g. data.path=/scratch/cosmo/train data.val_path=/scratch/cosmo/val)")
    train, val = Path(str(d.path)).absolute(), Path(str(d.val_path)).absolute()
    if train == val:
        raise ConfigError("data.val_path", d.val_path, "a folder other than data.path (validation universes are "
                          "never training ones)")
    if int(d.val_universes) < 1:
        raise ConfigError("data.val_universes", d.val_universes, "at least 1 universe for the validation set "
                          "(universes are split by universe, never by crop)")
    redshifts = tuple(float(z) for z in (d.redshifts if d.redshifts is not None else REDSHIFTS))
    channels = int(cfg.model.in_channels)
    if len(redshifts) != channels or any(z < 0 for z in redshifts):
        raise ConfigError("data.redshifts", list(redshifts), f"{channels} redshifts >= 0, one per input channel "
                          "(model.in_channels)")
    cells = int(d.box_cells)
    if cells % 2:
        raise ConfigError("data.box_cells", cells, "an even number of cells (e.g. 128 or 512)")
    workers = int(d.workers) or (os.cpu_count() or 1)
    total = int(d.universes) + int(d.val_universes)
    need = needed_memory(cells, channels, workers, total)
    from gems.bootstrap import node_memory_bytes

    avail = node_memory_bytes() if cfg.cluster.launcher != "slurm" else None
    if avail is not None and need > avail:
        raise ConfigError("data.box_cells", cells, f"universes that fit this machine's {avail / 2**30:.1f} GiB of "
                          f"free memory ({need / 2**30:.1f} GiB with data.workers={workers}; fewer workers, or a "
                          "Slurm job on a larger node)")
    for key, path in (("data.path", train), ("data.val_path", val)):
        writable_dir(key, path, "a folder gems can create or write the universes into")
    u = Universes(cells=cells, box_mpc=float(d.box_mpc), redshifts=redshifts, mean_count=float(d.mean_count),
                  ranges=ranges_of(d.param_ranges), seed=int(cfg.train.seed))
    return Plan(u, train, val, int(d.universes), int(d.val_universes), workers)


def needed_memory(cells: int, channels: int, workers: int, universes: int) -> int:
    """Host memory the writing takes: a universe a process, or one universe split over the processes where
    there are fewer universes than processes (:func:`gems.data.cosmology.memory_bytes`)."""
    if universes >= workers:
        return workers * memory_bytes(cells, channels)
    return memory_bytes(cells, channels, parts=workers)


def _settings_of(path: Path) -> dict[str, Any] | None:
    import h5py

    try:
        with h5py.File(path, "r") as f:
            return {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in f.attrs.items()}
    except OSError:
        return None


def to_write(plan: Plan) -> list[tuple[Path, int]]:
    """The (folder, index) pairs not written yet; a file that is in the way is bad input (named)."""
    want = plan.universes.attrs()
    ours = {folder: {NAME.format(i % VAL_BASE) for f, i in plan.targets() if f == folder} for folder in (plan.train, plan.val)}
    left = []

    def key(folder: Path) -> str:
        return "data.path" if folder == plan.train else "data.val_path"

    for folder, names in ours.items():
        if folder.is_dir():
            foreign = sorted(p.name for p in folder.iterdir() if p.name.endswith(SUFFIXES) and p.name not in names)
            if foreign:
                raise ConfigError(key(folder), str(folder), "a folder of this data set's universes only (it holds "
                                  f"{len(foreign)} other sample file(s), e.g. {foreign[0]}; nothing was overwritten)")
    for folder, index in plan.targets():
        path = folder / NAME.format(index % VAL_BASE)
        if not path.exists():
            left.append((folder, index))
            continue
        got = _settings_of(path)
        if got is None or any(_differs(got.get(k), v) for k, v in want.items()) or got.get("index") != index:
            raise ConfigError(key(folder), str(folder), f"a new folder or one written with these settings ({path.name} was "
                              "written with other ones, or is not a universe: nothing was overwritten)")
    return left


def _differs(a: Any, b: Any) -> bool:
    return not np.allclose(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)) \
        if a is not None and np.shape(a) == np.shape(b) else True


def write_universe(u: Universes, folder: Path, index: int,
                   map_slabs: Callable[..., Any] | None = None, parts: int = 1) -> float:
    """Make universe ``index`` and write it to ``folder`` (atomically); its seconds."""
    import h5py

    t0 = time.perf_counter()
    counts, unit, physical = make_universe(u, index, map_slabs, parts)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / NAME.format(index % VAL_BASE)
    tmp = folder / f".{final.name}.tmp"
    with h5py.File(tmp, "w") as f:  # channels last, as ExaLearn's: a depth slab is one run of bytes
        f.create_dataset("full", data=np.ascontiguousarray(np.moveaxis(counts, 0, -1)))
        f.create_dataset("unitPar", data=unit)
        f.attrs["layout"] = "exalearn"
        logs = np.log1p(counts.astype(np.float32))
        f.attrs.update({**u.attrs(), "index": index, "generator": "gems.data.cosmology (Zel'dovich, colossus)",
                        "log1p_mean": float(logs.mean()), "log1p_std": float(logs.std())})
        for name, value in physical.items():
            f.attrs[name] = value
    os.replace(tmp, final)
    return time.perf_counter() - t0


def log_counts(folder: Path) -> tuple[float, float] | None:
    """(mean, std) of log(1+counts) over the universes in ``folder``, from each file's own figures (headers only):
    what ``data.standardize`` takes."""
    import h5py

    got = []
    for p in sorted(folder.glob("*.hdf5")):
        with h5py.File(p, "r") as f:
            if "log1p_mean" in f.attrs:
                got.append((float(f.attrs["log1p_mean"]), float(f.attrs["log1p_std"])))
    if not got:
        return None
    m = np.array(got)
    mean = float(m[:, 0].mean())
    return mean, float(np.sqrt((m[:, 1] ** 2 + m[:, 0] ** 2).mean() - mean ** 2))


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)


def _write_one(args: tuple[Universes, Path, int]) -> float:
    return write_universe(*args)


class _Progress:
    """One line every few seconds (and one for the last universe), with what is left."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0, self.shown = total, 0, time.perf_counter(), 0.0

    def step(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self.shown < 3.0 and self.done < self.total:
            return
        self.shown = now
        el = now - self.t0
        left = el / self.done * (self.total - self.done) if self.done else 0.0
        print(f"gems data synth: {self.done}/{self.total} universes written ({el:.0f} s"
              + (f", about {left:.0f} s left" if self.done < self.total else "") + ")", flush=True)


def synth_universes(cfg: Any, job: Callable[..., int] | None = None) -> int:
    """``gems data synth data.kind=cosmology``: writes what is missing; the number of universes written. ``job``:
    what runs a function on every task of one Slurm job (:func:`gems.launch.tasks.run_tasks`, which the command line
    hands in), for ``cluster=`` a Slurm launcher."""
    plan = plan_of(cfg)
    left = to_write(plan)
    u = plan.universes
    total = plan.n_train + plan.n_val
    need = needed_memory(u.cells, len(u.redshifts), plan.workers, len(left) or 1)
    print(f"gems data synth: {total} universes of {len(u.redshifts)} x {u.cells}^3 cells ({u.box_mpc:g} Mpc/h a "
          f"side, z = {', '.join(f'{z:g}' for z in u.redshifts)}): {plan.n_train} to {plan.train}, {plan.n_val} to "
          f"{plan.val}; {total - len(left)} already there; {memory_bytes(u.cells, len(u.redshifts)) / 2**30:.2f} GiB "
          f"a universe, {need / 2**30:.2f} GiB with {plan.workers} process(es)", flush=True)
    written = _write(cfg, plan, left, job) if left else 0
    figures = log_counts(plan.train)
    if figures is not None:
        print(f"gems data synth: log(1+counts) of the training universes: mean {figures[0]:.3f}, std "
              f"{figures[1]:.3f} (for data.standardize=[{figures[0]:.3f},{figures[1]:.3f}])", flush=True)
    return written


def _write(cfg: Any, plan: Plan, left: list[tuple[Path, int]], job: Callable[..., int] | None) -> int:
    """Write the universes ``left``: here, in processes, or as a Slurm job."""
    u = plan.universes
    if cfg.cluster.launcher == "slurm":
        if job is None:
            raise ConfigError("cluster", cfg.cluster.name, "cluster=local here (a Slurm job is submitted by the "
                              "`gems data synth` command)")
        return _on_slurm(cfg, plan, left, job)
    progress = _Progress(len(left))
    t0 = time.perf_counter()
    if plan.workers == 1:
        for folder, index in left:
            write_universe(u, folder, index)
            progress.step()
    else:
        with ProcessPoolExecutor(plan.workers, mp_context=get_context("spawn"), initializer=_init_worker) as pool:
            if len(left) >= plan.workers:  # one universe a process
                for _ in pool.map(_write_one, [(u, f, i) for f, i in left]):
                    progress.step()
            else:  # fewer universes than processes: each universe's deposit split over all of them
                import torch

                torch.set_num_threads(plan.workers)  # the Fourier transforms, here
                for folder, index in left:
                    write_universe(u, folder, index, lambda fn, jobs: list(pool.map(_call, [(fn, j) for j in jobs])),
                                   parts=plan.workers)
                    progress.step()
    el = time.perf_counter() - t0
    print(f"gems data synth: wrote {len(left)} universes in {el:.1f} s ({el / len(left):.2f} s each on "
          f"{plan.workers} process(es))", flush=True)
    return len(left)


def _call(args: tuple[Callable[..., Any], tuple[Any, ...]]) -> Any:
    fn, a = args
    return fn(*a)


# ---------------------------------------------------------------------------- as a Slurm job
def share(plan: Plan, rank: int, tasks: int) -> list[tuple[Path, int]]:
    """Task ``rank`` of ``tasks``'s universes to write: every ``tasks``-th of the whole set, those not written yet."""
    left = set(to_write(plan))
    return [t for t in plan.targets()[rank::tasks] if t in left]


def task(cfg_yaml: str) -> int:
    """One Slurm task of the writing job: every k-th universe of the whole data set (k the job's tasks) that is
    not written yet. The share is cut from the whole set, which every task sees alike, never from what is missing
    when the task starts: tasks start at different moments, and a share of a list that changed in between skips
    a universe or gives one to two tasks."""
    import submitit
    from omegaconf import OmegaConf

    _init_worker()
    cfg = OmegaConf.create(cfg_yaml)
    env = submitit.JobEnvironment()
    plan = plan_of(cfg)
    mine = share(plan, env.global_rank, env.num_tasks)
    for folder, index in mine:
        write_universe(plan.universes, folder, index)
    return len(mine)


def _on_slurm(cfg: Any, plan: Plan, left: list[tuple[Path, int]], job: Callable[..., int]) -> int:
    progress = _Progress(len(left))

    def count(*_: Any) -> None:
        now = len(left) - len(to_write(plan))
        if now > progress.done:
            progress.step(now - progress.done)

    job(cfg, task, "synth", f"{len(left)} universes", on_update=count)
    count()
    return len(left)
