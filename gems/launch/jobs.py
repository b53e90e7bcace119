"""A Slurm job as gems keeps it: the submitted job (:class:`SlurmRun`), how it ended (:class:`Outcome`),
what its tasks returned (submitit's result files), and the one way gems runs Slurm's commands.

Admission, submission, the watcher and the diagnosis (:mod:`gems.launch.admission`, :mod:`~gems.launch.slurm`,
:mod:`~gems.launch.watch`, :mod:`~gems.launch.diagnose`) all speak of jobs in these terms.
"""
from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

# Slurm job states after which a job never runs again (squeue/scontrol/sacct spellings).
FINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED",
})


def slurm_command(cmd: list[str], timeout: float = 30.0, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run one of Slurm's commands (sinfo, sbatch, squeue, sacct, scontrol, scancel), its output as text."""
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)


def first_line(text: str) -> str:
    """The last non-blank line of a tool's message (where Slurm's commands say what went wrong)."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no message"


@dataclass
class SlurmRun:
    """One submitted job and what the waiter has learnt about it."""

    cfg: DictConfig
    job: Any  # submitit.slurm.slurm.SlurmJob
    job_dir: Path
    submitted_at: float
    timeout_s: float
    state: str = "PENDING"
    detail: str = ""  # pending reason or node list
    seen: bool = False  # squeue has listed it at least once
    ran: bool = False  # squeue has listed it RUNNING at least once
    ran_on: str = ""  # the nodes squeue last listed it running on (Slurm's node list form)
    #: when squeue first listed it running since it last waited in the queue (a requeue starts it again): the
    #: launcher's wait clock (cluster.timeout_min) counts from here, never from submission
    started_at: float | None = None
    ended_at: float | None = None
    error_seen_at: float | None = None
    #: the jobs this run was before it was submitted again (gems.launch.resubmit): each one's id, the nodes it left
    #: out and why
    resubmitted: list[dict[str, Any]] = field(default_factory=list)

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def run_id(self) -> str:
        return str(self.cfg.run_id)

    @property
    def num_tasks(self) -> int:
        from gems.config import job_tasks

        return job_tasks(self.cfg.cluster)

    @property
    def record_path(self) -> Path:
        return Path(self.cfg.results.dir) / f"{self.cfg.run_id}.json"


@dataclass
class Outcome:
    """How a job ended. ``ok`` only when Slurm says COMPLETED (or no longer knows) and every task returned."""

    run_id: str
    job_id: str
    ok: bool
    state: str
    error: str | None
    results: list[Any] = field(default_factory=list)  # each task's return value, None where it gave none
    record_path: Path | None = None
    job_dir: Path | None = None
    elapsed_s: float = 0.0
    failure: dict[str, Any] | None = None  # the cause, as gems.fault.reports.explain tells it


def task_outcomes(run: SlurmRun) -> list[tuple[str, Any] | None]:
    """Each task's ("success"|"error", value) from submitit's result pickles; None where absent."""
    from submitit.core import utils

    out: list[tuple[str, Any] | None] = []
    for t in range(run.num_tasks):
        path = utils.JobPaths(run.job_dir, job_id=run.job_id, task_id=t).result_pickle
        if not path.exists():
            out.append(None)
            continue
        try:
            out.append(utils.pickle_load(path))
        except Exception as e:  # a half-written or unreadable pickle is no result
            out.append(("error", f"unreadable result {path}: {e}"))
    return out


__all__ = ["FINAL_STATES", "SlurmRun", "Outcome", "task_outcomes", "slurm_command", "first_line"]
