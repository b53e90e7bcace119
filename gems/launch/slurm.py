"""``cluster.launcher=slurm``: gems jobs submitted to Slurm through submitit, waited for, and their records kept
(:class:`SlurmLauncher`, behind :class:`gems.launch.base.Launcher`). Around submission (:func:`submit_all`) stand the
sbatch options (gems.launch.options), the check that Slurm would take every job (gems.launch.admission), the watch
to their end (gems.launch.watch) and why one failed (gems.launch.diagnose).
"""
from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

from omegaconf import DictConfig

from gems.config import idle_gpus, job_tasks, section, to_yaml
from gems.launch.admission import check_reachable, preflight, refusal
from gems.launch.jobs import Outcome, SlurmRun, first_line
from gems.launch.options import default_job_dir, job_config, python_command, sbatch_parameters
from gems.launch.watch import wait
from gems.results import record as rec

RankFn = Callable[[str], Any]


def _default_fn() -> RankFn:
    from gems.worker import run_rank

    return run_rank


def make_executor(cfg: DictConfig, job_dir: Path) -> Any:
    """submitit's ``SlurmExecutor`` for ``cfg``, its pickles and logs in ``job_dir``."""
    from submitit import SlurmExecutor

    ex = SlurmExecutor(folder=job_dir, python=python_command(cfg), max_num_timeout=3)
    ex.update_parameters(**sbatch_parameters(cfg))
    return ex


def submit(cfg: DictConfig, job_dir: Path | str | None = None, fn: RankFn | None = None,
           check: bool = True) -> SlurmRun:
    """Submit one job running ``fn(cfg_yaml)`` (default ``gems.worker.run_rank``) on every task."""
    return submit_all([cfg], [job_dir] if job_dir is not None else None, fn=fn, check=check)[0]


def submit_all(cfgs: Sequence[DictConfig], job_dirs: Sequence[Path | str] | None = None,
               fn: RankFn | None = None, check: bool = True) -> list[SlurmRun]:
    """Submit a sweep: every configuration is checked with Slurm first, so a bad one submits nothing."""
    if not cfgs:
        return []
    prepared = [job_config(c) for c in cfgs]
    _note_idle_gpus(prepared)
    if job_dirs is not None and len(job_dirs) != len(prepared):
        raise ValueError("job_dirs must give one folder per configuration")
    dirs = [Path(d).resolve() for d in job_dirs] if job_dirs is not None else [default_job_dir(c) for c in prepared]
    if check:
        partitions = check_reachable(prepared[0])
        for c in prepared:
            preflight(c, partitions)
    fn = fn or _default_fn()
    runs: list[SlurmRun | None] = [None] * len(prepared)
    for c, d in zip(prepared, dirs):
        rec.private_dir(d)
        (d / "config.yaml").write_text(to_yaml(c))
    # jobs of one shape (the same sbatch request) go out as one job array: one sbatch call, one queue entry
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(prepared):
        key = repr(sorted((k, str(v)) for k, v in sbatch_parameters(c).items() if k != "job_name"))
        groups.setdefault(key if job_dirs is None and section(c, "cluster").arrays else f"{i}", []).append(i)
    for members in groups.values():
        first = prepared[members[0]]
        if len(members) == 1:
            folder = dirs[members[0]]
        else:
            folder = rec.private_dir(Path(first.results.dir).resolve() / ".jobs" / f"array-{uuid.uuid4().hex[:8]}")
        ex = make_executor(first, folder)
        if len(members) > 1:
            ex.update_parameters(job_name=str(section(first, "results").sweep or "gems"))
        try:
            if len(members) == 1:
                jobs = [ex.submit(fn, to_yaml(first))]
            else:
                with ex.batch():
                    pending = [ex.submit(fn, to_yaml(prepared[i])) for i in members]
                jobs = list(pending)
        except Exception as e:  # sbatch refused after preflight, or the controller went away
            msg = first_line(str(e))
            done = [r for r in runs if r is not None]
            if done:
                raise RuntimeError(f"sbatch failed after {len(done)} job(s) were submitted "
                                   f"({', '.join(r.job_id for r in done)}): {msg}") from e
            raise refusal(first, msg) from None
        for i, job in zip(members, jobs):
            runs[i] = SlurmRun(prepared[i], job, folder, time.time(), section(prepared[i], "cluster").wait_s())
    return [r for r in runs if r is not None]


def _note_idle_gpus(cfgs: Sequence[DictConfig]) -> None:
    """Say where a job leaves GPUs idle (gems.config.place: its last node partly used)."""
    for c in cfgs:
        idle = idle_gpus(c.cluster)
        if idle:
            print(f"gems: note: {c.run_id}: {job_tasks(c.cluster)} rank(s) on {c.cluster.nodes} node(s) of "
                  f"{c.cluster.gpus_per_node} GPUs leave {idle} GPU(s) idle (the last node partly used)",
                  file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the record
def record_of(run: SlurmRun, outcome: Outcome) -> dict[str, Any]:
    """The results record of a finished job; a failed one is written when the job left none."""
    if outcome.record_path is not None:
        return rec.read_record(outcome.record_path)
    if outcome.state == "LEFT":  # the job goes on and writes its own record: nothing is written for it here
        left = rec.failed_record(run.cfg, f"slurm job {outcome.job_id}: {outcome.error}",
                                 failure={"kind": "left_running", "slurm_job_id": outcome.job_id})
        left["env"]["slurm_job_id"] = outcome.job_id
        return left
    error = outcome.error or f"job {outcome.job_id} ended {outcome.state} without writing its record"
    record = rec.failed_record(run.cfg, f"slurm job {outcome.job_id}: {error}", failure=outcome.failure)
    record["logs"] = str(run.job_dir)
    record["env"]["slurm_job_id"] = outcome.job_id
    if rec.find_record(run.record_path) is None:
        rec.write_record(run.record_path, record)
    return record


def launch(cfg: DictConfig, on_progress: Callable[[str], None] | None = None, progress: bool = True) -> dict[str, Any]:
    """Submit ``cfg`` to Slurm, wait, and return its record (status ok or failed), like gems.launch.local."""
    return launch_all([cfg], on_progress=on_progress, progress=progress)[0]


def launch_all(cfgs: Sequence[DictConfig], on_progress: Callable[[str], None] | None = None,
               progress: bool = True) -> list[dict[str, Any]]:
    """A sweep on Slurm: submit every job (nothing when one is bad), wait for all, return their records; a job a
    node's health check stopped goes once more without that node where ``cluster.exclude_bad_nodes`` says so."""
    runs = submit_all(cfgs)

    def report(rs: Sequence[SlurmRun], done: dict[str, Outcome]) -> None:
        if on_progress is not None:
            states = ", ".join(f"{r.job_id}:{(done[r.job_id].state if r.job_id in done else r.state).lower()}" for r in rs)
            on_progress(f"{len(done)}/{len(rs)} done ({states})")

    from gems.launch.resubmit import retry_bad_nodes

    outcomes = wait(runs, progress=progress, on_update=report, retry=retry_bad_nodes)
    return [record_of(r, o) for r, o in zip(runs, outcomes)]


class SlurmLauncher:
    """:class:`~gems.launch.base.Launcher` on Slurm: one job submitted, watched with its own live table."""

    shows_progress = True

    def launch(self, cfg: DictConfig, on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        return launch(cfg, on_progress=on_progress)


__all__ = ["SlurmLauncher", "make_executor", "submit", "submit_all", "launch", "launch_all", "record_of"]
