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
    """Run the job on this machine; return its record (status ok or failed)."""
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
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    if cfg.comm.backend == "mpi":
        log = jd / "mpiexec.log"
        logs.append(log)
        mpi_cmd = [mpiexec_path(), "-n", str(world), *cmd]
        procs.append(subprocess.Popen(mpi_cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
    else:
        port = free_port()
        for r in range(world):
            log = jd / f"rank{r}.log"
            logs.append(log)
            e = dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            procs.append(subprocess.Popen(cmd, env=e, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                          start_new_session=True))
    failed: tuple[int, int] | None = None
    deadline = time.monotonic() + 60 * float(cfg.cluster.get("timeout_min") or (cfg.cluster.time_min + 5))
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad and failed is None:
                failed = bad[0]
                grace = time.monotonic() + 5.0
                while time.monotonic() < grace and any(p.poll() is None for p in procs):
                    time.sleep(0.1)
                break
            if all(c == 0 for c in codes):
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
