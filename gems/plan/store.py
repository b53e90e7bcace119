"""The planner's traces kept on disk between processes, so that the check before every launch is quick.

A trace (:func:`gems.trace.model.trace_layers`) is a pure function of what the planner keys it by in this
process (the model's settings, the spatial cut, the part, the micro-batch, the precision), of gems's own source
and of torch's version; so are the serial trunk's layer shapes and a decided pipeline balance, kept the same
way. Tracing costs about a second even for a small model, most of it torch's fake-tensor
machinery being imported, and every ``gems run``, every point of ``gems sweep`` and every repeat of a point plans
before it launches (``train.check_fit``). The traces are therefore kept under ``$GEMS_CACHE_DIR`` (by default
``$XDG_CACHE_HOME/gems`` or ``~/.cache/gems``), one small file per key, named by a digest of the key, in a folder
named by a digest of the ``gems`` package's source and torch's version: a changed gems or torch never reads an old
trace, and the folders of other versions untouched for a week are removed when a new one starts.
``GEMS_CACHE_DIR=`` (empty) turns it off. The files are pickles, read back as code would be: the folder must be
one only its user writes (the default is).

It also keeps what a CPU rank's convolution backward allocates for itself (``gems.plan.cpu.conv_workspace``):
bytes, not time, a pure function of the convolution, the batch, the threads, torch's version and the CPU's
instruction sets (oneDNN picks its kernels by them: :func:`cpu_identity` is in the key). Measuring them took
3-7 s of every ``gems plan`` of a CPU mesh.

Beside the traces, in a folder of its own (``cpu``), it keeps what a CPU rank's kernels take on this machine
(:func:`load` and :func:`keep`, ``gems.plan.cpu``): times, which load moves, kept as measurements are, with the rule
of when they are measured again beside them; a changed gems does not discard them.

What it never holds: a custom model's (``model=custom`` names a function whose source gems does not digest), a
failure, the machine's free memory. A file that cannot be read, written
or unpickled is a miss: the value is made again; a write is atomic (a temporary file renamed), so processes
planning at once never read half a file.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TypeVar

from gems.paths import cache_root

__all__ = ["cache_dir", "source_digest", "cached", "cpu_identity", "load", "keep"]

T = TypeVar("T")


def cache_dir() -> Path | None:
    """Where the traces are kept, or None when ``GEMS_CACHE_DIR`` is set empty."""
    root = cache_root()
    return root / "traces" if root is not None else None


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of every Python file of the ``gems`` package and of torch's version (a few ms)."""
    import torch

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(torch.__version__.encode())
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def cpu_identity() -> tuple[str, str]:
    """(model name, instruction-set flags) of this machine's CPU, from ``/proc/cpuinfo`` (its first processor);
    elsewhere the platform's processor or machine name and no flags."""
    import platform

    name = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            field, _, value = line.partition(":")
            field = field.strip()
            if field == "model name" and not name:
                name = value.strip()
            elif field in ("flags", "Features") and not flags:  # x86, Arm
                flags = " ".join(sorted(value.split()))
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), flags


#: a folder of another gems source or torch left untouched this long is removed (the key of every file in it
#: names a source that is not this one: nothing reads it again unless that source comes back)
STALE_S = 7 * 24 * 3600.0


def _path(key: tuple[Any, ...]) -> Path | None:
    where = cache_dir()
    if where is None:
        return None
    digest = hashlib.sha256(repr(key).encode()).hexdigest()
    return where / source_digest()[:16] / f"{digest}.pkl"


def cached(key: tuple[Any, ...], make: Callable[[], T]) -> T:
    """``make()``, read from the file of ``key`` when one is there, else made and written there. ``make`` may
    raise: nothing is kept then."""
    path = _path(key)
    if path is not None:
        try:
            with open(path, "rb") as f:
                stored_key, value = pickle.load(f)
            if stored_key == key:  # (a digest collision, however unlikely, is a miss)
                return value  # type: ignore[no-any-return]
        except Exception:  # noqa: BLE001 - no file, an unreadable folder, a truncated or foreign file: made again
            pass
    value = make()
    if path is not None:
        fresh = not path.parent.exists()
        _write(path, (key, value))
        if fresh:  # the first file of this source: the folders of others, untouched for a week, go
            _prune(path.parent)
    return value


def _prune(keep: Path) -> None:
    now = time.time()
    try:
        others = list(keep.parent.iterdir())
    except OSError:  # (the folder could not be made: nothing was kept)
        return
    for other in others:
        try:
            if other != keep and other.is_dir() and now - other.stat().st_mtime > STALE_S:
                shutil.rmtree(other, ignore_errors=True)
        except OSError:
            pass


def _write(path: Path, item: Any) -> None:
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".part-", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(item, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except Exception:  # noqa: BLE001 - a read-only or full home, or a value that does not pickle: not kept
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _kept_path(kind: str, key: tuple[Any, ...]) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    return root / kind / f"{hashlib.sha256(repr(key).encode()).hexdigest()}.pkl"


def load(kind: str, key: tuple[Any, ...]) -> Any:
    """The value kept under ``key`` in the folder ``kind`` (measurements, not a function of gems's source), None
    where there is none (or it cannot be read, or caching is off)."""
    path = _kept_path(kind, key)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            stored_key, value = pickle.load(f)
    except Exception:  # noqa: BLE001 - no file, a truncated or foreign one: none kept
        return None
    return value if stored_key == key else None


def keep(kind: str, key: tuple[Any, ...], value: Any) -> None:
    """Keep ``value`` under ``key`` in the folder ``kind`` for the next process (atomic; nothing where caching is off,
    or the folder cannot be written)."""
    path = _kept_path(kind, key)
    if path is not None:
        _write(path, (key, value))
