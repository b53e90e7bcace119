"""Worker processes that end with the process that started them: the pools of ``gems data convert`` and ``gems
data check`` (gems.data.convert) and the mesh search's tracing (gems.plan.search) start theirs here."""
from __future__ import annotations

import os


def die_with_parent(parent: int | None) -> None:
    """A worker process ends when the process that started it does, however that one ends (the out-of-memory
    killer's SIGKILL too, which leaves a pool's workers waiting on their queue forever): Linux's parent-death
    signal, then a look at whether the parent went before it was set. Elsewhere nothing (the pool's own pipes end
    the workers of a parent that exits)."""
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:  # the parent went between the fork and the line above
        os._exit(1)


def start_worker(parent: int | None = None) -> None:
    """A pool worker's start: it dies with ``parent`` (:func:`die_with_parent`) and computes on one thread (the
    pool has one worker a core)."""
    import torch

    die_with_parent(parent)
    torch.set_num_threads(1)


__all__ = ["die_with_parent", "start_worker"]
