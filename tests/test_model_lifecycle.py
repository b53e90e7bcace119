"""A trained model outlives its run: every run writes it (one file, the whole model's names, loaded strictly by
plain PyTorch), checkpoints are the whole model's and resume on any other mesh with the uninterrupted run's
losses, ``train.init_from`` starts from a model's weights, and ``gems eval`` gives the run's own validation figures
on any mesh. Checked with a model the transparency suites do not run (tests/_custom_models.py: ``lifecycle``),
through ``gems run`` and ``gems eval`` run by ``gems.cli.main`` in the test's process (tests/_cli.py's
``gems_here``: the launcher's own code, its ranks real processes forked by multiprocessing's fork server, as for
any program that calls ``main``; tests/test_cli.py and tests/test_forkserver.py hold the console script's own
process); bad input exits 2 with one line and writes nothing."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli import gems_here, records

MODEL = ["model=custom", "model._target_=_custom_models.lifecycle", "model.input_shape=[2,16,16,16]",
         "model.num_outputs=3", "train.batch_size=4", "train.warmup_steps=1", "train.check_fit=false"]
VAL = ["data.val_samples=8"]


def _run(folder: Path, *args: str) -> dict[str, Any]:
    given = {a.split("=", 1)[0] for a in args}
    base = [a for a in MODEL if a.split("=", 1)[0] not in given
            and not ("model" in given and a.startswith("model."))]  # (another model takes none of custom's keys)
    out = gems_here("run", f"results.dir={folder}", *base, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    (r,) = records(str(folder))
    assert r["status"] == "ok"
    return r


def _model_file(r: dict[str, Any]) -> dict[str, Any]:
    assert Path(r["model_file"]).is_file()
    d = torch.load(r["model_file"], map_location="cpu", weights_only=True)
    assert isinstance(d, dict) and isinstance(d["model"], dict)
    return d


def _strict(d: dict[str, Any]) -> torch.nn.Module:
    """The file's weights in the plain nn.Sequential one process builds: every key, every shape."""
    from gems.models import build_model

    seq = build_model(d["model"]).module
    seq.load_state_dict(d["state_dict"], strict=True)
    return seq


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, 8 steps, validated at the end, its checkpoint at the end: the losses every resumed chain must
    give."""
    return _run(tmp_path_factory.mktemp("reference"), "train.steps=8", "train.checkpoint_every=8", *VAL)


def test_the_trained_model_is_one_file_of_the_whole_model_the_same_from_every_mesh(tmp_path: Path,
                                                                                  reference: dict[str, Any]) -> None:
    """The run on D2 x S2 under GEMS-MAST writes the model the serial run writes (to float rounding), under the
    serial model's names (the spatial cut adds a gather layer, the partitions count from 0): it loads strictly into
    the plain nn.Sequential, and predicts what the serial file predicts."""
    mesh = _run(tmp_path / "mesh", "train.steps=8", *VAL, "parallel.pipeline=2", "parallel.spatial=2",
                "parallel.schedule=mast")
    a, b = _model_file(reference), _model_file(mesh)
    assert a["weights"] == b["weights"] == "last" and a["step"] == b["step"] == 8
    assert list(a["state_dict"]) == list(b["state_dict"]) == list(_strict(a).state_dict())
    for k, v in a["state_dict"].items():
        torch.testing.assert_close(b["state_dict"][k], v, rtol=2e-4, atol=2e-5, msg=lambda m: f"{k}: {m}")
    x = torch.randn(3, 2, 16, 16, 16, generator=torch.Generator().manual_seed(0))
    ya, yb = _strict(a).eval()(x), _strict(b).eval()(x)
    torch.testing.assert_close(yb, ya, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(torch.tensor(mesh["loss"]), torch.tensor(reference["loss"]), rtol=1e-4, atol=1e-6)


def test_a_weight_average_run_writes_its_average(tmp_path: Path) -> None:
    r = _run(tmp_path, "train.steps=4", "train.ema=0.9")
    d = _model_file(r)
    assert d["weights"] == "ema"
    _strict(d)


def test_checkpoints_resume_on_any_mesh_with_the_uninterrupted_losses(tmp_path: Path,
                                                                      reference: dict[str, Any]) -> None:
    """A chain of runs, each continuing the last one's checkpoint (train.resume_from) on another mesh: serial ->
    D2 x S2 mast -> R2 -> R2 x D2 1f1b -> S4. Every step's loss is the uninterrupted serial run's (the same global
    batch), and the final model is its model."""
    chain = [([], 2), (["parallel.pipeline=2", "parallel.spatial=2", "parallel.schedule=mast"], 4),
             (["parallel.replicas=2"], 5),
             (["parallel.replicas=2", "parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=2"], 7),
             (["parallel.spatial=4"], 8)]
    previous: Path | None = None
    done = 0
    for k, (mesh, steps) in enumerate(chain):
        folder = tmp_path / f"link{k}"
        resume = [f"train.resume_from={previous}"] if previous is not None else []
        r = _run(folder, f"train.steps={steps}", f"train.checkpoint_every={steps}", *resume, *mesh,
                 *(VAL if steps == 8 else []))
        assert r["loss"][:done] == pytest.approx(reference["loss"][:done], rel=1e-4, abs=1e-6)  # the history
        torch.testing.assert_close(torch.tensor(r["loss"][done:]), torch.tensor(reference["loss"][done:steps]),
                                   rtol=1e-4, atol=1e-6, msg=lambda m: f"link {k} {mesh}: {m}")
        if previous is not None:
            assert r["resumed_from"]["step"] == done and r["resumed_from"]["exact"] is True
        previous, done = folder / ".jobs" / r["run_id"], steps
        assert (previous / "ckpt" / "latest").read_text() == str(steps)
        if k == 0:  # what train.checkpoint_async stages in host memory, as gems plan counts it, is what is written
            from gems.checkpoint import entries

            saved = entries(previous / "ckpt" / "step00000002", "test")
            written = sum(math.prod(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in saved.values())
            assert _planned_host_copy() == pytest.approx(written, rel=0.05)
    last = _model_file(r)
    for key, v in _model_file(reference)["state_dict"].items():
        torch.testing.assert_close(last["state_dict"][key], v, rtol=5e-4, atol=5e-5, msg=lambda m: f"{key}: {m}")
    assert r["validation"][-1]["mae"] == pytest.approx(reference["validation"][-1]["mae"], rel=1e-4)


def _planned_host_copy() -> int:
    from gems.config import compose
    from gems.plan.memory import plan_memory

    plan, _, _ = plan_memory(compose([*MODEL, "train.checkpoint_async=true"]), quick=True)
    assert any("train.checkpoint_async" in n for n in plan.notes)
    return int(plan.device["checkpoint_host_bytes"])


def test_a_different_global_batch_is_said_in_the_record(tmp_path: Path) -> None:
    first = _run(tmp_path / "a", "train.steps=2", "train.checkpoint_every=2")
    r = _run(tmp_path / "b", "train.steps=3", "train.batch_size=8",
             f"train.resume_from={tmp_path / 'a' / '.jobs' / first['run_id'] / 'ckpt'}")
    assert r["resumed_from"]["exact"] is False and r["resumed_from"]["global_batch"] == 4
    assert any("global batch 4 at batch 8" in n for n in r["notes"])


def test_init_from_takes_the_weights_on_another_mesh_with_a_fresh_optimizer(tmp_path: Path,
                                                                            reference: dict[str, Any]) -> None:
    """The first step of a run started from the reference's model file, on S = 2, has the loss that file's plain
    nn.Sequential gives the run's first batch (the synthetic samples 0-3, their dropout masks); it starts at step 0
    (a fresh optimizer), and a run started from the checkpoint of the same weights agrees."""
    import torch.nn.functional as F

    from gems.data.synthetic import SyntheticData
    from gems.layers import batch_context
    from gems.models import build_model

    src = _model_file(reference)
    r = _run(tmp_path / "file", "train.steps=2", "parallel.spatial=2", f"train.init_from={reference['model_file']}")
    assert len(r["loss"]) == 2 and "resumed_from" not in r
    spec = build_model(src["model"])
    seq = spec.module
    seq.load_state_dict(src["state_dict"])
    x, y = SyntheticData(spec, 0, 64).batch([0, 1, 2, 3])
    with batch_context(0, 0, [0, 1, 2, 3]), torch.no_grad():
        want = float(F.mse_loss(seq.train()(x), y))
    assert r["loss"][0] == pytest.approx(want, rel=1e-4)
    assert r["loss"][0] != pytest.approx(reference["loss"][0], rel=1e-3)  # not the fresh model's
    ck = Path(reference["_path"]).parent / ".jobs" / reference["run_id"] / "ckpt"  # the file's weights, at step 8
    c = _run(tmp_path / "from-ckpt", "train.steps=2", "parallel.replicas=2", f"train.init_from={ck}")
    assert c["loss"][0] == pytest.approx(want, rel=1e-4)


def test_gems_eval_gives_the_runs_own_validation_figures_on_every_mesh(tmp_path: Path,
                                                                       reference: dict[str, Any]) -> None:
    """On 1 rank, on S = 2 and on D = 2: the same figures, equal to the run's last validation entry (the same set:
    the model file names the run's synthetic validation samples), each sample's prediction in a CSV; a checkpoint
    evaluates alike."""
    want = reference["validation"][-1]
    seen = []
    for mesh in ([], ["parallel.spatial=2"], ["parallel.pipeline=2", "parallel.schedule=gpipe",
                                              "parallel.micro_batches=2"]):
        out = gems_here("eval", reference["model_file"], f"results.dir={tmp_path}", *mesh)
        assert out.returncode == 0, out.stderr[-3000:]
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("gems eval:")]
        assert len(line) == 1 and "mae" in line[0] and "over 8 samples" in line[0], out.stdout
        rec = json.loads(Path(line[0].rsplit("record: ", 1)[1]).read_text())
        got = rec["evaluation"]
        assert got["samples"] == want["samples"] == 8
        for k in ("loss", "mae"):
            assert got[k] == pytest.approx(want[k], rel=1e-5), (mesh, k)
        assert got["mae_per_target"] == pytest.approx(want["mae_per_target"], rel=1e-5)
        rows = Path(rec["predictions_file"]).read_text().splitlines()
        assert rows[0].split(",")[:2] == ["sample", "prediction_0"] and len(rows) == 9
        seen.append([[float(v) for v in row.split(",")] for row in rows[1:]])
    for other in seen[1:]:
        torch.testing.assert_close(torch.tensor(other), torch.tensor(seen[0]), rtol=1e-4, atol=1e-6)


def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path: Path, reference: dict[str, Any]) -> None:
    results = tmp_path / "results"
    results.mkdir()
    cosmo = ["model.size=32", "model.width=0.25", "train.steps=2", "train.warmup_steps=1", f"results.dir={results}"]
    truncated = tmp_path / "cut.model.pt"
    data = Path(reference["model_file"]).read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    wide = tmp_path / "wide"
    assert gems_here("data", "synth", f"data.path={wide}", "data.num_samples=2", "model.size=32").returncode == 0
    ckpt_of_other = tmp_path / "other"
    other = gems_here("run", f"results.dir={ckpt_of_other}", *cosmo[:4], "train.checkpoint_every=2")
    assert other.returncode == 0, other.stderr[-2000:]
    (o,) = records(str(ckpt_of_other))
    other_ckpt = ckpt_of_other / ".jobs" / o["run_id"] / "ckpt"
    cases = [
        (["run", *cosmo, f"train.init_from={reference['model_file']}"], "train.init_from=",
         "0.weight is [4, 2, 3, 3, 3] there, [4, 4, 3, 3, 3] here"),
        (["eval", str(truncated), f"results.dir={results}"], "eval=", "a readable model file"),
        (["eval", str(tmp_path / "nowhere.pt"), f"results.dir={results}"], "eval=", "an existing model file"),
        (["run", *cosmo, f"train.init_from={tmp_path / 'nowhere'}"], "train.init_from=", "an existing"),
        (["eval", reference["model_file"], "data=hdf5", f"data.path={wide}", f"results.dir={results}"], "data.",
         ""),
        (["run", *MODEL[:4], "train.steps=4", f"train.resume_from={other_ckpt}", f"results.dir={results}"],
         "train.resume_from=", "0.weight is [4, 4, 3, 3, 3] there, [4, 2, 3, 3, 3] here"),
        (["eval", reference["model_file"], "model.width=2", f"results.dir={results}"], "model.width=2",
         "no model override"),
    ]
    for args, key, what in cases:
        out = gems_here(*args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2, (args, out.stderr[-2000:])
        assert len(lines) == 1 and lines[0].startswith("gems: error: ") and key in lines[0] and what in lines[0], \
            (args, lines)
    assert list(results.iterdir()) == [], list(results.iterdir())
    assert Path(reference["model_file"]).read_bytes() == data  # nothing overwritten
    shutil.rmtree(wide)


@pytest.mark.both_cores  # the experiment's train.threads: 2 at S = 1
def test_the_sample_size_studys_points_are_reproduced_by_gems_eval(tmp_path: Path) -> None:
    """One point of the study's own recipe (conf/experiment/cosmoflow_sample_size.yaml: HDF5 universes, the cube's
    48 symmetries, Adam, the weight average evaluated with BatchNorm recalibrated, each universe's crops averaged),
    on tiny universes: its model file, evaluated by `gems eval` alone (the file names the universes and the recipe's
    evaluation), gives the point's figures again, on 1 rank and on S = 2: docs/science.md's way to re-evaluate the
    study's table."""
    data = tmp_path / "universes"
    made = gems_here("data", "synth", "data.kind=cosmology", f"data.path={data}/train", f"data.val_path={data}/val",
                     "data.universes=2", "data.val_universes=1", "data.box_cells=64", "data.box_mpc=512")
    assert made.returncode == 0, made.stderr[-2000:]
    out = gems_here("run", "+experiment=cosmoflow_sample_size", f"data.path={data}/train", f"data.val_path={data}/val",
                    "data.box_cells=64", "data.crop=32", "train.batch_size=8", "train.bn_recalibrate=2", "train.epochs=1",
                    "train.check_fit=false", f"results.dir={tmp_path / 'point'}")
    assert out.returncode == 0, out.stderr[-2000:]
    (r,) = records(str(tmp_path / "point"))
    want = r["validation"][-1]
    assert _model_file(r)["weights"] == "ema" and "mae_avg_crops" in want
    for mesh in ([], ["parallel.spatial=2"]):
        ev = gems_here("eval", r["model_file"], f"results.dir={tmp_path / 'eval'}", *mesh)
        assert ev.returncode == 0, ev.stderr[-2000:]
        got = json.loads(Path(ev.stdout.strip().splitlines()[-1].rsplit("record: ", 1)[1]).read_text())["evaluation"]
        assert got["bn_recalibrate_batches"] == want["bn_recalibrate_batches"] == 2
        for k in ("loss", "mae", "mae_avg_crops"):
            assert got[k] == pytest.approx(want[k], rel=1e-5), (mesh, k)


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sinfo") is None, reason="Slurm is not installed (scripts/slurm_cluster.sh start)")
def test_gems_eval_runs_on_the_slurm_test_cluster(tmp_path: Path, reference: dict[str, Any]) -> None:
    """`cluster=` as for gems run: a Slurm job of 2 tasks on 2 nodes (S = 2), the same figures as the run's own."""
    out = gems_here("eval", reference["model_file"], f"results.dir={tmp_path}", "cluster=local_slurm", "cluster.nodes=2",
                    "cluster.tasks_per_node=1", "parallel.spatial=2")
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads(Path(out.stdout.strip().splitlines()[-1].rsplit("record: ", 1)[1]).read_text())
    assert rec["env"].get("launcher") == "slurm" or rec["nodes"] == 2, rec["env"]
    assert rec["evaluation"]["mae"] == pytest.approx(reference["validation"][-1]["mae"], rel=1e-5)


