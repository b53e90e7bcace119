"""Scaling studies that survive the cluster: ``gems sweep``, ``gems status``, ``gems cancel``.

A study is its points times ``results.repeats``, and everything about it lives in its folder (the records, the
manifest ``sweep.json``, the tables), so it can be left and picked up (docs/studies.md, "Studies that outlive the
login session").
"""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gems.errors import ConfigError
from gems.fault.reports import read_requeues
from gems.results import manifest
from gems.results.manifest import point_name


@dataclass
class Point:
    """One run of a study: a combination of the swept values, one repeat of it."""

    point: str  # the swept values, e.g. "parallel.replicas=2"
    repeat: int
    cfg: Any
    action: str = "run"  # run | skip
    why: str = ""  # why skipped: done, running, failed (rerun=none)


@dataclass
class Plan:
    sweep: str
    folder: Path
    points: list[Point] = field(default_factory=list)
    detach: bool = False

    @property
    def to_run(self) -> list[Point]:
        return [p for p in self.points if p.action == "run"]


def plan(combos: list[list[str]], base: list[str], experiment: str | None, detach: bool = False) -> Plan:
    """Compose and check every point (nothing is written), then decide which to run from what the folder holds."""
    from omegaconf import OmegaConf, open_dict

    from gems.config import compose
    from gems.prepare import prepare
    from gems.results.record import default_name, new_run_id
    from gems.results.table import check_reference_spec, load, measured, point_of

    first = compose(combos[0])
    sweep = first.results.sweep or experiment or f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    folder = Path(first.results.dir) / sweep
    check_reference_spec(first.results.reference)
    repeats = int(first.results.repeats)
    rerun = str(first.results.rerun)
    detach = detach or bool(first.results.detach)
    if detach and first.cluster.launcher != "slurm":
        raise ConfigError("results.detach", True, "false with cluster=local (its ranks are this command's processes); "
                          "detach a study on Slurm (cluster=local_slurm, a preset, or cluster=slurm)")
    from gems.launch.base import prestart

    prestart(first)  # the server of the points' ranks on this machine, before the checks run torch
    have: dict[tuple[str, int], list[dict[str, Any]]] = {}
    if folder.is_dir():
        for r in load(folder).records:
            if r.get("sweep") == sweep:
                have.setdefault((point_of(r), int(r.get("repeat") or 0)), []).append(r)
    old = manifest.read(folder) if folder.is_dir() else None
    jobs = {(p["point"], int(p.get("repeat", 0))): p for p in (old or {}).get("points", [])}
    live = manifest.job_states([p["job_id"] for p in jobs.values() if p.get("job_id")])
    out = Plan(sweep, folder, detach=detach)
    for combo in combos:
        name = point_name(combo, base)
        checked = None
        for k in range(repeats):
            if checked is None:
                cfg = compose(combo)
                with open_dict(cfg):
                    cfg.results.sweep, cfg.results.point = sweep, name
                    cfg.results.dir = str(folder)
                try:
                    checked = cfg = prepare(cfg)  # every point is checked before any runs
                except ConfigError as e:  # which point of the sweep, where there are several
                    if len(combos) > 1:
                        raise ConfigError(e.key, e.value, f"{e.expected} [point {name} of {len(combos)}; nothing "
                                          "was submitted]") from None
                    raise
            else:  # another repeat of a checked point: its own run id
                cfg = OmegaConf.create(OmegaConf.to_container(checked, resolve=True))  # type: ignore[assignment]
                cfg.run_id = new_run_id(default_name(cfg))
            cfg.results.repeat = k
            p = Point(name, k, cfg)
            recs = sorted(have.get((name, k), []), key=lambda r: r.get("run_id") or "")
            job = jobs.get((name, k))
            state = live.get(str(job.get("job_id"))) if job and job.get("job_id") else None
            if recs and rerun != "all":
                if measured(recs[-1]) or recs[-1].get("status") == "ok":
                    p.action, p.why = "skip", "done"
                elif rerun == "none":
                    p.action, p.why = "skip", "failed (results.rerun=none)"
            elif not recs and state in ("pending", "running"):
                p.action, p.why = "skip", f"{state} (job {job['job_id'] if job else '?'})"
            out.points.append(p)
    return out


def save(p: Plan, submitted: dict[tuple[str, int], dict[str, Any]] | None = None) -> Path:
    """Write the study's manifest: every point, and the run ids and jobs of those submitted now."""
    old = manifest.read(p.folder) if p.folder.is_dir() else None
    prev = {(q["point"], int(q.get("repeat", 0))): q for q in (old or {}).get("points", [])}
    points = []
    for pt in p.points:
        key = (pt.point, pt.repeat)
        entry = dict(prev.get(key, {}), point=pt.point, repeat=pt.repeat, name=_name(pt.cfg),
                     world=_world(pt.cfg), batch=int(pt.cfg.train.batch_size), schedule=str(pt.cfg.parallel.schedule))
        if pt.action == "run":
            entry.update(run_id=str(pt.cfg.run_id), job_id=None, job_dir=None)
        if submitted and key in submitted:
            entry.update(submitted[key])
        points.append(entry)
    return manifest.write(p.folder, {"sweep": p.sweep, "created": (old or {}).get("created", time.time()),
                                     "cluster": str(p.points[0].cfg.cluster.name) if p.points else None,
                                     "points": points})


def _name(cfg: Any) -> str:
    from gems.results.record import default_name

    return default_name(cfg)


def _world(cfg: Any) -> int:
    from gems.mesh import mesh_from_config

    return mesh_from_config(cfg).size


