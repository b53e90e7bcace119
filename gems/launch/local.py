"""``cluster=local``: the ranks as processes on this machine.

Each rank is ``python -m gems.worker --config job/config.yaml`` with
torchrun-style variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), or
the whole world under ``mpiexec`` when ``comm.backend=mpi``. The launcher
watches the processes: when one exits non-zero the others get a short grace
period and are then killed, and the run is recorded as failed with the
failing rank and the last lines it wrote, never left hanging.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig

from gems.errors import ConfigError
from gems.mesh import mesh_from_config
from gems.results import record as rec
from gems.testing import free_port


def job_dir(cfg: DictConfig) -> Path:
    return Path(cfg.results.dir) / ".jobs" / str(cfg.run_id)


def mpiexec_path() -> str:
    for cand in (shutil.which("mpiexec"), str(Path(sys.executable).parent / "mpiexec"), shutil.which("mpirun")):
        if cand and os.path.exists(cand):
            return cand
    raise ConfigError("comm.backend", "mpi", "an MPI launcher on PATH (pip install mpich mpi4py), or comm.backend=gloo")


def tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _last_error_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        s = line.strip()
        if s and not s.startswith(("File ", "^", "~")) and s != "Traceback (most recent call last):":
            return s
    return "no output"


def launch(cfg: DictConfig, on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the job on this machine; return its record (status ok or failed).

    A job whose ranks all stop with exit status 75 was preempted
    (``fault.preempt_at_step``): it is started again with
    ``GEMS_RESTART_COUNT`` set and resumes from its checkpoint, at most
    ``fault.max_restarts`` times.
    """
    from gems.checkpoint import PREEMPTED_EXIT
    from gems.config import to_yaml

    world = mesh_from_config(cfg).size
    jd = job_dir(cfg)
    jd.mkdir(parents=True, exist_ok=True)
    cfg_path = jd / "config.yaml"
    cfg_path.write_text(to_yaml(cfg))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, int(cfg.train.threads or 1))))
    env["PYTHONUNBUFFERED"] = "1"
    cmd = [sys.executable, "-m", "gems.worker", "--config", str(cfg_path)]
    deadline = time.monotonic() + 60 * float(cfg.cluster.get("timeout_min") or (cfg.cluster.time_min + 5))
    max_restarts = int(cfg.fault.get("max_restarts", 3))
    for attempt in range(max_restarts + 1):
        procs, logs = _start(cfg, world, jd, cmd, dict(env, GEMS_RESTART_COUNT=str(attempt)), attempt)
        failed = _watch(procs, logs, deadline, on_progress)
        if failed is None or failed[1] != PREEMPTED_EXIT or attempt == max_restarts:
            break
        if on_progress:
            on_progress(f"preempted; resuming (restart {attempt + 1})")
    path = rec.record_path(cfg)
    if failed is None and path.exists():
        return rec.read_record(path)
    if failed == (-1, -1):
        error = f"timed out after cluster.timeout_min={cfg.cluster.get('timeout_min') or cfg.cluster.time_min + 5} min"
    elif failed is not None:
        i, code = failed
        who = f"rank {i}" if cfg.comm.backend != "mpi" else "an MPI rank"
        sig = f" (signal {-code})" if code < 0 else ""
        error = f"{who} exited with status {code}{sig}: {_last_error_line(tail(logs[i], 40))}"
    else:
        error = "the job ended without writing its record: " + _last_error_line(tail(logs[0], 40))
    record = rec.failed_record(cfg, error)
    record["logs"] = [str(x) for x in logs]
    if not path.exists():
        rec.write_record(path, record)
    return record


def _start(cfg: DictConfig, world: int, jd: Path, cmd: list[str], env: dict[str, str],
           attempt: int) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    suffix = f".restart{attempt}" if attempt else ""
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    if cfg.comm.backend == "mpi":
        log = jd / f"mpiexec{suffix}.log"
        logs.append(log)
        procs.append(subprocess.Popen([mpiexec_path(), "-n", str(world), *cmd], env=env, stdout=open(log, "wb"),
                                      stderr=subprocess.STDOUT, start_new_session=True))
        return procs, logs
    port = free_port()
    for r in range(world):
        log = jd / f"rank{r}{suffix}.log"
        logs.append(log)
        e = dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(cmd, env=e, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs, logs


def _watch(procs: list[subprocess.Popen[bytes]], logs: list[Path], deadline: float,
           on_progress: Callable[[str], None] | None) -> tuple[int, int] | None:
    """Wait for the ranks. None: all done; (rank, status) of the first failure (status 75 for a
    preemption, when every rank stopped so); (-1, -1) past the deadline. Kills what is left."""
    from gems.checkpoint import PREEMPTED_EXIT

    failed: tuple[int, int] | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0, PREEMPTED_EXIT)]
            if bad:
                failed = bad[0]
                grace = time.monotonic() + 5.0
                while time.monotonic() < grace and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                break
            if all(c is not None for c in codes):
                stopped = [i for i, c in enumerate(codes) if c == PREEMPTED_EXIT]
                failed = (stopped[0], PREEMPTED_EXIT) if stopped else None
                break
            if time.monotonic() > deadline:
                failed = (-1, -1)
                break
            if on_progress:
                on_progress(_progress_line(logs[0]))
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except OSError:
                    p.kill()
                p.wait()
    return failed


def _progress_line(log: Path) -> str:
    try:
        with open(log, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 2048))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "starting"
    for line in reversed(lines):
        if line.startswith("gems: step"):
            return line[len("gems: "):]
    return "starting"
