"""Why a Slurm job failed, from what it left behind (:func:`outcome`): the ranks' own failure reports first, else a
task's Python exception from submitit's result files (unless srun saw another task end badly before it), else the
job's state with the tail of the error stream of the first task that ended badly.
"""
from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from gems.fault.reports import Exit, explain, read_reports
from gems.launch.jobs import Outcome, SlurmRun, task_outcomes
from gems.launch.options import default_job_dir
from gems.results import record as rec
from gems.telemetry.health import failure_of


def _tail(path: Path, lines: int) -> list[str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [ln for ln in text.rstrip().splitlines() if ln.strip()][-lines:]


_SRUN_EXIT = re.compile(r"tasks? ([0-9,\-]+): (Exited with exit code (\d+)|Killed|Segmentation fault|Aborted)")


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
    first = _first_bad(run)
    culprit = first.rank if first is not None else None
    headline = ""
    if first is not None:
        headline = f"task {first.rank} " + (f"exited with status {first.code}" if first.code >= 0
                                            else _SIGNAL_NAMES[first.code])
    if culprit is None:
        results = task_outcomes(run)
        culprit = next((t for t, r in enumerate(results) if r is None or r[0] != "success"), None)
    chunks = srun_lines[-5:]
    if culprit is not None:
        tail = [ln for ln in _tail(err_path(culprit), 200) if not _is_slurm_line(ln) and "submitit" not in ln]
        if tail:
            headline = (headline or f"task {culprit}") + ": " + tail[-1].strip()
            chunks += [f"[task {culprit} stderr]"] + tail[-lines:]
    return headline, "\n".join(chunks)


_SIGNALS = {"Killed": -9, "Segmentation fault": -11, "Aborted": -6}
_SIGNAL_NAMES = {v: k.lower() for k, v in _SIGNALS.items()}


def _first_bad(run: SlurmRun) -> Exit | None:
    """The first task srun saw end badly on its own: an exit status or a signal, not srun's own kill of the others
    after it (``Killed``)."""
    return next((e for e in _srun_exits(run) if e.code != _SIGNALS["Killed"]), None)


def _srun_exits(run: SlurmRun) -> list[Exit]:
    """The tasks srun reported as ended badly, in its order (exit statuses, or signals as negative codes)."""
    from submitit.core import utils

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
    own = default_job_dir(run.cfg)
    if not read_reports(own):
        return None
    return explain(own, _srun_exits(run), "task")


def error_of(run: SlurmRun, state: str) -> str | None:
    """Why the job failed (headline, then detail), or None when it ended well and every task returned."""
    results = task_outcomes(run)
    errors = [(t, r[1]) for t, r in enumerate(results) if r is not None and r[0] == "error"]
    missing = [t for t, r in enumerate(results) if r is None]
    if state in ("COMPLETED", "GONE") and not errors and not missing:
        return None
    cause = _cause(run)
    if cause is not None:
        return cause[0]
    # the task that failed first, as srun saw it (a killed task is a consequence): when it died without a Python
    # error (an exit status, a signal), a peer's exception after it (its connection closed) is not the cause
    bad = _first_bad(run)
    first = bad.rank if bad is not None else None
    raised = dict(errors)
    if errors and (first is None or first in raised):
        t = first if first is not None else errors[0][0]
        trace = raised[t]
        last = [ln for ln in str(trace).strip().splitlines() if ln.strip()]
        head = f"task {t} raised {last[-1] if last else 'an exception'}"
        return head + "\n" + "\n".join(last[-12:])
    why = {"GONE": "the job left the queue", "TIMEOUT": "the job hit its time limit (cluster.time_min)",
           "CANCELLED": "the job was cancelled", "OUT_OF_MEMORY": "a task ran out of memory (cluster.mem_gb)",
           "NODE_FAIL": "a node failed"}.get(state, f"the job ended {state}")
    headline, tail = stderr_tail(run)
    where = headline or (f"tasks {missing[:8]} gave no result" if missing else "no task failed in Python")
    return f"{why}: {where}" + (f"\n{tail}" if tail else f" (no error output in {run.job_dir})")


def outcome(run: SlurmRun, state: str, error: str | None) -> Outcome:
    """The :class:`Outcome` of a job that ended in ``state`` (``error`` None: it ended well), with its cause: a
    node's failed health check first (its own line and the node, gems/telemetry/health.py)."""
    results = [r[1] if r is not None and r[0] == "success" else None for r in task_outcomes(run)]
    rp = rec.find_record(run.record_path)  # its folder, or where the record went when that could not take it
    end = run.ended_at or time.time()
    failure = None
    if error is not None:
        cause = _cause(run)
        failure = cause[1] if cause is not None else {"kind": {"TIMEOUT": "timeout", "CANCELLED": "cancelled"}.get(
            state, "exit"), "state": state}
        bad = failure_of(default_job_dir(run.cfg))
        if bad is not None:
            error, failure = bad
    return Outcome(run.run_id, run.job_id, error is None, state, error, results, rp, run.job_dir,
                   end - run.submitted_at, failure)


__all__ = ["stderr_tail", "error_of", "outcome"]
