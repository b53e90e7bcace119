"""``cluster.launcher=slurm``: submit gems jobs to Slurm through submitit and wait for them.

Why this module exists: a job on a cluster can die in ways no Python code in it
sees (a rank killed, a node lost, a time limit), and many sites (and the test
cluster here) run without accounting, so ``sacct`` cannot say what happened
and submitit alone would wait forever for a result that never comes. Here the
job's state comes from ``squeue --states=all`` (which keeps finished jobs for
``MinJobAge``), then ``sacct`` where it works, then submitit's own per-task
result files; a job that leaves the queue without a result, or that runs past
``cluster.timeout_min``, is reported failed with the tail of its error stream.

The sbatch options are sbatch's own names, built from ``cfg.cluster`` in one
place (:func:`sbatch_parameters`) that ``gems/launch/render.py`` also uses, so
a hand-submitted script and a submitit job ask Slurm for the same thing.

Public API::

    run = submit(cfg)                       # one job -> SlurmRun
    runs = submit_all([cfg1, cfg2, ...])    # a sweep: checked first, then submitted
    outcomes = wait(runs)                   # live display; every job ends ok or failed
    record = launch(cfg)                    # submit + wait + the results record
"""
from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from gems.errors import Cancelled, ConfigError

RankFn = Callable[[str], Any]

# Slurm job states after which a job never runs again (squeue/scontrol/sacct spellings).
FINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
    "DEADLINE", "PREEMPTED", "SPECIAL_EXIT", "REVOKED",
})
START_HINT = "start it with scripts/slurm_cluster.sh start or use cluster=local"


# ----------------------------------------------------------------------------- options
_WHAT = {"account": "your project/budget account", "partition": "a partition (sinfo -s)",
         "qos": "a QOS (sacctmgr show qos)", "constraint": "a node feature (sinfo -o %f)"}


def _cluster_value(cfg: DictConfig, key: str) -> Any:
    """``cluster.<key>``; a placeholder (``???`` or ``<...>`` in a preset) is a ConfigError."""
    try:
        val = OmegaConf.select(cfg, f"cluster.{key}", throw_on_missing=True)
    except MissingMandatoryValue:
        val = "???"
    if isinstance(val, str) and (val == "???" or (val.startswith("<") and val.endswith(">"))):
        raise ConfigError(f"cluster.{key}", val, f"{_WHAT.get(key, 'a value')}: add cluster.{key}=NAME")
    return val


def _mem(gb: float) -> str:
    return f"{int(gb)}GB" if float(gb) == int(gb) else f"{int(float(gb) * 1024)}MB"


def job_name(cfg: DictConfig) -> str:
    return str(cfg.get("run_id") or cfg.results.get("name") or "gems")


def python_command(cfg: DictConfig) -> str:
    """The interpreter on the compute nodes: ``cluster.python``, else this one."""
    py = _cluster_value(cfg, "python")
    return str(py) if py else shlex.quote(sys.executable)


def sbatch_parameters(cfg: DictConfig) -> dict[str, Any]:
    """submitit ``SlurmExecutor`` parameters (sbatch names) for ``cfg.cluster``."""
    c = cfg.cluster
    params: dict[str, Any] = {
        "job_name": job_name(cfg),
        "time": int(c.time_min),
        "nodes": int(c.nodes),
        "ntasks_per_node": int(c.tasks_per_node),
        "cpus_per_task": int(c.cpus_per_task),
        "wckey": "gems",
        # SIGUSR2 this long before the time limit: every rank checkpoints and the job is requeued
        "signal_delay_s": int(c.get("signal_margin_s", 120)),
    }
    additional = OmegaConf.to_container(c.additional, resolve=True) if c.additional else {}
    # sites that count GPUs as a generic resource (--gres=gpu:4) get that instead of --gpus-per-node
    if int(c.gpus_per_node or 0) > 0 and "gres" not in additional:  # type: ignore[operator]
        params["gpus_per_node"] = int(c.gpus_per_node)
    if c.mem_gb is not None:
        params["mem"] = _mem(c.mem_gb)
    for key in ("partition", "account", "qos", "constraint"):
        val = _cluster_value(cfg, key)
        if val not in (None, ""):
            params[key] = str(val)
    setup = [str(s) for s in (c.setup or [])]
    if setup:
        params["setup"] = setup
    srun_args = [str(a) for a in (c.srun_args or [])]
    if srun_args:
        params["srun_args"] = srun_args
    if additional:
        params["additional_parameters"] = {str(k): v for k, v in additional.items()}  # type: ignore[union-attr]
    return params


