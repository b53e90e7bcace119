"""Stall detection: every rank's heartbeat, one monitor, and a job that ends instead of hanging.

A rank that dies ends a job quickly; a rank that stalls (a hung kernel, a read, a collective its peers never join)
would hold its peers in their collectives for torch.distributed's timeout, 30 minutes on gloo. Every rank runs a
:class:`Watchdog`; the monitor on rank 0 names the stalled rank and the phases the others wait in (:func:`diagnose`),
and the job ends (docs/faults.md).
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gems.config import CommConf, FaultConf
from gems.progress import PROGRESS, SLOW, WAITS, Progress

ABORT_KEY = "gems/abort"
#: after warm-up, a rank's allowance is at least this many of the slowest step it has timed (Watchdog.saw_step)
STALL_STEPS = 10
EXIT_STATUS = 1  # a rank that ends the job for a stall exits with this status


def collective_timeout_s(comm: CommConf, fault: FaultConf) -> float:
    """torch.distributed's timeout (gloo's collectives, NCCL's watchdog): ``comm.timeout_s``, else long
    enough that the watchdog names a stall first (the warm-up allowance plus the stall timeout), and finite,
    so that a stuck collective raises where no watchdog runs."""
    if comm.timeout_s is not None:
        return float(comm.timeout_s)
    # with stall detection off (null) the schema's default stall allowance still bounds a stuck collective
    stall = fault.stall_timeout_s if fault.stall_timeout_s is not None else FaultConf().stall_timeout_s
    return fault.warmup_timeout_s + float(stall or 0.0)


def hb_key(rank: int) -> str:
    return f"gems/hb/{rank}"


@dataclass
class Beat:
    """One rank's heartbeat as the monitor holds it."""

    rank: int
    seq: int
    step: int
    phase: str
    age: float  # seconds since the rank's last progress, when it published
    limit: float  # the allowance that applies to it there
    seen: float  # the monitor's clock when this seq arrived
    device: str | None = None  # what its device was doing, where a sampler reads it (gems.telemetry)

    def age_now(self, now: float) -> float:
        return self.age + (now - self.seen)


@dataclass
class Stall:
    """A diagnosis: who stalled where, and what everyone else was doing."""

    ranks: list[int]
    step: int
    phase: str
    age: float
    limit: float  # the allowance that was exceeded
    frozen: list[int] = field(default_factory=list)  # ranks whose heartbeat stopped arriving too
    waiting: dict[int, str] = field(default_factory=dict)  # other ranks: their phase
    missing: list[int] = field(default_factory=list)  # ranks that never sent a heartbeat

    def message(self, stall_s: float, warmup_s: float) -> str:
        who = _ranks(self.ranks)
        timeout_key = (allowance_key(self.limit, stall_s, warmup_s) if not self.missing
                       else allowance_key(warmup_s, stall_s, warmup_s))
        if self.missing and set(self.ranks) <= set(self.missing):
            text = f"{who} never reported progress within {self.age:.0f} s of the job's start ({timeout_key})"
        else:
            text = (f"{who} made no progress for {self.age:.0f} s at step {self.step}, in phase {self.phase} "
                    f"({timeout_key})")
        if self.frozen:
            text += f"; the heartbeat of {_ranks(self.frozen)} stopped too (frozen or overloaded process)"
        if self.waiting:
            by_phase: dict[str, list[int]] = {}
            for r, ph in self.waiting.items():
                by_phase.setdefault(ph, []).append(r)
            parts = [f"{ph}: {_ranks(rs)}" for ph, rs in sorted(by_phase.items(), key=lambda kv: kv[1][0])]
            text += "; the others were in " + "; ".join(parts)
        if self.phase in WAITS and not self.missing:
            text += " (every stalled rank was waiting for a peer: a collective or message not every rank joined)"
        return text

    def as_dict(self) -> dict[str, Any]:
        return {"kind": "stall", "ranks": self.ranks, "step": self.step, "phase": self.phase,
                "seconds": round(self.age, 1), "frozen": self.frozen, "missing": self.missing,
                "waiting": {str(k): v for k, v in sorted(self.waiting.items())}}


def allowance_key(limit: float, stall_s: float, warmup_s: float) -> str:
    """The setting behind an allowance of ``limit`` seconds, as a stall's message names it."""
    if limit == stall_s:
        return f"fault.stall_timeout_s={stall_s:g}"
    if limit == warmup_s:
        return f"fault.warmup_timeout_s={warmup_s:g}: set-up, warm-up, checkpoints"
    return f"fault.stall_timeout_s={stall_s:g}, raised to {limit:.0f} s: {STALL_STEPS}x the run's slowest step"


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    shown = ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + shown


