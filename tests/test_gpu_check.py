"""The GPU rig (scripts/gpu_check.sh, gems/gpucheck.py): its matrix, its comparison, its plumbing on CPU (the
dry mode), and the test aid that lets ranks share a GPU, refused outside the local launcher. What only a GPU can
show (NCCL's hangs, TF32, the shared GPU itself) the rig shows where one is lent: results/gpu/."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _cli import gems_here

from gems.errors import ConfigError
from gems.gpucheck import TOLERANCE, compare, matrix
from gems.pipeline.schedules import registered

ROOT = Path(__file__).resolve().parent.parent


def test_the_matrix_covers_every_schedule_the_hybrids_and_the_precisions() -> None:
    runs = matrix(dry=False)
    labels = {r.label: r for r in runs}
    for name in registered():
        for D in (2, 4):
            for m in (1, 2, 4):
                assert f"{name}-D{D}-m{m}" in labels, (name, D, m)
    # a combination the schedule refuses is listed, with the key and what would work
    refused = labels["interleaved1f1b-D2-m1"]
    assert refused.skipped.startswith("parallel.micro_batches")
    assert not labels["1f1b-D4-m4"].skipped and labels["1f1b-D4-m4"].ranks == 4
    for label in ("R2xD2xS2-mast", "R2xD2xS2-master", "S2", "R2", "1f1b-D2-m2-fp16", "mast-D2-m1-bf16"):
        assert label in labels
    assert labels["R2xD2xS2-mast"].ranks == 8
    # the strict mode: NCCL's buffers below any halo, one connection a GPU, over the spatial compositions
    strict = [r for r in runs if r.label.startswith("strict-")]
    assert {r.label for r in strict} >= {"strict-S2", "strict-R2xS2", "strict-D2xS2-1f1b-m2"}
    assert all(int(r.env["NCCL_BUFFSIZE"]) < 1 << 20 and r.env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1" for r in strict)
    # the U-Net's skips across cuts and recomputed pieces, against a U-Net reference (strict where parts talk)
    unet = [r for r in runs if r.family == "unet" and r.ranks > 1]
    assert {r.label for r in unet} >= {"unet-D2", "unet-D2xS2", "unet-S2-checkpoint"}
    assert all(r.reference_label == "1rank-fp32-unet" and "model=unet3d" in r.args for r in unet)
    assert labels["unet-D2xS2"].env == labels["strict-S2"].env
    # every run has its one-rank reference in the matrix, TF32 off in all of them
    for r in runs:
        assert r.reference_label in labels, r.label
    assert {"control-1f1b", "control-gpipe"} <= set(labels)
    from gems.gpucheck import _base
    assert "train.tf32=false" in _base(dry=False) and "train.device=cuda" in _base(dry=False)


def test_graphs_holding_nccl_work_run_last_and_the_verdict_counts_only_their_passes_as_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphed multi-rank points come last in the matrix, each with a limit of its own past gems's warm-up and
    stall allowances (gems's watchdog names the stuck ranks first) and NCCL's warnings on; the deterministic pair
    compares graphed against eager bit for bit. A point that hangs (a command that sleeps past its limit here, as a
    hang on a GPU would) is killed with what it started and runs once more with NCCL_GRAPH_MIXING_SUPPORT=0: a pass
    there is that setting's, counted apart and never toward turning train.graph_collectives on. One that hangs again
    is a timeout. One that wrote a good record and did not end, or whose ranks named their teardown past its limit,
    is a teardown hang, never a timeout, and the graphs its ranks named are the reason given. The hangs themselves
    are a GPU's: this drives the rig's handling of them with commands that stand for them."""
    import gems.gpucheck as gc

    runs = matrix(dry=False)
    graphed = [r for r in runs if r.label.startswith("graphed-")]
    assert [r.label for r in graphed] == ["graphed-R2", "graphed-S2", "graphed-R2xS2"]
    assert runs[-len(graphed):] == graphed and all(gc.GRAPHED_KEY in r.args for r in graphed)
    base = gc._base(dry=False)
    assert f"fault.warmup_timeout_s={gc.WARMUP_S:g}" in base and f"fault.stall_timeout_s={gc.STALL_S:g}" in base
    assert all(r.limit_s and r.limit_s > gc.WARMUP_S + gc.STALL_S and r.env["NCCL_DEBUG"] == "WARN" for r in graphed)
    exact = next(r for r in runs if r.label == "1rank-deterministic-graphed")
    assert exact.exact and exact.reference_label == "1rank-deterministic-eager"

    def command(run: Any, out: Path, dry: bool) -> list[str]:  # hangs unless graph mixing is off (or it is "twice")
        folder = out / "runs" / run.label
        body = ("import os, sys, time, json, pathlib\n"
                "if run.env.get('NCCL_GRAPH_MIXING_SUPPORT') != '0' and 'good' not in label or 'twice' in label: "
                "time.sleep(30)\n").replace("run.env", "os.environ").replace("label", repr(run.label))
        body += f"pathlib.Path({str(folder)!r}).mkdir(parents=True, exist_ok=True)\n"
        body += f"pathlib.Path({str(folder / 'losses.json')!r}).write_text(json.dumps([1.0, 0.5]))\n"
        if "stuck" in run.label:  # a good record, then a teardown that never ends
            body += "time.sleep(30)\n"
        if "named" in run.label:  # a good record, then the ranks' own limit: they name the graph and exit
            report = {"rank": 1, "time": 1.0, "echo": False, "kind": "teardown", "error": "rank 1: its process groups "
                      "were not destroyed within 30 s: CUDA graphs still alive: the step's graph holding NCCL work of "
                      "the world, not in the registry"}
            body += (f"f = pathlib.Path({str(folder / '.jobs' / 'x' / 'failures')!r}); f.mkdir(parents=True)\n"
                     f"(f / 'rank1.json').write_text({json.dumps(report)!r})\n")
        return [sys.executable, "-c", body]

    monkeypatch.setattr(gc, "_command", command)
    ref = gc.Run("control-1f1b-1rank", [], 1, control="1f1b", env={"NCCL_GRAPH_MIXING_SUPPORT": "0"})
    point = dict(control="1f1b", limit_s=2.0, retry_env=dict(gc.GRAPHED_RETRY))
    hung, twice, good, stuck, named = (gc.Run(label, [gc.GRAPHED_KEY], 1, **point)  # type: ignore[arg-type]
                                       for label in ("graphed-R2", "graphed-twice", "graphed-good", "graphed-good-stuck",
                                                     "graphed-good-named"))
    gc.run_matrix([ref, hung, twice, good, stuck, named], tmp_path, dry=True, budget_s=60, ranks=8)
    assert hung.status == "ok" and hung.equal and hung.setting == "NCCL_GRAPH_MIXING_SUPPORT=0"
    assert hung.first_try.startswith("killed after 2 s")
    assert twice.status == "timeout" and twice.setting == "NCCL_GRAPH_MIXING_SUPPORT=0"
    assert good.status == "ok" and good.equal and good.setting == "as set"
    assert stuck.status == "teardown hang" and stuck.setting == "as set" and "did not end" in stuck.error
    assert named.status == "teardown hang" and "the step's graph holding NCCL work of the world" in named.error
    summary = gc.write_summary([ref, hung, twice, good, stuck, named], tmp_path, dry=True, wall_s=1.0)
    assert summary["counts"]["equal"] == 1 and summary["counts"]["equal_other_setting"] == 1
    verdict = summary["graph_collectives"]
    assert not verdict["turn_on"] and verdict["passed"] == ["graphed-good"]
    assert "graphed-R2 ok under NCCL_GRAPH_MIXING_SUPPORT=0" in verdict["verdict"]
    table = (tmp_path / "summary.md").read_text()
    assert "| ok (NCCL_GRAPH_MIXING_SUPPORT=0) |" in table and "ran with NCCL_GRAPH_MIXING_SUPPORT=0 after a hang" in table
    assert "train.graph_collectives by default: no (" in table
    assert gc.graph_collectives([good])["turn_on"]


