"""A Slurm job submitted again as it was, without some nodes: the one way gems resubmits a job (:func:`resubmit`), by a
policy the waiter takes (``gems.launch.watch.wait(retry=...)``); :func:`retry_bad_nodes` is the policy of
``cluster.exclude_bad_nodes=true``, a job a node's health check stopped gone once more without the nodes that failed.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from gems.config import to_yaml
from gems.launch.jobs import Outcome, SlurmRun, first_line
from gems.launch.options import default_job_dir
from gems.launch.slurm import make_executor
from gems.results import record as rec
from gems.telemetry.health import failure_of

#: what a job's own folder holds of one attempt, set aside when it is submitted again
_ATTEMPT = ("failures", "nodes", "requeued.json")


def resubmit(run: SlurmRun, nodes: Sequence[str], why: str) -> SlurmRun:
    """Submit ``run``'s job again (its function, its configuration) without ``nodes``, and make ``run`` that job:
    the waiter then waits for it as for any job. ``why``: what was found, for ``cluster.resubmitted``. Raises what
    sbatch raises where Slurm refuses it (too few nodes left). The job keeps its run id, record path and folder (a
    checkpoint there resumes it); the nodes join ``cluster.exclude`` (sbatch ``--exclude``); the first job's failure
    reports and bad-node files are set aside (``failures.job<ID>``, ``nodes.job<ID>``) so the new job's own are
    read."""
    old = run.job_id
    cfg = OmegaConf.create(OmegaConf.to_container(run.cfg, resolve=True))
    assert isinstance(cfg, DictConfig)
    left_out = sorted({*[str(n) for n in cfg.cluster.get("exclude") or []], *[str(n) for n in nodes]})
    with open_dict(cfg):
        cfg.cluster.exclude = left_out
        cfg.cluster.resubmitted = f"Slurm job {old} failed: {why}; submitted again without {', '.join(nodes)}"
    folder = default_job_dir(cfg)
    _set_aside(folder, old)
    rec.private_dir(folder)
    (folder / "config.yaml").write_text(to_yaml(cfg))
    fn = run.job.submission().function
    job = make_executor(cfg, folder).submit(fn, to_yaml(cfg))
    run.resubmitted.append({"slurm_job_id": old, "excluded": list(nodes), "why": why})
    run.cfg, run.job, run.job_dir, run.submitted_at = cfg, job, folder, time.time()
    run.state, run.detail, run.seen, run.ran = "PENDING", "", False, False
    run.started_at = run.ended_at = run.error_seen_at = None
    return run


def _set_aside(folder: Path, job_id: str) -> None:
    for name in _ATTEMPT:
        if (folder / name).is_dir():
            (folder / name).rename(folder / f"{name}.job{job_id}")


def retry_bad_nodes(run: SlurmRun, out: Outcome) -> bool:
    """The waiter's policy for ``cluster.exclude_bad_nodes=true``: a job a node's failed health check stopped is
    submitted once more without the nodes that failed (True: ``run`` is the new job). Where Slurm refuses it, the
    outcome's error says so and the job stays failed."""
    if out.ok or out.state == "LEFT" or run.resubmitted or not bool(run.cfg.cluster.get("exclude_bad_nodes")):
        return False
    bad = failure_of(default_job_dir(run.cfg))
    if bad is None:
        return False
    error, failure = bad
    old, nodes = run.job_id, list(failure["nodes"])
    try:
        resubmit(run, nodes, error)
    except Exception as e:  # sbatch refused (no nodes left that fit), or the controller went away
        out.error = f"{out.error}; not submitted again without {', '.join(nodes)}: {first_line(str(e))}"
        return False
    print(f"gems: {run.run_id}: Slurm job {old}: {error}; submitted again without {', '.join(nodes)} as job "
          f"{run.job_id} (cluster.exclude_bad_nodes=true)", file=sys.stderr, flush=True)
    return True


__all__ = ["resubmit", "retry_bad_nodes"]
