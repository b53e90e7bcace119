"""Checkpoint and resume, so that a preempted, timed-out or requeued job continues where it stopped.

A Slurm job can be preempted or requeued at any time; ``fault.preempt_at_step``
does it on purpose, and a job's time limit does it for certain: gems asks
Slurm for ``SIGUSR2`` ``cluster.signal_margin_s`` before the limit
(``--signal=USR2@margin``); :func:`install_time_limit_handler` turns it into a
request that the worker's per-step sync shares with every rank, so all of
them save after the same step, and rank 0 requeues the job.

The model and optimizer state of a pipeline position is the same on every
copy of it (data-parallel replicas and spatial parts hold identical weights and
optimizer state, their gradients summed), so one copy writes it: the rank of
replica 0 and spatial part 0 of each pipeline position saves its partitions'
parameters and buffers, their optimizer state and ``train.ema``'s average to
``<job dir>/ckpt/step<N>/state-d<position>.pt`` (:func:`share_of`; at R = 256,
D = 8 eight files where every rank used to write one). Every rank saves what
is its own, the run's history (per-step losses, step times, time breakdown), to
``rank<k>.pt``. Both atomically; once every rank has saved, rank 0 points
``latest`` at the step and removes the older one. A resumed rank reads its own
history and its position's state.
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
from dataclasses import dataclass
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
#: the history entry that is model state (train.ema's average: gems.rank.optim.WeightAverage): saved with it
MODEL_HISTORY = ("weight_average",)


@dataclass(frozen=True)
class Share:
    """Where a rank's model and optimizer state is kept (``state-<name>.pt``) and whether this rank writes it."""

    name: str
    writes: bool


def share_of(mesh: Any, rank: int) -> Share:
    """One copy of each pipeline position writes its state: replica 0, spatial part 0 (:mod:`gems.checkpoint`)."""
    c = mesh.coord(rank)
    return Share(f"d{c.pipeline}", c.replica == 0 and c.spatial == 0)


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


def _write(obj: Any, path: Path) -> None:
    tmp = path.parent / f".{path.name}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def save(cfg: Any, rank: int, step: int, modules: list[torch.nn.Module], opt: torch.optim.Optimizer,
         history: dict[str, Any], share: Share = Share("d0", True)) -> None:
    """Every rank saves its history before ``step``, one copy of each position its model and optimizer state
    (``share``); rank 0 marks the step complete after a barrier."""
    import torch.distributed as dist

    root = ckpt_dir(cfg)
    d = root / f"step{step:08d}"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(root, 0o700)
    own = {k: v for k, v in history.items() if k not in MODEL_HISTORY}
    _write({"step": step, "history": own, "fingerprint": fingerprint(cfg)}, d / f"rank{rank}.pt")
    if share.writes:
        _write({"step": step, "modules": [m.state_dict() for m in modules], "opt": opt.state_dict(),
                "history": {k: history[k] for k in MODEL_HISTORY if k in history}}, d / f"state-{share.name}.pt")
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


def load(cfg: Any, rank: int, modules: list[torch.nn.Module], opt: torch.optim.Optimizer,
         share: Share = Share("d0", True)) -> tuple[int, dict[str, Any]] | None:
    """Restore this rank's history and its position's model and optimizer state from the last complete
    checkpoint, if there is one."""
    root = ckpt_dir(cfg)
    if not (root / "latest").exists():
        return None
    check_fingerprint(cfg, root)
    step = int((root / "latest").read_text())
    d = root / f"step{step:08d}"
    own = torch.load(d / f"rank{rank}.pt", map_location="cpu", weights_only=False)
    state = torch.load(d / f"state-{share.name}.pt", map_location="cpu", weights_only=False)
    for got, what in ((own, f"rank {rank}'s"), (state, f"state-{share.name}")):
        if int(got["step"]) != step:
            raise RuntimeError(f"checkpoint {what} is at step {got['step']}, the run's at {step}")
    for m, sd in zip(modules, state["modules"]):
        m.load_state_dict(sd)
    opt.load_state_dict(state["opt"])
    return step, {**own["history"], **state["history"]}


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