def test_the_comparison_names_a_difference_and_refuses_unequal_lengths() -> None:
    ref = [1.0, 0.5, 0.25]
    assert compare(ref, ref) == 0.0
    assert compare([1.0, 0.5, 0.26], ref) == pytest.approx(0.04)
    assert compare([1.0, 0.5], ref) is None and compare([], ref) is None
    assert TOLERANCE["fp32"] < TOLERANCE["bf16"]


def test_the_dry_rig_runs_a_pipeline_and_the_torch_control_equal_to_one_rank(tmp_path: Path) -> None:
    """The plumbing on CPU: gems's 1F1B at D = 2, torch.distributed.pipelining's Schedule1F1B and the U-Net at
    D = 2 (its skips across the cut), each against its own one-rank run, through the script a GPU user runs."""
    out = tmp_path / "check"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry", "--only", "1f1b,unet-D2", "--out",
                        str(out)], capture_output=True, text=True, timeout=420, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    runs = {x["label"]: x for x in summary["runs"]}
    assert set(runs) == {"1rank-fp32", "1f1b-D2-m2", "control-1f1b-1rank", "control-1f1b", "1rank-fp32-unet",
                         "unet-D2"}
    for label in ("1f1b-D2-m2", "control-1f1b", "unet-D2"):
        x = runs[label]
        assert x["status"] == "ok" and x["equal"] is True, x
        assert len(x["losses"]) == len(x["reference"]) == 2 and x["max_rel_diff"] < TOLERANCE["fp32"]
    assert runs["unet-D2"]["reference"] == runs["1rank-fp32-unet"]["losses"] != runs["1rank-fp32"]["losses"]
    assert summary["counts"]["equal"] == summary["counts"]["compared"] == 3
    assert "| 1f1b-D2-m2 | 2 | fp32 | ok |" in (out / "summary.md").read_text()


