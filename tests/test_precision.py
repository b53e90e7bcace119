"""fp16's loss scaling (gems.precision), on real gloo worlds and through `gems run`.

Scaling by a power of two is exact, so with no overflow a scaled fp32 run equals an unscaled one bit for
bit; where one rank's gradients overflow, every rank skips that step and halves the scale (the world's
verdict, one all-reduce), so the replicas stay identical; after ``growth_interval`` clean steps the scale
doubles. On a GPU, fp16 autocast runs the same code; here CPU autocast to fp16 runs it (slowly)."""
from __future__ import annotations

import math

import torch
from _cli import gems_here, records
from _worlds import loss_scaling

from gems.launch.world import run_world
from gems.precision import LossScaler


def test_scaling_is_exact_without_overflow() -> None:
    plain = run_world(loss_scaling, 2, False, -1, timeout=120)
    scaled = run_world(loss_scaling, 2, True, -1, timeout=120)
    for a, b in zip(plain, scaled):
        assert a["losses"] == b["losses"] and all(b["stepped"])
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
    assert scaled[0]["scales"] == [2.0**10, 2.0**11, 2.0**11, 2.0**12, 2.0**12]  # doubles every 2 clean steps


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    out = run_world(loss_scaling, 2, True, 2, timeout=120)
    for r in out:
        assert r["stepped"] == [True, True, False, True, True] and r["skipped"] == [2]
        assert r["scales"] == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11]
    assert all(torch.equal(p, q) for p, q in zip(out[0]["params"], out[1]["params"]))  # replicas still agree
    assert all(torch.isfinite(p).all() for p in out[0]["params"])
    # without scaling, rank 1's huge input reaches the optimizer: the weights are no longer finite
    bare = run_world(loss_scaling, 2, False, 2, timeout=120)
    assert not all(torch.isfinite(p).all() for p in bare[0]["params"])


def test_the_gradscaler_field_read_exists() -> None:
    """LossScaler reads GradScaler's per-optimizer overflow flags after unscale_: fails here if torch renames
    them, not in a user's run."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    s = LossScaler(torch.device("cpu"), True)
    s.scale(p.sum()).backward()
    s._scaler.unscale_(opt)
    found = s._found(opt)
    assert set(found) == {torch.device("cpu")} and float(found[torch.device("cpu")]) == 0.0


def test_fp16_trains_on_two_replicas(tmp_path) -> None:
    """`gems run train.precision=fp16` (CPU autocast to fp16 here): finite losses, the scale in the record."""
    r = gems_here("run", "model=resnet", "model.depth=11", "model.size=16", "model.width=0.25", "parallel.replicas=2",
                  "train.precision=fp16", "train.steps=3", "train.warmup_steps=1", f"results.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(str(tmp_path))
    assert rec["status"] == "ok" and all(math.isfinite(v) for v in rec["loss"]), rec["loss"]
    assert rec["loss_scale"]["final_scale"] > 0 and isinstance(rec["loss_scale"]["skipped_steps"], list)


def test_steps_whose_scaled_gradients_overflow_are_skipped_and_counted_in_the_record(tmp_path) -> None:
    """A first loss scale too large for this model's fp16 gradients (2^20; 2^16 is not): the first steps'
    gradients overflow, every rank skips them (their updates are dropped), the scale halves each time, and the
    record lists the skipped steps."""
    r = gems_here("run", "model=resnet", "model.depth=11", "model.size=16", "model.width=0.25", "parallel.replicas=2",
                  "train.precision=fp16", "train.steps=8", "train.warmup_steps=1", "train.loss_scale_init=1048576",
                  "train.optimizer=sgd", f"results.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(str(tmp_path))
    skipped = rec["loss_scale"]["skipped_steps"]
    assert skipped and skipped == list(range(len(skipped))) and len(skipped) < 8, rec["loss_scale"]
    assert rec["loss_scale"]["final_scale"] == 2.0 ** (20 - len(skipped))
    assert all(math.isfinite(v) for v in rec["loss"])  # the losses themselves stay finite: no run is stopped
