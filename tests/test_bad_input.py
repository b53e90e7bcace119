"""The bad-input catalogue: every command, every class of mistake (a choice, a range, a relation between
keys, a model that does not fit its input, a path the command cannot use, a run id that exists).
Each is exit status 2, one line naming the key, the value and what would work, no traceback, and
nothing created or changed where the command would have written.

In-process through ``gems.cli.main`` (the same function the console script calls), so the catalogue
stays fast; test_cli.py runs a few of them as real processes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from gems.cli import main

CUSTOM = ["model=custom", "model._target_=_custom_models.plain"]

CASES = [
    # ---- run: devices and backends refused before launch (issue 24): NCCL on CPU ranks, gloo on GPU ranks,
    # more ranks on a node than GPUs
    (["run", "comm=nccl"], "comm.backend=nccl"),
    (["run", "train.device=cuda"], "train.device=cuda"),
    (["run", "cluster=perlmutter", "cluster.account=x", "comm=gloo"], "comm.backend=gloo"),
    (["run", "cluster=perlmutter", "cluster.account=x", "parallel.replicas=8", "train.batch_size=8",
      "cluster.tasks_per_node=8"], "cluster.tasks_per_node=8"),
    # ---- run: choices, ranges, relations
    (["run", "model=nope"], "model=nope"),
    (["run", "parallel.replicas=3"], "train.batch_size=4"),
    (["run", "parallel.schedule=mast"], "parallel.schedule=mast"),
    (["run", "parallel.schedule=zigzag"], "parallel.schedule=zigzag"),
    (["run", "parallel.pipeline=0"], "parallel.pipeline=0"),
    (["run", "parallel.spatial=[2,0]"], "parallel.spatial=[2,0]"),
    (["run", "parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=3"], "parallel.micro_batches=3"),
    (["run", "train.steps=0"], "train.steps=0"),
    (["run", "train.warmup_steps=6"], "train.warmup_steps=6"),
    (["run", "train.checkpoint_every=-1"], "train.checkpoint_every=-1"),
    (["run", "train.lr=0"], "train.lr=0"),
    (["run", "train.momentum=1.5"], "train.momentum=1.5"),
    (["run", "train.seed=-1"], "train.seed=-1"),
    (["run", "train.threads=-2"], "train.threads=-2"),
    (["run", "train.precision=fp8"], "train.precision=fp8"),
    (["run", "parallel.micro_batches=8"], "parallel.micro_batches=8"),  # lp on one rank: nothing would use it
    (["run", "train.on_nonfinite=ignore"], "train.on_nonfinite=ignore"),
    (["run", "train.stepz=3"], "train.stepz"),
    (["run", "model.dropout=1"], "model.dropout=1"),
    (["run", "model=unet3d", "model.norm=group"], "model.norm=group"),  # a model's own key, its choices
    (["run", "model=cosmoflow", "model.depth=20"], "model.depth=20"),  # another model's own key
    (["run", "model.width=0"], "model.width=0"),
    (["run", "model.size=-32"], "model.size=-32"),
    (["run", "data.num_samples=0"], "data.num_samples=0"),
    (["run", "comm.timeout_s=-5"], "comm.timeout_s=-5"),
    (["run", "comm.bucket_mb=0"], "comm.bucket_mb=0"),
    (["run", "fault.stall_timeout_s=0"], "fault.stall_timeout_s=0"),
    (["run", "fault.warmup_timeout_s=-1"], "fault.warmup_timeout_s=-1"),
    (["run", "fault.stall_rank=5"], "fault.stall_rank=5"),
    (["run", "fault.kill_rank=-2"], "fault.kill_rank=-2"),
    (["run", "fault.nan_rank=2", "parallel.replicas=2"], "fault.nan_rank=2"),
    (["run", "fault.at_step=-1"], "fault.at_step=-1"),
    (["run", "fault.step_delay_s=-1"], "fault.step_delay_s=-1"),
    (["run", "cluster.time_min=0"], "cluster.time_min=0"),
    (["run", "cluster.poll_s=0"], "cluster.poll_s=0"),
    (["run", "cluster=local_slurm", "cluster.time_min=5", "cluster.signal_margin_s=300"], "cluster.signal_margin_s=300"),
    (["run", "cluster=local_slurm", "cluster.nodes=2", "cluster.tasks_per_node=3", "parallel.replicas=2"],
     "cluster.tasks_per_node=3"),
    # ---- run: models that do not fit their declared input, found on a meta trace before launch
    ([*CUSTOM, "model.input_shape=[3,8,8,8]", "model.num_outputs=3"], "model.input_shape=[3, 8, 8, 8]"),
    ([*CUSTOM, "model.input_shape=[1,8,8]", "model.num_outputs=3"], "model.input_shape=[1, 8, 8]"),
    ([*CUSTOM, "model.input_shape=[1,8,8,8]", "model.num_outputs=5"], "model.num_outputs=5"),
    (["run", "model=custom", "model._target_=no_such_pkg.make", "model.input_shape=[1,8,8]"],
     "model._target_=no_such_pkg.make"),
    # ---- run: paths
    (["run", "results.dir=/proc/gems-results"], "results.dir=/proc/gems-results"),
    (["run", "results.dir=AFILE"], "results.dir=AFILE"),
    (["run", "results.dir=AFILE/below"], "results.dir=AFILE/below"),
    (["run", "data=hdf5", "data.path=/does/not/exist"], "data.path=/does/not/exist"),
    (["run", "run_id=EXISTING"], "run_id=EXISTING"),
    # ---- sweep: every point is checked before any runs
    (["sweep", "parallel.replicas=1,3"], "train.batch_size=4"),
    (["sweep", "train.steps=0,2"], "train.steps=0"),
    (["sweep", "parallel.replicas=1,2", "results.dir=/proc/gems-sweep"], "results.dir=/proc/gems-sweep"),
    (["sweep", "+experiment=nope"], "experiment=nope"),
    # ---- plan
    (["plan", "model=nope"], "model=nope"),
    (["plan", "plan.format=xml"], "plan.format=xml"),
    (["plan", "plan.reserve_gb=-1"], "plan.reserve_gb=-1"),
    (["plan", "plan.dry_run=true", "plan.dry_run_rank=4"], "plan.dry_run_rank=4"),
    (["plan", "plan.dry_run_rank=-1"], "plan.dry_run_rank=-1"),
    (["plan", "cluster.gpu=v100-64gb", "cluster.gpu_memory_gb=64"], "cluster.gpu=v100-64gb"),
    (["plan", "cluster=slurm", "cluster.account=x", "cluster.gpu=h100", "cluster.gpu_memory_gb=80",
      "parallel.replicas=2", "train.batch_size=4"], "cluster.intra_node_GBps"),
    # ---- render
    (["render", "cluster=juwels_booster"], "cluster.account=<project>"),
    (["render", "cluster=local_slurm", "results.dir=/proc/gems-render"], "results.dir=/proc/gems-render"),
    (["render", "cluster=perlmutter", "cluster.account=x", "cluster.nodes=3", "parallel.replicas=4",
      "cluster.tasks_per_node=null"], "cluster.nodes=3"),
    # ---- results
    (["results", "/does/not/exist"], "results DIR=/does/not/exist"),
    (["results", "AFILE"], "results DIR=AFILE"),
    (["results", "a", "b"], "results='a b'"),
    (["results", "results.dir=x"], "results=results.dir=x"),
    # ---- data synth
    (["data", "synth"], "data.path=None"),
    (["data", "synth", "data.path=/proc/gems-data"], "data.path=/proc/gems-data"),
    (["data", "synth", "data.path=AFILE"], "data.path=AFILE"),
    (["data", "synth", "data.path=new", "data.num_samples=0"], "data.num_samples=0"),
    (["data", "synth", "data.path=new", "model.size=0"], "model.size=0"),
    (["data", "nope"], "data=nope"),
    # ---- bench, commands
    (["bench", "nope"], "bench=nope"),
    (["bench", "overhead", "out=/proc/gems-bench"], "out=/proc/gems-bench"),
    (["bench", "overhead", "rounds=3"], "bench option=rounds=3"),
    (["frobnicate"], "command=frobnicate"),
]


def _tree(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime) for p in sorted(root.rglob("*"))}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A folder holding a file (AFILE) and an existing record (results/EXISTING.json)."""
    (tmp_path / "AFILE").write_text("not a folder\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "EXISTING.json").write_text(json.dumps({"schema": "gems.record/1", "status": "ok"}))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_catalogue_is_large_and_covers_every_command():
    assert len(CASES) >= 40
    assert {c[0][0] if not c[0][0].startswith("model=") else "run" for c in CASES} >= {
        "run", "sweep", "plan", "render", "results", "data", "bench"}


@pytest.mark.parametrize("args,needle", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_bad_input_is_exit_2_one_line_and_nothing_written(workdir, capsys, args, needle):
    if args[0].startswith("model="):
        args = ["run", *args]
    before = _tree(workdir)
    code = main(list(args))
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert code == 2, out.err + out.out
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in out.err, out.err
    assert lines[0].startswith("gems: error: ") and "expected" in lines[0], lines[0]
    assert _tree(workdir) == before, "bad input created or changed files"
    assert not any(p.name.startswith(".gems-probe") for p in Path("/proc").glob(".gems-probe*"))
