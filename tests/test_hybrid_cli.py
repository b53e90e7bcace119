"""Every composition of the strategies, launched by `gems run`, trains like one process.

Each case is a real multi-process job (gloo) whose per-step losses are compared
with the single-process run of the same model on the same global batch:
spatial parts (one and two cut dims), GEMS schedules, pipelines with
micro-batches, data replicas on top, HDF5 input read as hyperslabs, U-Net
with global BatchNorm, recomputed and pipelined, ResNet partitioned over a pipeline.

``gems`` runs through ``gems.cli.main`` in the test's process (tests/_cli.py's ``gems_here``): the launcher's own
code, its ranks real processes (gloo) forked by multiprocessing's fork server, as for any program that calls
``main``; the console script's own process is tests/test_cli.py's and tests/test_forkserver.py's.
"""
import pytest
import torch
from _cli import gems_here, merged, records

COSMO = ["model.size=32", "model.width=0.5", "train.steps=3", "train.warmup_steps=1"]
UNET = ["model=unet3d", "model.size=16", "model.width=0.125", "train.batch_size=2", "train.steps=3",
        "train.warmup_steps=1"]


def losses(tmp, *args):
    out = gems_here("run", f"results.dir={tmp}", *args)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-1000:]
    (r,) = records(str(tmp))
    assert r["status"] == "ok"
    return r


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    cache = {}

    def get(*args):
        if args not in cache:
            cache[args] = losses(tmp_path_factory.mktemp("serial"), *args)["loss"]
        return cache[args]

    return get


CASES = [
    ("spatial depth S=2", COSMO + ["train.batch_size=2"], ["parallel.spatial=2"]),
    # recomputed pieces on spatial parts: their halos at one place of the backward on both parts (torch's lazy
    # recomputation hung here: each part recomputed at its own graph's first saved tensor)
    ("spatial depth S=2 checkpoint", COSMO + ["train.batch_size=2"], ["parallel.spatial=2", "parallel.checkpoint=true"]),
    ("spatial 2x2 pencils", COSMO + ["train.batch_size=2"], ["parallel.spatial=[2,2]", "parallel.spatial_dims=[0,1]"]),
    ("mast D=2", COSMO + ["train.batch_size=4"], ["parallel.pipeline=2", "parallel.schedule=mast"]),
    ("master eta=4 D=2", COSMO + ["train.batch_size=8"],
     ["parallel.pipeline=2", "parallel.schedule=master", "parallel.gems_replicas=4"]),
    ("1f1b D=2 m=2 with R=2", COSMO + ["train.batch_size=8"],
     ["parallel.replicas=2", "parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=2"]),
    ("hybrid R2 x D2(mast) x S2", COSMO + ["train.batch_size=8"],
     ["parallel.replicas=2", "parallel.pipeline=2", "parallel.schedule=mast", "parallel.spatial=2"]),
    ("unet3d S=2 global BN", ["model=unet3d", "model.size=16", "model.width=0.125", "train.batch_size=2",
                              "train.steps=3", "train.warmup_steps=1"], ["parallel.spatial=2"]),
    # skips through recomputed pieces and across a pipeline's cut (gems.models.skips)
    ("unet3d checkpoint", UNET, ["parallel.checkpoint=true"]),
    ("unet3d S=2 checkpoint", UNET, ["parallel.spatial=2", "parallel.checkpoint=true"]),
    ("unet3d D=2 lp", UNET, ["parallel.pipeline=2"]),
    ("unet3d D=2 x S=2", UNET, ["parallel.pipeline=2", "parallel.spatial=2"]),  # the layouts learnt in headers
    # (without norms: a micro-batch's BatchNorm normalises over its own samples, as in any pipeline)
    ("unet3d D=2 1f1b m=2", UNET + ["model.norm=none"],
     ["parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=2"]),
    ("custom model S=2, gathered before its Flatten", ["model=custom", "model._target_=_custom_models.plain",
                                                        "model.input_shape=[1,8,8,8]", "model.num_outputs=3",
                                                        "train.batch_size=2", "train.steps=3", "train.warmup_steps=1"],
     ["parallel.spatial=2"]),
    ("resnet D=2 gpipe", ["model=resnet", "model.depth=11", "model.size=32", "model.width=0.25", "model.norm=group",
                          "train.batch_size=4", "train.steps=3", "train.warmup_steps=1"],
     ["parallel.pipeline=2", "parallel.schedule=gpipe", "parallel.micro_batches=2"]),
    ("resnet D=2 mast, comm cut", ["model=resnet", "model.depth=11", "model.size=32", "model.width=0.25",
                                   "model.norm=group", "train.batch_size=4", "train.steps=3", "train.warmup_steps=1"],
     ["parallel.pipeline=2", "parallel.schedule=mast", "parallel.balance_by=comm"]),
]