def diagnose(beats: dict[int, Beat], size: int, now: float, started: float, startup_limit: float,
             tick: float) -> Stall | None:
    """The stall among ``beats`` (rank -> last heartbeat) at ``now``, or None.

    A rank is stalled when its age on the monitor's clock reaches its limit; a
    rank that never published is stalled ``startup_limit`` after ``started``.
    The cause is the stalled ranks that were not waiting for a peer; when all
    of them were waiting, the one that has waited longest.
    """
    stalled = [b for b in beats.values() if b.age_now(now) >= b.limit]
    missing = [r for r in range(size) if r not in beats] if now - started >= startup_limit else []
    if not stalled and not missing:
        return None
    # a heartbeat is up to a tick old when it arrives: a rank that stopped computing a moment before its
    # peers stopped waiting for it may cross its limit just after them; it is still the cause
    near = [b for b in beats.values() if b.age_now(now) >= b.limit - 2 * tick]
    frozen = sorted(b.rank for b in stalled if now - b.seen > 3 * tick)
    causes = [b for b in near if b.phase not in WAITS]
    if not causes and stalled and not missing:
        causes = [max(stalled, key=lambda b: b.age_now(now))]
    if causes:
        first = min(causes, key=lambda b: (b.step, -b.age_now(now)))
        ranks = sorted(b.rank for b in causes)
        step, phase, limit = first.step, first.phase, first.limit
        age = max(limit, max(b.age_now(now) for b in causes))  # its heartbeat was up to a tick old
    else:
        ranks, step, phase, age, limit = sorted(missing), -1, "setup", now - started, startup_limit
    waiting = {b.rank: b.phase for b in beats.values() if b.rank not in ranks}
    return Stall(ranks + [r for r in missing if r not in ranks], step, phase, age, limit, frozen, waiting, missing)


