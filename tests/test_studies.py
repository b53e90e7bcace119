"""Scaling studies that survive the cluster: manifests, resume, repeats, tables a user can trust, references,
comparisons; on the Slurm test cluster detached sweeps, status, arrays, cancel and interrupted sweeps.

``gems`` runs through ``gems.cli.main`` in the test's process (tests/_cli.py's ``gems_here``: the launcher's own
code, its ranks real processes forked by multiprocessing's fork server, its Slurm jobs real jobs); an interrupted
sweep, where a signal to the command is what is tested, is a ``gems`` process of its own."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _cli import gems_here, merged, records

TINY = ["model.size=32", "model.width=0.25", "train.steps=3", "train.warmup_steps=1"]


def _rows(table: Path) -> list[dict[str, str]]:
    lines = [ln for ln in table.read_text().splitlines() if ln.startswith("|") and not ln.startswith("|---")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, [c.strip() for c in ln.strip("|").split("|")])) for ln in lines[1:]]


def test_repeats_give_medians_and_a_resumed_sweep_runs_only_what_is_missing_or_failed(tmp_path):
    args = ["sweep", f"results.dir={tmp_path}", "results.sweep=s", *TINY, "parallel.replicas=1,2", "train.batch_size=2",
            "results.repeats=2"]
    out = gems_here(*args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 point(s) x 2 repeats, 4 to run" in out.stdout
    recs = records(str(tmp_path / "s"))
    assert len(recs) == 4 and sorted((r["point"], r["repeat"]) for r in recs) == [
        ("parallel.replicas=1", 0), ("parallel.replicas=1", 1), ("parallel.replicas=2", 0), ("parallel.replicas=2", 1)]
    rows = _rows(tmp_path / "s" / "table.md")
    assert [r["n"] for r in rows] == ["2", "2"]
    for r in rows:
        lo, hi, med = float(r["samples/s_min"]), float(r["samples/s_max"]), float(r["samples/s"])
        assert lo <= med <= hi
    manifest = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert manifest["schema"] == "gems.sweep/1" and len(manifest["points"]) == 4
    # again: everything is done
    again = gems_here(*args)
    assert again.returncode == 0 and "0 to run (4 done: skipped" in again.stdout, again.stdout
    # one record lost, one failed: the default re-runs both, rerun=none only the missing one
    lost = next(r for r in recs if r["point"] == "parallel.replicas=2" and r["repeat"] == 1)
    Path(lost["_path"] if "_path" in lost else next((tmp_path / "s").glob(f"{lost['run_id']}.json"))).unlink()
    bad = next((tmp_path / "s").glob(f"{next(r for r in recs if r['repeat'] == 0 and r['point'].endswith('=1'))['run_id']}.json"))
    rec = json.loads(bad.read_text())
    bad.unlink()
    bad.write_text(json.dumps(dict(rec, status="failed", error="made to fail by the test")))
    none = gems_here(*args, "results.rerun=none")
    assert none.returncode == 1 and "1 to run" in none.stdout, none.stdout  # exit 1: the failed point stays failed
    again = gems_here(*args)
    assert again.returncode == 0 and "1 to run" in again.stdout, again.stdout + again.stderr[-500:]
    rows = _rows(tmp_path / "s" / "table.md")
    assert [r["status"] for r in rows] == ["ok", "ok"] and [r["n"] for r in rows] == ["2", "2"]


def test_scaling_is_inferred_and_single_runs_get_no_speedup(tmp_path):
    strong = gems_here("sweep", f"results.dir={tmp_path}", "results.sweep=strong", *TINY, "parallel.replicas=1,2",
                       "train.batch_size=2")
    assert strong.returncode == 0, strong.stderr[-2000:]
    r1, r2 = _rows(tmp_path / "strong" / "table.md")
    eff = float(r2["efficiency"])
    want = float(r1["step_s"]) / (2 * float(r2["step_s"]))
    assert abs(eff - want) < 1e-3 * want and eff < 1.0  # strong: p0 T(p0) / (p T(p)), never above 1 here
    single = gems_here("run", f"results.dir={tmp_path}/single", *TINY)
    other = gems_here("run", f"results.dir={tmp_path}/single", *merged(*TINY, "model.width=0.5", "parallel.replicas=2",
                                                                  "train.batch_size=2"))
    assert single.returncode == other.returncode == 0
    res = gems_here("results", f"{tmp_path}/single")
    assert res.returncode == 0, res.stderr
    rows = _rows(tmp_path / "single" / "table.md")
    assert len(rows) == 2 and all(r["speedup"] == "" and r["efficiency"] == "" for r in rows)
    assert sorted(p.name for p in (tmp_path / "single").iterdir() if p.is_dir()) == [".jobs"]  # no new folders


def test_a_comparison_at_one_world_size_references_and_skipped_records(tmp_path):
    ref = '{1:{throughput:[0.001,null]},all:{step_time:[null,1e-9]}}'
    out = gems_here("sweep", f"results.dir={tmp_path}", "results.sweep=cmp", *TINY, "train.optimizer=sgd,adam",
                    f"results.reference={ref}")
    assert out.returncode == 1, out.stderr[-2000:]  # the step-time bound cannot be met
    assert "missed their reference" in out.stderr
    rows = _rows(tmp_path / "cmp" / "table.md")
    assert len(rows) == 2 and all(r["world"] == "1" for r in rows)
    assert all(r["reference"].startswith("pass") for r in rows) or all(r["reference"].startswith("fail") for r in rows)
    (tmp_path / "cmp" / "broken.json").write_text('{"schema": "gems.record/1", "status": "ok", ')
    res = gems_here("results", str(tmp_path))
    assert res.returncode == 1 and "skipped" in res.stderr and "broken.json" in res.stderr, res.stderr
    bad = gems_here("sweep", f"results.dir={tmp_path}", "results.sweep=x", *TINY, 'results.reference={1:{speed:[1,2]}}')
    assert bad.returncode == 2 and "results.reference.1.speed" in bad.stderr


def test_compare_puts_two_studies_side_by_side(tmp_path):
    for name, extra in (("a", []), ("b", ["train.optimizer=sgd"])):
        out = gems_here("sweep", f"results.dir={tmp_path}", f"results.sweep={name}", *TINY, "parallel.replicas=1,2",
                        "train.batch_size=2", *extra)
        assert out.returncode == 0, out.stderr[-2000:]
    res = gems_here("results", "--compare", str(tmp_path / "a"), str(tmp_path / "b"))
    assert res.returncode == 0, res.stderr
    text = (tmp_path / "a" / "compare-a-vs-b.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| 1") or ln.startswith("| 2")]
    assert len(rows) == 2 and "ratio (B/A)" in text
    # the step and its terms, A beside B: what a predicted study is compared with term by term
    header = text.splitlines()[2]
    for term in ("step_s", "compute_s", "allreduce_s", "data_s"):
        assert f"| a {term} | b {term} |" in header, header
    assert (tmp_path / "a" / "compare-a-vs-b.png").stat().st_size > 1000
    bad = gems_here("results", "--compare", str(tmp_path / "a"), "nope")
    assert bad.returncode == 2 and "nope" in bad.stderr


def test_status_and_cancel_of_an_unknown_study_are_bad_input(tmp_path):
    for cmd in (["status", "nope", f"results.dir={tmp_path}"], ["cancel", "nope", f"results.dir={tmp_path}"]):
        out = gems_here(*cmd)
        assert out.returncode == 2 and "sweep=nope" in out.stderr or "results.dir" in out.stderr, out.stderr
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "sweep.json").write_text('{"schema": "gems.sweep/0", "points": []}')
    out = gems_here("status", "old", f"results.dir={tmp_path}")
    assert out.returncode == 2 and "gems.sweep/1" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_detach_needs_slurm(tmp_path):
    out = gems_here("sweep", f"results.dir={tmp_path}", *TINY, "parallel.replicas=1,2", "train.batch_size=2", "--detach")
    assert out.returncode == 2 and "results.detach" in out.stderr
    assert not any(tmp_path.iterdir())


# ---------------------------------------------------------------------------- the Slurm test cluster
slurm = [pytest.mark.slurm,
         pytest.mark.skipif(shutil.which("sinfo") is None, reason="Slurm is not installed (scripts/slurm_cluster.sh start)")]


def _shim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, str], Path]:
    """PATH with an `sbatch` that logs each call and runs the real one: how many submissions a sweep makes. This
    process's PATH too (for the commands run here); the environment returned is a process's of its own."""
    bin_dir, log = tmp_path / "shim", tmp_path / "sbatch.calls"
    bin_dir.mkdir()
    real = shutil.which("sbatch")
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {log}\nexec {real} "$@"\n')
    (bin_dir / "sbatch").chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    monkeypatch.setenv("PATH", path)
    return dict(os.environ, PATH=path, PYTHONUNBUFFERED="1"), log


def _calls(log: Path) -> int:
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(1 for ln in lines if "--test-only" not in ln)


def _until_done(tmp_path: Path, name: str, limit: float = 900) -> str:
    t0 = time.monotonic()
    while True:
        out = gems_here("status", name, f"results.dir={tmp_path}")
        assert out.returncode == 0, out.stderr
        if "pending" not in out.stdout and "running" not in out.stdout:
            return out.stdout
        assert time.monotonic() - t0 < limit, out.stdout  # a guard against a hang only
        time.sleep(1)


@pytest.mark.parametrize("_", [0], ids=["detached"])
@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sinfo") is None, reason="no Slurm test cluster")
def test_a_detached_sweep_returns_at_once_and_is_followed_to_its_table(tmp_path, _, monkeypatch):
    _, log = _shim(tmp_path, monkeypatch)
    out = gems_here("sweep", f"results.dir={tmp_path}", "results.sweep=det", "cluster=local_slurm", *TINY,
                    "parallel.replicas=1,2", "train.batch_size=2", "results.repeats=2", "--detach")
    returned = time.time()
    assert out.returncode == 0, out.stderr[-2000:]
    assert "gems status det" in out.stdout, out.stdout
    assert _calls(log) == 2  # two shapes (1 and 2 tasks), each a job array of its two repeats: two sbatch calls
    final = _until_done(tmp_path, "det")
    assert final.count("done") >= 4, final
    # it returned at once: before any of its jobs ended (each job's rank 0 writes its record as it ends)
    ends = [p.stat().st_mtime for p in (tmp_path / "det").glob("*.json") if '"gems.record/' in p.read_text()]
    assert len(ends) == 4 and returned < min(ends), (returned, ends)
    res = gems_here("results", str(tmp_path / "det"))
    assert res.returncode == 0, res.stderr
    rows = _rows(tmp_path / "det" / "table.md")
    assert [r["n"] for r in rows] == ["2", "2"] and all(r["status"] == "ok" for r in rows)
    again = gems_here("sweep", f"results.dir={tmp_path}", "results.sweep=det", "cluster=local_slurm", *TINY,
                      "parallel.replicas=1,2", "train.batch_size=2", "results.repeats=2")
    assert again.returncode == 0 and "0 to run" in again.stdout and _calls(log) == 2, again.stdout


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sinfo") is None, reason="no Slurm test cluster")
def test_an_interrupted_sweep_leaves_its_jobs_running_and_recoverable_and_cancel_ends_them(tmp_path, monkeypatch):
    env, log = _shim(tmp_path, monkeypatch)
    p = subprocess.Popen([sys.executable, "-m", "gems.cli", "sweep", f"results.dir={tmp_path}", "results.sweep=int",
                          "cluster=local_slurm", *merged(*TINY, "train.steps=40"), "fault.step_delay_s=0.5",
                          "parallel.replicas=1,2", "train.batch_size=2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    t0 = time.monotonic()
    while _calls(log) < 2:
        assert time.monotonic() - t0 < 600 and p.poll() is None  # a guard against a hang only
        time.sleep(0.5)
    time.sleep(3)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and "go on" in err and "gems status int" in err, err
    status = gems_here("status", "int", f"results.dir={tmp_path}").stdout
    assert status.count("running") + status.count("pending") == 2, status
    out = gems_here("cancel", "int", f"results.dir={tmp_path}")
    assert out.returncode == 0 and "cancelled Slurm job(s)" in out.stdout, out.stdout
    final = _until_done(tmp_path, "int", limit=60)
    assert final.count("│ cancelled │") == 2, final
    # picked up again: the cancelled points are run once more (two sbatch calls, one per shape)
    again = gems_here("sweep", f"results.dir={tmp_path}", "results.sweep=int", "cluster=local_slurm", *TINY,
                      "parallel.replicas=1,2", "train.batch_size=2")
    assert again.returncode == 0 and "2 to run" in again.stdout, again.stdout + again.stderr[-1000:]
    assert _calls(log) == 4


def test_steps_csv_beside_the_record_and_a_chrome_trace_per_rank(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", *merged(*TINY, "train.steps=5"), "parallel.replicas=2",
                    "train.batch_size=2", "train.profile=true")
    assert out.returncode == 0, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    csv_path = Path(r["_path"]).with_suffix(".steps.csv")
    lines = csv_path.read_text().splitlines()
    assert lines[0] == "step,loss,step_time_s,warmup,measured,lr,val_loss,val_mae,val_accuracy" and len(lines) == 1 + 5
    rows = [ln.split(",") for ln in lines[1:]]
    assert [float(row[1]) for row in rows] == r["loss"] and [float(row[5]) for row in rows] == r["lr"]
    # warm-up, profiled for tensor memory, traced (train.profile), then the measured ones
    assert [row[4] for row in rows] == ["0", "0", "0", "1", "1"]
    # the traced step (the first after the tensor-memory profile) is left out of the timings
    assert len(r["step_time_s"]["all"]) == 2
    for rank in (0, 1):
        trace = json.loads((tmp_path / ".jobs" / r["run_id"] / "profile" / f"rank{rank}.json").read_text())
        assert trace["traceEvents"] and any("conv3d" in str(e.get("name", "")).lower() for e in trace["traceEvents"])
