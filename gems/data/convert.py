"""``gems data convert``: a published layout that cannot be read by position (MLPerf's TFRecords, ``.nii.gz`` volumes)
written into one that can, a source file a unit of work converted by its layout, on ``data.workers`` processes or one
Slurm job's tasks. It resumes where it stopped (a file there is whole: :func:`gems.paths.commit`) and goes on past a
bad file, naming each at the end (exit 2).
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
                tile: int | None = None, tolerance: float | None = None) -> Path: ...


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
    tolerance: float | None = None  # data.affine_tolerance: labels lined up onto their volume's grid (data.tile)
    path: str = ""  # data.path (messages)

    def left(self, share: tuple[int, int] = (0, 1)) -> list[tuple[str, Path, Path]]:
        """The items whose converted file is not there yet (a file there is whole: gems.paths.commit); ``share``
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
    if d.get("val_path") not in (None, ""):
        val = Path(str(d.val_path))
        shown = next((lay.convert_command(val) for lay in layouts.registered().values() if lay.files(val)), None)
        raise ConfigError("data.val_path", str(val), "null for gems data convert, which converts data.path (a folder, "
                          f"or a folder of folders: train/ and validation/); convert it on its own: "
                          f"`{shown or f'gems data convert data.path={val} data.out={val}_converted'}`")
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
        other = sorted({name for name, _, _ in items if layouts.get(name).target != "dense"})
        if other:
            raise ConfigError("data.tile", tile, f"null for {other[0]} files (tiles are of labelled volumes: LiTS's "
                              "NIfTI volumes, a Decathlon task, an nnU-Net dataset)")
    return Work(tuple(items), workers, int(cfg.model.in_channels), int(tile) if tile is not None else None,
                float(d.affine_tolerance), str(src))


def _converts(layout: Any) -> bool:
    """Whether gems data convert converts ``layout``'s files: its class has a ``convert`` of its own, not the
    protocol's (MLPerf's TFRecords, LiTS's volumes, whose ``.nii`` ones it copies as they are beside the
    ``.nii.gz`` it decompresses; not the HDF5 layouts, read where they lie)."""
    from gems.data.layouts import Layout

    return getattr(type(layout), "convert", Layout.convert) is not Layout.convert


def _holds_any(folder: Path) -> bool:
    from gems.data import layouts

    return any(lay.files(folder) and _converts(lay) for lay in layouts.registered().values())


def convert_one(item: tuple[str, Path, Path], channels: int, tile: int | None = None,
                tolerance: float | None = None) -> tuple[str, str] | None:
    """Convert one source file; None, or (the file, what is wrong: the refusal's words) (a ConfigError does not
    cross a process's bounds)."""
    name, src, out = item
    try:
        _converter(name).convert(src, out, channels=channels, tile=tile, tolerance=tolerance)
    except ConfigError as e:
        return str(src), e.expected
    return None


def bad_files_line(bad: Sequence[tuple[str, str]], shown: int = 20) -> str:
    """Bad files in one line, each with what is wrong (the first ``shown``, by name): gems data convert's and
    gems data check's last words."""
    out = "; ".join(f"{Path(f).name}: {why}" for f, why in sorted(bad)[:shown])
    return out + (f"; and {len(bad) - shown} more" if len(bad) > shown else "")


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
    """Convert ``left`` on ``work.workers`` processes (one: in this one), past any bad file (:func:`refused`)."""
    bad: list[tuple[str, str]] = []

    def take(got: tuple[str, str] | None) -> bool:
        if got is not None:
            bad.append(got)
        return True

    work_through(functools.partial(convert_one, channels=work.channels, tile=work.tile, tolerance=work.tolerance),
                 left, work.workers, take)
    refused(work, bad, len(left) - len(bad))
    return len(left)


def refused(work: Work, bad: list[tuple[str, str]], done: int) -> None:
    """Every bad file of a conversion named in one refusal (none: nothing), with what was converted."""
    if bad:
        raise ConfigError("data.path", work.path, f"files that convert; {len(bad)} did not: {bad_files_line(bad)} ({done} other "
                          "file(s) were converted and are kept; the same command converts the rest once they are "
                          "mended or removed)")


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
    bad = [got for item in mine if (got := convert_one(item, work.channels, work.tile, work.tolerance)) is not None]
    report(cfg, env.global_rank, bad)
    return len(mine)


def report(cfg: Any, rank: int, bad: list[tuple[str, str]]) -> None:
    """What a Slurm task of gems data convert or check found bad, written to the job's folder (``task<K>.json``),
    which the command reads once the job is done (:func:`found`)."""
    import json

    out = Path(str(cfg.found))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"task{rank}.json").write_text(json.dumps(bad))


def reported_bad_files(cfg: Any, tasks: int) -> list[tuple[str, str]]:
    """The bad files every task of a Slurm job of gems data convert or check reported (:func:`report`)."""
    import json

    bad: list[tuple[str, str]] = []
    for k in range(tasks):
        f = Path(str(cfg.found)) / f"task{k}.json"
        if not f.is_file():
            raise ConfigError("cluster", cfg.cluster.name, f"a job whose every task reports; task {k} wrote nothing "
                              f"({f})")
        bad += [(str(a), str(b)) for a, b in json.loads(f.read_text())]
    return bad


def reporting(cfg: Any, command: str) -> None:
    """``cfg`` made a job's: its run id and the folder its tasks report in (gems.results.record.job_dir)."""
    from omegaconf import open_dict

    from gems.results.record import job_dir

    with open_dict(cfg):
        cfg.run_id = f"{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        cfg.found = str(job_dir(cfg) / "found")


def _on_slurm(cfg: Any, work: Work, left: list[tuple[str, Path, Path]], job: Callable[..., int]) -> int:
    bar = _Bar(len(left), "files")
    shown = [0]

    def count(*_: Any) -> None:
        now = len(left) - len(work.left())
        if now > shown[0]:
            bar.advance(now - shown[0])
            shown[0] = now

    reporting(cfg, "convert")
    try:
        tasks = job(cfg, task, "convert", f"{len(left)} file(s)", on_update=count)
        count()
    finally:
        bar.close()
    bad = reported_bad_files(cfg, tasks)
    refused(work, bad, len(left) - len(bad))
    return len(left)
