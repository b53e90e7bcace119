"""``cluster=local``: the ranks as processes on this machine, forked from a server that has imported torch once
(gems.launch.forkserver), or the whole world under ``mpiexec`` with ``comm.backend=mpi``.

The launcher watches the processes: when one exits non-zero the others get a short grace and are killed, and the run
is recorded as failed, naming the cause, not the echo (gems.fault.reports.explain). Whatever ends the launcher ends
its ranks: a signal records the run as cancelled; a launcher killed outright leaves each rank's watchdog to end it.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Union

from omegaconf import DictConfig

from gems.bootstrap import free_port
from gems.config import section
from gems.errors import Cancelled, ConfigError
from gems.fault.reports import Exit, explain
from gems.launch import cancel_on_signals
from gems.launch.forkserver import Forked, start_worker
from gems.mesh import mesh_from_config
from gems.results import record as rec
from gems.storage import full_note, writing
from gems.telemetry.health import failure_of
from gems.worker import TEARDOWN_EXIT

GRACE_S = 5.0  # after the first failure, how long the other ranks get to end (and report) by themselves


def job_dir(cfg: DictConfig) -> Path:
    return rec.job_dir(cfg)


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
    return ""


#: a rank's process, as the watch sees it: a subprocess (mpiexec) or a rank forked by the fork server
Proc = Union[subprocess.Popen, Forked]


def launch(cfg: DictConfig, on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the job on this machine; return its record (status ok or failed).

    A job whose ranks all stop with exit status 75 was preempted
    (``fault.preempt_at_step``): it is started again with
    ``GEMS_RESTART_COUNT`` set and resumes from its checkpoint, at most
    ``fault.max_restarts`` times. SIGINT, SIGTERM or SIGHUP end the ranks, write
    a cancelled record and raise :class:`Cancelled`.
    """
    from gems.config import to_yaml

    world = mesh_from_config(cfg).size
    cfg_path = rec.job_dir(cfg) / "config.yaml"
    with writing("the run's configuration", cfg_path):
        jd = rec.make_job_dir(cfg)
        cfg_path.write_text(to_yaml(cfg))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, int(cfg.train.threads or 1))))
    env["PYTHONUNBUFFERED"] = "1"
    env["GEMS_LAUNCHER_PID"] = str(os.getpid())
    deadline = time.monotonic() + section(cfg, "cluster").wait_s()
    max_restarts = section(cfg, "fault").max_restarts
    path = rec.record_path(cfg)
    watch = _Watch([], [], on_progress)
    try:
        with cancel_on_signals():
            for attempt in range(max_restarts + 1):
                procs, logs = _start(cfg, world, jd, cfg_path, dict(env, GEMS_RESTART_COUNT=str(attempt)), attempt)
                watch = _Watch(procs, logs, on_progress)
                watch.run(deadline)
                if not watch.preempted or attempt == max_restarts:
                    break
                if on_progress:
                    on_progress(f"preempted; resuming (restart {attempt + 1})")
    except Cancelled as c:
        watch.stop()
        error = (f"cancelled: the launcher received {signal.Signals(c.signum).name}; its {world} rank(s) were "
                 "ended")
        _keep(path, rec.failed_record(cfg, error, failure={"kind": "cancelled", "signal": c.signum}))
        c.detail = f"its {world} rank(s) were ended; record: {path}"
        raise
    found = rec.find_record(path)  # the ranks' own record: ok, or a failure they diagnosed (its folder's or fallback)
    if found is not None:
        record = rec.read_record(found)
        hung = sorted(e.rank for e in watch.exits if e.code == TEARDOWN_EXIT)
        if hung:  # a rank whose process group's end outlasted its limit, after the record (its failure report says why)
            record.setdefault("notes", []).append(
                f"rank(s) {', '.join(map(str, hung))} ended past the teardown's limit after the record was written "
                f"(exit {TEARDOWN_EXIT}: graphs still alive at the process group's end; their failure reports in {jd} "
                "name them)")
        return record
    if watch.timed_out:
        cl = section(cfg, "cluster")
        error = (f"timed out after {cl.wait_s() / 60:g} min ({cl.wait_key()}): the ranks were ended unfinished "
                 "(raise it for a longer run)")
        failure = {"kind": "timeout"}
    else:
        who = "rank" if cfg.comm.backend != "mpi" else "MPI rank"
        error, failure = failure_of(jd) or explain(jd, watch.exits, who)  # a node's failed health check first
        full = full_note(jd)  # no record, and a full disk under the job: the likely cause, named
        if full is not None:
            error, failure = f"{error}; {full}", {**failure, "storage": "disk_full"}
    record = rec.failed_record(cfg, error, failure=failure)
    record["logs"] = [str(x) for x in watch.logs]
    return _keep(path, record)


