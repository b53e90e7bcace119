"""``gems data check``: a data set checked whole before a long run, every file read through the reader a run uses, on
``data.workers`` processes or one Slurm job's tasks; it goes on past a bad file and names each (exit 2 where any is).
A set that passes is remembered in gems's cache, and a run over a large set that has not says once that the check
exists (:func:`unchecked_note`; docs/data.md, "Checking a data set whole").
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from gems.errors import ConfigError

#: a set this large (bytes, estimated from its first file) that has not passed the check is named once by a run
LARGE_BYTES = 8 * 2**30


def check_file(name: str, file: str, key: str, classes: int | None,
               tolerance: float | None = None) -> tuple[str, str] | None:
    """Read file ``file`` of layout ``name`` whole, as a run's reader reads it (a set of that one file, every
    sample of it), or, where a run reads it only once converted (a ``.nii.gz``), as the layout reads it whole
    (gems.data.layouts.Layout.check_whole); None where it is good, else (the file, what is wrong: the refusal's
    words). ``tolerance``: data.affine_tolerance."""
    from gems.data import layouts

    layout = layouts.get(name)
    try:
        if layout.check_whole(Path(file), key, classes, tolerance):
            return None
        samples = layout.open(file, None, key=key, target=layout.target, classes=classes, affine_tolerance=tolerance)
        try:
            samples.check_all(None, None)
            for i in range(len(samples)):
                samples.read([i])
        finally:
            samples.close()
    except ConfigError as e:
        return file, e.expected
    except (OSError, ValueError, RuntimeError) as e:  # what no refusal foresaw: said, not raised
        return file, f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return None


def _classes(cfg: Any, layout: Any, path: str) -> int | None:
    """The classes a label must be below: the model's where it takes a class a voxel (``check_classes``, which
    :func:`check_main` sets on the configuration a Slurm job's tasks get), else the set's own."""
    given = cfg.get("check_classes")
    if given is not None:
        return int(given)
    names = layout.class_names(path) if hasattr(layout, "class_names") else None
    return len(names) if names else None


Item = tuple[str, str, str, int | None, float]


def sets_of(cfg: Any) -> list[tuple[str, str, Any]]:
    """(key, folder, layout) of ``data.path`` and ``data.val_path``; bad input (no such folder, no layout that holds
    it) is a ConfigError naming the key."""
    from gems.data import layouts

    d = cfg.data
    if d.path in (None, "", "???"):
        raise ConfigError("data.path", d.path, "the folder of files to check, e.g. data.path=/data/Task03_Liver")
    out = []
    for key, path in (("data.path", d.path), ("data.val_path", d.val_path)):
        if path in (None, ""):
            continue
        if not Path(str(path)).exists():
            raise ConfigError(key, str(path), "a folder (or file) of samples to check")
        out.append((key, str(path), layouts.detect(str(path), d.get("layout"), key)))
    return out


def work_of(cfg: Any) -> list[Item]:
    """(layout, file, key, classes, data.affine_tolerance) of every file of ``data.path`` and ``data.val_path``."""
    return [(layout.name, str(f), key, _classes(cfg, layout, path), float(cfg.data.affine_tolerance))
            for key, path, layout in sets_of(cfg) for f in layout.files(path)]


def _check_item(item: Item) -> tuple[str, str] | None:
    return check_file(*item)


def check_main(cfg: Any, job: Callable[..., int] | None = None, classes: int | None = None) -> int:
    """``gems data check``: every file of each set read through the reader a run uses; the exit status (0 all good,
    2 any bad).
    ``classes``: the configured model's (:attr:`gems.models.ModelSpec.classes`), kept on ``cfg`` for a Slurm
    job's tasks."""
    from omegaconf import open_dict

    from gems.config import given
    from gems.data.task import from_the_data

    sets = sets_of(cfg)
    from_the_data(cfg)  # a task's classes against a model.num_classes the user set: refused as gems run refuses it
    with open_dict(cfg):  # the model's where the user set them, else the set's own
        cfg.check_classes = classes if given(cfg, "model.num_classes") else None
    items = work_of(cfg)
    here = cfg.cluster.launcher != "slurm"
    workers = min(int(cfg.data.workers) or (os.cpu_count() or 1), max(1, len(items)))
    print(f"gems data check: {len(items)} file(s) to read whole on "
          f"{f'{workers} process(es)' if here else 'the tasks of a Slurm job'}", flush=True)
    t0 = time.perf_counter()
    if here:
        bad = _here(items, workers)
    elif job is not None:
        bad = _on_slurm(cfg, items, job)
    else:
        raise ConfigError("cluster", cfg.cluster.name, "cluster=local here (a Slurm job is submitted by the "
                          "`gems data check` command)")
    print(summary(len(items), bad, time.perf_counter() - t0), flush=True)
    for key, path, layout in sets:  # a set a run reads only once converted: said once
        hint = layout.convert_hint(path, layout.files(path))
        if hint:
            print(f"gems: note: {key}: {hint}", flush=True)
    if bad:
        return 2
    for key, path in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        if path not in (None, ""):
            remember(str(path))
    return 0


