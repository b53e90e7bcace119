"""The files a checkpoint's run trained on: each data set's listing, kept in the checkpoint's ``gems.json``, and
what changed in them since (files gone, files added), which a run that goes on from the checkpoint is refused on.
What a set's files are is the data layouts' to say: gems.data.layouts hands its listing here when it is imported
(:func:`lists`), as a registry hands the configuration its values (gems.config.owned)."""
from __future__ import annotations

import hashlib
from typing import Any, Callable

from gems.errors import ConfigError

#: the names a listing keeps of a set (past it: their count and digest, which tell that it changed, not how)
NAMES = 100_000

_LISTING: list[Callable[[Any], dict[str, list[str]]]] = []


def lists(fn: Callable[[Any], dict[str, list[str]]]) -> None:
    """Declare how a configuration's data sets are listed: ``fn(cfg)`` is {key: the set's files, as names under its
    folder} for ``data.path`` and ``data.val_path`` (gems.data.layouts)."""
    _LISTING[:] = [fn]


def listing(cfg: Any) -> dict[str, dict[str, Any]] | None:
    """What a checkpoint keeps of ``cfg``'s data sets (None where no files are read, or no listing was handed in):
    per key, the folder, the files' count, their digest and, up to :data:`NAMES`, their names."""
    if not _LISTING:
        return None
    try:
        got = _LISTING[0](cfg)
    except (ConfigError, OSError):  # a folder gone under a run: its checkpoint keeps no listing, and is kept
        return None
    return {key: {"path": str(cfg.data.get("val_path" if key == "data.val_path" else "path")), "count": len(names),
                  "digest": hashlib.sha256("\0".join(names).encode()).hexdigest(),
                  "names": names if len(names) <= NAMES else None}
            for key, names in got.items()} or None


def _shown(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def changed(saved: dict[str, Any] | None, now: dict[str, Any] | None) -> tuple[str, str] | None:
    """(the key, what changed in its set's files: the files gone, those added) between a checkpoint's listing and
    the sets as they are now; None where nothing did, or where the checkpoint keeps none (an earlier gems's)."""
    if not saved:
        return None
    now = now or {}
    for key, then in sorted(saved.items()):
        cur = now.get(key)
        if cur is None:
            return key, f"{key} named {then.get('count')} file(s) then and names none now"
        if cur.get("digest") == then.get("digest"):
            continue
        if then.get("names") is None or cur.get("names") is None:
            return key, f"its listing differs ({then.get('count')} file(s) then, {cur.get('count')} now)"
        gone = sorted(set(then["names"]) - set(cur["names"]))
        added = sorted(set(cur["names"]) - set(then["names"]))
        parts = ([f"{len(gone)} file(s) gone ({_shown(gone)})"] if gone else []) + (
            [f"{len(added)} added ({_shown(added)})"] if added else [])
        return key, "; ".join(parts) or "its files are listed in another order"
    return None


def check_files(cfg: Any, meta: dict[str, Any], where: Any, how: str) -> None:
    """The data sets of ``cfg`` as the checkpoint's run (its ``meta``, in ``where``) trained on them, else bad input
    naming what changed (``how``: the way to go on anyway, or to start over)."""
    got = changed(meta.get("files"), listing(cfg))
    if got is None:
        return
    key, what = got
    raise ConfigError(key, (meta.get("files") or {}).get(key, {}).get("path"), f"the files the run of the checkpoint "
                      f"{where} trained on, to go on from it; since then {what} ({how})")
