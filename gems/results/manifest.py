"""A sweep's manifest: its points, their jobs and folders, so a study outlives the process that launched it.

``results/<sweep>/sweep.json`` is written (atomically) before the first job is
submitted and updated as jobs go out. ``gems status``, ``gems results`` and
``gems cancel`` read it; running the same sweep again reads it to skip the
points that already have what ``results.rerun`` asks for.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gems.errors import ConfigError
from gems.paths import write_result_json

SCHEMA = "gems.sweep/1"
NAME = "sweep.json"


def path_of(folder: Path | str) -> Path:
    return Path(folder) / NAME


def read(folder: Path | str) -> dict[str, Any] | None:
    """The manifest in ``folder``; None when there is none; ConfigError when it is not one gems can read."""
    p = path_of(folder)
    if not p.is_file():
        return None
    try:
        m = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError("sweep manifest", str(p), f"a readable {NAME} ({type(e).__name__}: {e})") from None
    if not isinstance(m, dict) or m.get("schema") != SCHEMA:
        got = m.get("schema") if isinstance(m, dict) else type(m).__name__
        raise ConfigError("sweep manifest", str(p), f"schema {SCHEMA} (it has {got!r}: written by another version "
                          "of gems; start the study under a new results.sweep)")
    return m


def write(folder: Path | str, manifest: dict[str, Any]) -> Path:
    """Write ``manifest`` into ``folder`` atomically (readable by all, like the records)."""
    return write_result_json(path_of(Path(folder)), dict(manifest, schema=SCHEMA, updated=time.time()))


def unfinished_points(folder: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifest's points (and repeats) that have no record yet, with what Slurm says of their jobs."""
    m = read(folder) if path_of(folder).is_file() else None
    if not m:
        return []
    have = {(str(r.get("point") or ""), int(r.get("repeat") or 0)) for r in records}
    left = [p for p in m.get("points", []) if (p["point"], int(p.get("repeat", 0))) not in have]
    if not left:
        return []
    states = job_states([p["job_id"] for p in left if p.get("job_id")])
    out = []
    for p in left:
        state = states.get(str(p.get("job_id")), "pending" if p.get("job_id") else "not submitted")
        out.append(dict(p, state=state))
    return out


def job_states(job_ids: list[str]) -> dict[str, str]:
    """{job id: pending | running | lost | ended} from one ``squeue`` (and ``sacct`` for the jobs squeue no
    longer lists); {} where Slurm cannot be asked."""
    import shutil
    import subprocess

    ids = sorted({str(j) for j in job_ids if j})
    if not ids or shutil.which("squeue") is None:
        return {}
    try:
        out = subprocess.run(["squeue", "-h", "-r", "--states=all", "-j", ",".join(ids), "-o", "%i|%T"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    got: dict[str, str] = {}
    for line in out.stdout.splitlines():
        jid, _, state = line.strip().partition("|")
        got[jid] = _word(state)
    missing = [j for j in ids if j not in got]
    if missing and shutil.which("sacct"):
        try:
            acct = subprocess.run(["sacct", "-n", "-X", "-P", "-j", ",".join(missing), "-o", "JobID,State"],
                                  capture_output=True, text=True, timeout=30)
            for line in acct.stdout.splitlines():
                jid, _, state = line.strip().partition("|")
                if jid in missing:
                    got[jid] = _word(state.split()[0] if state else "")
        except (OSError, subprocess.TimeoutExpired):
            pass
    for j in missing:
        got.setdefault(j, "lost")
    return got


def _word(state: str) -> str:
    s = state.upper()
    if s in ("PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "SUSPENDED"):
        return "pending"
    if s in ("RUNNING", "COMPLETING"):
        return "running"
    if s == "COMPLETED":
        return "ended"
    return s.lower() or "lost"


def point_name(combo: list[str], base: list[str]) -> str:
    """The swept values of a combination (what differs from the fixed overrides), in a stable order."""
    swept = [o for o in combo if o not in base]
    return " ".join(sorted(swept)) or "(single point)"
