"""Checkpoint and resume, so that a preempted, timed-out or requeued job continues where it stopped.

A Slurm job can be preempted or requeued at any time; ``fault.preempt_at_step``
does it on purpose, and a job's time limit does it for certain: gems asks
Slurm for ``SIGUSR2`` ``cluster.signal_margin_s`` before the limit
(``--signal=USR2@margin``); :func:`install_time_limit_handler` turns it into a
request that the worker's per-step sync shares with every rank, so all of
them save after the same step, and rank 0 requeues the job.

Each rank saves what it alone holds (its partitions' parameters, their
optimizer state) plus the run's history (per-step losses, step times, time
breakdown) to ``<job dir>/ckpt/step<N>/rank<k>.pt``, atomically; once every
rank has saved, rank 0 points ``latest`` at it and removes the older step.
A crash while saving therefore leaves the previous checkpoint whole. The
configuration that shapes the saved state (model, mesh, batch, schedule,
optimizer, precision, seed) is saved beside it (``fingerprint.json``), and a
run whose configuration differs is refused with the key that differs,
instead of loading state that does not fit it. Data and dropout masks are
pure functions of (seed, step, sample), so a resumed run computes exactly
the losses of an uninterrupted one.

The launchers restart a preempted job: Slurm requeues it (``scontrol
requeue``; ``SLURM_RESTART_COUNT`` counts), the local launcher starts the
ranks again with ``GEMS_RESTART_COUNT`` set. Exit status 75 (EX_TEMPFAIL)
tells the local launcher that a rank stopped to be resumed.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import torch

from gems.errors import ConfigError

PREEMPTED_EXIT = 75
#: the keys whose values shape a checkpoint's state or the losses it continues
FINGERPRINT_KEYS = (
    "model", "parallel.replicas", "parallel.pipeline", "parallel.spatial", "parallel.spatial_dims",
    "parallel.schedule", "parallel.micro_batches", "parallel.gems_replicas", "parallel.balance",
    "parallel.balance_by", "parallel.virtual_stages", "train.batch_size", "train.optimizer",
    "train.precision", "train.seed", "data.name", "data.num_samples",
)

_STOP: dict[str, Any] = {"requested": False, "signal": None}


def restart_count() -> int:
    for key in ("SLURM_RESTART_COUNT", "GEMS_RESTART_COUNT"):
        val = os.environ.get(key)
        if val:
            return int(val)
    return 0


def ckpt_dir(cfg: Any) -> Path:
    from gems.results.record import job_dir

    return job_dir(cfg) / "ckpt"


def fingerprint(cfg: Any) -> dict[str, Any]:
    """The values of :data:`FINGERPRINT_KEYS` (flattened, resolved) in ``cfg``."""
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}
    for key in FINGERPRINT_KEYS:
        val = OmegaConf.select(cfg, key, default=None)
        if OmegaConf.is_config(val):
            val = OmegaConf.to_container(val, resolve=True)
        if isinstance(val, dict):
            for k, v in sorted(val.items()):
                out[f"{key}.{k}"] = v
        else:
            out[key] = val
    return json.loads(json.dumps(out))  # tuples -> lists: compares equal to what was saved


def check_fingerprint(cfg: Any, where: Path | None = None) -> None:
    """ConfigError naming the first key in which ``cfg`` differs from the checkpoint in ``where``."""
    d = where if where is not None else ckpt_dir(cfg)
    path = d / "fingerprint.json"
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return
    now = fingerprint(cfg)
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            raise ConfigError(key, now.get(key), f"{saved.get(key)} (the value the checkpoint in {d} was saved "
                              "with; a run resumes only with the configuration it started with, or give a new run_id)")


def has_checkpoint(cfg: Any) -> bool:
    return (ckpt_dir(cfg) / "latest").is_file()


def save(cfg: Any, rank: int, step: int, modules: list[torch.nn.Module], opt: torch.optim.Optimizer,
         history: dict[str, Any]) -> None:
    """Every rank saves its state before ``step``; rank 0 marks it complete after a barrier."""
    import torch.distributed as dist

    root = ckpt_dir(cfg)
    d = root / f"step{step:08d}"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(root, 0o700)
    state = {"step": step, "modules": [m.state_dict() for m in modules], "opt": opt.state_dict(),
             "history": history, "fingerprint": fingerprint(cfg)}
    tmp = d / f".rank{rank}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, d / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        fp = root / ".fingerprint.json.tmp"
        fp.write_text(json.dumps(fingerprint(cfg), indent=1))
        os.replace(fp, root / "fingerprint.json")
        tmp_latest = root / ".latest.tmp"
        tmp_latest.write_text(str(step))
        os.replace(tmp_latest, root / "latest")
        for old in root.glob("step*"):  # the new one is complete: the older ones are not needed
            if old.is_dir() and old != d:
                shutil.rmtree(old, ignore_errors=True)


def load(cfg: Any, rank: int, modules: list[torch.nn.Module], opt: torch.optim.Optimizer) -> tuple[int, dict[str, Any]] | None:
    """Restore this rank's state from the last complete checkpoint, if there is one."""
    root = ckpt_dir(cfg)
    if not (root / "latest").exists():
        return None
    check_fingerprint(cfg, root)
    step = int((root / "latest").read_text())
    state = torch.load(root / f"step{step:08d}" / f"rank{rank}.pt", map_location="cpu", weights_only=False)
    if int(state["step"]) != step:
        raise RuntimeError(f"checkpoint of rank {rank} is at step {state['step']}, the run's at {step}")
    for m, sd in zip(modules, state["modules"]):
        m.load_state_dict(sd)
    opt.load_state_dict(state["opt"])
    return step, state["history"]


def request_requeue() -> bool:
    """Ask Slurm to requeue this job (it restarts with SLURM_RESTART_COUNT + 1). False off Slurm."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    return out.returncode == 0


# ---- the time limit ------------------------------------------------------------------------------------------
def install_time_limit_handler(sig: int = signal.SIGUSR2) -> None:
    """``sig`` (Slurm's warning before the time limit, or a preemption notice) asks for a checkpoint."""

    def handler(signum: int, frame: Any) -> None:
        _STOP["requested"], _STOP["signal"] = True, signum

    signal.signal(sig, handler)


def stop_requested() -> bool:
    return bool(_STOP["requested"])


def clear_stop() -> None:
    _STOP["requested"], _STOP["signal"] = False, None