def default_job_dir(cfg: DictConfig) -> Path:
    """Where submitit keeps a run's pickles and logs: ``{results.dir}/.jobs/{run_id}``."""
    return Path(cfg.results.dir).resolve() / ".jobs" / str(cfg.run_id or "gems")


def prepare(cfg: DictConfig) -> DictConfig:
    """A copy of ``cfg`` with a run id and an absolute ``results.dir`` (ranks may start elsewhere)."""
    from gems.results import record as rec

    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[assignment]  # a mapping
    if not cfg.get("run_id"):
        cfg.run_id = rec.new_run_id(rec.default_name(cfg))
    cfg.results.dir = str(Path(cfg.results.dir).resolve())
    return cfg


# ----------------------------------------------------------------------------- slurm commands
def _run(cmd: list[str], timeout: float = 30.0, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout)


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no message"


def check_reachable(cfg: DictConfig) -> list[str]:
    """Slurm's partitions, or ConfigError if sbatch is absent or the controller does not answer."""
    name = str(cfg.cluster.name)
    for tool in ("sbatch", "srun", "squeue", "sinfo"):
        if shutil.which(tool) is None:
            raise ConfigError("cluster", name, f"a machine with Slurm ({tool} is not on PATH); {START_HINT}")
    try:
        out = _run(["sinfo", "-h", "-o", "%R"], timeout=45)
    except subprocess.TimeoutExpired:
        raise ConfigError("cluster", name, f"a Slurm controller that answers (sinfo timed out); {START_HINT}") from None
    if out.returncode != 0:
        msg = _first_line(out.stderr or out.stdout)
        raise ConfigError("cluster", name, f"a Slurm controller that answers (sinfo: {msg}); {START_HINT}")
    return sorted({p.strip() for p in out.stdout.split() if p.strip()})


def _node_limits(partition: str | None) -> tuple[int, int, int]:
    """(nodes, min CPUs per node, min memory MB per node) of a partition, 0 when unknown."""
    cmd = ["sinfo", "-h", "-N", "-o", "%N %c %m"] + (["-p", partition] if partition else [])
    try:
        out = _run(cmd, timeout=30)
    except subprocess.TimeoutExpired:
        return 0, 0, 0
    rows = [ln.split() for ln in out.stdout.splitlines() if len(ln.split()) == 3]
    if not rows:
        return 0, 0, 0
    nodes = len({r[0] for r in rows})
    cpus = min(int(r[1]) for r in rows if r[1].isdigit()) if any(r[1].isdigit() for r in rows) else 0
    mem = min(int(r[2]) for r in rows if r[2].isdigit()) if any(r[2].isdigit() for r in rows) else 0
    return nodes, cpus, mem


