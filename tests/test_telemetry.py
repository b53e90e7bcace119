"""The GPUs seen through NVML (issue 80), against the fake pynvml of tests/fake_nvml (NVML's documented behaviour:
monotone energy counters, NotSupported queries, MIG instances, a query that needs root): each health check fails on
its own bad state and names it; a query NVML does not answer is left out with its reason, never a zero; telemetry
sums right across ranks and steps, a CPU node's RAPL counters once; a straggler is named with its cause; the sampler
stops on every way out and never holds a rank's exit; `gems nodes check`, a run stopped by a bad node (exit 2, the
record naming it), the plan's cost, the tables' energy columns and the sampler's benchmark."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from _cli import gems_here

from gems.telemetry import figures, health, node_name, nvml
from gems.telemetry.rank import RankTelemetry
from gems.telemetry.rapl import Rapl

FAKE = Path(__file__).resolve().parent / "fake_nvml"
ROOT = Path(__file__).resolve().parents[1]
GOOD = {"uuid": "GPU-11111111", "power_mw": 300000, "reasons": 1, "pcie": [5, 5, 16, 16]}


def _all_checks(**off: bool) -> SimpleNamespace:
    return SimpleNamespace(**{c: off.get(c, True) for c in health.CHECKS})


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write the fake's state (``fake({node: {...}})``) and see NVML through it: its folder first on sys.path and
    PYTHONPATH (for the processes a test starts), NVML started afresh."""
    state = tmp_path / "nvml.json"
    monkeypatch.setenv("GEMS_FAKE_NVML", str(state))
    monkeypatch.setenv("PYTHONPATH", f"{FAKE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.syspath_prepend(str(FAKE))
    nvml.forget()

    def write(nodes: dict) -> Path:
        state.write_text(json.dumps(nodes))
        nvml.forget()
        return state

    yield write
    nvml.forget()


# ----------------------------------------------------------------------------- the node's checks
#: (check, the bad GPU's state, words its finding holds)
BAD = [
    ("ecc", {"ecc_uncorrected": 3}, "3 uncorrected ECC error(s)"),
    ("retired_pages", {"retired_pending": True}, "pages wait to be retired"),
    ("row_remap", {"remap": [0, 1, 0, 1]}, "a row remap failed"),
    ("memory", {"processes": [[1, 3 * 2**30]]}, "3.00 GiB held by 1 process(es) not of this job (pid 1)"),
    ("throttle", {"reasons": 0x40 | 0x1}, "hardware thermal slowdown"),
    ("pcie", {"pcie": [4, 5, 8, 16], "reasons": 0}, "PCIe gen 4 x8 (at most gen 5 x16)"),
]


def test_each_health_check_fails_on_its_own_bad_state_and_names_it(fake) -> None:
    """Each check's bad state on GPU 1 of two: that check alone fails, on that GPU, and its line names the node,
    the GPU's index and UUID, the check, the value found and the key that skips it; the good GPU passes all."""
    for check, bad, said in BAD:
        fake({"*": {"gpus": [GOOD, {**GOOD, "uuid": "GPU-22222222", **bad}]}})
        found = health.check(_all_checks(), want=2, ours=lambda pid: False)
        failed = [f for f in found if f.ok is False]
        assert [(f.check, f.gpu, f.uuid) for f in failed] == [(check, 1, "GPU-22222222")], (check, found)
        line = failed[0].line(node_name())
        assert line.startswith(f"node {node_name()} GPU 1 (GPU-22222222): the {check} check failed: ") and said in line
        assert f"health.{check}=false skips it" in line
        assert all(f.ok for f in found if f.gpu == 0), found
        assert not [f for f in health.check(_all_checks(**{check: False}), 2, lambda pid: False) if f.ok is False]
    fake({"*": {"gpus": [GOOD], "cuda": 11080}})  # a driver for CUDA 11.8 under a torch built for 12
    import torch

    drv = [f for f in health.check(_all_checks(), 4) if f.ok is False]
    assert [f.check for f in drv][:1] == ["gpus"] and "1 GPU(s) seen" in drv[0].value and "4 asked" in drv[0].value
    if torch.version.cuda:
        assert drv[1].check == "driver" and "runs CUDA up to 11.8" in drv[1].value
    else:  # a CPU build of torch: the check is left out, saying why
        assert [f.value for f in health.check(_all_checks(), 1) if f.check == "driver"] == ["torch was built without CUDA"]


def test_what_is_left_out_says_why_and_this_jobs_processes_are_its_own(fake, monkeypatch) -> None:
    """A query that needs root (a user's process), an ECC the GPU does not have and a PCIe link slowed at idle are
    left out with their reasons (never passed or failed on a zero); this process's own memory is not another job's;
    CUDA_VISIBLE_DEVICES limits what the task sees, by index or by (a MIG instance's) UUID."""
    fake({"*": {"root": False, "gpus": [{**GOOD, "root_only": ["nvmlDeviceGetRemappedRows"],
                                         "not_supported": ["nvmlDeviceGetTotalEccErrors"], "pcie": [1, 5, 16, 16],
                                         "processes": [["self", 2**30]]},
                                        {**GOOD, "uuid": "GPU-33333333", "mig": [{"uuid": "MIG-aaaa"}]}]}})
    found = {f.check: f for f in health.check(_all_checks(), 2) if f.gpu == 0}
    assert found["row_remap"].ok is None and "needs root" in found["row_remap"].value
    assert found["ecc"].ok is None and "not supported" in found["ecc"].value
    assert found["pcie"].ok is None and "not judged at idle" in found["pcie"].value
    assert found["memory"].ok is True
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-aaaa")
    (g,) = nvml.visible()
    assert g.mig and g.uuid == "MIG-aaaa" and g.parent is not None and g.parent.uuid == "GPU-33333333"
    assert {f.gpu for f in health.check(_all_checks(), 1)} == {None, 1}  # the instance's GPU is the one checked
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7,0")  # CUDA stops at the first entry it cannot use
    assert [g.index for g in nvml.visible()] == [1]


def test_no_nvml_here_is_said_once_and_a_cpu_job_never_imports_pynvml(fake, monkeypatch, capsys) -> None:
    """Without NVML's library the check and the sampler go without it, said once a process; a CPU job with
    health.check=auto never imports pynvml at all."""
    from gems.config import compose

    monkeypatch.delenv("GEMS_FAKE_NVML")
    nvml.forget()
    assert nvml.library() is None and "NVML Shared Library Not Found" in (nvml.absent() or "")
    cfg = compose(["health.check=always"])
    health.check_node(cfg, "cpu", 1, "/nonexistent")
    health.check_node(cfg, "cpu", 1, "/nonexistent")
    t = RankTelemetry(0, 0, 0.01)
    t.start()
    t.stop()
    err = capsys.readouterr().err
    assert err.count("no NVML here") == 1, err
    assert t.summary()["left_out"] == {"everything": f"no NVML here ({nvml.absent()})"} and t.describe_now()
    nvml.forget()
    health.check_node(compose([]), "cpu", 1, "/nonexistent")  # auto on CPU ranks: nothing asked of NVML
    assert "pynvml" not in sys.modules


# ----------------------------------------------------------------------------- telemetry
def _steps(ts: list[RankTelemetry], warm: int, measured: int, dt: float, samples: int, slow: dict[int, float]) -> None:
    for k in range(warm + measured):
        for t in ts:
            t.step_began(k, k >= warm)
        time.sleep(dt)
        for r, t in enumerate(ts):
            t.step_ended(k, dt * slow.get(r, 1.0), samples)


def test_telemetry_is_summed_right_across_ranks_and_steps(fake) -> None:
    """Two GPU ranks at 300 and 100 W: each rank's energy is its power over the measured steps' metered time (the
    warm-up steps left out, the counter read at the bounds), the run's the sum, a sample's the sum over the global
    batch times the steps; the GPU left out of energy (pre-Volta) has no energy and the run's says why."""
    fake({"*": {"gpus": [{**GOOD, "power_mw": 300000}, {**GOOD, "uuid": "GPU-2", "power_mw": 100000}]}})
    ts = [RankTelemetry(r, r, 0.02) for r in (0, 1)]
    for t in ts:
        t.start()
    _steps(ts, warm=3, measured=5, dt=0.04, samples=8, slow={})
    for t in ts:
        t.stop()
    per = [t.summary() for t in ts]
    for s, watts in zip(per, (300.0, 100.0)):
        assert s["steps"] == 5 and s["samples"] == 40 and 5 * 0.04 <= s["metered_s"] < 5 * 0.04 + 1.0
        assert s["energy_j"] == pytest.approx(watts * s["metered_s"], rel=0.02)
        assert s["power_w"]["mean"] == pytest.approx(watts, rel=0.02) and s["power_w"]["peak"] == watts
    run = figures.combine(per, global_batch=8, measured_steps=5)
    assert run["energy_j"] == pytest.approx(per[0]["energy_j"] + per[1]["energy_j"])
    assert run["j_per_sample"] == pytest.approx(run["energy_j"] / 40) and run["devices"] == 2
    assert run["w_per_device"] == pytest.approx(200.0, rel=0.02) and run["left_out"] == {}
    fake({"*": {"gpus": [{**GOOD, "not_supported": ["nvmlDeviceGetTotalEnergyConsumption"]}]}})
    old = RankTelemetry(0, 0, 0.02)
    old.start()
    _steps([old], 0, 5, 0.03, 8, {})
    old.stop()
    s = old.summary()
    assert "energy_j" not in s and s["power_w"]["mean_from"] == "samples"
    run = figures.combine([s], 8, 5)
    assert "energy_j" not in run and "not supported" in run["left_out"]["energy"] and "rank 0" in run["left_out"]["energy"]


def test_a_cpu_nodes_rapl_counters_count_once_and_wrap(tmp_path: Path, monkeypatch) -> None:
    """RAPL's packages summed, a counter's wrap taken as one step on; two ranks of one node read one meter, which the
    run counts once; where nothing can be read, the energy is not measured, said once."""
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()
    (zone / "max_energy_range_uj").write_text("1000000\n")
    (zone / "energy_uj").write_text("900000\n")
    (tmp_path / "intel-rapl:0:0").mkdir()  # a sub-zone (the cores): inside the package, not added
    r = Rapl(tmp_path)
    (zone / "energy_uj").write_text("100000\n")  # wrapped: 0.2 J on
    assert r.read() == pytest.approx(0.2)
    (zone / "energy_uj").write_text("600000\n")
    assert r.read() == pytest.approx(0.7)
    per = [{"rank": k, "host": "n1", "source": "rapl", "meter": "rapl@n1", "energy_j": 5.0, "power_w": {"mean": 50.0},
            "left_out": {}} for k in (0, 1)]
    assert figures.combine(per, 4, 2)["energy_j"] == 5.0
    assert Rapl(tmp_path / "none").why.startswith("RAPL not readable here")


def test_a_stragglers_report_names_its_cause_and_the_mig_instance_leaves_out_what_nvml_does_not_read(fake,
                                                                                                   monkeypatch) -> None:
    """Rank 1's GPU held at a thermal slowdown takes twice rank 0's time: the scores put it at 0.5 of the fastest,
    and the words name it, its node and GPU, its clock and the throttle reason; describe_now says the same of the
    GPU now. A rank on a MIG instance reads its memory and leaves out power, energy and clocks, saying why."""
    fake({"*": {"gpus": [GOOD, {**GOOD, "uuid": "GPU-2", "sm_mhz": 1155, "reasons": 0x40, "temp_c": 87, "util": 100},
                         {**GOOD, "uuid": "GPU-3", "mig": [{"uuid": "MIG-bbbb", "memory_total": 10 * 2**30,
                                                            "memory_used": 2**30}]}]}})
    ts = [RankTelemetry(r, r, 0.01) for r in (0, 1)]
    for t in ts:
        t.start()
    _steps(ts, 1, 6, 0.03, 2, slow={1: 2.0})
    for t in ts:
        t.stop()
    assert ts[1].describe_now() == "SM clock 1155 MHz, hardware thermal slowdown, 87 C, 100% busy, 300 W"
    run = figures.combine([t.summary() for t in ts], 2, 6, window=3)
    slow = run["stragglers"]["slowest"]
    assert slow["rank"] == 1 and slow["score"] == pytest.approx(0.5) and run["stragglers"]["own"][1] == [1.0, 1.0]
    assert slow["words"].startswith(f"rank 1, {node_name()} GPU 1, at 0.50 of the fastest rank: SM clock 1155 MHz")
    assert "hardware thermal slowdown" in slow["words"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-bbbb")
    mig = RankTelemetry(0, 0, 0.01)
    mig.start()
    _steps([mig], 0, 2, 0.02, 2, {})
    mig.stop()
    s = mig.summary()
    assert s["uuid"] == "MIG-bbbb" and s["mig"] and s["memory_bytes"]["nvml_used_peak"] == 2**30
    for what in ("energy", "power", "sm_clock", "temperature", "utilization"):
        assert s["left_out"][what] == "not supported on a MIG instance", what
    assert "energy_j" not in s and "sm_clock_mhz" not in s


def test_the_sampler_stops_on_every_way_out_and_never_holds_the_ranks_exit(fake, tmp_path: Path) -> None:
    """stop() ends the sampler at once and again does nothing; a sampler stuck in a GPU that stopped answering does
    not hold stop() past its second; a rank that ends by an exception, or by exiting without stop(), ends at once."""
    fake({"*": {"gpus": [GOOD]}})
    t = RankTelemetry(0, 0, 0.01)
    t.start()
    time.sleep(0.05)
    t.stop()
    t.stop()
    assert not [th for th in __import__("threading").enumerate() if th.name == "gems-telemetry-0"]
    script = tmp_path / "rank.py"
    script.write_text(
        "import sys, time\nfrom gems.telemetry.rank import RankTelemetry\n"
        "t = RankTelemetry(0, 0, 0.01)\nt.start()\nt.step_began(0, True)\n"
        "if sys.argv[1] == 'raise':\n    raise RuntimeError('the step failed')\n"
        "if sys.argv[1] == 'hang':\n    time.sleep(0.3)\n    t0 = time.monotonic()\n    t.stop()\n"
        "    print('stopped in', time.monotonic() - t0)\n")
    fake({"*": {"gpus": [GOOD]}})
    for how in ("raise", "exit"):
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=60)
        assert r.returncode == (1 if how == "raise" else 0) and time.monotonic() - t0 < 30, r.stderr
    hanging = {**GOOD, "slow": {"nvmlDeviceGetPowerUsage": 30}}  # the sampler's read takes 30 s: a GPU gone silent
    fake({"*": {"gpus": [hanging]}})
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script), "hang"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split()[-1]) < 1.5 and time.monotonic() - t0 < 60  # nothing waits for the stuck read


