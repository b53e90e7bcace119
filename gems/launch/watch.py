"""Watching Slurm jobs until each has ended, ok or failed, and the live view of them (:func:`wait`).

A job can die in ways no code in it sees (a rank killed, a node lost, a time limit), and many sites run without
accounting, so submitit alone could wait forever: a job that leaves the queue without a result is failed
(gems.launch.diagnose says why). Waiting in the queue is never held against a job (docs/commands.md).
"""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from gems.config import section
from gems.errors import Cancelled
from gems.fault.reports import read_requeues, write_requeues
from gems.launch import cancel_on_signals
from gems.launch.diagnose import error_of, outcome, stderr_tail
from gems.launch.jobs import FINAL_STATES, Outcome, SlurmRun, slurm_command, task_outcomes
from gems.results import record as rec

#: squeue's states of a job whose ranks have started: the launcher's wait clock runs
RUNNING_STATES = ("RUNNING", "COMPLETING", "SUSPENDED", "STOPPED")


def _squeue(job_ids: Iterable[str]) -> dict[str, tuple[str, str]] | None:
    """{job id: (state, reason or nodes)} for jobs Slurm still knows; None when squeue fails."""
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    try:
        out = slurm_command(["squeue", "-h", "-r", "--states=all", "-j", ",".join(ids), "-o", "%i|%T|%r|%N"],
                            timeout=30)
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
        out = slurm_command(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"], timeout=30)
    except subprocess.TimeoutExpired:
        return None
    lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
    if out.returncode != 0 or not lines:
        return None
    return lines[0].split()[0]


def _cancel(run: SlurmRun) -> None:
    try:
        slurm_command(["scancel", run.job_id], timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass


class Watcher:
    """What Slurm says of a set of jobs. Each :meth:`poll` asks once for every job not yet finished and
    moves the ones that ended into :attr:`finished` (by job id), a cache that is never asked about again. A job's
    state comes from ``squeue --states=all`` (Slurm keeps finished jobs for ``MinJobAge``), then ``sacct`` where
    it works, then submitit's own per-task result files."""

    def __init__(self, runs: Sequence[SlurmRun], error_grace_s: float = 30.0,
                 retry: Callable[[SlurmRun, Outcome], bool] | None = None) -> None:
        self.runs = list(runs)
        self.finished: dict[str, Outcome] = {}
        self.error_grace_s = error_grace_s
        self.retry = retry  # given a failed job: True where it submitted it again (gems.launch.resubmit)

    @property
    def unfinished(self) -> list[SlurmRun]:
        return [r for r in self.runs if r.job_id not in self.finished]

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.runs)

    def outcomes(self) -> list[Outcome]:
        """Every job's outcome, in the order of :attr:`runs` (once :attr:`done`)."""
        return [self.finished[r.job_id] for r in self.runs]

    def poll(self) -> None:
        """One look at every unfinished job; puts the ones that ended into :attr:`finished`."""
        live = self.unfinished
        if not live:
            return
        info = _squeue(r.job_id for r in live)
        now = time.time()
        for run in live:
            if info is not None and run.job_id in info:
                run.seen = True
                was = run.state
                run.state, run.detail = info[run.job_id]
                if run.state in RUNNING_STATES:
                    run.ran = True
                    run.started_at = run.started_at or now
                    if run.state == "RUNNING" and run.detail:
                        run.ran_on = run.detail
                elif run.state in WAITING:
                    run.started_at = None  # waiting again (requeued): the clock starts when it runs again
                    # requeued after it ran (its last poll saw it running or completing): a node lost under it?
                    lost = lost_nodes(run, run.ran_on) if run.ran and was not in WAITING else None
                    if lost is not None:  # a second node lost: cancelled
                        run.ended_at = now
                        self.finished[run.job_id] = outcome(run, "NODE_FAIL", lost)
                        continue
                if run.state == "PENDING" and run.detail == "BeginTime" and run.ran:
                    # gems requeued it (a preemption, the time limit near): Slurm holds a requeued job back for
                    # two minutes; the job's own checkpoint makes an immediate restart safe
                    slurm_command(["scontrol", "update", f"JobId={run.job_id}", "StartTime=now"], timeout=30)
            elif info is not None and (run.seen or now - run.submitted_at > 60):
                # Slurm no longer knows it (purged after MinJobAge, or never listed): ask accounting, else files
                acct = _sacct_state(run.job_id)
                run.state = acct if acct else "GONE"
            self._settle(run, now)

    def _settle(self, run: SlurmRun, now: float) -> None:
        """Put ``run`` into :attr:`finished` if it ended, failed while its peers run on, or ran out of time."""
        results = task_outcomes(run)
        if run.state in FINAL_STATES or run.state == "GONE":
            run.ended_at = run.ended_at or now
            # results may land a moment after Slurm says the job ended (shared filesystems)
            if run.state == "COMPLETED" and any(r is None for r in results) and now - run.ended_at < 15:
                return
            state = "COMPLETED" if run.state == "GONE" and all(r is not None for r in results) else run.state
            self._finish(run, outcome(run, state, error_of(run, state)))
            return
        if any(r is not None and r[0] == "error" for r in results):
            # a task raised while its peers still run (they may wait forever on it): give them a grace period
            run.error_seen_at = run.error_seen_at or now
            if now - run.error_seen_at > self.error_grace_s:
                _cancel(run)
                run.ended_at = now
                self._finish(run, outcome(run, "FAILED", error_of(run, "FAILED")))
                return
        if run.started_at is not None and now - run.started_at > run.timeout_s:
            run.ended_at = now
            self.finished[run.job_id] = _stop_waiting(run)

    def _finish(self, run: SlurmRun, out: Outcome) -> None:
        """``run`` ended with ``out``, unless :attr:`retry` submits a failed one again: then ``run`` is its new job,
        waited for as any other."""
        if not out.ok and self.retry is not None and self.retry(run, out):
            return
        self.finished[run.job_id] = out


#: the states of a job waiting in the queue (again, where it ran before: requeued)
WAITING = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")


def lost_nodes(run: SlurmRun, ran_on: str) -> str | None:
    """A job Slurm requeued after it ran on ``ran_on`` (its node list): where some of those nodes are down now (Slurm's
    NODE_FAIL: a node lost mid-run), the job goes on once from its last checkpoint on the nodes it gets, without
    them (``scontrol update ExcNodeList``), and its folder says so for its record (:data:`REQUEUED`). A second node
    lost cancels it: the error returned says so (None: it goes on)."""
    down = down_nodes(ran_on)
    if not down:
        return None
    folder = Path(str(run.cfg.results.dir)) / ".jobs" / run.run_id
    said = read_requeues(folder)
    if said:
        _cancel(run)
        run.state = "NODE_FAIL"
        return (f"node(s) {', '.join(down)} failed (Slurm's NODE_FAIL) after the job had already gone on once without "
                f"{', '.join(said[-1]['nodes'])}: cancelled; its last whole checkpoint is kept and the same command "
                "goes on from it")
    excluded = sorted({*[str(n) for n in run.cfg.cluster.get("exclude") or []], *down})
    slurm_command(["scontrol", "update", f"JobId={run.job_id}", f"ExcNodeList={','.join(excluded)}"], timeout=30)
    entry = {"slurm_job_id": run.job_id, "nodes": down, "ran_on": ran_on, "excluded": excluded, "at": time.time()}
    try:
        write_requeues(folder, [*said, entry])
    except OSError as e:  # the record then says less; the job goes on all the same
        print(f"gems: {run.run_id}: could not note the lost node(s) in {folder}: {e}", file=sys.stderr, flush=True)
    print(f"gems: {run.run_id}: node(s) {', '.join(down)} of Slurm job {run.job_id} failed (NODE_FAIL); Slurm requeued "
          f"it: it goes on from its last checkpoint without them", file=sys.stderr, flush=True)
    return None


def down_nodes(nodelist: str) -> list[str]:
    """The nodes of ``nodelist`` (Slurm's form, node[1-2]) that Slurm holds down, drained or failed now."""
    if not nodelist or nodelist.startswith("("):
        return []
    try:
        out = slurm_command(["sinfo", "-h", "-N", "-n", nodelist, "-t", "down,drain,fail,no_respond",
                             "-o", "%N"], timeout=30)
    except subprocess.TimeoutExpired:
        return []
    if out.returncode != 0:
        return []
    return sorted({ln.strip() for ln in out.stdout.splitlines() if ln.strip()})


def _stop_waiting(run: SlurmRun) -> Outcome:
    """The outcome of a job the launcher stops waiting for: it ran ``cluster.timeout_min`` (default its time limit
    and 5 minutes). It goes on, and the outcome says how to follow it (``LEFT``); with
    ``cluster.cancel_on_timeout=true`` it is cancelled (``TIMEOUT``)."""
    minutes = run.timeout_s / 60
    key = section(run.cfg, "cluster").wait_key()
    if bool(run.cfg.cluster.cancel_on_timeout):
        _cancel(run)
        _, tail = stderr_tail(run)
        msg = (f"gave up after {minutes:g} min running ({key}); cluster.cancel_on_timeout=true: the job was "
               "cancelled" + (f"\n{tail}" if tail else ""))
        return outcome(run, "TIMEOUT", msg)
    sweep = run.cfg.results.sweep
    follow = f"gems status {sweep}" if sweep else f"squeue -j {run.job_id}"
    msg = (f"stopped waiting after {minutes:g} min running ({key}); Slurm job {run.job_id} goes on: follow it with "
           f"`{follow}`; it writes its record to {run.record_path} when it ends (cluster.cancel_on_timeout=true "
           "would have cancelled it)")
    return outcome(run, "LEFT", msg)


def table(runs: Sequence[SlurmRun], finished: dict[str, Outcome]) -> Any:
    """The jobs as a rich table: run, job, state, nodes or pending reason (the error when failed), time."""
    from rich.table import Table

    t = Table(title=f"gems: {len(finished)}/{len(runs)} Slurm job(s) done", title_justify="left")
    for col in ("run", "job", "state", "nodes / reason", "time"):
        t.add_column(col)
    now = time.time()
    for r in runs:
        out = finished.get(r.job_id)
        if out is not None:
            state = "[green]done[/]" if out.ok else "[yellow]left running[/]" if out.state == "LEFT" else \
                f"[red]{out.state.lower()}[/]"
            detail = "" if out.ok else (out.error or "").splitlines()[0][:70]
            elapsed = out.elapsed_s
        else:
            state, detail, elapsed = r.state.lower(), r.detail, now - r.submitted_at
        t.add_row(r.run_id, r.job_id, state, detail, f"{elapsed:.0f}s")
    return t


class LiveView:
    """A watcher's :func:`table` on stderr: redrawn after each poll on a terminal, drawn once at the end elsewhere."""

    def __init__(self, watcher: Watcher) -> None:
        from rich.console import Console
        from rich.live import Live

        self.watcher = watcher
        console = Console(stderr=True)
        self.live = Live(self._table(), console=console, refresh_per_second=4, transient=False,
                         auto_refresh=console.is_terminal)
        self.live.start()

    def _table(self) -> Any:
        return table(self.watcher.runs, self.watcher.finished)

    def refresh(self) -> None:
        if self.live.console.is_terminal:
            self.live.update(self._table())

    def close(self) -> None:
        self.live.update(self._table())
        self.live.stop()


def _record_cancelled(run: SlurmRun, signum: int) -> None:
    """Cancel a job the launcher gives up on (it received ``signum``) and write its cancelled record."""
    _cancel(run)
    error = f"slurm job {run.job_id}: cancelled: the launcher received {signal.Signals(signum).name}"
    record = rec.failed_record(run.cfg, error, failure={"kind": "cancelled", "signal": signum,
                                                        "slurm_job_id": run.job_id})
    record["env"]["slurm_job_id"] = run.job_id
    try:
        rec.write_record(run.record_path, record)
    except FileExistsError:
        pass


def wait(runs: SlurmRun | Sequence[SlurmRun], progress: bool = True, poll_s: float | None = None,
         on_update: Callable[[Sequence[SlurmRun], dict[str, Outcome]], None] | None = None,
         on_cancel: str = "cancel", retry: Callable[[SlurmRun, Outcome], bool] | None = None) -> list[Outcome]:
    """Wait until every job has ended (ok or failed); outcomes in the order of ``runs``.

    Waits as long as a job waits in the queue; once it runs, at most ``cluster.timeout_min`` (default
    ``cluster.time_min + 5``, again from each requeue), then stops waiting: the job goes on and its outcome
    (``LEFT``) says how to follow it, unless ``cluster.cancel_on_timeout=true`` cancels it. SIGINT, SIGTERM or
    SIGHUP raise :class:`~gems.errors.Cancelled`: with ``on_cancel="cancel"`` the jobs still queued or
    running are cancelled first and recorded so; with ``"leave"`` they go on (a detached study). ``retry``: a
    failed job's policy (:func:`gems.launch.resubmit.retry_bad_nodes`); where it submits the job again, its
    :class:`SlurmRun` becomes the new job and is waited for.
    """
    runs = [runs] if isinstance(runs, SlurmRun) else list(runs)
    if not runs:
        return []
    step = float(poll_s if poll_s is not None else min(section(r.cfg, "cluster").poll_s for r in runs))
    watcher = Watcher(runs, retry=retry)
    view = LiveView(watcher) if progress else None
    try:
        with cancel_on_signals():
            interval, seen = step, None
            while True:
                watcher.poll()
                if view is not None:
                    view.refresh()
                if on_update is not None:
                    on_update(runs, watcher.finished)
                if watcher.done:
                    break
                # one squeue a poll for all jobs; while nothing changes, ask less and less often
                now = (len(watcher.finished), tuple(r.state for r in runs))
                interval = step if now != seen else min(interval * 1.5, max(step, min(5 * step, 300.0)))
                seen = now
                time.sleep(interval)
    except Cancelled as c:
        left = watcher.unfinished
        ids = ", ".join(r.job_id for r in left)
        if on_cancel == "cancel":
            for r in left:
                _record_cancelled(r, c.signum)
            c.detail = f"cancelled Slurm job(s) {ids}" if left else "every job had ended"
        else:
            c.detail = f"Slurm job(s) {ids} go on" if left else "every job had ended"
        raise
    finally:
        if view is not None:
            view.close()
    return watcher.outcomes()


__all__ = ["Watcher", "LiveView", "table", "wait"]
