"""Figures a user can trust (issue 19): the run asks the planner first, every reported term is measured as
the planner defines it, memory is the peak over the steps, thin or super-linear figures are flagged, predicted
studies say so, and the small lies of the command line are gone."""
from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace

import pytest
from _cli import gems_here, records

from gems.pipeline.runtime import split_waits
from gems.results.table import markdown, plot, rows_for

SMALL_RESNET = ["model=resnet", "model.depth=11", "model.size=16", "model.width=0.25"]


# ---- the planner before the run ---------------------------------------------------------------------------
def test_a_run_that_cannot_fit_stops_before_it_starts(tmp_path: Path) -> None:
    r = gems_here("run", "cluster.mem_gb=0.01", f"results.dir={tmp_path}")
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("gems: error: train.check_fit=true") and "does not fit" in line, line
    assert not list(tmp_path.rglob("*")), "nothing is written for a point that cannot fit"
    r = gems_here("run", "cluster.mem_gb=0.01", "train.check_fit=false", "train.steps=2", "train.warmup_steps=0",
                  f"results.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-1500:]


# ---- every term measured as the planner defines it --------------------------------------------------------
def test_waits_split_into_transfer_and_bubble_as_the_planner_does() -> None:
    sent = {(0, 1): 10.0, (0, 2): 20.0}
    received = {(0, 1): (12.0, 12.5),  # sent before the wait began: all of it transfer
                (0, 2): (15.0, 21.0),  # 5 s before the sender sent it (bubble), then 1 s of transfer
                (0, 3): (30.0, 31.0)}  # no send time known: bubble
    assert split_waits(received, sent) == (0.5 + 1.0, 5.0 + 1.0)


def test_a_pipeline_run_measures_its_transfers(tmp_path: Path) -> None:
    r = gems_here("run", "parallel.pipeline=2", "parallel.schedule=gpipe", "parallel.micro_batches=2", *SMALL_RESNET,
                  "train.steps=5", "train.warmup_steps=2", f"results.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-1500:]
    (rec,) = records(str(tmp_path))
    bd = rec["time_breakdown_s"]
    assert bd["pipeline_comm"] > 0, bd  # it was always 0
    assert bd["bubble_or_wait"] >= 0 and bd["compute"] > 0
    assert abs(sum(bd.values()) - rec["step_time_s"]["median"]) < 0.05 * rec["step_time_s"]["median"] + 1e-3


# ---- memory over the steps, and how many steps a figure rests on ------------------------------------------
def test_tensor_memory_counts_a_step_after_the_first_optimizer_step(tmp_path: Path) -> None:
    """With one warm-up step, the tensor memory was read on step 0 alone, before Adam's state existed
    (CosmoFlow 64^3 at batch 2: 160 MiB against 200 with two warm-up steps)."""
    peaks = {}
    for warm in (1, 2):
        out = tmp_path / f"w{warm}"
        r = gems_here("run", "train.batch_size=2", "train.steps=4", f"train.warmup_steps={warm}", f"results.dir={out}")
        assert r.returncode == 0, r.stderr[-1500:]
        (rec,) = records(str(out))
        mem = rec["peak_memory_bytes"]
        assert mem["tensor_steps"] == [0, 1] and rec["step_time_s"]["measured_from"] == 2
        peaks[warm] = mem["tensor_max"]
        if warm == 1:
            assert any("profiled for tensor memory" in n for n in rec["notes"])
    assert abs(peaks[1] - peaks[2]) <= 0.02 * peaks[2], peaks


def test_a_throughput_on_one_step_says_so(tmp_path: Path) -> None:
    r = gems_here("run", *SMALL_RESNET, "train.steps=3", "train.warmup_steps=2", f"results.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-1500:]
    assert "rests on 1 measured step(s)" in r.stderr
    (rec,) = records(str(tmp_path))
    assert any("rests on 1 measured step(s)" in n for n in rec["notes"])
    assert "rests on 1 measured step(s)" in r.stdout  # the console's table
    rows = list(csv.DictReader(open(Path(rec["_path"]).with_suffix(".steps.csv"))))
    assert [int(x["warmup"]) for x in rows] == [1, 1, 0] and [int(x["measured"]) for x in rows] == [0, 0, 1]
    assert all(float(x["step_time_s"]) > 0 for x in rows)  # warm-up steps have their times too
    row = rows_for([rec], sweep=False)[0]
    assert "rests on 1 measured step(s)" in row["note"]


def _record(world: int, step_s: float, batch: int, **kw: object) -> dict:
    return {"schema": "gems.record/1", "run_id": f"r{world}", "name": f"p{world}", "sweep": "s", "point": f"w{world}",
            "status": "ok", "world_size": world, "nodes": 1, "global_batch": batch, "schedule": "lp",
            "mesh": {"replicas": world, "pipeline": 1, "spatial": 1},
            "config": {"model": {"name": "cosmoflow"}, "parallel": {"replicas": world}},
            "throughput_samples_per_s": batch / step_s,
            "step_time_s": {"median": step_s, "min": step_s, "max": step_s, "all": [step_s] * 4},
            "time_breakdown_s": {"compute": step_s}, "peak_memory_bytes": {"max": 1}, "loss": [1.0],
            "env": {"cores": 64}, **kw}


def test_super_linear_points_are_flagged_in_table_and_plot(tmp_path: Path, monkeypatch) -> None:
    recs = [_record(1, 0.66, 1), _record(2, 0.40, 2), _record(4, 0.50, 4)]
    rows = rows_for(recs, sweep="s")
    by = {r["world"]: r for r in rows}
    assert by[2]["efficiency"] > 1.6 and "super-linear" in by[2]["note"] and "baseline" in by[2]["note"]
    assert "super-linear" not in by[4]["note"] or by[4]["efficiency"] > 1.05
    figs = []
    monkeypatch.setattr("matplotlib.figure.Figure.savefig", lambda self, *a, **k: figs.append(self))
    plot(rows, tmp_path / "p.png", "s")
    (fig,) = figs
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert any("super-linear" in t for t in labels), labels
    assert fig.axes[0].get_yscale() == "log" and fig.axes[0].get_xscale() == "log"


def test_predicted_studies_say_so_everywhere(tmp_path: Path, monkeypatch) -> None:
    recs = [_record(w, 1.0, w, predicted=True) for w in (1, 2, 4)]
    rows = rows_for(recs, sweep="s")
    assert markdown(rows, "s").splitlines()[2].startswith("Predicted by `gems plan`, not measured")
    assert all("predicted by gems plan, not measured" in r["note"] for r in rows)
    figs = []
    monkeypatch.setattr("matplotlib.figure.Figure.savefig", lambda self, *a, **k: figs.append(self))
    plot(rows, tmp_path / "p.png", "s")
    labels = [t.get_text() for t in figs[0].axes[0].get_legend().get_texts()]
    assert "predicted by gems plan" in labels and "measured" not in labels
    assert "predicted by gems plan" in figs[0]._suptitle.get_text()


def test_a_failed_point_says_why_in_its_own_column() -> None:
    rec = _record(2, 1.0, 2, status="failed", error="rank 1: out of memory")
    rec["step_time_s"] = None
    row = rows_for([rec], sweep=False)[0]
    assert row["error"] == "rank 1: out of memory" and row["final_loss"] == ""


def test_the_plan_warns_when_data_is_most_of_the_step() -> None:
    from gems.plan.timing import DATA_WARN, data_share, data_warning

    pr = SimpleNamespace(step_s=1.33, breakdown={"compute": 0.03, "data": 1.30})
    assert data_share(pr) > DATA_WARN
    text = data_warning(SimpleNamespace(data=SimpleNamespace(name="synthetic")), data_share(pr))
    assert "98%" in text and "data=files" in text and "data.prefetch" in text
    files = data_warning(SimpleNamespace(data=SimpleNamespace(name="hdf5")), data_share(pr))
    assert "data.stage=node" in files and "data.prefetch" in files


# ---- the small lies of the command line -------------------------------------------------------------------
def test_help_shows_what_a_run_would_use() -> None:
    r = gems_here("run", "--help")
    assert "  model.size=64 " in r.stdout and "  model.name=cosmoflow " in r.stdout  # not the schema's 128
    r = gems_here("run", "model=resnet", "--help")
    assert "  model.name=resnet " in r.stdout and "  model.size=512 " in r.stdout


def test_render_of_a_study_writes_every_point(tmp_path: Path) -> None:
    r = gems_here("render", "+experiment=spatial_weak", "cluster=local_slurm", f"results.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    assert "2 points of spatial_weak" in r.stderr
    lines = r.stdout.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["parallel.replicas=1", "parallel.replicas=2"]
    for ln in lines:
        assert Path(ln.split(": ", 1)[1]).is_file()


@pytest.mark.parametrize("args,key", [
    (["run", "cluster=local", "cluster=local_slurm"], "cluster"),
    (["plan", "train.steps=3", "train.steps=4"], "train.steps"),
])
def test_a_key_given_twice_is_bad_input(args: list[str], key: str) -> None:
    r = gems_here(*args)
    assert r.returncode == 2 and r.stderr.startswith(f"gems: error: {key}="), r.stderr


def test_a_sweep_names_the_point_that_cannot_fit_and_submits_nothing(tmp_path: Path) -> None:
    r = gems_here("sweep", "model.size=32,512", "model=cosmoflow", "cluster.mem_gb=4", f"results.dir={tmp_path}")
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("gems: error: train.check_fit=true") and "[point model.size=512 of 2" in line, line
    assert not list(tmp_path.rglob("*.json")), "no point ran"


def test_the_shipped_gpu_studies_fit_their_presets() -> None:
    """Each GPU study as shipped passes the check before launch on the preset its comment names (the ResNet-1001
    study did not at D = 4: 75 GiB a GPU)."""
    from gems.config import compose
    from gems.plan.fit import check_fit

    for exp, preset in (("gems_resnet1001", "juwels_booster"), ("cosmoflow512_weak", "perlmutter")):
        check_fit(compose([f"+experiment={exp}", f"cluster={preset}", "cluster.account=x"]))