def summary(total: int, bad: list[tuple[str, str]], seconds: float) -> str:
    """The check's last line: the files checked, each bad one named with what is wrong."""
    from gems.data.convert import bad_files_line

    if not bad:
        return f"gems data check: {total} file(s) checked in {seconds:.1f} s, all good"
    return f"gems data check: {total} file(s) checked in {seconds:.1f} s, {len(bad)} bad: {bad_files_line(bad)}"


def _here(items: list[Any], workers: int) -> list[tuple[str, str]]:
    """Every item checked on ``workers`` processes (one: in this one), each bad one kept."""
    from gems.data.convert import work_through

    bad: list[tuple[str, str]] = []

    def take(got: tuple[str, str] | None) -> bool:
        if got is not None:
            bad.append(got)
        return True

    work_through(_check_item, items, workers, take, "gems data check")
    return bad


def task(cfg_yaml: str) -> int:
    """One Slurm task of the check: every k-th file (k the job's tasks), what it found written to the job's
    folder (gems.data.convert.report), which the command reads once the job is done."""
    import submitit
    from omegaconf import OmegaConf

    from gems.data.convert import _init_worker, report

    _init_worker()
    cfg = OmegaConf.create(cfg_yaml)
    env = submitit.JobEnvironment()
    mine = work_of(cfg)[env.global_rank::env.num_tasks]
    report(cfg, env.global_rank, [got for item in mine if (got := _check_item(item)) is not None])
    return len(mine)


def _on_slurm(cfg: Any, items: list[Any], job: Callable[..., int]) -> list[tuple[str, str]]:
    from gems.data.convert import reported_bad_files, reporting

    reporting(cfg, "check")
    return reported_bad_files(cfg, job(cfg, task, "check", f"{len(items)} file(s)"))


# ---------------------------------------------------------------------------- sets that passed
def _digest(path: str) -> tuple[str, str]:
    """(where a passed check of the set at ``path`` is kept, what the set is now: its files' names and the folder's
    modification time; a file added, removed or renamed changes it)."""
    p = Path(path).resolve()
    h = hashlib.sha256()
    if p.is_dir():
        with os.scandir(p) as entries:
            for name in sorted(e.name for e in entries):
                h.update(name.encode() + b"\0")
    st = p.stat()
    h.update(str(st.st_mtime_ns).encode())
    return hashlib.sha256(str(p).encode()).hexdigest()[:24], h.hexdigest()


def remember(path: str) -> None:
    """The set at ``path`` passed the check (kept in gems's cache; nothing where the cache is off)."""
    from gems.paths import cache_root

    root = cache_root()
    if root is None:
        return
    name, now = _digest(path)
    folder = root / "checked"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps({"path": str(Path(path).resolve()), "digest": now,
                                                     "when": time.strftime("%Y-%m-%d %H:%M:%S")}))


def passed(path: str) -> bool:
    """Whether the set at ``path``, as it is now, passed the check."""
    from gems.paths import cache_root

    root = cache_root()
    if root is None:
        return False
    name, now = _digest(path)
    try:
        return bool(json.loads((root / "checked" / f"{name}.json").read_text()).get("digest") == now)
    except (OSError, ValueError):
        return False


def unchecked_note(key: str, path: str, files: list[Path]) -> str | None:
    """What a run says once of a large set (:data:`LARGE_BYTES`, estimated from its first file) that has not passed
    the check, else None."""
    if not files:
        return None
    try:
        size = files[0].stat().st_size * len(files)
    except OSError:
        return None
    if size < LARGE_BYTES or passed(path):
        return None
    return (f"{key}: {len(files)} file(s), about {size / 2**30:.0f} GiB, not checked whole: a bad file met after the "
            f"launch stops the run there (its training kept); `gems data check {key}={path}` reads every file first")