def test_a_unet_model_evaluates_alike_on_a_pipeline_of_spatial_parts(tmp_path: Path) -> None:
    """The U-Net's skips cross every pipeline cut packed with the activation, their layout learnt from the first
    forward's header over spatial parts (gems.models.skips): `gems eval` of its model file on D = 2 x S = 2 and
    under 1F1B gives the one-rank figures."""
    unet = ["model=unet3d", "model.size=16", "model.width=0.125", "train.batch_size=2"]
    r = _run(tmp_path / "run", *unet, "train.steps=2", "train.warmup_steps=1")
    figures = []
    for mesh in ([], ["parallel.pipeline=2", "parallel.spatial=2"],
                 ["parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=2"]):
        out = gems_here("eval", r["model_file"], "data.val_samples=4", "train.batch_size=2",
                        f"results.dir={tmp_path / 'eval'}", *mesh)
        assert out.returncode == 0, out.stderr[-3000:]
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("gems eval:")]
        assert len(line) == 1, out.stdout
        figures.append(json.loads(Path(line[0].rsplit("record: ", 1)[1]).read_text())["evaluation"])
    for got in figures[1:]:
        for k in ("loss", "accuracy"):
            assert got[k] == pytest.approx(figures[0][k], rel=1e-5), (got, figures[0])
