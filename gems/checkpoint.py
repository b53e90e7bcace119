"""Checkpoint and resume, so that a preempted or requeued job continues where it stopped.

A Slurm job can be preempted or requeued at any time; ``fault.preempt_at_step``
does it on purpose. Each rank saves what it alone holds (its partitions'
parameters, their optimizer state) plus the run's history (per-step losses,
step times, time breakdown) to ``<job dir>/ckpt/rank<k>.pt``, atomically; once
every rank has saved, rank 0 writes ``latest`` with the step to resume from.
Data and dropout masks are pure functions of (seed, step, sample), so a
resumed run computes exactly the losses of an uninterrupted one.

The launchers restart a preempted job: Slurm requeues it (``scontrol
requeue``; ``SLURM_RESTART_COUNT`` counts), the local launcher starts the
ranks again with ``GEMS_RESTART_COUNT`` set. Exit status 75 (EX_TEMPFAIL)
tells the local launcher that a rank stopped to be resumed.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import torch

PREEMPTED_EXIT = 75


def restart_count() -> int:
    for key in ("SLURM_RESTART_COUNT", "GEMS_RESTART_COUNT"):
        val = os.environ.get(key)
        if val:
            return int(val)
    return 0


def ckpt_dir(cfg: Any) -> Path:
    return Path(cfg.results.dir) / ".jobs" / str(cfg.run_id) / "ckpt"


def save(cfg: Any, rank: int, step: int, modules: list[torch.nn.Module], opt: torch.optim.Optimizer,
         history: dict[str, Any]) -> None:
    """Every rank saves its state before ``step``; rank 0 marks it complete after a barrier."""
    import torch.distributed as dist

    d = ckpt_dir(cfg)
    d.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "modules": [m.state_dict() for m in modules], "opt": opt.state_dict(), "history": history}
    tmp = d / f".rank{rank}.pt.tmp"
    torch.save(state, tmp)
    os.replace(tmp, d / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        tmp = d / ".latest.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, d / "latest")


def load(cfg: Any, rank: int, modules: list[torch.nn.Module], opt: torch.optim.Optimizer) -> tuple[int, dict[str, Any]] | None:
    """Restore this rank's state from the last complete checkpoint, if there is one."""
    d = ckpt_dir(cfg)
    if not (d / "latest").exists():
        return None
    step = int((d / "latest").read_text())
    state = torch.load(d / f"rank{rank}.pt", map_location="cpu", weights_only=False)
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
