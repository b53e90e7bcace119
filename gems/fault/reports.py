"""Why a run failed, told by the rank that caused it and not by the peers that noticed: every rank that fails writes a
small report into its job folder (``failures/rank<k>.json``: when, its error in one line, whether it echoes a peer's),
and :func:`explain` names the cause from them and the exits the launcher saw, the same for the local launcher and
the Slurm waiter.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# what torch.distributed, gloo, NCCL and the store say when a *peer* failed or stalled (whole words)
_ECHOES = re.compile(r"\b(connection closed by peer|connection reset by peer|broken pipe|connection refused|"
                     r"socket timeout|timed out|timeout|nccl communicator was aborted|remote process exited|"
                     r"watchdog caught collective operation|distbackenderror|distnetworkerror|diststoreerror|"
                     r"failed to recv|failed to send|remote peer|was aborted|stops:)")


@dataclass
class Exit:
    """How one rank (or, under mpiexec, the launcher of all) ended, as the launcher saw it."""

    rank: int  # -1: not known (an MPI launcher's exit)
    code: int  # negative: killed by that signal
    rss_bytes: int | None = None  # last resident memory the launcher saw
    last_line: str = ""  # the last meaningful line of its log


def reports_dir(job_dir: Path | str) -> Path:
    return Path(job_dir) / "failures"


def is_echo(exc: BaseException) -> bool:
    """True when ``exc`` is a communication error: the rank saw a peer fail, it did not fail itself."""
    try:
        import torch.distributed as dist

        kinds = tuple(k for k in (getattr(dist, "DistError", None),) if k is not None)
        if kinds and isinstance(exc, kinds):
            return True
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return _ECHOES.search(f"{type(exc).__name__}: {exc}".lower()) is not None


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message``."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}".rstrip(": ")


def write_report(job_dir: Path | str, rank: int, error: str, *, echo: bool, kind: str = "rank_error",
                 blame: list[int] | None = None, trace: str = "", **extra: Any) -> Path | None:
    """Write this rank's failure report (atomically); None when the folder cannot be written."""
    d = reports_dir(job_dir)
    report = {"rank": rank, "time": time.time(), "error": error, "echo": echo, "kind": kind,
              "blame": blame, "trace": trace[-4000:], "pid": os.getpid(), **extra}
    tmp = d / f".rank{rank}.{os.getpid()}.tmp"
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp.write_text(json.dumps(report))
        final = d / f"rank{rank}.json"
        os.replace(tmp, final)
        return final
    except OSError:
        try:  # (a full disk: no half report left behind)
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return None


def amend_report(job_dir: Path | str, rank: int, **extra: Any) -> bool:
    """Add ``extra`` to the report this rank wrote (atomically; its error, kind and time stay, so the cause it names
    keeps its place); False where it wrote none or it cannot be rewritten."""
    final = reports_dir(job_dir) / f"rank{rank}.json"
    tmp = final.with_name(f".rank{rank}.{os.getpid()}.tmp")
    try:
        report = json.loads(final.read_text())
        tmp.write_text(json.dumps({**report, **extra}))
        os.replace(tmp, final)
        return True
    except (OSError, ValueError):
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False


def report_exception(job_dir: Path | str, rank: int, exc: BaseException) -> Path | None:
    return write_report(job_dir, rank, one_line(exc), echo=is_echo(exc), kind="rank_error",
                        trace="".join(traceback.format_exception(exc)), exception=type(exc).__name__)


def read_reports(job_dir: Path | str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    d = reports_dir(job_dir)
    if not d.is_dir():
        return out
    for p in sorted(d.glob("rank*.json")):
        try:
            r = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(r, dict) and "rank" in r:
            out.append(r)
    return sorted(out, key=lambda r: float(r.get("time", 0.0)))


def signal_text(code: int, rss_bytes: int | None = None) -> str:
    """What an exit by signal ``-code`` means, e.g. signal 9 and the out-of-memory killer."""
    num = -code
    try:
        name = signal.Signals(num).name
    except ValueError:
        name = f"signal {num}"
    text = f"was killed by signal {num} ({name})"
    if num == signal.SIGKILL:
        text += ": on a node this is usually the kernel's out-of-memory killer"
        if rss_bytes:
            text += f"; its last known resident memory was {rss_bytes / 2**30:.2f} GiB"
        text += " (see `gems plan` and train.host_memory)"
    elif num == signal.SIGSEGV:
        text += ": a crash in native code (a driver, a kernel or an extension)"
    elif num in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        text += ": something outside gems ended it"
    return text


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(set(ranks))
    shown = ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return ("rank " if len(ranks) == 1 else "ranks ") + shown


def explain(job_dir: Path | str | None, exits: list[Exit], who: str = "rank") -> tuple[str, dict[str, Any]]:
    """(headline, failure details) of a run whose ranks failed; ``exits`` in the order they were seen. It names,
    in this order: the earliest rank that failed on its own; a rank killed by a signal (with what the signal
    usually means); a rank the others blame (the host of the job's store, when it stops answering); the first rank
    that exited."""
    reports = read_reports(job_dir) if job_dir is not None else []
    causes = [r for r in reports if not r.get("echo")]
    echoes = [r for r in reports if r.get("echo")]
    if causes:
        c = causes[0]
        head = f"rank {c['rank']} failed: {c['error']}"
        after = sorted({int(r["rank"]) for r in reports if r is not c})
        if after:
            head += f" ({_ranks(after)} failed after it; their logs hold the echoes)"
        return head, {"kind": c.get("kind", "rank_error"), "rank": int(c["rank"]), "error": c["error"],
                      "exception": c.get("exception"), "others": after}
    killed = [e for e in exits if e.code < 0]
    if killed:
        k = killed[0]
        name = f"{who} {k.rank}" if k.rank >= 0 else "an MPI rank"
        return f"{name} {signal_text(k.code, k.rss_bytes)}", {
            "kind": "signal", "rank": k.rank, "signal": -k.code, "rss_bytes": k.rss_bytes}
    blamed = [b for r in echoes for b in (r.get("blame") or [])]
    if blamed:
        r = next(r for r in echoes if r.get("blame"))
        return r["error"], {"kind": r.get("kind", "stall"), "ranks": sorted(set(blamed)), "error": r["error"]}
    if echoes:
        r = echoes[0]
        return (f"rank {r['rank']} failed: {r['error']} (an error from communication: a peer failed or stalled "
                "without saying why)"), {"kind": "rank_error", "rank": int(r["rank"]), "error": r["error"]}
    bad = [e for e in exits if e.code != 0]
    if bad:
        e = bad[0]
        name = f"{who} {e.rank}" if e.rank >= 0 else "an MPI rank"
        return f"{name} exited with status {e.code}: {e.last_line or 'no output'}", {
            "kind": "exit", "rank": e.rank, "status": e.code}
    return "the job ended without writing its record", {"kind": "exit"}


#: the file in a run's folder that lists the nodes lost under it (gems.launch.watch.lost_nodes; the run's record says so)
REQUEUED = "requeued.json"


def read_requeues(folder: Path) -> list[dict[str, Any]]:
    """The nodes lost under the run whose folder is ``folder``, a requeue an entry (Slurm's job id, the nodes, the
    nodes it ran on, those left out after)."""
    try:
        got = json.loads((folder / REQUEUED).read_text())
    except (OSError, ValueError):
        return []
    return got if isinstance(got, list) else []


def write_requeues(folder: Path, entries: list[dict[str, Any]]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{REQUEUED}.tmp"
    tmp.write_text(json.dumps(entries))
    os.replace(tmp, folder / REQUEUED)