# ----------------------------------------------------------------------------- the commands
def test_gems_nodes_check_here_names_each_failed_check_and_exits_2(fake) -> None:
    """`gems nodes check` on this machine: one line a GPU, the last naming every failed check (exit 2); a key skips
    its check (exit 0); the GPUs a job asks for are counted; a wrong subcommand is one line, exit 2."""
    fake({"*": {"gpus": [GOOD, {**GOOD, "uuid": "GPU-22222222", "ecc_uncorrected": 2}]}})
    r = gems_here("nodes", "check")
    node = node_name()
    assert r.returncode == 2, r.stderr
    lines = r.stdout.strip().splitlines()
    assert f"{node} GPU 1 (GPU-22222222): FAILED ecc: 2 uncorrected ECC error(s) since the driver loaded" in r.stdout
    assert lines[-1] == (f"gems nodes check: 1 node(s), 2 GPU(s): 1 failed check(s): node {node} GPU 1 (GPU-22222222): "
                         "the ecc check failed: 2 uncorrected ECC error(s) since the driver loaded (expected none; "
                         "health.ecc=false skips it)")
    r = gems_here("nodes", "check", "health.ecc=false")
    assert r.returncode == 0 and r.stdout.strip().endswith("no check failed"), r.stdout
    r = gems_here("nodes", "check", "health.ecc=false", "cluster.gpus_per_node=4")
    assert r.returncode == 2 and "2 GPU(s) seen (every GPU NVML counts), 4 asked for" in r.stdout
    r = gems_here("nodes", "verify")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "nodes=verify" in r.stderr