def _refusal(cfg: DictConfig, message: str) -> ConfigError:
    """Turn sbatch's refusal into the config key the user can change."""
    c = cfg.cluster
    low = message.lower()
    if "partition" in low:
        return ConfigError("cluster.partition", c.partition, f"a partition of this cluster (sbatch: {message})")
    if "account" in low or "association" in low:
        return ConfigError("cluster.account", c.account, f"an account you may charge (sbatch: {message})")
    if "qos" in low:
        return ConfigError("cluster.qos", c.qos, f"a QOS of your account (sbatch: {message})")
    if "feature" in low or "constraint" in low:
        return ConfigError("cluster.constraint", c.constraint, f"a node feature of this cluster (sbatch: {message})")
    if "gres" in low or "gpu" in low:
        return ConfigError("cluster.gpus_per_node", c.gpus_per_node,
                           f"GPUs the nodes have, 0 where they have none (sbatch: {message})")
    if "time limit" in low:
        return ConfigError("cluster.time_min", c.time_min, f"a time within the partition's limit (sbatch: {message})")
    if "node configuration is not available" in low or "node count" in low:
        nodes, cpus, mem_mb = _node_limits(c.partition)
        if nodes and int(c.nodes) > nodes:
            return ConfigError("cluster.nodes", c.nodes, f"at most {nodes} nodes in this partition")
        per_node = int(c.tasks_per_node) * int(c.cpus_per_task)
        if cpus and per_node > cpus:
            return ConfigError("cluster.tasks_per_node", c.tasks_per_node,
                               f"tasks_per_node x cpus_per_task <= {cpus} CPUs per node (now {per_node})")
        if mem_mb and c.mem_gb is not None and float(c.mem_gb) * 1024 > mem_mb:
            return ConfigError("cluster.mem_gb", c.mem_gb, f"at most {mem_mb // 1024} GB per node")
        return ConfigError("cluster.nodes", f"{c.nodes} x {c.tasks_per_node} tasks",
                           f"a request the partition's nodes can satisfy (sbatch: {message})")
    return ConfigError("cluster", c.name, f"a job Slurm accepts (sbatch --test-only: {message})")


def preflight(cfg: DictConfig, partitions: Sequence[str] | None = None) -> None:
    """Ask Slurm, without submitting, whether it would take this job (``sbatch --test-only``)."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = sbatch_parameters(cfg)
    part = params.get("partition")
    if part and partitions is not None and part not in partitions:
        raise ConfigError("cluster.partition", part, "one of " + ", ".join(partitions))
    text = _make_sbatch_string(command="true", folder="/tmp/gems-preflight", **params)
    try:
        out = _run(["sbatch", "--test-only"], timeout=45, stdin=text)
    except subprocess.TimeoutExpired:
        raise ConfigError("cluster", cfg.cluster.name,
                          f"a Slurm controller that answers (sbatch timed out); {START_HINT}") from None
    if out.returncode != 0:
        msg = _first_line(out.stderr or out.stdout)
        if "contact" in msg.lower() or "connection" in msg.lower():
            raise ConfigError("cluster", cfg.cluster.name, f"a Slurm controller that answers (sbatch: {msg}); {START_HINT}")
        raise _refusal(cfg, msg)


# ----------------------------------------------------------------------------- submission
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
    ended_at: float | None = None
    error_seen_at: float | None = None

    @property
    def job_id(self) -> str:
        return str(self.job.job_id)

    @property
    def run_id(self) -> str:
        return str(self.cfg.run_id)

    @property
    def num_tasks(self) -> int:
        return int(self.cfg.cluster.nodes) * int(self.cfg.cluster.tasks_per_node)

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


def _default_fn() -> RankFn:
    from gems.worker import run_rank

    return run_rank


def _timeout_s(cfg: DictConfig) -> float:
    tmo = cfg.cluster.get("timeout_min")
    return 60.0 * float(tmo if tmo is not None else int(cfg.cluster.time_min) + 5)


def make_executor(cfg: DictConfig, job_dir: Path) -> Any:
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
    from gems.config import to_yaml

    if not cfgs:
        return []
    prepared = [prepare(c) for c in cfgs]
    if job_dirs is not None and len(job_dirs) != len(prepared):
        raise ValueError("job_dirs must give one folder per configuration")
    dirs = [Path(d).resolve() for d in job_dirs] if job_dirs is not None else [default_job_dir(c) for c in prepared]
    if check:
        partitions = check_reachable(prepared[0])
        for c in prepared:
            preflight(c, partitions)
    fn = fn or _default_fn()
    runs: list[SlurmRun | None] = [None] * len(prepared)
    from gems.results.record import private_dir

    for c, d in zip(prepared, dirs):
        private_dir(d)
        (d / "config.yaml").write_text(to_yaml(c))
    # jobs of one shape (the same sbatch request) go out as one job array: one sbatch call, one queue entry
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(prepared):
        key = repr(sorted((k, str(v)) for k, v in sbatch_parameters(c).items() if k != "job_name"))
        groups.setdefault(key if job_dirs is None and c.cluster.get("arrays", True) else f"{i}", []).append(i)
    for members in groups.values():
        first = prepared[members[0]]
        if len(members) == 1:
            folder = dirs[members[0]]
        else:
            folder = private_dir(Path(first.results.dir).resolve() / ".jobs" / f"array-{uuid.uuid4().hex[:8]}")
        ex = make_executor(first, folder)
        if len(members) > 1:
            ex.update_parameters(job_name=str(first.results.get("sweep") or "gems"))
        try:
            if len(members) == 1:
                jobs = [ex.submit(fn, to_yaml(first))]
            else:
                with ex.batch():
                    pending = [ex.submit(fn, to_yaml(prepared[i])) for i in members]
                jobs = list(pending)
        except Exception as e:  # sbatch refused after preflight, or the controller went away
            msg = _first_line(str(e))
            done = [r for r in runs if r is not None]
            if done:
                raise RuntimeError(f"sbatch failed after {len(done)} job(s) were submitted "
                                   f"({', '.join(r.job_id for r in done)}): {msg}") from e
            raise _refusal(first, msg) from None
        for i, job in zip(members, jobs):
            runs[i] = SlurmRun(prepared[i], job, folder, time.time(), _timeout_s(prepared[i]))
    return [r for r in runs if r is not None]


# ----------------------------------------------------------------------------- watching
def _squeue(job_ids: Iterable[str]) -> dict[str, tuple[str, str]] | None:
    """{job id: (state, reason or nodes)} for jobs Slurm still knows; None when squeue fails."""
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    try:
        out = _run(["squeue", "-h", "-r", "--states=all", "-j", ",".join(ids), "-o", "%i|%T|%r|%N"], timeout=30)
    except subprocess.TimeoutExpired:
        return None
    if out.returncode != 0:
        if "invalid job id" in (out.stderr + out.stdout).lower():
            return {}
        return None
    info: dict[str, tuple[str, str]] = {}
    for line in out.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) == 4 and parts[0] in ids:
            jid, state, reason, nodes = parts
            info[jid] = (state.split()[0], nodes if state == "RUNNING" and nodes else reason)
    return info


def _sacct_state(job_id: str) -> str | None:
    """The job's final state from accounting, where the site has it."""
    if shutil.which("sacct") is None:
        return None
    try:
        out = _run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], timeout=30)
    except subprocess.TimeoutExpired:
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    if out.returncode != 0 or not lines:
        return None
    return lines[0].split()[0]


