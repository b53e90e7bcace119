"""The launcher interface: a configuration's job run to its end, on this machine or on Slurm.

A :class:`Launcher` (as submitit's executors, local and Slurm behind one interface) runs one job and
returns its results record; :func:`launcher_for` picks :class:`~gems.launch.local.LocalLauncher` or
:class:`~gems.launch.slurm.SlurmLauncher` from ``cluster.launcher``.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from omegaconf import DictConfig

from gems.launch.local import LocalLauncher, forks_ranks
from gems.launch.slurm import SlurmLauncher


class Launcher(Protocol):
    """Runs one configuration's job to its end."""

    @property
    def shows_progress(self) -> bool:
        """True when the launcher draws its own progress (Slurm's live table of jobs); False when it passes
        rank 0's step lines to ``on_progress`` for the caller to show."""

    def launch(self, cfg: DictConfig, on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Run ``cfg``'s job and return its record (status ok or failed); never hangs, never leaves ranks behind."""


def launcher_for(cfg: DictConfig) -> Launcher:
    """The launcher ``cluster.launcher`` names: ``slurm``, else ranks as local processes."""
    return SlurmLauncher() if cfg.cluster.launcher == "slurm" else LocalLauncher()


def prestart(cfg: DictConfig) -> None:
    """Before a command's checks run any torch operation: where ``cfg``'s ranks will be forked on this machine,
    fork the server that forks them now, sharing this process's import of torch (gems/launch/forkserver.py). Only
    in the ``gems`` command's own process (``gems.launch.COMMAND_LINE``): a program calling ``gems.cli.main`` has
    run torch already and keeps multiprocessing's server."""
    import gems.launch

    if gems.launch.COMMAND_LINE and isinstance(launcher_for(cfg), LocalLauncher) and forks_ranks(cfg):
        from gems.launch.forkserver import prestart as fork_server

        fork_server()


__all__ = ["Launcher", "launcher_for", "prestart"]
