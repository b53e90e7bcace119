"""The gems command: the embedded default, records, tables, failures and bad input."""
import json
import time

import pytest
from _cli import gems, gems_here, records

from gems.results.record import REQUIRED, validate_record, write_record


def test_default_run_prints_its_row_and_writes_a_valid_record(tmp_path):
    t0 = time.monotonic()
    out = gems("run", cwd=str(tmp_path))
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert "cosmoflow64-R1D1S1-lp" in out.stdout and " ok " in out.stdout
    (r,) = records(str(tmp_path / "results"))
    assert validate_record(r) == []
    assert set(REQUIRED) <= set(r)
    assert r["steps"] == 6 and len(r["loss"]) == 6 and r["throughput_samples_per_s"] > 0
    assert r["config"]["model"]["name"] == "cosmoflow" and r["env"]["torch"]
    print(f"default run took {took:.1f}s")


def test_sweep_writes_records_table_and_plot(tmp_path):
    out = gems_here("sweep", f"results.dir={tmp_path}", "results.sweep=s1", "model.size=32", "model.width=0.25",
                    "train.steps=3", "train.warmup_steps=1", "parallel.replicas=1,2", "train.batch_size=2")
    assert out.returncode == 0, out.stderr + out.stdout
    recs = [r for r in records(str(tmp_path)) if r.get("sweep") == "s1"]
    assert sorted(r["world_size"] for r in recs) == [1, 2]
    table = (tmp_path / "s1" / "table.md").read_text()
    assert table.count("\n| cosmoflow32") == 2
    assert (tmp_path / "s1" / "scaling.png").stat().st_size > 1000
    csv = (tmp_path / "s1" / "table.csv").read_text().splitlines()
    assert csv[0].startswith("name,status,world") and len(csv) == 3
    # gems results regenerates the same tables from the records alone
    (tmp_path / "s1" / "table.md").unlink()
    out = gems_here("results", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "s1" / "table.md").read_text() == table


def test_a_killed_rank_is_a_failed_record_and_exit_1(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", "model.size=32", "model.width=0.25", "parallel.replicas=2",
                    "train.batch_size=2", "fault.kill_rank=1", "fault.at_step=1", "comm.timeout_s=30")
    assert out.returncode == 1, out.stderr
    assert "rank 1" in out.stderr
    (r,) = records(str(tmp_path))
    assert r["status"] == "failed" and "rank 1" in r["error"] and validate_record(r) == []


@pytest.mark.parametrize("args,needle", [
    (["run", "model=nope"], "model=nope"),
    (["run", "parallel.replicas=3"], "train.batch_size=4"),
    (["run", "data=hdf5", "data.path=/does/not/exist"], "data.path=/does/not/exist"),
    (["run", "model=custom", "model._target_=no_such_pkg.make", "model.input_shape=[1,8,8]"], "model._target_=no_such_pkg.make"),
    (["run", "parallel.schedule=mast"], "parallel.schedule=mast"),
    (["run", "cluster=local_slurm", "cluster.nodes=2", "cluster.tasks_per_node=3", "parallel.replicas=2"],
     "cluster.tasks_per_node=3"),
    (["bench", "nope"], "bench=nope"),
    (["frobnicate"], "command=frobnicate"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    out = gems_here(*args, cwd=str(tmp_path))
    assert out.returncode == 2, out.stderr + out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "results").exists() or not any((tmp_path / "results").iterdir())


def test_records_are_never_overwritten(tmp_path):
    path = tmp_path / "r.json"
    write_record(path, {"a": 1})
    with pytest.raises(FileExistsError):
        write_record(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def _double(n: int = 8):
    from torch import nn

    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * n * n, 3))


def test_custom_model_runs(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", "model=custom", "model._target_=test_cli._double",
                    "model.input_shape=[1,8,8]", "model.num_outputs=3", "model.loss=cross_entropy",
                    "parallel.replicas=2", "train.batch_size=4")
    assert out.returncode == 0, out.stderr + out.stdout
    (r,) = records(str(tmp_path))
    assert r["status"] == "ok" and r["world_size"] == 2


def test_a_preempted_run_resumes_and_trains_like_an_uninterrupted_one(tmp_path):
    args = ["model.size=32", "model.width=0.25", "parallel.replicas=2", "train.batch_size=2", "train.steps=5",
            "train.warmup_steps=1"]
    out = gems_here("run", f"results.dir={tmp_path}/pre", *args, "fault.preempt_at_step=2")
    assert out.returncode == 0, out.stderr
    # the model and optimizer state once, each replica writing half of it; one history for every rank
    (ck,) = list((tmp_path / "pre").glob(".jobs/*/ckpt/step*"))
    assert sorted(f.name for f in ck.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "gems.json",
                                                    "history.pt"]
    sizes = [(ck / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
    assert min(sizes) > 0.4 * sum(sizes)
    ref = gems_here("run", f"results.dir={tmp_path}/ref", *args)
    assert ref.returncode == 0, ref.stderr
    (p,), (r,) = records(str(tmp_path / "pre")), records(str(tmp_path / "ref"))
    assert p["restarts"] == 1 and r["restarts"] == 0
    assert p["loss"] == r["loss"]  # bit for bit: data and dropout are functions of (seed, step, sample)
    # steps 2-4 measured: one warm-up step, then step 1 profiled for tensor memory (the first after an optimizer
    # step) and left out of the timings; the resumed run keeps the first attempt's measured times
    assert len(p["step_time_s"]["all"]) == 3 and p["step_time_s"]["measured_from"] == 2
