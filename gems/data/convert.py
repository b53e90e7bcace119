"""``gems data convert``: a published layout that cannot be read by position, written into one that can.

``data.path`` is a folder of a layout that converts (gems.data.layouts: one with ``convert``),
or a folder of such folders (MLPerf's ``train/`` and ``validation/``); ``data.out`` gets the converted files,
in a folder of the same name for each (``data.out/train``, ``data.out/validation``). Each source file is one
unit of work, converted by its layout (:meth:`convert`): MLPerf's TFRecords into ExaLearn's channels-last HDF5
(the record's counts bit for bit, every record's CRC checked), LiTS's ``.nii.gz`` into ``.nii``.

It resumes where it stopped: a layout writes each file under a hidden name and renames it when it is whole,
so a file there is finished and is never written again, and one half-written is done again. The work is spread
over ``data.workers`` processes here (0: this machine's cores), with a progress bar, or over the tasks of one
Slurm job (``cluster=...``: each task converts every k-th file left). A bad file (a corrupt gzip stream, a
record whose CRC does not match, labels missing) stops the conversion and is named (exit 2); what was written
before it stays.
"""
from __future__ import annotations

import functools
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, cast

from gems.errors import ConfigError


class Converts(Protocol):
    """What a layout that ``gems data convert`` converts has beside the protocol (gems.data.layouts)."""

    def converted_name(self, source: Path, tile: int | None = None) -> str: ...

    def convert(self, source: Path, folder: Path, channels: int | None = None, key: str = "data.path",
                tile: int | None = None) -> Path: ...


def _converter(name: str) -> Converts:
    from gems.data.layouts import get

    return cast(Converts, get(name))


@dataclass(frozen=True)
class Work:
    """What to convert: every (layout name, source file, output folder), and the processes."""

    items: tuple[tuple[str, Path, Path], ...]
    workers: int
    channels: int
    tile: int | None = None  # data.tile: labelled volumes written tile by tile (gems.data.layouts.tiles)

    def left(self, share: tuple[int, int] = (0, 1)) -> list[tuple[str, Path, Path]]:
        """The items whose converted file is not there yet (a file there is whole: module docstring); ``share``
        (k, n): of every n-th item from the k-th (a Slurm task's share: of all the items, so that the shares stay
        apart while other tasks convert theirs). Each output folder is listed once (one scandir, no stat a file:
        the progress of a Slurm conversion of half a million files asks this every update)."""
        from gems.data.layouts import listing

        k, n = share
        there: dict[Path, set[str]] = {}
        for name, src, out in self.items:  # each folder a converted file lands in (a Decathlon task's imagesTr/)
            folder = (out / _converter(name).converted_name(src, self.tile)).parent
            if folder not in there:
                there[folder] = set(listing(folder)) if folder.is_dir() else set()
        return [(name, src, out) for name, src, out in self.items[k::n]
                if (out / (c := _converter(name).converted_name(src, self.tile))).name not in there[(out / c).parent]]


