"""A step's distance to the device (gems/plan/roofline.py): the model's FLOPs and bytes a training step, counted on
the serial trace, against a count by hand; the device's peak by name; the record, the results table and gems plan
carry them."""
from __future__ import annotations

import json

import pytest
from _cli import gems_here, records

from gems.config import compose
from gems.plan import roofline


def test_a_steps_flops_are_a_forward_and_a_backward_of_twice_it_but_the_first_layers() -> None:
    """MLPerf's CosmoFlow: about 69 GFLOP a 128^3 sample forward (MLCommons's figure); a step is three times that,
    less the first convolution's input gradient, which nothing needs."""
    w = roofline.model_work(compose(["model=cosmoflow_mlperf", "train.batch_size=1"]))
    first = 2 * 4 * 32 * 27 * 128 ** 3  # its first convolution, 4 -> 32 channels, k = 3, forward
    forward = (w.flops + first) / 3
    assert 66e9 < forward < 72e9
    # linear in the batch, and R replicas of B/R samples are the same work as one of B
    w8 = roofline.model_work(compose(["model=cosmoflow_mlperf", "train.batch_size=8"]))
    assert w8.flops == pytest.approx(8 * w.flops, rel=1e-9)
    r8 = roofline.model_work(compose(["model=cosmoflow_mlperf", "train.batch_size=8", "parallel.replicas=8"]))
    assert r8.flops == pytest.approx(w8.flops, rel=1e-9) and r8.bytes == pytest.approx(8 * w.bytes, rel=1e-9)
    assert r8.per_rank(8).flops == pytest.approx(w.flops, rel=1e-9)


def test_the_peak_is_the_data_sheets_at_the_runs_precision() -> None:
    assert roofline.gpu_named("NVIDIA H100 80GB HBM3") == "h100"
    assert roofline.gpu_named("NVIDIA H200") == "h200"
    assert roofline.gpu_named("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert roofline.gpu_named("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    assert roofline.gpu_named("Tesla V100-SXM2-16GB") == "v100-16gb"
    assert roofline.gpu_named("NVIDIA GH200 480GB") == "gh200"
    assert roofline.gpu_named("cpu") is None and roofline.gpu_named(None) is None
    assert roofline.peak("h100", "bf16") == (989.5e12, 3350e9)
    assert roofline.peak("h100", "fp32") == (494.5e12, 3350e9)  # TF32, torch's default for convolutions
    assert roofline.peak("h100", "fp32", tf32=False) == (67.0e12, 3350e9)
    assert roofline.peak("v100-16gb", "fp32") == (15.7e12, 900e9)  # no TF32 on a V100
    assert roofline.peak("cpu", "fp32") is None
    f = roofline.fractions(roofline.Work(1e12, 1e10), 0.5, 4, (1e12, 1e11))
    assert f["flops_per_s_per_rank"] == pytest.approx(5e11) and f["flops_fraction"] == pytest.approx(0.5)
    assert f["bytes_per_s_per_rank"] == pytest.approx(5e9) and f["bytes_fraction"] == pytest.approx(0.05)
    assert roofline.fractions(roofline.Work(1e12, 1e10), 0.5, 4, None)["flops_fraction"] is None


def test_a_runs_record_table_and_plan_say_how_far_its_step_is_from_the_device(tmp_path) -> None:
    out = gems_here("run", f"results.dir={tmp_path}", "model.size=32", "model.width=0.25", "train.batch_size=2",
                    "train.steps=3", "train.warmup_steps=1")
    assert out.returncode == 0, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    hw = r["hardware"]
    w = roofline.model_work(compose(["model.size=32", "model.width=0.25", "train.batch_size=2"]))
    assert hw["model_flops_per_step"] == pytest.approx(w.flops) and hw["device"] == "cpu"
    assert hw["flops_per_s_per_rank"] == pytest.approx(w.flops / r["step_time_s"]["median"])
    assert hw["flops_fraction"] is None and "no data-sheet peak" in hw["note"]  # a CPU
    assert "TFLOP/s/gpu" in out.stdout
    from gems.results.table import rows_for

    (row,) = rows_for([r], sweep=False)
    assert row["TFLOP/s/gpu"] == pytest.approx(hw["flops_per_s_per_rank"] / 1e12)
    plan = gems_here("plan", "model=cosmoflow_mlperf", "train.batch_size=1", "train.precision=bf16", "cluster.gpu=h100",
                     "plan.format=json")
    assert plan.returncode == 0, plan.stderr[-2000:]
    got = json.loads(plan.stdout)["predicted_hardware"]
    step = json.loads(plan.stdout)["predicted_step_time_s"]["total"]
    assert got["device"] == "h100" and got["peak_flops_per_s"] == 989.5e12
    assert got["flops_fraction"] == pytest.approx(got["model_flops_per_step"] / step / 989.5e12)
    text = gems_here("plan", "model=cosmoflow_mlperf", "train.batch_size=1", "train.precision=bf16",
                     "cluster.gpu=h100").stdout
    assert "predicted on the device: the model's" in text and "of h100's 989.5 TFLOP/s" in text


@pytest.mark.parametrize("overrides", [
    ["model=cosmoflow", "model.size=32", "model.width=0.25", "train.batch_size=2"],
    ["model=unet3d", "model.size=16", "model.width=0.125", "train.batch_size=2"],
    ["model=resnet", "model.depth=11", "model.size=32", "model.width=0.25", "train.batch_size=3"],
    ["model=cosmoflow_mlperf", "model.size=32", "model.width=0.25", "train.batch_size=2", "parallel.replicas=2"],
], ids=["cosmoflow", "unet3d", "resnet-2d", "mlperf-R2"])
def test_the_counted_flops_are_what_torch_counts_on_a_real_step(overrides: list[str]) -> None:
    """The planner's count (a forward, and a backward of twice its FLOPs but the first layer's input gradient)
    against torch's FlopCounterMode over a real forward and backward of the serial model at the replica's batch,
    times the replicas, on 3D and 2D models with skips and norms."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from gems.config import section
    from gems.layers import batch_context
    from gems.models import build_model

    cfg = compose(overrides)
    spec = build_model(section(cfg, "model"))
    R, B = int(cfg.parallel.replicas), int(cfg.train.batch_size)
    x = torch.randn(B // R, *spec.input_shape)
    with FlopCounterMode(display=False) as counter:
        with batch_context(0, 0, list(range(B // R))):
            out = spec.module.train()(x)
        out.float().square().mean().backward()
    counted = roofline.model_work(cfg).flops
    assert counted == pytest.approx(R * counter.get_total_flops(), rel=0.01)
