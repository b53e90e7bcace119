"""Whole `gems run`s, every message and collective of every rank logged (GEMS_COMM_LOG) and replayed under
NCCL's rules (gems.commlog), with sends that complete at once and with sends that wait for their receive (as
NCCL's do once a message outgrows its buffers): set-up, the links' start, every step, the gradient sums, the
step sync and the record's own collectives. Every shipped model, spatial cuts of 2 to 4 parts (even, uneven,
cubes), R x S, and D x S with micro-batches under every schedule family, one measured step each (the gradient
sums run in one-parameter buckets, so they start all through the backward, between the halos).

The README's own example, ``gems run parallel.spatial=2``, hung in this replay before the reducer launched its
sums at points every part reaches in the same order (gems.replication): part 0 issued a gradient sum before a
backward halo that part 1 issued first. Its run is the documented command's own, logged and replayed the same way in
tests/test_readme_commands.py (test_the_documented_command_runs[gems run parallel.spatial=2]).

Also: under bf16 the pipeline's activations cross at bf16 (traced under the run's autocast; they went as fp32,
twice the bytes)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from _cli import gems_here, records

from gems.commlog import load, replay

SMALL_RESNET = ["model=resnet", "model.depth=11", "model.size=16", "model.width=0.25"]
FEW = ["model.width=0.25", "comm.bucket_mb=0.0001"]  # narrow layers, a bucket a parameter
COSMO32 = ["model=cosmoflow_small", "model.size=32", "comm.bucket_mb=0.0001"]
RESNET = ["model=resnet", "model.depth=11", "model.size=32", "model.width=0.25", "comm.bucket_mb=0.0001"]
UNET = ["model=unet3d", "model.size=32", "model.width=0.25", "comm.bucket_mb=0.0001"]
DXS = ["parallel.pipeline=2", "parallel.spatial=2", "parallel.micro_batches=2"]

RUNS = {
    "gpipe-bf16": ["parallel.pipeline=2", "parallel.schedule=gpipe", "parallel.micro_batches=2",
                   "train.precision=bf16", *SMALL_RESNET],
    "mast-x-spatial": ["parallel.pipeline=2", "parallel.spatial=2", "parallel.schedule=mast", *COSMO32],
    "cosmoflow128-S2": ["model.size=128", "parallel.spatial=2", "train.batch_size=2", *FEW],
    "cosmoflow128-R2xS2": ["model.size=128", "parallel.replicas=2", "parallel.spatial=2", "train.batch_size=2",
                           *FEW],
    "cosmoflow64-S4": ["parallel.spatial=4", *FEW],
    "cosmoflow64-S3-uneven": ["parallel.spatial=3", "train.batch_size=3", *FEW],
    "unet-S2": ["parallel.spatial=2", "train.batch_size=2", *UNET],
    "unet-S2x2": ["parallel.spatial=[2,2]", "train.batch_size=2", *UNET],
    "resnet-S2": ["parallel.spatial=2", *RESNET],
    "resnet-S2x2-uneven": ["parallel.spatial=[2,2]", "model.size=30", *RESNET[:2], *RESNET[3:]],
    "resnet-R2xS2": ["parallel.replicas=2", "parallel.spatial=2", *RESNET],
    "gpipe-DxS": [*DXS, "parallel.schedule=gpipe", *RESNET],
    "1f1b-DxS": [*DXS, "parallel.schedule=1f1b", *RESNET],
    "1f1b-DxS-cosmoflow": [*DXS, "parallel.schedule=1f1b", *COSMO32],
    "interleaved-DxS": [*DXS, "parallel.schedule=interleaved1f1b", *COSMO32],
    "zbh1-DxS": [*DXS, "parallel.schedule=zbh1", *RESNET],
    "master-DxS": [*DXS, "parallel.schedule=master", "train.batch_size=8", *RESNET],
    # GEMS's mirrored sums start inside the backward that completes them where nothing comes between
    # (gems.pipeline.exchange.at_points): with replicas, and with the weight gradients of a split backward
    "mast-R2xD2": ["parallel.replicas=2", "parallel.pipeline=2", "parallel.schedule=mast", *RESNET],
    "master-split-DxS": [*DXS, "parallel.schedule=master", "parallel.split_backward=true", "train.batch_size=8",
                         *COSMO32],
    # recomputed pieces on spatial parts: each piece's forward again at one place of the backward on every part
    # (torch's lazy recomputation ran it at each part's own first saved tensor, and the parts hung)
    "cosmoflow-S2-checkpoint": ["parallel.spatial=2", "parallel.checkpoint=true", "train.batch_size=2", *COSMO32],
    "unet-S2-checkpoint": ["parallel.spatial=2", "parallel.checkpoint=true", "train.batch_size=2", *UNET],
    # the U-Net's skips across a pipeline's cuts, packed with the activation (gems.models.skips.Carried)
    "unet-D2-1f1b": ["parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=2",
                     "train.batch_size=2", "parallel.checkpoint=true", *UNET],
    "unet-DxS": [*DXS, "parallel.schedule=1f1b", "train.batch_size=2", *UNET],
}


def released_before_destroyed(logs: dict[int, list[dict[str, Any]]], captured: bool = True) -> None:
    """Every rank reset its graphs before it destroyed its process groups, none left alive then (gems.capture: NCCL's
    teardown waits for every graph holding its work), and where NCCL work was captured (``captured``) every launch
    inside a graph was chained after the one before (the replay refuses one that was not: gems.commlog.unordered)."""
    for r, events in logs.items():
        kinds = [e["e"] for e in events]
        assert kinds.count("destroy") == 1 and "graph_reset" in kinds, (r, kinds[-5:])
        end = kinds.index("destroy")
        assert "graph_reset" not in kinds[end:] and events[end]["graphs_alive"] == 0, (r, kinds[end - 3:])
        inside = [e for e in events if e.get("e") == "post" and e.get("graph") is not None]
        assert bool(inside) == captured and all(e["chained"] for e in inside), r


def _logged_run(logs_dir: Path, *args: str) -> Any:
    """``gems run ARGS`` with every rank's communication logged under ``logs_dir`` (GEMS_COMM_LOG), run by
    ``gems.cli.main`` in this process (the ranks real processes, given the launcher's environment)."""
    env_before = os.environ.get("GEMS_COMM_LOG")
    os.environ["GEMS_COMM_LOG"] = str(logs_dir)
    try:
        return gems_here("run", *args)
    finally:
        if env_before is None:
            os.environ.pop("GEMS_COMM_LOG")
        else:
            os.environ["GEMS_COMM_LOG"] = env_before


@pytest.mark.parametrize("name", list(RUNS))
def test_a_run_replays_under_nccl_rules(tmp_path: Path, name: str) -> None:
    args = RUNS[name]
    logs_dir = tmp_path / "comm"
    r = _logged_run(logs_dir, *args, "train.steps=2", "train.warmup_steps=1", "train.check_fit=false",
                    f"results.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(str(tmp_path))
    logs = load(logs_dir)
    assert sorted(logs) == list(range(rec["world_size"]))
    for strict in (False, True):
        ran = replay(logs, strict_sends=strict)
        assert ran["messages"] > 0 and ran["collectives"] > 0
    if "train.precision=bf16" in args:
        sends = [e for e in logs[0] if e.get("e") == "post" and e["kind"] == "send" and e["bytes"] > 4]
        assert sends and all(e["dtype"] == "bfloat16" for e in sends), {e["dtype"] for e in sends}


def test_rounds_placed_by_measured_times_train_alike_and_replay_under_nccl_rules(tmp_path: Path) -> None:
    """``parallel.rounds_by=time`` on uneven stages (1F1B, 4 micro-batches, a cut of 4 and 18 layers): after the
    warm-up step every rank places the rounds by the times its actions took, the largest over the ranks; the
    record says so, the losses are the unit clock's to the bit, and the whole run replays under NCCL's rules."""
    args = ["model=cosmoflow_small", "model.size=32", "parallel.pipeline=2", "parallel.schedule=1f1b",
            "parallel.micro_batches=4", "parallel.balance=[4,18]", "train.batch_size=8", "train.steps=3",
            "train.warmup_steps=1", "train.check_fit=false"]
    losses = {}
    for how in ("unit", "time"):
        r = _logged_run(tmp_path / how / "comm", *args, f"parallel.rounds_by={how}", f"results.dir={tmp_path / how}")
        assert r.returncode == 0, r.stderr[-2000:]
        (rec,) = records(str(tmp_path / how))
        losses[how] = rec["loss"]
        timed = [n for n in rec.get("notes", []) if "placed by their measured times" in n]
        assert bool(timed) == (how == "time"), rec.get("notes")
        logs = load(tmp_path / how / "comm")
        for strict in (False, True):
            assert replay(logs, strict_sends=strict)["messages"] > 0
    assert losses["time"] == losses["unit"] and len(losses["unit"]) == 3


def test_a_graphed_replicas_run_with_checkpoints_replays_under_nccl_rules(tmp_path: Path, monkeypatch) -> None:
    """Two replicas replaying their model (the CUDA graphs' protocol through its CPU stand-in: the gradient sums
    after the backward, in bucket order), saving a checkpoint every step (the histories' all-reduces on every rank,
    the writers' group made once, DCP's plans over it) and writing the model file at the end: every rank's calls
    replay under NCCL's rules, strict sends too."""
    from gems.rank.graphs import STAND_IN_ENV

    monkeypatch.setenv(STAND_IN_ENV, "1")
    logs_dir = tmp_path / "comm"
    r = _logged_run(logs_dir, "parallel.replicas=2", "train.graph_collectives=true", *RESNET, "train.batch_size=4",
                    "train.steps=3",
                    "train.warmup_steps=1", "train.check_fit=false", "train.checkpoint_every=1",
                    f"results.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(str(tmp_path))
    assert rec["cuda_graphs"] is True and rec["checkpoint"]["saves"] == 3
    logs = load(logs_dir)
    assert sorted(logs) == [0, 1]
    comms = {(e["fn"], e["comm"]) for e in logs[0] if e.get("e") == "post"}
    # the sums on the gradient group, the step syncs and histories on the world's, DCP's plans on the writers'
    assert len({c for _, c in comms}) >= 3 and any(fn == "scatter" for fn, _ in comms)
    for strict in (False, True):
        assert replay(logs, strict_sends=strict)["collectives"] > 0
    released_before_destroyed(logs)


def test_a_graphed_replicas_step_read_a_step_late_replays_under_nccl_rules(tmp_path: Path, monkeypatch) -> None:
    """Two replicas of CosmoFlow with BatchNorm and dropout, their steps graphed (the stand-in: the eager step, the
    capture's run, then a replay a step, each the body's sums at the reducer's points in one-parameter buckets,
    BatchNorm's averages and the step's sync) and their figures read a step late: every rank's calls replay under
    NCCL's rules, strict sends too."""
    from gems.rank.graphs import STAND_IN_ENV

    monkeypatch.setenv(STAND_IN_ENV, "1")
    logs_dir = tmp_path / "comm"
    r = _logged_run(logs_dir, "parallel.replicas=2", "train.graph_collectives=true", *COSMO32[:2], "model.width=0.25",
                    "model.norm=batch",
                    "model.dropout=0.5", "comm.bucket_mb=0.0001", "train.batch_size=4", "train.steps=5",
                    "train.warmup_steps=1", "train.check_fit=false", f"results.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(str(tmp_path))
    assert rec["cuda_graphs"] is True and rec["device_ops"]["per_step"] <= 8
    logs = load(logs_dir)
    for strict in (False, True):
        assert replay(logs, strict_sends=strict)["collectives"] > 0
    released_before_destroyed(logs)


def test_graphed_spatial_parts_replay_under_nccl_rules(tmp_path: Path, monkeypatch) -> None:
    """train.graph_spatial (the stand-in): R2 x S2, each part's step one graph with its halo messages, BatchNorm's
    global statistics and the gradient sums captured in it in the eager step's order: every rank's calls replay
    under NCCL's rules, strict sends too."""
    from gems.rank.graphs import STAND_IN_ENV

    monkeypatch.setenv(STAND_IN_ENV, "1")
    logs_dir = tmp_path / "comm"
    r = _logged_run(logs_dir, "parallel.replicas=2", "parallel.spatial=2", "train.graph_collectives=true",
                    *COSMO32[:2], "model.width=0.25",
                    "model.norm=batch", "train.batch_size=4", "train.steps=4", "train.warmup_steps=1",
                    "train.check_fit=false", "train.graph_spatial=true", f"results.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(str(tmp_path))
    assert rec["cuda_graphs"] is True and rec["device_ops"]["per_step"] <= 8
    logs = load(logs_dir)
    for strict in (False, True):
        ran = replay(logs, strict_sends=strict)
        assert ran["messages"] > 0 and ran["collectives"] > 0
    released_before_destroyed(logs)
    sends = [e for e in logs[0] if e.get("e") == "post" and e["kind"] == "send" and e.get("graph") is not None]
    assert sends and {e["fn"] for e in logs[0] if e.get("graph") is not None} >= {"all_reduce", "isend"}


@pytest.mark.parametrize("schedule", ["1f1b", "mast"])
def test_a_pipelines_graphed_pieces_replay_under_nccl_rules(tmp_path: Path, monkeypatch, schedule: str) -> None:
    """train.graph_pieces (the stand-in): each partition's pieces replayed between the schedule's rounds, its sums
    after each backward action (GEMS-MAST's mirrored ones between the rounds every holder shares), at R2 x D2: every
    rank's calls replay under NCCL's rules, strict sends too."""
    from gems.rank.graphs import STAND_IN_ENV

    monkeypatch.setenv(STAND_IN_ENV, "1")
    logs_dir = tmp_path / "comm"
    r = _logged_run(logs_dir, "parallel.replicas=2", "parallel.pipeline=2", f"parallel.schedule={schedule}",
                    "parallel.micro_batches=2", *COSMO32, "train.batch_size=8", "train.steps=3", "train.warmup_steps=1",
                    "train.check_fit=false", "train.graph_pieces=true", f"results.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(str(tmp_path))
    assert rec["cuda_graphs"] is True
    logs = load(logs_dir)
    for strict in (False, True):
        assert replay(logs, strict_sends=strict)["messages"] > 0
    released_before_destroyed(logs, captured=False)  # a piece holds no NCCL work: the messages stay eager