def test_sharing_a_gpu_is_a_test_aid_of_the_local_launcher_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from gems.bootstrap import SHARE_GPU_ENV, check_launch, sharing_gpu
    from gems.config import compose

    monkeypatch.delenv(SHARE_GPU_ENV, raising=False)
    assert not sharing_gpu()
    monkeypatch.setenv(SHARE_GPU_ENV, "1")
    assert sharing_gpu()
    cfg = compose(["cluster=local_slurm", "cluster.nodes=1", "cluster.tasks_per_node=2", "parallel.replicas=2"])
    with pytest.raises(ConfigError, match=SHARE_GPU_ENV):
        check_launch(cfg, 2)
    assert check_launch(compose(["parallel.replicas=2"]), 2) == "cpu"  # the local launcher: allowed


def test_the_overhead_benchmarks_gpu_mode_runs_both_loops_side_by_side_on_any_device() -> None:
    """`gems bench overhead` on a GPU: gems's loop and a plain loop over the same module in one process, at fp32
    and bf16. Its plumbing on this CPU: both loops run, each row has both medians and the ratio of them."""
    import torch

    from gems.bench.overhead import device_rows

    rows = device_rows(torch.device("cpu"), ["model.size=32", "model.width=0.25", "train.batch_size=2"], rounds=1,
                       steps=4, warmup=1)
    assert [r[0].split(",")[2].split()[0] for r in rows] == ["fp32", "bf16"]
    for r in rows:
        gems_s, plain_s = float(r[1].split()[0]), float(r[2].split()[0])
        assert gems_s > 0 and plain_s > 0
        # the ratio of the medians (the row prints them rounded to 0.1 ms)
        assert r[3].endswith("x throughput") and abs(float(r[3].split("x")[0]) * gems_s / plain_s - 1) < 0.02


