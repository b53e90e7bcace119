"""The storage under a run failing: a full disk or quota, an I/O error, a read-only file system, a folder removed
during the run, each named as what it is (:class:`StorageFailed`), and a record written elsewhere when its own
folder cannot take it (:func:`with_fallback`)."""
from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

from gems.errors import RunError

T = TypeVar("T")

#: errno -> (the failure's kind, what it means), for the errors the machine causes rather than gems
CAUSES = {
    errno.ENOSPC: ("disk_full", "the disk is full"),
    errno.EDQUOT: ("quota", "the quota is full"),
    errno.EIO: ("io_error", "the file system reported an I/O error"),
    errno.EROFS: ("read_only", "the file system is read-only"),
    errno.ESTALE: ("gone", "the file system's handle went stale (a network file system lost it)"),
}
#: the kinds where free space and the write's size say how far from enough it was
SPACE = ("disk_full", "quota")


class StorageFailed(RunError):
    """A write the run needed failed for the machine's reason (exit status 1): ``what`` was being written, to
    ``where``, ``kind`` (disk_full, quota, io_error, read_only, gone) and ``reason`` say why; ``free`` and
    ``needed`` (bytes, None where unknown) how far from enough a full disk or quota was."""

    def __init__(self, what: str, where: Path | str, kind: str, reason: str, free: int | None = None,
                 needed: int | None = None) -> None:
        self.what, self.where, self.kind, self.reason = what, str(where), kind, reason
        self.free, self.needed = free, needed
        super().__init__(self.line())

    def line(self) -> str:
        text = f"writing {self.what} ({self.where}): {self.reason}"
        if self.kind in SPACE:
            sizes = [f"{size(self.free)} free" if self.free is not None else None,
                     f"{size(self.needed)} needed" if self.needed is not None else None]
            shown = ", ".join(s for s in sizes if s)
            text += f" ({shown})" if shown else ""
        return text

    def as_dict(self) -> dict[str, Any]:
        """The failed record's ``failure`` fields."""
        return {"kind": "storage", "storage": self.kind, "what": self.what, "where": self.where,
                "free_bytes": self.free, "needed_bytes": self.needed}

    @staticmethod
    def from_dict(d: dict[str, Any], reason: str) -> "StorageFailed":
        return StorageFailed(d["what"], d["where"], d["storage"], reason, d.get("free_bytes"), d.get("needed_bytes"))


def size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind ``e``: itself, its cause or context, or one a DCP checkpoint's failure wraps."""
    seen = 0
    while e is not None and seen < 16:
        seen += 1
        if isinstance(e, OSError) and e.errno is not None:
            return e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            for wrapped in failures.values():
                inner = os_error(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
                if inner is not None:
                    return inner
        e = e.__cause__ or e.__context__
    return None


def free_bytes(path: Path | str) -> int | None:
    """Bytes an unprivileged writer may still write on the file system of ``path`` (its nearest existing
    folder's); None where that cannot be read."""
    p = Path(path).absolute()
    for cand in (p, *p.parents):
        try:
            st = os.statvfs(cand)
        except OSError:
            continue
        return int(st.f_bavail * st.f_frsize)
    return None


def named(e: BaseException, what: str, where: Path | str, needed: int | None = None) -> StorageFailed | None:
    """``e`` named as the storage failure it is, writing ``what`` to ``where``; None where it is not one (gems's own
    error, or a file missing for another reason than its folder's removal)."""
    if isinstance(e, StorageFailed):
        return e
    err = os_error(e)
    if err is None:
        return None
    where = Path(where)
    if err.errno == errno.ENOENT:  # a folder removed under the run (the results folder, a job's), not a bug
        folder = where if not where.suffix else where.parent
        gone = next((p for p in (folder, *folder.parents) if not p.exists() and p.parent.exists()), None)
        if gone is None:
            return None
        return StorageFailed(what, where, "gone", f"the folder {gone} was removed during the run")
    if err.errno not in CAUSES:
        return None
    kind, reason = CAUSES[err.errno]
    return StorageFailed(what, where, kind, reason, free_bytes(where) if kind in SPACE else None, needed)


@contextlib.contextmanager
def writing(what: str, where: Path | str, needed: int | None = None) -> Iterator[None]:
    """Around a write of ``what`` to ``where`` (``needed`` bytes, where known): a storage failure inside it leaves as
    :class:`StorageFailed`; any other error as it is."""
    try:
        yield
    except StorageFailed:
        raise
    except BaseException as e:
        failed = named(e, what, where, needed)
        if failed is None:
            raise
        raise failed from e


def fallback_dirs() -> list[Path]:
    """Where a record goes when its folder cannot take it, in order: ``$TMPDIR``, the system's temporary folder, the
    folder the command ran in (:func:`with_fallback` writes there, ``gems.results.record.find_record`` looks there)."""
    given = os.environ.get("TMPDIR")
    return list(dict.fromkeys([*([Path(given)] if given else []), Path(tempfile.gettempdir()), Path.cwd()]))


def with_fallback(write: Callable[[Path], T], path: Path | str, what: str) -> tuple[T, Path | None]:
    """``write(path)``; where the storage fails, ``write`` into the first of :func:`fallback_dirs` that takes it (the
    same file name). Returns what ``write`` returned and the path it used instead of ``path`` (None where ``path``
    took it). Every fallback failing too raises the first failure."""
    path = Path(path)
    try:
        with writing(what, path):
            return write(path), None
    except StorageFailed as first:
        for folder in fallback_dirs():
            other = folder / path.name
            if other.parent.resolve() == path.parent.resolve():
                continue
            try:
                with writing(what, other):
                    return write(other), other
            except (StorageFailed, PermissionError):
                continue
        raise first


#: free bytes under which a folder's file system counts as full when a run failed without saying why
NEARLY_FULL = 1 << 20


def full_note(path: Path | str) -> str | None:
    """Where the file system under ``path`` is (nearly) full: the words that say so, for a run that failed
    without a record of its own (its ranks' logs and reports could not be written); None otherwise."""
    free = free_bytes(path)
    if free is None or free >= NEARLY_FULL:
        return None
    return (f"the disk under {path} is full ({size(free)} free): the ranks' logs and failure reports could not be "
            "written whole")