def plan_of(cfg: Any) -> Work:
    """The work ``cfg`` asks for, every key checked (bad input: a ConfigError naming it)."""
    from gems.data import layouts
    from gems.paths import writable_dir

    d = cfg.data
    if d.path in (None, "", "???"):
        raise ConfigError("data.path", d.path, "the folder of files to convert (MLPerf's TFRecords, LiTS's .nii.gz), "
                          "e.g. data.path=/data/cosmoUniverse_2019_05_4parE_tf_v2")
    src = Path(str(d.path))
    if not src.is_dir():
        raise ConfigError("data.path", str(src), "a folder of files to convert")
    if d.get("out") in (None, "", "???"):
        raise ConfigError("data.out", d.get("out"), "a folder for the converted files, e.g. data.out=/scratch/cosmo")
    out = Path(str(d.out))
    if out.absolute() == src.absolute():
        raise ConfigError("data.out", str(out), "a folder other than data.path (the sources are kept)")
    name = d.get("layout")
    folders = [src] if _holds_any(src) else sorted(p for p in src.iterdir() if p.is_dir() and _holds_any(p))
    if not folders:
        what = ("a folder of files gems data convert converts, or of such folders (MLPerf's train/ and "
                "validation/): " + "; ".join(f"{lay.name}: {lay.about}" for lay in layouts.registered().values()
                                             if _converts(lay)))
        try:  # files of a layout read where they lie (HDF5's): say so
            held = layouts.detect(src, name, "data.path")
        except ConfigError:
            held = None
        if held is not None:
            raise ConfigError("data.path", str(src), f"{what}; these are {held.name} files ({held.about}), which gems "
                              f"run reads where they lie: nothing to convert (data=files data.path={src})")
        subs = layouts.holding_subfolders(src, layouts.registered().values())
        if subs:  # folders of files read where they lie (HDF5 universes split into train/ and val/)
            shown = ", ".join(f"{s.name}/ ({n} {kind})" for s, n, kind in subs[:4])
            raise ConfigError("data.path", str(src), f"{what}; its subfolders {shown} hold files gems run reads where "
                              f"they lie: nothing to convert (data=files data.path={subs[0][0]})")
        raise ConfigError("data.path", str(src), what)
    items = []
    for folder in folders:
        layout = layouts.detect(folder, name, "data.path")
        if not _converts(layout):
            raise ConfigError("data.path", str(folder), f"files of a layout gems data convert converts; these are "
                              f"{layout.name} files ({layout.about}), read where they lie")
        dest = out if folder == src else out / folder.name
        writable_dir("data.out", str(dest), "a folder gems can create or write the converted files into")
        items += [(layout.name, f, dest) for f in layout.files(folder)]
    workers = int(d.workers) or (os.cpu_count() or 1)
    tile = d.get("tile")
    if tile is not None:
        labelled = {"nifti", "decathlon"}
        other = sorted({name for name, _, _ in items} - labelled)
        if other:
            raise ConfigError("data.tile", tile, f"null for {other[0]} files (tiles are of labelled volumes: LiTS's "
                              "NIfTI volumes, a Decathlon task)")
    return Work(tuple(items), workers, int(cfg.model.in_channels), int(tile) if tile is not None else None)


def _converts(layout: Any) -> bool:
    """Whether gems data convert converts ``layout``'s files: its class has a ``convert`` of its own, not the
    protocol's (MLPerf's TFRecords, LiTS's volumes, whose ``.nii`` ones it copies as they are beside the
    ``.nii.gz`` it decompresses; not the HDF5 layouts, read where they lie)."""
    from gems.data.layouts import Layout

    return getattr(type(layout), "convert", Layout.convert) is not Layout.convert


def _holds_any(folder: Path) -> bool:
    from gems.data import layouts

    return any(lay.files(folder) and _converts(lay) for lay in layouts.registered().values())


def convert_one(item: tuple[str, Path, Path], channels: int, tile: int | None = None) -> tuple[str, Any, str] | None:
    """Convert one source file; None, or the bad input it is as (key, value, expected) (a ConfigError does not
    cross a process's bounds)."""
    name, src, out = item
    try:
        _converter(name).convert(src, out, channels=channels, tile=tile)
    except ConfigError as e:
        return e.key, e.value, e.expected
    return None


def _context() -> Any:
    """How the worker processes start: forked where the system forks (nothing is open or running in this process
    yet that a child could inherit half-way: the sources were only listed, no HDF5 file is open, torch has run
    nothing), so that they start in milliseconds rather than importing torch again each; spawned elsewhere."""
    import multiprocessing

    return get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


#: the pid of the process whose workers these are (set before the pool starts: a worker checks it is still there)
_PARENT: list[int] = []


def _init_worker() -> None:
    from gems.pools import start_worker

    start_worker(_PARENT[0] if _PARENT else None)


class _Bar:
    """rich's progress bar of the files converted (a plain line at the end where the output is no terminal)."""

    def __init__(self, total: int, what: str, command: str = "gems data convert") -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.total, self.t0 = total, time.perf_counter()
        self.progress = Progress(TextColumn(command), BarColumn(), MofNCompleteColumn(),
                                 TimeRemainingColumn(), transient=False)
        self.task = self.progress.add_task(what, total=total)
        self.progress.start()

    def advance(self, n: int = 1) -> None:
        self.progress.advance(self.task, n)

    def close(self) -> None:
        self.progress.stop()