def _task_outcomes(run: SlurmRun) -> list[tuple[str, Any] | None]:
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


def _tail(path: Path, lines: int) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.rstrip().splitlines() if ln.strip()][-lines:]


_SRUN_EXIT = re.compile(r"tasks? ([0-9,\-]+): (Exited with exit code (\d+)|Killed|Segmentation fault|Aborted)")


def _first_task(spec: str) -> int:
    return int(re.split(r"[,\-]", spec)[0])


def _is_slurm_line(line: str) -> bool:
    return line.startswith(("srun:", "slurmstepd"))


def stderr_tail(run: SlurmRun, lines: int = 15) -> tuple[str, str]:
    """(headline, tail): which task failed first and the end of its error stream.

    srun's own messages (in task 0's stream) name the first task that exited badly;
    without them, the first task with no successful result is taken.
    """
    from submitit.core import utils

    def err_path(t: int) -> Path:
        return utils.JobPaths(run.job_dir, job_id=run.job_id, task_id=t).stderr

    srun_lines = [ln for ln in _tail(err_path(0), 400) if _is_slurm_line(ln)]
    culprit: int | None = None
    headline = ""
    for ln in srun_lines:
        m = _SRUN_EXIT.search(ln)
        if m and m.group(2) != "Killed":
            culprit = _first_task(m.group(1))
            code = m.group(3)
            headline = f"task {culprit} " + (f"exited with status {code}" if code else m.group(2).lower())
            break
    if culprit is None:
        results = _task_outcomes(run)
        culprit = next((t for t, r in enumerate(results) if r is None or r[0] != "success"), None)
    chunks = srun_lines[-5:]
    if culprit is not None:
        tail = [ln for ln in _tail(err_path(culprit), 200) if not _is_slurm_line(ln) and "submitit" not in ln]
        if tail:
            headline = (headline or f"task {culprit}") + ": " + tail[-1].strip()
            chunks += [f"[task {culprit} stderr]"] + tail[-lines:]
    return headline, "\n".join(chunks)


