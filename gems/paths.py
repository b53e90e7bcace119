"""Every path a command takes, checked for what the command will do with it before it does anything: a path that
cannot work is bad input (exit 2, one line naming the key, the path and what would work).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from gems.errors import ConfigError


def cache_root() -> Path | None:
    """Where gems keeps what it may compute again (the planner's traces, the data sets ``gems data check`` passed):
    ``$GEMS_CACHE_DIR``, else ``$XDG_CACHE_HOME/gems`` or ``~/.cache/gems``; None where ``GEMS_CACHE_DIR`` is set
    empty (nothing kept)."""
    given = os.environ.get("GEMS_CACHE_DIR")
    if given is not None:
        return Path(os.path.expanduser(given)) if given.strip() else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gems"


def _nearest_existing(p: Path) -> Path:
    for cand in (p, *p.parents):
        if cand.exists():
            return cand
    return Path("/")


def writable_dir(key: str, path: str | os.PathLike[str], what: str = "a folder gems can create or write") -> Path:
    """``path`` if a command can create it (with its parents) or write into it; else ConfigError. Probed by creating
    and removing an empty folder in its nearest existing ancestor, whose times are then restored: permissions alone
    do not say it (a read-only or virtual file system, ``/proc``, refuses root too)."""
    p = Path(os.path.expanduser(str(path)))
    if p.exists() and not p.is_dir():
        raise ConfigError(key, str(path), f"{what} (a file of that name exists)")
    anc = _nearest_existing(p.absolute())
    if not anc.is_dir():
        raise ConfigError(key, str(path), f"{what} ({anc} is a file, not a folder)")
    st = anc.stat()
    try:
        probe = tempfile.mkdtemp(prefix=".gems-probe-", dir=anc)
        os.rmdir(probe)
    except OSError as e:
        raise ConfigError(key, str(path), f"{what} ({anc}: {e.strerror or e})") from None
    try:  # the probe leaves no trace, not even in the folder's times
        os.utime(anc, ns=(st.st_atime_ns, st.st_mtime_ns))
    except OSError:
        pass
    return p


def readable_dir(key: str, path: str | os.PathLike[str], what: str) -> Path:
    """``path`` if it is a folder this process can list; else ConfigError."""
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise ConfigError(key, str(path), f"{what} (it does not exist)")
    if not p.is_dir():
        raise ConfigError(key, str(path), f"{what} (it is a file)")
    try:
        next(iter(os.scandir(p)), None)
    except OSError as e:
        raise ConfigError(key, str(path), f"{what} ({e.strerror or e})") from None
    return p


def commit(tmp: str | os.PathLike[str], path: str | os.PathLike[str], sync: bool = True) -> None:
    """``tmp`` renamed to ``path``: a reader finds the old file or the whole new one. ``sync``: ``tmp`` synced to
    the disk first and the rename after (the folder's entry), so that a crash at any moment too leaves the old file
    or the whole new one, never a name on half a file (what a resumed ``gems data convert`` trusts: a converted
    file there is finished); without, a writer whose files nothing resumes from (a test's, a bench's) spares
    the syncs (~10 ms a file on a local disk)."""
    if sync:
        _fsync(tmp)
    os.replace(tmp, path)
    if sync:
        _fsync(os.path.dirname(os.path.abspath(path)))


def _fsync(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_result_json(path: str | os.PathLike[str], obj: Any, *, replace: bool = True, **dump: Any) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically (a temporary file in the same folder, synced, then renamed:
    a reader sees the old file or the whole new one), readable by all as the umask allows (a result: mkstemp
    makes it owner-only). ``replace=False`` never replaces an existing file (FileExistsError)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=path.suffix, dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, **{"indent": 1, **dump})
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o644 & ~umask)
        if replace:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)  # fails if the file exists
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