def test_a_run_on_a_node_with_a_bad_gpu_stops_before_training_with_exit_2_and_its_record_names_it(
        fake, tmp_path: Path) -> None:
    """A run whose node has a GPU with a failed row remap (health.check=always on these CPU ranks): no step runs;
    the command exits 2 with one line naming the node, the GPU's index and UUID, the check and the value; the
    record is failed with the node, and the node is kept in the run's folder for the launchers."""
    from _cli import gems

    fake({"*": {"gpus": [{**GOOD, "remap": [0, 0, 0, 1]}]}})
    r = gems("run", "health.check=always", f"results.dir={tmp_path}", "model.size=32", "model.width=0.25",
             "run_id=bad-node", timeout=300)
    node = node_name()
    line = (f"node {node} GPU 0 (GPU-11111111): the row_remap check failed: a row remap failed (expected no failed "
            "remap; health.row_remap=false skips it)")
    assert r.returncode == 2, r.stderr[-2000:]
    assert [ln for ln in r.stderr.splitlines() if ln.startswith("gems: error:")] == \
        [f"gems: error: run bad-node failed: {line}"], r.stderr
    record = json.loads((tmp_path / "bad-node.json").read_text())
    assert record["status"] == "failed" and record["steps"] == 0 and record["error"] == line
    assert record["failure"] == {"kind": "bad_node", "node": node, "gpu": 0, "uuid": "GPU-11111111",
                                 "check": "row_remap", "value": "a row remap failed", "nodes": [node]}
    assert health.bad_nodes(tmp_path / ".jobs" / "bad-node")[0]["node"] == node