_SIGNALS = {"Killed": -9, "Segmentation fault": -11, "Aborted": -6}


def _srun_exits(run: SlurmRun) -> list[Any]:
    """The tasks srun reported as ended badly, in its order (exit statuses, or signals as negative codes)."""
    from submitit.core import utils

    from gems.fault.reports import Exit

    err0 = utils.JobPaths(run.job_dir, job_id=run.job_id, task_id=0).stderr
    exits: list[Exit] = []
    for ln in _tail(err0, 400):
        m = _SRUN_EXIT.search(ln) if _is_slurm_line(ln) else None
        if m:
            code = int(m.group(3)) if m.group(3) else _SIGNALS.get(m.group(2), -9)
            for t in _task_list(m.group(1)):
                if all(e.rank != t for e in exits):
                    exits.append(Exit(t, code))
    return exits


def _task_list(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def _cause(run: SlurmRun) -> tuple[str, dict[str, Any]] | None:
    """The cause from the ranks' failure reports (the first rank that failed on its own), if any wrote one.
    They are in the run's own folder (``{results.dir}/.jobs/{run_id}``), also when a job array shares one
    submitit folder."""
    from gems.fault.reports import explain, read_reports

    own = default_job_dir(run.cfg)
    if not read_reports(own):
        return None
    return explain(own, _srun_exits(run), "task")


def _error_of(run: SlurmRun, state: str) -> str | None:
    results = _task_outcomes(run)
    errors = [(t, r[1]) for t, r in enumerate(results) if r is not None and r[0] == "error"]
    missing = [t for t, r in enumerate(results) if r is None]
    if state in ("COMPLETED", "GONE") and not errors and not missing:
        return None
    cause = _cause(run)
    if cause is not None:
        return cause[0]
    if errors:
        t, trace = errors[0]
        last = [ln for ln in str(trace).strip().splitlines() if ln.strip()]
        head = f"task {t} raised {last[-1] if last else 'an exception'}"
        return head + "\n" + "\n".join(last[-12:])
    why = {"GONE": "the job left the queue", "TIMEOUT": "the job hit its time limit (cluster.time_min)",
           "CANCELLED": "the job was cancelled", "OUT_OF_MEMORY": "a task ran out of memory (cluster.mem_gb)",
           "NODE_FAIL": "a node failed"}.get(state, f"the job ended {state}")
    headline, tail = stderr_tail(run)
    where = headline or (f"tasks {missing[:8]} gave no result" if missing else "no task failed in Python")
    return f"{why}: {where}" + (f"\n{tail}" if tail else f" (no error output in {run.job_dir})")


def _outcome(run: SlurmRun, state: str, error: str | None) -> Outcome:
    results = [r[1] if r is not None and r[0] == "success" else None for r in _task_outcomes(run)]
    rp = run.record_path if run.record_path.exists() else None
    end = run.ended_at or time.time()
    failure = None
    if error is not None:
        cause = _cause(run)
        failure = cause[1] if cause is not None else {"kind": {"TIMEOUT": "timeout", "CANCELLED": "cancelled"}.get(
            state, "exit"), "state": state}
    return Outcome(run.run_id, run.job_id, error is None, state, error, results, rp, run.job_dir,
                   end - run.submitted_at, failure)


def poll(runs: Sequence[SlurmRun], finished: dict[str, Outcome], error_grace_s: float = 30.0) -> None:
    """One look at every unfinished job; puts the ones that ended into ``finished`` (by job id)."""
    live = [r for r in runs if r.job_id not in finished]
    if not live:
        return
    info = _squeue(r.job_id for r in live)
    now = time.time()
    for run in live:
        if info is not None and run.job_id in info:
            run.seen = True
            run.state, run.detail = info[run.job_id]
            if run.state == "RUNNING":
                run.ran = True
            if run.state == "PENDING" and run.detail == "BeginTime" and run.ran:
                # gems requeued it (a preemption, the time limit near): Slurm holds a requeued job back for
                # two minutes; the job's own checkpoint makes an immediate restart safe
                _run(["scontrol", "update", f"JobId={run.job_id}", "StartTime=now"], timeout=30)
        elif info is not None and (run.seen or now - run.submitted_at > 60):
            # Slurm no longer knows it (purged after MinJobAge, or never listed): ask accounting, else files
            acct = _sacct_state(run.job_id)
            run.state = acct if acct else "GONE"
        results = _task_outcomes(run)
        if run.state in FINAL_STATES or run.state == "GONE":
            run.ended_at = run.ended_at or now
            # results may land a moment after Slurm says the job ended (shared filesystems)
            if run.state == "COMPLETED" and any(r is None for r in results) and now - run.ended_at < 15:
                continue
            state = "COMPLETED" if run.state == "GONE" and all(r is not None for r in results) else run.state
            finished[run.job_id] = _outcome(run, state, _error_of(run, state))
            continue
        if any(r is not None and r[0] == "error" for r in results):
            # a task raised while its peers still run (they may wait forever on it): give them a grace period
            run.error_seen_at = run.error_seen_at or now
            if now - run.error_seen_at > error_grace_s:
                _cancel(run)
                run.ended_at = now
                finished[run.job_id] = _outcome(run, "FAILED", _error_of(run, "FAILED"))
                continue
        if now - run.submitted_at > run.timeout_s:
            _cancel(run)
            run.ended_at = now
            _, tail = stderr_tail(run)
            minutes = run.timeout_s / 60
            msg = (f"gave up after {minutes:g} min in state {run.state} (cluster.timeout_min; "
                   f"the job was cancelled)" + (f"\n{tail}" if tail else ""))
            finished[run.job_id] = _outcome(run, "TIMEOUT", msg)


def _cancel(run: SlurmRun) -> None:
    try:
        _run(["scancel", run.job_id], timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass


def _table(runs: Sequence[SlurmRun], finished: dict[str, Outcome]) -> Any:
    from rich.table import Table

    table = Table(title=f"gems: {len(finished)}/{len(runs)} Slurm job(s) done", title_justify="left")
    for col in ("run", "job", "state", "nodes / reason", "time"):
        table.add_column(col)
    now = time.time()
    for r in runs:
        out = finished.get(r.job_id)
        if out is not None:
            state = "[green]done[/]" if out.ok else f"[red]{out.state.lower()}[/]"
            detail = "" if out.ok else (out.error or "").splitlines()[0][:70]
            elapsed = out.elapsed_s
        else:
            state, detail, elapsed = r.state.lower(), r.detail, now - r.submitted_at
        table.add_row(r.run_id, r.job_id, state, detail, f"{elapsed:.0f}s")
    return table


def wait(runs: SlurmRun | Sequence[SlurmRun], progress: bool = True, poll_s: float | None = None,
         on_update: Callable[[Sequence[SlurmRun], dict[str, Outcome]], None] | None = None,
         on_cancel: str = "cancel") -> list[Outcome]:
    """Wait until every job has ended (ok or failed); outcomes in the order of ``runs``.

    Never waits forever: each job ends at the latest ``cluster.timeout_min`` after submission
    (default ``cluster.time_min + 5``), when it is cancelled and reported failed. SIGINT, SIGTERM or
    SIGHUP raise :class:`~gems.errors.Cancelled`: with ``on_cancel="cancel"`` the jobs still queued or
    running are cancelled first and recorded so; with ``"leave"`` they go on (a detached study).
    """
    from gems.launch import cancel_on_signals

    runs = [runs] if isinstance(runs, SlurmRun) else list(runs)
    if not runs:
        return []
    step = float(poll_s if poll_s is not None else min(float(r.cfg.cluster.get("poll_s") or 1.0) for r in runs))
    finished: dict[str, Outcome] = {}
    live_ctx: Any = None
    if progress:
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        live_ctx = Live(_table(runs, finished), console=console, refresh_per_second=4, transient=False,
                        auto_refresh=console.is_terminal)
        live_ctx.start()
    try:
        with cancel_on_signals():
            interval, seen = step, None
            while True:
                poll(runs, finished)
                if live_ctx is not None and live_ctx.console.is_terminal:
                    live_ctx.update(_table(runs, finished))
                if on_update is not None:
                    on_update(runs, finished)
                if len(finished) == len(runs):
                    break
                # one squeue a poll for all jobs; while nothing changes, ask less and less often
                now = (len(finished), tuple(r.state for r in runs))
                interval = step if now != seen else min(interval * 1.5, max(step, min(5 * step, 300.0)))
                seen = now
                time.sleep(interval)
    except Cancelled as c:
        left = [r for r in runs if r.job_id not in finished]
        ids = ", ".join(r.job_id for r in left)
        if on_cancel == "cancel":
            from gems.results import record as rec

            for r in left:
                _cancel(r)
                error = f"slurm job {r.job_id}: cancelled: the launcher received {signal.Signals(c.signum).name}"
                rec_failed = rec.failed_record(r.cfg, error, failure={"kind": "cancelled", "signal": c.signum,
                                                                      "slurm_job_id": r.job_id})
                rec_failed["env"]["slurm_job_id"] = r.job_id
                try:
                    rec.write_record(r.record_path, rec_failed)
                except FileExistsError:
                    pass
            c.detail = f"cancelled Slurm job(s) {ids}" if left else "every job had ended"
        else:
            c.detail = f"Slurm job(s) {ids} go on" if left else "every job had ended"
        raise
    finally:
        if live_ctx is not None:
            live_ctx.update(_table(runs, finished))
            live_ctx.stop()
    return [finished[r.job_id] for r in runs]


# ----------------------------------------------------------------------------- the gems path
def record_of(run: SlurmRun, outcome: Outcome) -> dict[str, Any]:
    """The results record of a finished job; a failed one is written when the job left none."""
    from gems.results import record as rec

    if outcome.record_path is not None:
        return rec.read_record(outcome.record_path)
    error = outcome.error or f"job {outcome.job_id} ended {outcome.state} without writing its record"
    record = rec.failed_record(run.cfg, f"slurm job {outcome.job_id}: {error}", failure=outcome.failure)
    record["logs"] = str(run.job_dir)
    record["env"]["slurm_job_id"] = outcome.job_id
    if not run.record_path.exists():
        rec.write_record(run.record_path, record)
    return record


def launch(cfg: DictConfig, on_progress: Callable[[str], None] | None = None, progress: bool = True) -> dict[str, Any]:
    """Submit ``cfg`` to Slurm, wait, and return its record (status ok or failed), like gems.launch.local."""
    return launch_all([cfg], on_progress=on_progress, progress=progress)[0]


def launch_all(cfgs: Sequence[DictConfig], on_progress: Callable[[str], None] | None = None,
               progress: bool = True) -> list[dict[str, Any]]:
    """A sweep on Slurm: submit every job (nothing when one is bad), wait for all, return their records."""
    runs = submit_all(cfgs)

    def report(rs: Sequence[SlurmRun], done: dict[str, Outcome]) -> None:
        if on_progress is not None:
            states = ", ".join(f"{r.job_id}:{(done[r.job_id].state if r.job_id in done else r.state).lower()}" for r in rs)
            on_progress(f"{len(done)}/{len(rs)} done ({states})")

    outcomes = wait(runs, progress=progress, on_update=report)
    return [record_of(r, o) for r, o in zip(runs, outcomes)]


__all__ = [
    "SlurmRun", "Outcome", "sbatch_parameters", "check_reachable", "preflight", "submit", "submit_all",
    "wait", "poll", "launch", "launch_all", "record_of", "stderr_tail", "default_job_dir", "prepare",
]