def describe(p: Plan) -> str:
    runs = p.to_run
    skipped: dict[str, int] = {}
    for q in p.points:
        if q.action == "skip":
            kind = q.why.split(" ")[0]
            skipped[kind] = skipped.get(kind, 0) + 1
    points = len({q.point for q in p.points})
    reps = max((q.repeat for q in p.points), default=0) + 1
    text = f"sweep {p.sweep}: {points} point(s)" + (f" x {reps} repeats" if reps > 1 else "") + f", {len(runs)} to run"
    if skipped:
        text += " (" + ", ".join(f"{n} {k}: skipped" for k, n in sorted(skipped.items())) + "; results.rerun says which)"
    return text


def follow_text(sweep: str, results_dir: str) -> str:
    arg = f" results.dir={results_dir}" if results_dir != "results" else ""
    return (f"follow it with `gems status {sweep}{arg}`, collect it with `gems results {Path(results_dir) / sweep}`, "
            f"cancel it with `gems cancel {sweep}{arg}`")


# ---- status and cancel -------------------------------------------------------------------------------------------
def find(name: str | None, results_dir: str | Path = "results") -> list[Path]:
    """Sweep folders: the one named (a folder, or a sweep under ``results_dir``), or every one under it."""
    root = Path(results_dir)
    if name:
        for cand in (Path(name), root / name):
            if manifest.path_of(cand).is_file():
                return [cand]
        known = sorted(p.parent.name for p in root.rglob(manifest.NAME)) if root.is_dir() else []
        raise ConfigError("sweep", name, ("one of " + ", ".join(known)) if known
                          else f"a sweep with a manifest under {root} (none there; give results.dir=...)")
    if not root.is_dir():
        raise ConfigError("results.dir", str(root), "a folder holding sweeps")
    found = sorted({p.parent for p in root.rglob(manifest.NAME) if ".jobs" not in p.parts})
    if not found:
        raise ConfigError("results.dir", str(root), "a folder holding sweeps (no sweep.json under it)")
    return found


def status_rows(folder: Path) -> list[dict[str, Any]]:
    """Each point (and repeat) of a study with its state: done, failed (why), diverged, pending, running, lost."""
    from gems.results.table import load, point_of

    m: dict[str, Any] = manifest.read(folder) or {}
    recs: dict[tuple[str, int], dict[str, Any]] = {}
    for r in sorted(load(folder).records, key=lambda r: r.get("run_id") or ""):
        recs[(point_of(r), int(r.get("repeat") or 0))] = r
    states = manifest.job_states([p["job_id"] for p in m.get("points", []) if p.get("job_id")
                                  and (p["point"], int(p.get("repeat", 0))) not in recs])
    rows = []
    for p in m.get("points", []):
        key = (p["point"], int(p.get("repeat", 0)))
        got = recs.get(key)
        # a job submitted again without a bad node (cluster.exclude_bad_nodes): the manifest's, or the record's word
        again = [f"Slurm job {a['slurm_job_id']} failed: {a['why']}; submitted again without {', '.join(a['excluded'])}"
                 for a in p.get("resubmitted") or []]
        if got is not None:
            r = got
            state = "diverged" if r.get("diverged") else ("done" if r.get("status") == "ok" else "failed")
            why = (r.get("error") or "").splitlines()[0][:100] if state == "failed" else ""
            again = [str(t) for t in [((r.get("config") or {}).get("cluster") or {}).get("resubmitted")] if t] or again
        elif p.get("job_id"):
            state = states.get(str(p["job_id"]), "pending")
            if state == "cancelled":
                why = "cancelled (gems cancel, scancel or the launcher)"
            elif state not in ("pending", "running"):
                state, why = "failed", f"the job ended ({state}) without a record"
            else:
                why = ""
        else:
            state, why = "not submitted", ""
        lost = [f"node(s) {', '.join(q['nodes'])} failed (NODE_FAIL): Slurm job {q['slurm_job_id']} went on without them"
                for q in (got or {}).get("requeued") or read_requeues(folder / ".jobs" / str(p.get("run_id")))]
        again += lost
        if again:
            why = f"{why}; {again[-1]}" if why else again[-1]
        rows.append({"point": p["point"], "repeat": key[1], "run_id": p.get("run_id", ""), "job": p.get("job_id") or "",
                     "state": state, "why": why})
    return rows


def cancel(folder: Path) -> list[str]:
    """Cancel the jobs of a study that have no record yet (one ``scancel``); returns their job ids."""
    rows = status_rows(folder)
    ids = sorted({str(r["job"]) for r in rows if r["job"] and r["state"] in ("pending", "running")})
    if ids:
        try:
            subprocess.run(["scancel", *ids], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ConfigError("cluster", "slurm", f"a Slurm whose scancel answers ({type(e).__name__})") from None
    return ids


def print_status(folder: Path) -> int:
    from rich.console import Console
    from rich.table import Table

    rows = status_rows(folder)
    t = Table(title=f"{folder.name}: {sum(r['state'] == 'done' for r in rows)}/{len(rows)} done", title_justify="left")
    for c in ("point", "repeat", "job", "state", "why"):
        t.add_column(c)
    for r in rows:
        colour = {"done": "green", "failed": "red", "diverged": "red", "running": "cyan"}.get(r["state"], "yellow")
        t.add_row(r["point"], str(r["repeat"]), str(r["job"]), f"[{colour}]{r['state']}[/]", r["why"])
    Console(width=None if sys.stdout.isatty() else 200).print(t)
    return 0