def test_the_plan_gives_the_runs_gpu_hours_node_hours_and_energy_bound(capsys) -> None:
    """gems plan's cost: the run's steps at the predicted step, its GPU-hours and node-hours, and every GPU at the
    model's power limit for that time (the JSON and the table's line agree)."""
    from gems.cli import main
    from gems.telemetry.limits import power_limit_w

    common = ["model=cosmoflow", "model.size=128", "parallel.spatial=4", "cluster.gpu=h100", "cluster.gpus_per_node=4",
              "train.steps=1000"]
    assert main(["plan", *common, "plan.format=json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    c, step = plan["cost"], plan["predicted_step_time_s"]["total"]
    assert c["steps"] == 1000 and c["ranks"] == 4 and c["nodes"] == 1
    assert c["seconds"] == pytest.approx(1000 * step, rel=1e-3)
    assert c["gpu_hours"] == pytest.approx(4 * c["seconds"] / 3600) and c["node_hours"] == pytest.approx(c["seconds"] / 3600)
    assert c["energy_bound_j"] == pytest.approx(power_limit_w("h100") * 4 * c["seconds"]) and power_limit_w("h100") == 700
    assert main(["plan", *common]) == 0
    assert f"{c['gpu_hours']:.3g} GPU-hours (4 GPUs)" in capsys.readouterr().out


def _record(run_id: str, world: int, telemetry: dict | None) -> dict:
    """A measured point's record as gems results reads it (its figures made up but its telemetry's)."""
    return {"schema": "gems.record/1", "run_id": run_id, "name": f"cf-R{world}", "sweep": "energy",
            "point": f"parallel.replicas={world}", "repeat": 0, "status": "ok", "world_size": world, "nodes": 1,
            "config": {"model": {"name": "cosmoflow"}, "train": {"threads": 1}, "results": {}}, "global_batch": 4 * world,
            "mesh": {"replicas": world, "pipeline": 1, "spatial": 1}, "schedule": "lp", "steps": 4,
            "throughput_samples_per_s": 40.0 * world, "step_time_s": {"median": 0.1, "all": [0.1] * 4},
            "time_breakdown_s": {}, "peak_memory_bytes": {"max": 2**20, "per_rank": [2**20] * world}, "loss": [1.0] * 4,
            "env": {"device": "cuda", "gpus": 4}, **({"telemetry": telemetry} if telemetry else {})}


def test_tables_give_j_per_sample_and_w_per_gpu_and_the_power_plot(fake, tmp_path: Path) -> None:
    """A study whose records hold a telemetry section: J/sample and W/gpu beside the efficiency, the energy panel
    in scaling.png, and each record's power and SM clock over its steps (one line a rank); a study without it has
    neither column."""
    from gems.results.table import columns, rows_for, write_studies

    fake({"*": {"gpus": [GOOD, {**GOOD, "uuid": "GPU-2", "power_mw": 200000}]}})
    made = []
    for world in (1, 2):
        ts = [RankTelemetry(r, r, 0.01) for r in range(world)]
        for t in ts:
            t.start()
        _steps(ts, 1, 4, 0.02, 4 * world, {})
        for t in ts:
            t.stop()
        made.append(figures.combine([dict(t.summary(), trace=t.trace()) for t in ts], 4 * world, 4))
    folder = tmp_path / "energy"
    folder.mkdir()
    for world, tel in zip((1, 2), made):
        (folder / f"run{world}.json").write_text(json.dumps(_record(f"run{world}", world, tel)))
    (study,), _ = write_studies(tmp_path)
    table = (folder / "table.md").read_text()
    head = table.splitlines()[2]
    assert "| efficiency | J/sample | W/gpu |" in head, head
    by_world = {row["world"]: row for row in study.rows}
    for world, tel in zip((1, 2), made):
        assert by_world[world]["J/sample"] == pytest.approx(tel["j_per_sample"])
        assert by_world[world]["W/gpu"] == pytest.approx(tel["w_per_device"])
    assert by_world[2]["W/gpu"] == pytest.approx(250.0, rel=0.02)  # 300 and 200 W
    assert (folder / "run2.power.png").stat().st_size > 0 and (folder / "scaling.png").is_file()
    assert "J/sample" not in columns(rows_for([_record("plain", 1, None)]))


def test_the_sampler_benchmark_measures_its_cost_and_what_it_read(fake, tmp_path: Path) -> None:
    """gems bench telemetry (a few steps): the plain loop against the sampler at two intervals, the faster reading
    more samples; the energy and mean power it read through (the fake) NVML, within the GPU's limit."""
    from gems.bench.telemetry import bench_telemetry

    fake({"*": {"gpus": [GOOD]}})
    text = bench_telemetry(tmp_path, rounds=1, steps=4)
    got = json.loads((tmp_path / "telemetry.json").read_text())
    plain, default, fast = (got["contenders"][label] for label in ("plain loop", "sampler, default interval",
                                                                    "sampler at 0.01 s"))
    assert plain["ratio"] == 1.0 and plain["summary"] is None and default["interval_s"] == 0.25
    assert fast["summary"]["samples_taken"] > default["summary"]["samples_taken"] >= 1
    s = default["summary"]
    assert s["energy_j"] > 0 and s["power_w"]["mean"] == pytest.approx(300.0, rel=0.02) and s["power_limit_w"] == 700
    assert "mean power 300.0 W of a 700 W limit (within it)" in text and got["sample_s"] > 0
    assert (tmp_path / "telemetry.md").read_text() == text


def test_the_leases_telemetry_phase_runs_dry(fake, tmp_path: Path) -> None:
    """scripts/gpu_lease.py --phases telemetry on CPU (--dry, NVML faked): the nodes' check passes on a good GPU, the
    benchmark's table and the check's lines come back in telemetry-gpu.md, and the run with the check on is archived."""
    import tarfile

    fake({"*": {"gpus": [GOOD]}})
    env = dict(os.environ, OMP_NUM_THREADS="1", GEMS_LEASE_WORK=str(tmp_path / "work"))
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_lease.py"), "--dry", "--phases", "telemetry",
                        "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=480, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    phases = {p["label"]: p["rc"] for p in json.loads((tmp_path / "work" / "phases.json").read_text())}
    assert phases["nodes-check"] == 0 and phases["bench-telemetry"] == 0 and phases["run-health"] == 0, phases
    text = (tmp_path / "out" / "telemetry-gpu.md").read_text()
    assert "gems nodes check: 1 node(s), 1 GPU(s): no check failed" in text and "## gems bench telemetry" in text
    assert "mean power 300.0 W of a 700 W limit (within it)" in text
    with tarfile.open(tmp_path / "out" / "lease.tgz") as tar:
        assert "telemetry/run/lease-telemetry.json" in tar.getnames()


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sinfo") is None, reason="no Slurm here (start one with scripts/slurm_cluster.sh start)")
def test_a_slurm_job_stopped_by_a_bad_gpu_goes_once_more_without_its_node(fake, tmp_path: Path) -> None:
    """The real Slurm test cluster: every node's fake GPU has uncorrected ECC errors until the job's first node has
    said so (a thread then makes every other node good), so the first job stops at its check wherever Slurm put it;
    with cluster.exclude_bad_nodes=true the launcher submits it once more with that node in --exclude, and the second
    job trains. The record is ok and says why it ran again; the first job's bad-node file is set aside."""
    import threading

    from gems.config import compose
    from gems.launch import slurm

    bad = {"gpus": [{**GOOD, "ecc_uncorrected": 5}]}
    state = fake({"*": bad})
    results = tmp_path / "results"
    cfg = compose(["cluster=local_slurm", "health.check=always", "cluster.exclude_bad_nodes=true", "parallel.replicas=1",
                   "model.size=32", "model.width=0.25", "train.steps=3", "train.warmup_steps=1", f"results.dir={results}"])
    found: list[str] = []

    def heal() -> None:  # the first job's node is known: it stays bad, every other node is good
        deadline = time.monotonic() + 600  # a guard against a hang only
        while not found and time.monotonic() < deadline:
            for p in results.glob(".jobs/*/nodes/*.json"):
                state.write_text(json.dumps({p.stem: bad, "*": {"gpus": [GOOD]}}))
                found.append(p.stem)
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=heal, daemon=True)
    watcher.start()
    record = slurm.launch(cfg, progress=False)
    watcher.join(5)
    assert found, "the first job's check wrote no bad node"
    assert record["status"] == "ok", record.get("error")
    again = record["config"]["cluster"]
    assert again["exclude"] == found
    assert f"node {found[0]} GPU 0 (GPU-11111111): the ecc check failed: 5 uncorrected ECC error(s)" in again["resubmitted"]
    assert again["resubmitted"].endswith(f"; submitted again without {found[0]}")
    job_dir = results / ".jobs" / record["run_id"]
    (aside,) = job_dir.glob("nodes.job*")
    assert [p.name for p in aside.iterdir()] == [f"{found[0]}.json"] and not (job_dir / "nodes").exists()
    assert record["env"]["slurm_job_id"] != aside.name.removeprefix("nodes.job")


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sinfo") is None, reason="no Slurm here (start one with scripts/slurm_cluster.sh start)")
def test_gems_nodes_check_on_an_allocation_checks_each_node_once(fake, tmp_path: Path) -> None:
    """`gems nodes check cluster=local_slurm cluster.nodes=3`: one Slurm task a node, each node's GPUs named; the one
    node whose GPU holds its clocks down at idle fails (exit 2), the others pass."""
    fake({"node2": {"gpus": [{**GOOD, "reasons": 0x80}]}, "*": {"gpus": [GOOD]}})
    r = gems_here("nodes", "check", "cluster=local_slurm", "cluster.nodes=3", "cluster.exclude=[node4]",
                  f"results.dir={tmp_path}")
    assert r.returncode == 2, r.stdout + r.stderr
    checked = sorted(ln.split()[0] for ln in r.stdout.splitlines() if ln.startswith("node") and " GPU 0 (" in ln)
    assert checked == ["node1", "node2", "node3"], r.stdout
    assert r.stdout.strip().splitlines()[-1] == (
        "gems nodes check: 3 node(s), 3 GPU(s): 1 failed check(s): node node2 GPU 0 (GPU-11111111): the throttle check "
        "failed: clocks held down at idle: hardware power brake (expected no hardware slowdown, thermal slowdown or "
        "power brake; health.throttle=false skips it)")


def test_a_runs_record_holds_the_energy_of_its_measured_steps(tmp_path: Path, monkeypatch) -> None:
    """The rank's loop (gems.rank.hooks.telemetry) meters its measured steps: a CPU rank's RAPL counter (a package zone
    whose counter a thread moves on, 1 J every 10 ms, read where the kernel keeps it) gives the record's energy, J a
    step and J a sample over exactly the measured steps, the rank's step times and its trace."""
    import contextlib
    import io
    import threading

    import torch
    from omegaconf import open_dict

    from gems.bootstrap import World
    from gems.config import compose
    from gems.rank.loop import train
    from gems.telemetry import rapl

    zone = tmp_path / "rapl" / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "max_energy_range_uj").write_text(str(2**40))
    (zone / "energy_uj").write_text("0")
    stop = threading.Event()

    def burn() -> None:
        uj = 0
        while not stop.wait(0.01):
            uj += 1_000_000
            (zone / "energy_uj").write_text(str(uj))

    monkeypatch.setattr(rapl, "ROOT", zone.parent)
    cfg = compose(["model.size=32", "model.width=0.25", "train.batch_size=2", "train.steps=6", "train.warmup_steps=2",
                   "train.check_fit=false", "telemetry.interval_s=0.01", f"results.dir={tmp_path / 'r'}"])
    with open_dict(cfg):
        cfg.run_id = "metered"
    world = World(0, 1, 0, "127.0.0.1", 0, "single", torch.device("cpu"), "gloo", "torch", None, "localhost")
    hand = threading.Thread(target=burn, daemon=True)
    hand.start()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            record = train(cfg, world)
    finally:
        stop.set()
        hand.join()
    t = record["telemetry"]
    measured = len(record["step_time_s"]["all"])
    assert t["source"] == "rapl" and t["measured_steps"] == measured == 4 and t["devices"] == 1
    (me,) = t["per_rank"]
    assert me["steps"] == measured and me["samples"] == 2 * measured
    assert t["energy_j"] > 0 and t["j_per_step"] == pytest.approx(t["energy_j"] / measured)
    assert t["j_per_sample"] == pytest.approx(t["energy_j"] / (2 * measured))
    # about 100 W over the measured steps' own time: never the whole run's (set-up and warm-up burn too)
    assert me["metered_s"] <= sum(record["step_time_s"]["every"]) + 0.1
    assert t["trace"]["0"] and "everything" not in t["left_out"]


def test_a_stalls_report_names_what_the_stalled_ranks_device_was_doing() -> None:
    """A rank's heartbeat carries its device's words (the sampler's latest reading: gems.rank.hooks.telemetry sets
    Watchdog.describe_device where its device is metered), and the stall's message names them for the stalled rank."""
    from gems.fault.watchdog import Watchdog, _LocalStore
    from gems.progress import Progress

    said: list[str] = []

    class Kept(Watchdog):
        def _end(self, message: str | None) -> None:  # (the real one ends the process)
            raise SystemExit(message)

    p = Progress()
    p.mark("forward", 5)
    p.since -= 100  # no progress for 100 s
    wd = Kept(0, 1, stall_s=1, warmup_s=1, progress=p, tick=0.01, on_stall=lambda m, f: said.append(m))
    wd.warm_until, wd.store = 0, _LocalStore()
    wd.describe_device = lambda: "SM clock 1155 MHz, hardware thermal slowdown, 87 C, 100% busy"
    with pytest.raises(SystemExit):
        wd.beat()
    assert "rank 0 made no progress" in said[0], said
    assert said[0].endswith("rank 0's device: SM clock 1155 MHz, hardware thermal slowdown, 87 C, 100% busy"), said