def test_bench_overhead_refuses_overrides_without_a_gpu(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the overrides set the GPU mode's job")
    r = gems_here("bench", "overhead", "model.size=64", f"out={tmp_path}")
    assert r.returncode == 2 and "bench option=model.size=64" in r.stderr and "GPU mode" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def dry_lease(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One dry lease (scripts/gpu_lease.py --dry) of every phase but the rig (the dry rig has its test above): the
    graphed points first, gems bench step's plumbing, a one-rank row, the calibration, gems bench search's GPU half,
    and the science point trained in the background beside them. Its folder: work/ (the lease's scratch) and out/
    (what a device call brings back)."""
    tmp = tmp_path_factory.mktemp("lease")
    env = dict(os.environ, OMP_NUM_THREADS="1", GEMS_LEASE_WORK=str(tmp / "work"))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_lease.py"), "--dry", "--phases",
                        "graphed,step,rows,bench,search,science", "--out", str(tmp / "out")], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return tmp


@pytest.mark.xdist_group("dry_lease")  # one worker runs both: the lease runs once
def test_the_lease_scripts_science_point_writes_universes_trains_beside_a_phase_and_is_archived(
        dry_lease: Path, tmp_path: Path) -> None:
    """The science phase on CPU (--dry): universes written with the study's generator, the sample-size study's
    point trained on them in the background while the rows phase runs, its record and validations in the archive;
    the same universes and recipe train to the same figures as a plain `gems run` of the point (HDF5 counts read
    raw and finished where the step runs)."""
    import tarfile

    out = dry_lease / "out"
    phases = json.loads((dry_lease / "work" / "phases.json").read_text())
    science = next(x for x in phases if x["label"] == "science")
    assert science["rc"] == 0 and science["background"] is True
    with tarfile.open(out / "lease.tgz") as tar:
        names = tar.getnames()
        record_name = next(n for n in names if n.startswith("science/run/") and n.endswith("lease-science-128.json"))
        record = json.loads(tar.extractfile(record_name).read())  # type: ignore[union-attr]
    assert record["status"] == "ok" and record["epochs"] == 2 and len(record["validation"]) == 2
    assert not any("universes" in n for n in names)  # the data stays on the machine
    # the point's own run, outside the lease, on the universes it wrote: the same losses to the bit
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_lease", ROOT / "scripts" / "gpu_lease.py")
    assert spec is not None and spec.loader is not None
    lease = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lease)
    point = lease.science_commands(dry_lease / "work", True, 1)[1]
    point = [a for a in point[3:] if not a.startswith(("results.dir=", "run_id="))]  # gems run's own arguments
    assert point[0] == "run"
    again = gems_here(*point, f"results.dir={tmp_path / 'again'}", "run_id=again", cwd=ROOT)  # ranks as processes
    assert again.returncode == 0, again.stderr[-3000:]
    rerun = json.loads((tmp_path / "again" / "again.json").read_text())
    assert rerun["loss"] == record["loss"] and rerun["validation"][-1]["mae"] == record["validation"][-1]["mae"]


@pytest.mark.xdist_group("dry_lease")  # one worker runs these: the lease runs once
def test_the_lease_runs_the_graphed_points_first_to_their_end_with_the_deterministic_pair_and_their_pools(
        dry_lease: Path) -> None:
    """The graphed phase on CPU (--dry: R = 2 through the capture's stand-in, its sums and sync captured): it runs
    first, its points and the deterministic pair through the rig to their processes' end (no rank named a teardown
    past its limit), the pair equal bit for bit, each graphed point's record beside gems plan's peak for its
    configuration (a CPU holds no CUDA pool: the lease's GPU fills that column), graphed.md back and the records and
    graphed.json in the archive; a dry run turns nothing on."""
    import tarfile

    phases = json.loads((dry_lease / "work" / "phases.json").read_text())
    assert [x["label"] for x in phases][:2] == ["imports", "graphed"] and phases[1]["rc"] == 0
    got = json.loads((dry_lease / "work" / "graphed.json").read_text())
    runs = {r["label"]: r for r in got["summary"]["runs"]}
    assert set(runs) == {"1rank-fp32", "1rank-deterministic-eager", "1rank-deterministic-graphed", "graphed-R2"}
    assert runs["graphed-R2"]["status"] == "ok" and runs["graphed-R2"]["equal"] and not runs["graphed-R2"]["first_try"]
    pair = runs["1rank-deterministic-graphed"]
    assert pair["exact"] and pair["equal"] and pair["max_rel_diff"] == 0.0
    assert not got["summary"]["graph_collectives"]["turn_on"] and "not from a dry run" in \
        got["summary"]["graph_collectives"]["verdict"]
    (pool,) = got["pools"]
    assert pool["label"] == "graphed-R2" and pool["status"] == "ok" and pool["planned_bytes"] > 0
    assert pool["reserved_bytes"] is None
    table = (dry_lease / "out" / "graphed.md").read_text()
    assert "| graphed-R2 | ok |" in table and "| graphed-R2 | 2 | fp32 | ok |" in table
    with tarfile.open(dry_lease / "out" / "lease.tgz") as tar:
        names = tar.getnames()
    assert "graphed.json" in names and any(n.startswith("graphed/runs/graphed-R2/") and n.endswith(".json")
                                           for n in names)


@pytest.mark.xdist_group("dry_lease")  # one worker runs these: the lease runs once
def test_the_lease_searches_one_gpus_steps_as_they_are_and_under_a_cap(dry_lease: Path) -> None:
    """gems bench search's GPU half (the lease's search phase, issue 72) on CPU (--dry): one rank's plain step is
    chosen and run as it is; under a cap halfway between its planned peak and its recomputing step's, the recomputing
    step is chosen and runs, and the plain step run past the fit check stops at the cap, as planned."""
    plain, capped = json.loads((dry_lease / "work" / "search" / "search-gpu.json").read_text())
    assert [(r["options"], r["chosen"]) for r in plain["rows"]] == [("plain", True)] and plain["rows"][0]["measured"]
    assert [(r["options"], r["chosen"]) for r in capped["rows"]] == [("plain recompute", True)]
    assert capped["rows"][0]["measured"] and "cluster.rank_memory_gb=" in " ".join(capped["overrides"])
    past = capped["past_cap"]
    assert past["options"] == "plain" and past["stopped_at_cap"] and past["measured_peak_bytes"] > past["cap_bytes"]
    assert "stopped at the cap" in (dry_lease / "out" / "search-gpu.md").read_text()


@pytest.mark.xdist_group("dry_lease")  # one worker runs these: the lease runs once
def test_the_lease_script_writes_rows_in_the_gpu_files_schema_and_refuses_a_bad_phase(
        dry_lease: Path, tmp_path: Path) -> None:
    """scripts/gpu_lease.py's plumbing on CPU: a one-rank row through a real `gems run`, in the schema
    tests/test_plan_gpu.py reads from results/gpu/, a calibration, and everything in the one archive a device call
    brings back; a phase it does not know is exit 2 and writes nothing."""
    import tarfile

    env = dict(os.environ, OMP_NUM_THREADS="1", GEMS_LEASE_WORK=str(tmp_path / "work"))
    out = dry_lease / "out"
    # gems bench step's table (here its plumbing's) and every gems record of it come back
    assert "gems bench step on cpu" in (out / "step-cpu.md").read_text()
    assert {x["contender"] for x in json.loads((out / "step-records.json").read_text())} == {"gems", "gems eager"}
    rows = json.loads((out / "rows.json").read_text())
    row = rows["runs"]["dry_small"]
    assert row["status"] == "ok" and row["overrides"]["size"] == 32 and row["overrides"]["batch"] == 4
    assert row["step_time_s_median"] > 0 and len(row["loss"]) == 3 and "compute" in row["time_breakdown_s"]
    # a CPU rank counts neither what CUDA allocated nor what its tensors requested
    assert row["cuda_max_allocated_bytes"] is None and row["cuda_max_requested_bytes"] is None
    assert "torch" in rows["machine"]
    with tarfile.open(out / "lease.tgz") as tar:
        names = tar.getnames()
    assert "phases.json" in names and any(n.endswith("calibration-cpu.json") for n in names)
    assert not any(n.endswith(".pt") for n in names)
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_lease.py"), "--dry", "--phases", "rows,gpu",
                          "--out", str(tmp_path / "bad")], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "--phases" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "bad").exists()
    for opt, named in (("--rows=c512_b1_bf16,nope", "nope is not a row"), ("--science-epochs=0", "1 or more")):
        bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_lease.py"), "--dry", opt,
                              "--out", str(tmp_path / "bad")], capture_output=True, text=True, timeout=120, env=env)
        assert bad.returncode == 2 and named in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert not (tmp_path / "bad").exists()
    # a scratch folder no lease made is not cleared
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    other = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_lease.py"), "--dry", "--phases", "rows",
                            "--out", str(tmp_path / "other")], capture_output=True, text=True, timeout=120,
                           env=dict(env, GEMS_LEASE_WORK=str(mine)))
    assert other.returncode == 2 and "GEMS_LEASE_WORK" in other.stderr and (mine / "keep.txt").exists()
    assert not (tmp_path / "other").exists()


def test_a_lease_command_at_its_limit_goes_with_what_it_started(tmp_path: Path) -> None:
    """A rig killed at the lease's limit must not leave its ranks on the GPU through the timed phases after it:
    the command runs in a session of its own, and its whole process group goes at the limit."""
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("gpu_lease", ROOT / "scripts" / "gpu_lease.py")
    assert spec is not None and spec.loader is not None
    lease_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lease_mod)
    lease = lease_mod.Lease(tmp_path / "out", tmp_path / "work", 60.0, True)
    pidfile = tmp_path / "child.pid"
    t0 = time.monotonic()
    rc = lease.run("sleeper", ["bash", "-c", f"sleep 60 & echo $! > {pidfile}; wait"], 1.5)
    # it returned at its limit: before the child it started would have ended by itself (its 60 s)
    assert rc == 124 and time.monotonic() - t0 < 60
    child = int(pidfile.read_text())

    def alive() -> bool:
        try:
            os.kill(child, 0)
            return Path(f"/proc/{child}/stat").read_text().split()[2] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            return False

    while alive():  # the kill was sent: it goes when the kernel has delivered it
        assert time.monotonic() - t0 < 60, "the command's child outlived its limit"
        time.sleep(0.1)
    assert lease.phases[-1]["label"] == "sleeper" and lease.phases[-1]["rc"] == 124