@pytest.mark.parametrize("name,base,par", CASES, ids=[c[0] for c in CASES])
def test_parallel_losses_equal_serial(tmp_path, serial, name, base, par):
    ref = serial(*base)
    r = losses(tmp_path, *base, *par)
    torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(ref), rtol=2e-5, atol=1e-6)
    assert r["global_batch"] == int(next(a for a in base if a.startswith("train.batch_size=")).split("=")[1])
    if r["mesh"]["pipeline"] > 1 and r["mesh"]["spatial"] > 1:  # spatial partitions: balanced, and as planned
        bal = r["mesh"]["balance"]
        n = sum(bal)
        assert bal != [n - n // 2, n // 2], "balanced by memory on the serial layers, not split by count"
        plan = gems_here("plan", *base, *par, "plan.predict=false")
        assert plan.returncode == 0 and f"balance {bal};" in plan.stdout, plan.stdout[-800:]


SGD = ["model.size=32", "model.width=0.5", "train.steps=4", "train.warmup_steps=1", "train.batch_size=4",
       "train.optimizer=sgd"]
SGD_LR = 0.02


@pytest.mark.parametrize("par", [["parallel.spatial=2", "parallel.spatial_dims=[0]"],
                                 ["parallel.replicas=2", "parallel.spatial=2", "parallel.spatial_dims=[0]"]],
                         ids=["S=2 depth", "R=2 x S=2"])
def test_sgd_gradients_are_summed_over_spatial_parts(tmp_path, serial, par):
    """Adam divides the gradient by its own scale: the Adam cases above see gradients averaged over the
    spatial parts instead of summed only through Adam's eps, by a few times their tolerance. SGD (with
    momentum) does not: a gradient scaled by c trains exactly like the learning rate scaled by c."""
    ref = torch.tensor(serial(*SGD, f"train.lr={SGD_LR}"))
    r = losses(tmp_path, *SGD, f"train.lr={SGD_LR}", *par)
    got = torch.tensor(r["loss"])
    assert r["world_size"] == (4 if "parallel.replicas=2" in par else 2) and r["global_batch"] == 4
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=1e-6)
    # the comparison can fail: gradients averaged over the 2 parts would train like lr / 2
    averaged = torch.tensor(serial(*SGD, f"train.lr={SGD_LR / 2}"))
    tol = 2e-5 * ref.abs() + 1e-6
    assert ((got - averaged).abs() > 20 * tol)[1:].all(), (got, averaged)


def test_hdf5_partitioned_input_trains_like_serial(tmp_path):
    data = tmp_path / "data"
    out = gems_here("data", "synth", f"data.path={data}", "data.num_samples=4", "model.size=32")
    assert out.returncode == 0, out.stderr
    assert len(list(data.glob("*.h5"))) == 4
    # standardized by the files' own log(1+counts), as the studies' configurations do (conf/experiment/): on raw
    # log counts the second step's loss jumps fivefold, which magnifies the rounding of the batch of 2 against two
    # of 1 (oneDNN's AVX-512 kernels: 3e-4 by the third step; 3e-7 standardized)
    import h5py
    import numpy as np

    logs = []
    for f in sorted(data.glob("*.h5")):
        with h5py.File(f) as h:
            logs.append(np.log1p(h["full"][()].astype(np.float64)))
    mean, std = float(np.mean(logs)), float(np.std(logs))
    base = COSMO + ["data=hdf5", f"data.path={data}", "train.batch_size=2", f"data.standardize=[{mean},{std}]"]
    ref = losses(tmp_path / "serial", *base)
    par = losses(tmp_path / "s2", *base, "parallel.spatial=2", "parallel.replicas=2")
    torch.testing.assert_close(torch.tensor(par["loss"]), torch.tensor(ref["loss"]), rtol=2e-5, atol=1e-6)
    # files that do not match the model are named before anything starts
    bad = gems_here("run", f"results.dir={tmp_path}/bad", *merged(*COSMO, "model.size=64"), "data=hdf5", f"data.path={data}")
    assert bad.returncode == 2 and "sample_" in bad.stderr and "[4, 32, 32, 32]" in bad.stderr, bad.stderr
    assert not (tmp_path / "bad").exists()
    # synth refuses to overwrite what is there
    again = gems_here("data", "synth", f"data.path={data}", "data.num_samples=4", "model.size=32")
    assert again.returncode == 2 and len(again.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("args,key", [
    (["parallel.schedule=mast"], "parallel.schedule=mast"),
    (["parallel.pipeline=2", "parallel.schedule=gpipe", "parallel.micro_batches=3"], "parallel.micro_batches=3"),
    (["parallel.pipeline=2", "parallel.schedule=master", "parallel.gems_replicas=3"], "parallel.gems_replicas=3"),
    (["parallel.pipeline=99"], "parallel.pipeline=99"),
    (["parallel.pipeline=2", "parallel.balance=[1,2]"], "parallel.balance=[1, 2]"),
    (["parallel.spatial=64", "model.size=32"], "parallel.spatial=64"),
    (["parallel.spatial=[2,2]", "parallel.spatial_dims=[0,3]"], "parallel.spatial_dims=[0, 3]"),
    (["model=resnet", "model.depth=12"], "model.depth=12"),
    (["data=hdf5", "data.path=/nonexistent"], "data.path=/nonexistent"),
    (["parallel.pipeline=4", "parallel.schedule=mast", "parallel.balance_by=comm"], "parallel.balance_by=comm"),
    # (a custom model with a global pooling, or a layer of the user's own, before its gather point is no longer
    # refused: tests/test_spatial_registry.py trains both exactly)
])
def test_bad_parallel_input_exits_2_before_launch(tmp_path, args, key):
    out = gems_here("run", f"results.dir={tmp_path}/r", *args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], out.stderr
    assert not (tmp_path / "r").exists()


def test_bf16_through_a_gems_pipeline_tracks_serial_bf16(tmp_path, serial):
    base = COSMO + ["train.batch_size=4", "train.precision=bf16"]
    ref = serial(*base)
    r = losses(tmp_path, *base, "parallel.pipeline=2", "parallel.schedule=mast")
    assert all(x == x for x in r["loss"]), "no NaN: activations cross the cut in the dtype the receiver expects"
    torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(ref), rtol=2e-2, atol=1e-3)


