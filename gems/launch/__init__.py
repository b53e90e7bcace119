"""Launchers: ranks as local processes (:mod:`~gems.launch.local`) or Slurm jobs through submitit
(:mod:`~gems.launch.slurm`), behind one interface (:mod:`~gems.launch.base`), and sbatch scripts for submitting by
hand (:mod:`~gems.launch.render`). Here: :func:`cancel_on_signals`, which every launcher uses.
"""
from __future__ import annotations

import contextlib
import signal
from typing import Any, Iterator

from gems.errors import Cancelled

#: whether this process is the ``gems`` command itself (``gems.cli.main`` given no arguments of a caller's): only
#: then may it fork itself as its ranks' server (gems/launch/forkserver.py), never a program calling ``main``
COMMAND_LINE = False


@contextlib.contextmanager
def cancel_on_signals() -> Iterator[None]:
    """While inside, SIGINT, SIGTERM and SIGHUP (a lost terminal) raise :class:`~gems.errors.Cancelled` in the
    main thread, so a launcher ends what it started, whatever signal ends it."""
    def raise_cancelled(signum: int, frame: Any) -> None:
        raise Cancelled(signum)

    old: dict[signal.Signals, Any] = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            old[sig] = signal.signal(sig, raise_cancelled)
    except ValueError:  # not the main thread: the caller handles signals
        pass
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