def _keep(path: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Write ``record`` unless a record exists (a record is never replaced: one the ranks wrote themselves, of a
    stall or a non-finite loss, names the cause better than the launcher can); return the one on disk."""
    try:
        rec.write_record(path, record)
    except FileExistsError:
        return rec.read_record(rec.find_record(path) or path)
    return record


def _start(cfg: DictConfig, world: int, jd: Path, cfg_path: Path, env: dict[str, str],
           attempt: int) -> tuple[list[Proc], list[Path]]:
    suffix = f".restart{attempt}" if attempt else ""
    procs: list[Proc] = []
    logs: list[Path] = []
    if not forks_ranks(cfg):
        log = jd / f"mpiexec{suffix}.log"
        logs.append(log)
        cmd = [mpiexec_path(), "-n", str(world), sys.executable, "-m", "gems.worker", "--config", str(cfg_path)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                      start_new_session=True))
        return procs, logs
    port = free_port()
    for r in range(world):
        log = jd / f"rank{r}{suffix}.log"
        logs.append(log)
        e = dict(env, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(start_worker(cfg_path, e, log, r))
    return procs, logs


def forks_ranks(cfg: DictConfig) -> bool:
    """Whether this launcher forks the ranks itself (gems/launch/forkserver.py): every backend but MPI's, whose
    world ``mpiexec`` starts."""
    return str(cfg.comm.backend) != "mpi"


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process and its descendants (mpiexec's ranks), from /proc; None off Linux."""
    try:
        children: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                    children.setdefault(ppid, []).append(int(entry.name))
                except (OSError, ValueError, IndexError):
                    continue
    except OSError:
        return None
    total, todo = 0, [pid]
    page = os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            pass
        todo.extend(children.get(p, []))
    return total or None


class _Watch:
    """Watch a job's processes until all end, one fails (then the others get :data:`GRACE_S`), or the deadline."""

    def __init__(self, procs: list[Proc], logs: list[Path],
                 on_progress: Callable[[str], None] | None) -> None:
        self.procs, self.logs, self.on_progress = procs, logs, on_progress
        self.exits: list[Exit] = []  # non-zero exits in the order seen (not counting the ones killed here)
        self.rss: dict[int, int] = {}
        self.preempted = self.timed_out = False
        self._last_rss = 0.0
        self._seen: set[int] = set()

    def run(self, deadline: float) -> None:
        from gems.checkpoint import PREEMPTED_EXIT

        try:
            failed_at: float | None = None
            while True:
                self._collect()
                codes = [p.poll() for p in self.procs]
                if failed_at is None and any(c not in (None, 0, PREEMPTED_EXIT) for c in codes):
                    failed_at = time.monotonic()
                if failed_at is not None and (time.monotonic() - failed_at > GRACE_S or
                                              all(c is not None for c in codes)):
                    break
                if all(c is not None for c in codes):
                    self.preempted = any(c == PREEMPTED_EXIT for c in codes)
                    break
                if time.monotonic() > deadline:
                    self.timed_out = True
                    break
                if self.on_progress and failed_at is None:
                    self.on_progress(_progress_line(self.logs[0]))
                time.sleep(0.2)
        finally:
            self.stop()

    def _collect(self) -> None:
        now = time.monotonic()
        sample = now - self._last_rss > 1.0
        for i, p in enumerate(self.procs):
            code = p.poll()
            if code is None:
                if sample:
                    got = rss_bytes(p.pid)
                    if got:
                        self.rss[i] = got
            elif code not in (0, 75) and i not in self._seen:  # 75: preempted, to be resumed
                self._seen.add(i)
                rank = -1 if self.logs[i].name.startswith("mpiexec") else i
                self.exits.append(Exit(rank, code, self.rss.get(i), _last_error_line(tail(self.logs[i], 40))))
        if sample:
            self._last_rss = now

    def stop(self) -> None:
        """End every process still running (the whole process group: mpiexec takes its ranks along)."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not wait
                pass


class LocalLauncher:
    """:class:`~gems.launch.base.Launcher` on this machine: rank 0's step lines go to ``on_progress``."""

    shows_progress = False

    def launch(self, cfg: DictConfig, on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        return launch(cfg, on_progress=on_progress)


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