def test_mirrored_copies_stay_identical_buffers_included(tmp_path):
    """GEMS-MAST on D=2: both ranks hold partitions 0 and 1 (A's and B's), and the checkpoint a preemption leaves
    holds one copy of each (its tensors under the whole model's names). A run resumed from it evaluates exactly as
    the run that was not stopped, where both copies serve the evaluation's two directions: so the copies the
    uninterrupted run kept were bit-identical, parameters and BatchNorm statistics alike (the one that was not
    saved is replaced by the saved one on resume)."""
    args = ["model=resnet", "model.depth=11", "model.size=32", "model.width=0.25", "train.batch_size=4",
            "train.steps=4", "train.warmup_steps=1", "parallel.pipeline=2", "parallel.schedule=mast",
            "data.val_samples=8"]
    cut = gems_here("run", f"results.dir={tmp_path}/cut", *args, "fault.preempt_at_step=3")
    assert cut.returncode == 0, cut.stderr[-2000:]
    ref = gems_here("run", f"results.dir={tmp_path}/ref", *args)
    assert ref.returncode == 0, ref.stderr[-2000:]
    (c,), (r,) = records(str(tmp_path / "cut")), records(str(tmp_path / "ref"))
    assert c["restarts"] == 1 and c["loss"] == r["loss"]
    assert c["validation"][-1]["loss"] == r["validation"][-1]["loss"]
    assert c["validation"][-1]["accuracy"] == r["validation"][-1]["accuracy"]
    (ck,) = list((tmp_path / "cut").glob(".jobs/*/ckpt/step*"))
    from gems.checkpoint import entries

    saved = entries(ck, "test")
    assert any("running_mean" in k for k in saved) and all(k.split(".", 1)[0] in ("model", "optim") for k in saved)


def test_a_resumed_pipeline_of_spatial_parts_restores_every_copy_from_one_file_a_position(tmp_path):
    """D2 x S2 under GEMS-MAST: each pipeline position's spatial parts hold the same weights and optimizer state,
    so one part of each writes (the others write no file), and the two positions hold the same partitions (A's and
    B's), so each writes about half of them; every part resumes from them, training bit for bit as the run that
    was not stopped."""
    args = ["model.size=32", "model.width=0.25", "train.batch_size=4", "train.steps=4", "train.warmup_steps=1",
            "parallel.pipeline=2", "parallel.spatial=2", "parallel.schedule=mast"]
    cut = gems_here("run", f"results.dir={tmp_path}/cut", *args, "fault.preempt_at_step=2")
    assert cut.returncode == 0, cut.stderr[-2000:]
    (ck,) = list((tmp_path / "cut").glob(".jobs/*/ckpt/step*"))
    # spatial part 0 of each position (ranks 0 and 2: the writers' group ranks 0 and 1) writes
    assert sorted(f.name for f in ck.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "gems.json",
                                                    "history.pt"]
    sizes = [(ck / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
    assert min(sizes) > 0.3 * sum(sizes)
    ref = gems_here("run", f"results.dir={tmp_path}/ref", *args)
    assert ref.returncode == 0, ref.stderr[-2000:]
    (c,), (r,) = records(str(tmp_path / "cut")), records(str(tmp_path / "ref"))
    assert c["restarts"] == 1 and c["loss"] == r["loss"]