def convert_main(cfg: Any, job: Callable[..., int] | None = None) -> int:
    """``gems data convert``: converts what is left; the number of files converted. ``job``: what runs a function
    on every task of one Slurm job (gems.launch.tasks.run_tasks, which the command line hands in), for ``cluster=``
    a Slurm launcher."""
    work = plan_of(cfg)
    left = work.left()
    total = len(work.items)
    outs = sorted({str(out) for _, _, out in work.items})
    print(f"gems data convert: {total} file(s) to {', '.join(outs)}: {total - len(left)} already there, "
          f"{len(left)} to convert on {work.workers if cfg.cluster.launcher != 'slurm' else 'Slurm'} "
          f"{'process(es)' if cfg.cluster.launcher != 'slurm' else 'tasks'}", flush=True)
    if not left:
        return 0
    t0 = time.perf_counter()
    if cfg.cluster.launcher == "slurm" and job is None:
        raise ConfigError("cluster", cfg.cluster.name, "cluster=local here (a Slurm job is submitted by the "
                          "`gems data convert` command)")
    done = _on_slurm(cfg, work, left, job) if job is not None and cfg.cluster.launcher == "slurm" else _here(work, left)
    el = time.perf_counter() - t0
    print(f"gems data convert: converted {done} file(s) in {el:.1f} s", flush=True)
    return done


def work_through(fn: Callable[[Any], Any], items: Sequence[Any], workers: int, take: Callable[[Any], bool],
                 command: str = "gems data convert") -> None:
    """``fn`` of each of ``items`` (a file's work) on ``workers`` processes here (one, or one item: in this
    process), twice ``workers`` items queued at most, with a progress bar of the files that ``command`` names (gems
    data convert's and gems data check's one loop). Each result is handed to ``take`` in this process as it comes:
    True counts the file on the bar; False does not, and no more items are started (those under way are taken)."""
    if workers == 1 or len(items) == 1:
        bar = _Bar(len(items), "files", command)
        try:
            for item in items:
                if not take(fn(item)):
                    break
                bar.advance()
        finally:
            bar.close()
        return
    _PARENT[:] = [os.getpid()]  # the workers end with this process (gems.pools.die_with_parent)
    with ProcessPoolExecutor(min(workers, len(items)), mp_context=_context(), initializer=_init_worker) as pool:
        queue = iter(items)
        running: set[Future] = set()
        going = True

        def feed() -> None:
            for item in queue:
                running.add(pool.submit(fn, item))
                if len(running) >= 2 * workers:
                    return

        feed()  # the workers start here, all of them (a forked pool's), before the bar's thread does
        bar = _Bar(len(items), "files", command)
        try:
            while running:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for f in finished:
                    running.discard(f)
                    if take(f.result()):
                        bar.advance()
                    else:
                        going = False
                if going:
                    feed()
        finally:
            bar.close()


def _here(work: Work, left: list[tuple[str, Path, Path]]) -> int:
    """Convert ``left`` on ``work.workers`` processes (one: in this one), the first bad file ending it."""
    done = 0
    bad: tuple[str, Any, str] | None = None

    def take(got: tuple[str, Any, str] | None) -> bool:
        nonlocal done, bad
        if got is not None:
            bad = bad or got
            return False
        done += 1
        return True

    work_through(functools.partial(convert_one, channels=work.channels, tile=work.tile), left, work.workers, take)
    if bad is not None:
        key, value, expected = bad
        raise ConfigError(key, value, f"{expected} ({done} other file(s) were converted and are kept; run the same "
                          "command again once it is mended or removed)")
    return done


# ---------------------------------------------------------------------------- as a Slurm job
def task(cfg_yaml: str) -> int:
    """One Slurm task of the conversion job: every k-th file left (k the job's tasks)."""
    import submitit
    from omegaconf import OmegaConf

    _init_worker()
    cfg = OmegaConf.create(cfg_yaml)
    env = submitit.JobEnvironment()
    work = plan_of(cfg)
    mine = work.left((env.global_rank, env.num_tasks))
    for item in mine:
        bad = convert_one(item, work.channels, work.tile)
        if bad is not None:
            raise ConfigError(*bad)
    return len(mine)


def _on_slurm(cfg: Any, work: Work, left: list[tuple[str, Path, Path]], job: Callable[..., int]) -> int:
    bar = _Bar(len(left), "files")
    shown = [0]

    def count(*_: Any) -> None:
        now = len(left) - len(work.left())
        if now > shown[0]:
            bar.advance(now - shown[0])
            shown[0] = now

    try:
        job(cfg, task, "convert", f"{len(left)} file(s)", on_update=count)
        count()
    finally:
        bar.close()
    return len(left)
