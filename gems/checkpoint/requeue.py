"""The time-limit and requeue protocol: Slurm sends ``SIGUSR2`` ``cluster.signal_margin_s`` before a job's time
limit (``--signal=USR2@margin``), or a preemption notice; :func:`install_time_limit_handler` turns it into a request
(:func:`stop_requested`) that the worker's per-step sync shares with every rank, so all of them save after the same
step, and rank 0 requeues the job (:func:`request_requeue`; ``SLURM_RESTART_COUNT`` counts the restarts, the local
launcher's ``GEMS_RESTART_COUNT``). A rank stopped to be resumed exits :data:`PREEMPTED_EXIT` (EX_TEMPFAIL).
"""
from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

PREEMPTED_EXIT = 75
_STOP: dict[str, Any] = {"requested": False, "signal": None}


def restart_count() -> int:
    for key in ("SLURM_RESTART_COUNT", "GEMS_RESTART_COUNT"):
        val = os.environ.get(key)
        if val:
            return int(val)
    return 0


def request_requeue() -> bool:
    """Ask Slurm to requeue this job (it restarts with SLURM_RESTART_COUNT + 1). False off Slurm."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    return out.returncode == 0


def install_time_limit_handler(sig: int = signal.SIGUSR2) -> None:
    """``sig`` (Slurm's warning before the time limit, or a preemption notice) asks for a checkpoint."""

    def handler(signum: int, frame: Any) -> None:
        _STOP["requested"], _STOP["signal"] = True, signum

    signal.signal(sig, handler)


def stop_requested() -> bool:
    return bool(_STOP["requested"])


def clear_stop() -> None:
    _STOP["requested"], _STOP["signal"] = False, None
