"""The results record: one JSON file per run, written atomically by rank 0.

The fields are the public interface (INTERFACE.md, "The results record");
``SCHEMA`` is bumped when a field changes meaning. ``write_record`` writes
a temporary file beside the target and renames it into place, so a reader
never sees half a record and an existing record is never overwritten.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from gems.paths import write_result_json
from gems.storage import StorageFailed, fallback_dirs, with_fallback, writing

SCHEMA = "gems.record/1"

REQUIRED = (
    "schema", "run_id", "name", "sweep", "status", "config", "world_size", "nodes", "mesh", "schedule",
    "global_batch", "steps", "throughput_samples_per_s", "step_time_s", "time_breakdown_s",
    "peak_memory_bytes", "loss", "restarts", "env",
)
BREAKDOWN_KEYS = ("compute", "pipeline_comm", "halo", "allreduce", "bubble_or_wait", "data")


def new_run_id(name: str) -> str:
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"


def default_name(cfg: Any) -> str:
    if cfg.results.name:
        return str(cfg.results.name)
    p = cfg.parallel
    sp = p.spatial if isinstance(p.spatial, int) else "x".join(str(s) for s in p.spatial)
    size = cfg.model.size
    model = cfg.model.name if not size or getattr(cfg.model, "input_shape", None) else f"{cfg.model.name}{size}"
    return f"{model}-R{p.replicas}D{p.pipeline}S{sp}-{p.schedule}"


def record_path(cfg: Any) -> Path:
    return Path(cfg.results.dir) / f"{cfg.run_id}.json"


def job_dir(cfg: Any) -> Path:
    """A run's own folder: its resolved configuration, rank logs, failure reports and checkpoints
    (``{results.dir}/.jobs/{run_id}``; every launcher and the worker use this one place)."""
    return Path(cfg.results.dir) / ".jobs" / str(cfg.run_id or "gems")


def make_job_dir(cfg: Any) -> Path:
    """Create the run's folder readable by its owner alone: logs and checkpoints can hold data, paths and
    environment; records stay readable beside them."""
    return private_dir(job_dir(cfg))


def private_dir(d: Path | str) -> Path:
    """``d`` created with mode 0700 (and ``.jobs`` above it, where it is one); existing folders are kept."""
    d = Path(d)
    if d.parent.name == ".jobs":
        d.parent.parent.mkdir(parents=True, exist_ok=True)
        d.parent.mkdir(exist_ok=True, mode=0o700)
    else:
        d.parent.mkdir(parents=True, exist_ok=True)
    d.mkdir(exist_ok=True, mode=0o700)
    return d


def git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def env_info(world: Any = None, hosts: list[str] | None = None, machines: list[str] | None = None) -> dict[str, Any]:
    import torch

    from gems.bootstrap import sharing_gpu

    gpu = None
    if world is not None and getattr(world, "device", None) is not None and world.device.type == "cuda":
        gpu = torch.cuda.get_device_name(world.device)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "backend": None if world is None else (world.backend + ("+mpi" if world.grad_comm == "mpi" else "")),
        "device": None if world is None else world.device.type,
        "gpu_name": gpu,
        "cpu": platform.processor() or platform.machine(),
        "hostnames": sorted(set(hosts or [platform.node()])),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "launcher": None if world is None else world.source,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        # the most ranks on one physical machine (several slurmd "nodes" of one host share its cores)
        "ranks_sharing_cpus": max(Counter(machines).values()) if machines else None,
        "git_commit": git_commit(),
        # the test aid GEMS_TEST_SHARE_GPU (gems.bootstrap.sharing_gpu): ranks shared a GPU, timings mean nothing
        **({"test_shared_gpu": True} if sharing_gpu() else {}),
    }


def build_record(cfg: Any, world: Any, mesh: Any, *, losses: list[float], step_times: list[float],
                 global_batch: int, breakdown: dict[str, float], peaks: list[int], hosts: list[str],
                 wall_s: float, restarts: int = 0, tensor_peaks: list[int] | None = None,
                 balance: list[int] | None = None, machines: list[str] | None = None) -> dict[str, Any]:
    from omegaconf import OmegaConf

    median = statistics.median(step_times) if step_times else float("nan")
    return {
        "schema": SCHEMA,
        "run_id": cfg.run_id,
        "name": default_name(cfg),
        "sweep": cfg.results.sweep,
        "point": cfg.results.point,
        "repeat": int(cfg.results.repeat or 0),
        "status": "ok",
        "config": OmegaConf.to_container(cfg, resolve=True),
        "world_size": world.size,
        "nodes": len(set(hosts)),
        "mesh": {"replicas": mesh.replicas, "pipeline": mesh.pipeline, "spatial": mesh.spatial,
                 "spatial_parts": list(mesh.parts), "spatial_dims": list(mesh.spatial_dims),
                 "balance": balance},  # layers per pipeline partition (a spatial model counts its gather)
        "schedule": cfg.parallel.schedule,
        "global_batch": global_batch,
        "steps": len(losses),
        "warmup_steps": int(cfg.train.warmup_steps),
        "throughput_samples_per_s": global_batch / median if step_times else 0.0,
        "step_time_s": {"median": median, "min": min(step_times, default=float("nan")),
                        "max": max(step_times, default=float("nan")), "all": step_times},
        "time_breakdown_s": {k: float(breakdown.get(k, 0.0)) for k in BREAKDOWN_KEYS},
        "peak_memory_bytes": {"max": max(peaks), "per_rank": peaks,
                              "kind": "cuda_max_allocated" if world.device.type == "cuda" else "rss_growth",
                              **({"tensor_max": max(tensor_peaks), "tensor_per_rank": tensor_peaks}
                                 if tensor_peaks else {})},
        "loss": [float(x) for x in losses],
        "restarts": restarts,
        "wall_s": wall_s,
        "env": env_info(world, hosts, machines),
    }


def failed_record(cfg: Any, error: str, world_size: int | None = None, hosts: list[str] | None = None,
                  failure: dict[str, Any] | None = None, losses: list[float] | None = None,
                  restarts: int = 0) -> dict[str, Any]:
    """The record of a run that failed: ``error`` is the one-line reason, ``failure`` its details
    (``kind``: stall, nonfinite, rank_error, signal, cancelled, timeout, exit; the ranks, step and phase)."""
    from omegaconf import OmegaConf

    from gems.mesh import mesh_from_config

    mesh = mesh_from_config(cfg)
    return {
        "schema": SCHEMA, "run_id": cfg.run_id, "name": default_name(cfg), "sweep": cfg.results.sweep,
        "point": cfg.results.point, "repeat": int(cfg.results.repeat or 0), "status": "failed", "error": error,
        "failure": failure or {"kind": "exit"},
        "config": OmegaConf.to_container(cfg, resolve=True),
        "world_size": world_size or mesh.size, "nodes": len(set(hosts or [])) or int(cfg.cluster.nodes),
        "mesh": {"replicas": mesh.replicas, "pipeline": mesh.pipeline, "spatial": mesh.spatial,
                 "spatial_parts": list(mesh.parts), "spatial_dims": list(mesh.spatial_dims)},
        "schedule": cfg.parallel.schedule, "global_batch": int(cfg.train.batch_size), "steps": len(losses or []),
        "throughput_samples_per_s": None, "step_time_s": None,
        "time_breakdown_s": None, "peak_memory_bytes": None, "loss": [float(x) for x in (losses or [])],
        "restarts": restarts,
        "env": env_info(None, hosts),
    }


def write_record(path: Path | str, record: dict[str, Any]) -> Path:
    """Write ``record`` to ``path`` atomically; never replace an existing record (FileExistsError). Where the storage
    under ``path`` fails (a full disk or quota, a folder removed), the record goes to the fallback folder
    (gems.storage.with_fallback); returns where it went."""
    where, _ = with_fallback(lambda p: write_result_json(p, record, replace=False, allow_nan=True), path,
                             "the run's record")
    return where


def find_record(path: Path | str) -> Path | None:
    """Where the record meant for ``path`` is: there, or in the fallback folder its own could not take it in."""
    path = Path(path)
    return next((p for p in [path, *(d / path.name for d in fallback_dirs())] if p.exists()), None)


def write_steps(record_file: Path | str, record: dict[str, Any]) -> Path | None:
    """The per-step losses and step times as CSV beside the record (``<run_id>.steps.csv``), and as
    TensorBoard scalars in the run's folder (``tb/``) where ``tensorboard`` is installed."""
    import csv

    path = Path(record_file).with_suffix(".steps.csv")
    warm = int(record.get("warmup_steps") or 0)
    st = record.get("step_time_s") or {}
    times = st.get("all") or []
    every = st.get("every")  # every step's time (records before it kept the measured ones only)
    start = int(st.get("measured_from", warm))
    lrs = record.get("lr") or []
    val = {int(v["step"]) - 1: v for v in record.get("validation") or [] if "step" in v}  # evaluated after that step
    try:
        with writing("the per-step CSV", path), open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "loss", "step_time_s", "warmup", "measured", "lr", "val_loss", "val_mae",
                        "val_accuracy"])
            for i, loss in enumerate(record.get("loss") or []):
                if every is not None and i < len(every):
                    t: Any = every[i]
                else:
                    t = times[i - start] if i >= start and i - start < len(times) else ""
                v = val.get(i, {})
                w.writerow([i, repr(float(loss)), t if t == "" else repr(float(t)), int(i < warm), int(i >= start),
                            repr(float(lrs[i])) if i < len(lrs) else "",
                            *(repr(float(v[k])) if k in v else "" for k in ("loss", "mae", "accuracy"))])
    except StorageFailed:
        path.unlink(missing_ok=True)  # no half file: the storage's failure is said by the caller
        raise
    except OSError:
        return None
    try:
        tensorboard(record_file, record, every, times, lrs, start)
    except Exception as e:  # (its scalars are a copy of the CSV's: never the run's end)
        print(f"gems: warning: the TensorBoard scalars were not written: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
    return path


def tensorboard(record_file: Path | str, record: dict[str, Any], every: Any, times: list[Any], lrs: list[Any],
                start: int) -> None:
    """The per-step CSV's figures as TensorBoard scalars in the run's folder (``tb/``), where tensorboard is
    installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
    except ImportError:
        return
    tb = SummaryWriter(log_dir=str(Path(record_file).parent / ".jobs" / str(record.get("run_id")) / "tb"))
    for v in record.get("validation") or []:
        for k in ("loss", "mae", "accuracy"):
            if k in v:
                tb.add_scalar(f"validation/{k}", float(v[k]), int(v["step"]))
    for i, loss in enumerate(record.get("loss") or []):
        tb.add_scalar("loss", float(loss), i)
        if i < len(lrs):
            tb.add_scalar("lr", float(lrs[i]), i)
        if every is not None and i < len(every):
            tb.add_scalar("step_time_s", float(every[i]), i)
        elif i >= start and i - start < len(times):
            tb.add_scalar("step_time_s", float(times[i - start]), i)
    tb.close()


def read_record(path: Path | str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def validate_record(r: dict[str, Any]) -> list[str]:
    """Problems with a record, empty when it is well formed."""
    problems = [f"missing field {k}" for k in REQUIRED if k not in r]
    if r.get("schema") != SCHEMA:
        problems.append(f"schema {r.get('schema')!r} != {SCHEMA!r}")
    if r.get("status") not in ("ok", "failed"):
        problems.append(f"status {r.get('status')!r}")
    if r.get("status") == "failed" and not r.get("error"):
        problems.append("failed record without error")
    if r.get("status") == "ok":
        if len(r.get("loss", [])) != r.get("steps"):
            problems.append("one loss per step expected")
        if set(r.get("time_breakdown_s", {})) != set(BREAKDOWN_KEYS):
            problems.append("time_breakdown_s keys")
        if len(r["peak_memory_bytes"]["per_rank"]) != r["world_size"]:
            problems.append("peak memory per rank")
    return problems