class _LocalStore:
    """The store of a one-rank job: a dict with TCPStore's few calls."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.d[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys: list[str]) -> bool:
        return all(k in self.d for k in keys)

    def get(self, key: str) -> bytes:
        return self.d[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.d[k] for k in keys]


class Watchdog:
    """The heartbeat thread of one rank (and the monitor, on rank 0). Every ``tick`` seconds it

    1. publishes the rank's heartbeat (step, phase, seconds since its last progress and the allowance that applies
       there) in the job's TCPStore, the one torch.distributed rendezvouses through (rank 0 hosts it);
    2. on rank 0, reads every heartbeat (one ``multi_get``) and calls :func:`diagnose`: a rank that made no progress
       for its allowance is stalled;
    3. on the other ranks, looks for the monitor's abort key and ends the process.

    A stall found, the monitor has the failed record written (``on_stall``), sets the abort key, lets the peers go,
    asks Slurm to cancel the job (``scancel`` where ``SLURM_JOB_ID`` is set: a rank that cannot be interrupted must
    not hold the allocation) and ends its process. Where rank 0 cannot answer, the others see the store fall silent
    for their allowance and end with a report that blames it. The allowance is ``fault.stall_timeout_s`` (or
    :data:`STALL_STEPS` times the slowest step timed since the first after a (re)start, where longer), and
    ``fault.warmup_timeout_s`` during set-up, warm-up, the first step after a (re)start, checkpoints and the record.
    A heartbeat carries its own age, so clocks need not agree across nodes; one that stops arriving ages on the
    monitor's clock. A rank of the local launcher also ends when the launcher is gone (``launcher_pid``)."""

    def __init__(self, rank: int, size: int, *, stall_s: float, warmup_s: float, addr: str = "127.0.0.1",
                 port: int = 0, on_stall: Callable[[str, dict[str, Any]], None] | None = None,
                 on_report: Callable[[str, dict[str, Any]], None] | None = None,
                 progress: Progress = PROGRESS, tick: float | None = None, launcher_pid: int | None = None) -> None:
        self.rank, self.size = rank, size
        self.stall_s, self.warmup_s = float(stall_s), float(warmup_s)
        self.addr, self.port = addr, int(port)
        self.on_stall = on_stall  # monitor: write the failed record (message, failure details)
        self.on_report = on_report  # any rank that ends for a reason only it knows: write its failure report
        self.progress = progress
        self.tick = float(tick if tick is not None else min(5.0, max(0.25, self.stall_s / 6)))
        self.launcher_pid = launcher_pid
        self.warm_until = 1  # steps below this get the warm-up allowance (set by the worker)
        #: this rank's device in words, sent with its heartbeat (a sampler's: gems.rank.hooks.telemetry)
        self.describe_device: Callable[[], str] | None = None
        self.slowest_step_s = 0.0  # the slowest step timed since the first after a (re)start (saw_step)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq = 0
        self._beats: dict[int, Beat] = {}
        self._started = time.monotonic()
        self._last_ok = time.monotonic()
        self._said = False
        self.store: Any = None

    # ---- life ---------------------------------------------------------------------------------------------
    def start(self) -> "Watchdog":
        self.store = self._connect()
        self._started = self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="gems-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.tick + 5)

    def _connect(self) -> Any:
        if self.size == 1:
            return _LocalStore()
        import torch.distributed as dist

        # a client of its own (thread-safe use), to the server torch.distributed's rendezvous started
        return dist.TCPStore(self.addr, self.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=max(5.0, 2 * self.tick)))

    def saw_step(self, seconds: float) -> None:
        """A step of this rank took ``seconds`` (the worker tells it every step but the first after a (re)start,
        which compiles and plans): the allowance after warm-up is at least STALL_STEPS of the slowest."""
        self.slowest_step_s = max(self.slowest_step_s, float(seconds))

    def limit(self, step: int, phase: str) -> float:
        """The allowance at ``step`` in ``phase``."""
        if step < self.warm_until or phase in SLOW:
            return self.warmup_s
        return max(self.stall_s, STALL_STEPS * self.slowest_step_s)

    def _run(self) -> None:
        io: threading.Thread | None = None
        while not self._stop.wait(self.tick):
            if self.launcher_pid and not _alive(self.launcher_pid):
                self._end(f"rank {self.rank} stops: its launcher (pid {self.launcher_pid}) is gone")
            # the store's calls run beside this loop: one that hangs (rank 0 frozen: its server takes the
            # request and never answers) cannot hang the watchdog with it
            if io is None or not io.is_alive():
                io = threading.Thread(target=self._beat_safely, name="gems-heartbeat", daemon=True)
                io.start()
            if self.rank != 0:
                self._check_store()

    def _beat_safely(self) -> None:
        try:
            self.beat()
        except Exception as e:  # the store does not answer (counted by _check_store), or a bug: say it once
            if not self._said:
                self._said = True
                print(f"gems: watchdog of rank {self.rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def _check_store(self) -> None:
        """End this rank when the store on rank 0 has not answered for this rank's allowance."""
        silent = time.monotonic() - self._last_ok
        limit = self.limit(self.progress.step, self.progress.phase)
        if silent < limit + self.tick:
            return
        key = allowance_key(limit, self.stall_s, self.warmup_s)
        msg = (f"rank 0 stopped answering: the job's store on rank 0 ({self.addr}:{self.port}) has been silent "
               f"for {silent:.0f} s ({key}): rank 0 is stalled, frozen or gone")
        if self.on_report:
            self.on_report(msg, {"kind": "stall", "ranks": [0], "blame": [0], "phase": "unknown"})
        self._end(f"rank {self.rank}: {msg}")

    # ---- one tick -----------------------------------------------------------------------------------------
    def beat(self) -> None:
        """Publish this rank's heartbeat; on rank 0 read everyone's, elsewhere look for the abort key."""
        p = self.progress
        step, phase, age = p.step, p.phase, p.age()
        limit = self.limit(step, phase)
        self._seq += 1
        device = None
        if self.describe_device is not None:
            try:  # (a reading that fails never stops the heartbeat)
                device = self.describe_device()
            except Exception:
                device = None
        beat = json.dumps({"seq": self._seq, "step": step, "phase": phase, "age": round(age, 3), "limit": limit,
                           "device": device})
        self.store.set(hb_key(self.rank), beat)
        if self.rank == 0:
            self._monitor()
        elif self.store.check([ABORT_KEY]):
            msg = self.store.get(ABORT_KEY).decode(errors="replace")
            self._end(f"rank {self.rank} stops: {msg}")
        self._last_ok = time.monotonic()

    def _monitor(self) -> None:
        now = time.monotonic()
        keys = [hb_key(r) for r in range(self.size)]
        present = [r for r in range(self.size) if r in self._beats or self.store.check([keys[r]])]
        if present:
            values = self.store.multi_get([keys[r] for r in present])
            for r, raw in zip(present, values):
                d = json.loads(raw)
                old = self._beats.get(r)
                if old is None or old.seq != d["seq"]:
                    self._beats[r] = Beat(r, int(d["seq"]), int(d["step"]), str(d["phase"]), float(d["age"]),
                                          float(d["limit"]), now, d.get("device"))
        stall = diagnose(self._beats, self.size, now, self._started, self.warmup_s, self.tick)
        if stall is None:
            return
        message = stall.message(self.stall_s, self.warmup_s)
        seen = [f"rank {r}'s device: {self._beats[r].device}" for r in stall.ranks
                if r in self._beats and self._beats[r].device]
        if seen:  # why a rank is slow or stuck, where its device says (clocks, throttling, temperature, load)
            message += "; " + "; ".join(seen)
        if os.environ.get("GEMS_DEBUG"):
            print(f"gems: watchdog beats at {now:.2f}: {self._beats}", file=sys.stderr, flush=True)
        failure = stall.as_dict()
        if self.on_stall is not None:
            try:
                self.on_stall(message, failure)
            except Exception as e:  # the record could not be written: the launcher still names the stall
                print(f"gems: could not write the stall record: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        if self.on_report:
            self.on_report(message, failure)
        self.store.set(ABORT_KEY, message)
        print(f"gems: error: {message}", file=sys.stderr, flush=True)
        time.sleep(min(2 * self.tick, 3.0))  # the others read the abort key and end
        job = os.environ.get("SLURM_JOB_ID")
        if job and self.size > 1:
            try:  # a rank that cannot be interrupted must not hold the allocation to its time limit
                subprocess.run(["scancel", job], capture_output=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._end(None)

    def _end(self, message: str | None) -> None:
        if message:
            print(f"gems: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STATUS)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else (pid reused): treat as gone
        return False
    return True
