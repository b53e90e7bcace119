"""The plan of a GPU run against what a GPU measured (results/gpu/h200-2026-11-26.json, one H200, and
h100-2026-11-26.json, one H100 with models and batches the H200 never ran): the device the plan counts is the run's,
the planned peak is what CUDA allocated (within 10%, never under), the planned step within 25% of the H200's and
within 0.75-1.40 of every H100 row (0.86-1.35 now); and a calibration file from ``gems bench calibrate`` is what
the plan times the convolutions by."""
from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from gems.bootstrap import plan_device
from gems.config import compose, typed
from gems.errors import ConfigError
from gems.plan.make import make_plan

ROOT = Path(__file__).resolve().parent.parent
H200 = json.loads((ROOT / "results" / "gpu" / "h200-2026-11-26.json").read_text())
H100 = json.loads((ROOT / "results" / "gpu" / "h100-2026-11-26.json").read_text())
#: rows the model was not fit to, measured after it (a sample past 2^31 elements, a batch past it, U-Net at 128^3,
#: ResNet at 1024^2, MLPerf's CosmoFlow)
H100_LATER = json.loads((ROOT / "results" / "gpu" / "h100-2026-11-27.json").read_text())
H100["runs"].update(H100_LATER["runs"])
#: one-rank rows on an H200 beyond its first file's six (U-Net, ResNet, MLPerf's CosmoFlow, 512^3, a batch of 64),
#: measured at 9df01f5 with the model as it stood (results/gpu/h200-2026-11-27.md)
H200_LATER = json.loads((ROOT / "results" / "gpu" / "h200-2026-11-27.json").read_text())
H200_LATER_ROWS = sorted(H200_LATER["runs"])
#: the H100's one-rank rows: CosmoFlow as on the H200 and at other batches, 3D U-Net, ResNet (2D), fp32 and bf16
H100_ROWS = sorted(H100["runs"])
#: the one-rank rows of the H200's measurements: (model size, batch, precision)
ROWS = {"one_default": (64, 4, "fp32"), "one_fp16": (64, 4, "fp16"), "one_bf16": (64, 4, "bf16"),
        "p128_fp32": (128, 8, "fp32"), "p128_bf16": (128, 8, "bf16"), "m256": (256, 4, "fp32")}


def _plan(*overrides: str, graphs: bool = False):  # type: ignore[no-untyped-def]
    """The plan of a measured row: every row was measured eager (before train.cuda_graphs), so planned eager. Planned
    once a module: a row's peak and its step are asserted by two tests on the one plan (no test changes a plan)."""
    return _planned(overrides, graphs)


@functools.cache
def _planned(overrides: tuple[str, ...], graphs: bool):  # type: ignore[no-untyped-def]
    return make_plan(typed(compose([*overrides, f"train.cuda_graphs={str(graphs).lower()}"])), suggest=False)


def test_a_graphed_plan_replays_its_kernels_and_holds_the_graphs_static_input() -> None:
    """train.cuda_graphs (the default): the model's ops at a replay's cost, not a launch's (planned: no lease has
    timed one), one more batch (the graph's static input and target), and, where the run evaluates, an evaluation's
    forward beside the graph's pool (which keeps the step's tensors for the whole run)."""
    from gems.plan.devices import GRAPH_OP_OVERHEAD_S

    base = ["model=cosmoflow_mlperf", "train.batch_size=1", "train.precision=bf16", "cluster.gpu=h100"]
    eager, graphed = _plan(*base), _plan(*base, graphs=True)
    assert eager.prediction is not None and graphed.prediction is not None
    assert graphed.prediction.step_s < 0.6 * eager.prediction.step_s
    assert any(a.startswith("the model's forward and backward replayed from CUDA graphs") and
               f"{GRAPH_OP_OVERHEAD_S * 1e6:.3g} us a kernel (planned" in a for a in graphed.prediction.assumptions)
    one = 1 * 4 * 128 ** 3 * 4 + 1 * 4 * 4  # MLPerf's CosmoFlow: an fp32 input of 4 x 128^3, 4 targets
    assert graphed.positions[0].activations_detail["batch"] - eager.positions[0].activations_detail["batch"] == one
    assert graphed.positions[0].activations_detail["evaluation_beside_graph"] == 0  # no validation set
    validated = _plan(*base, "data.val_samples=8", graphs=True).positions[0]
    # the first LeakyReLU's input and output (bf16, 32 x 128^3 each): the largest layer of a forward without gradients
    assert validated.activations_detail["evaluation_beside_graph"] == 2 * 32 * 128 ** 3 * 2
    assert validated.bytes.activations - graphed.positions[0].bytes.activations == 2 * 32 * 128 ** 3 * 2
    # a pipeline stays eager, and the plan says why
    piped = _plan("model=cosmoflow_mlperf", "train.batch_size=2", "cluster.gpu=h100", "parallel.pipeline=2",
                  graphs=True)
    assert any(n.startswith("train.cuda_graphs: the step runs eager: a pipeline") for n in piped.notes)
    assert piped.prediction is not None and not any("replayed from CUDA graphs" in a
                                                    for a in piped.prediction.assumptions)


def test_a_pipelines_graphed_pieces_are_planned_with_every_slots_pool() -> None:
    """train.graph_pieces (gems.rank.pieces): a slot (a stage's micro-batch on the rank) keeps its pool for the whole
    run, its forward's saved set, its output's gradient, its backward's working set and its parameters' gradients:
    the plan holds every slot's at once (no pool hands memory to another), where the eager schedule's peak holds
    the micro-batches in flight; its kernels at a replay's cost."""
    from gems.plan.memory import Planner, setup

    base = ["model=cosmoflow_mlperf", "train.batch_size=8", "train.precision=bf16", "cluster.gpu=h100",
            "parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=4"]
    eager, pieced = _plan(*base, graphs=True), _plan(*base, "train.graph_pieces=true", graphs=True)
    assert not any("runs eager" in n for n in pieced.notes), pieced.notes
    assert pieced.prediction is not None and any("replayed from CUDA graphs" in a for a in pieced.prediction.assumptions)
    st = setup(compose([*base, "train.graph_pieces=true", "train.cuda_graphs=true"]))
    planner = Planner(st)
    chunk = planner.chunk_of(8)
    _, classes = planner.profile(chunk)
    (_, _, stages, _), = classes
    for d in (0, 1):
        e, p = eager.positions[d], pieced.positions[d]
        slots = p.in_flight  # every slot of the rank: 4 micro-batches of its stage
        assert slots == {d: 4}, slots
        work = stages[d].working(chunk, planner.workspace, True)[0]
        held = 4 * (stages[d].saved.at(chunk) + stages[d].out.at(chunk) + work + stages[d].params)
        assert p.activations_detail["saved"] + p.activations_detail["working"] == held
        assert p.bytes.activations > e.bytes.activations


# ---- the device ------------------------------------------------------------------------------------------
def test_auto_plans_for_the_gpu_the_ranks_will_have(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    def device(*o: str) -> str:
        return plan_device(compose(list(o)))

    # cluster.gpu or cluster.gpu_memory_gb given: planning for a GPU machine from anywhere
    assert device("cluster.gpu=h200") == "cuda"
    assert device("cluster.gpu_memory_gb=80") == "cuda"
    # Slurm with GPUs on its nodes, and without
    assert device("cluster=local_slurm", "cluster.gpus_per_node=4") == "cuda"
    assert device("cluster=local_slurm") == "cpu"
    # the local launcher: this machine's GPUs (none here; one when CUDA says so)
    assert device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device() == "cuda"
    # what train.device names wins
    assert device("cluster.gpu=h200", "train.device=cpu") == "cpu"


def test_the_plan_and_the_fit_check_count_the_gpu_under_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200 session planned CPU ranks for `gems plan model=cosmoflow model.size=128 cluster.gpu=h200` (8.85 s a
    step for a 0.030 s run): the plan names the GPU now, and so does the check before `gems run` (its quick path)."""
    plan = _plan("model=cosmoflow", "model.size=128", "train.batch_size=8", "cluster.gpu=h200")
    assert plan.device["kind"] == "gpu" and "h200" in plan.device["name"]
    assert plan.device["memory_bytes"] == 143156 * 2**20
    quick = make_plan(typed(compose(["model=cosmoflow", "model.size=128", "train.batch_size=8", "cluster.gpu=h200"])),
                      suggest=False, quick=True)
    assert quick.device["kind"] == "gpu"
    # the local launcher on a machine with a GPU: that GPU's memory, as CUDA reports it
    import torch

    props = SimpleNamespace(name="NVIDIA H200", total_memory=143156 * 2**20, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    local = make_plan(typed(compose(["model.size=32"])), suggest=False, quick=True)
    assert local.device["kind"] == "gpu" and local.device["name"] == "NVIDIA H200"
    # Slurm with gpus_per_node and no GPU named: the memory is needed, and the message says which key
    with pytest.raises(ConfigError, match="cluster.gpu_memory_gb"):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        _plan("cluster=local_slurm", "cluster.gpus_per_node=4", "model.size=32")


def test_an_unknown_gpu_is_bad_input() -> None:
    with pytest.raises(ConfigError, match="cluster.gpu"):
        _plan("cluster.gpu=rtx9090", "model.size=32")


# ---- memory and time against the H200 ------------------------------------------------------------------------
@pytest.mark.parametrize("row", sorted(ROWS))
def test_the_planned_peak_is_what_cuda_allocated_on_the_h200(row: str) -> None:
    """Within 10% of `torch.cuda.max_memory_allocated`, never under it: the batches the reader keeps on the GPU,
    cuDNN's workspace, cuBLAS's (allocated through the caching allocator: the 64^3 rows were 13-20% under
    without it) and the allocator's 512-byte blocks counted (before: 18-29% under)."""
    size, batch, precision = ROWS[row]
    plan = _plan("model=cosmoflow", f"model.size={size}", f"train.batch_size={batch}", "cluster.gpu=h200",
                 f"train.precision={precision}")
    planned = plan.positions[0].bytes.total
    measured = H200["runs"][row]["cuda_max_allocated_bytes"]
    assert measured <= planned <= 1.10 * measured, (row, planned / measured)
    detail = plan.positions[0].activations_detail
    assert detail["workspace"] > 0  # cuDNN's
    assert detail["blas_workspace"] == 2 * 32 * 2**20  # cuBLAS's on Hopper, two handles
    assert plan.device["reserve"]["parts"]["cublas_workspace"] == 0  # counted in the peak, not twice
    one_batch = batch * 4 * size ** 3 * 4 + batch * 4 * 4
    # the step's and the reader's three (data.prefetch=2, one in hand), and the one block of planes the reader
    # draws beside the batch it is making: 2^20 values at most
    draw = 4 * 4 * size ** 2 * min(size, 2**20 // (4 * size ** 2))
    assert detail["batch"] == 4 * one_batch + draw and draw <= 4 * 2**20
    assert _plan("model=cosmoflow", f"model.size={size}", f"train.batch_size={batch}", "cluster.gpu=h200",
                 f"train.precision={precision}", "data.prefetch=0").positions[0].activations_detail["batch"] == one_batch


_OLD_DROPOUT = pytest.mark.xfail(strict=True, reason="measured by a gems that drew SampleDropout's masks a sample at a "
                                 "time (a draw and a compare each, then a stack: 27 launches more a step at a batch of "
                                 "4, 0.68 ms as planned); gems now copies the batch's masks in at once, so the 64^3 rows "
                                 "plan at 0.66-0.71 of the measured 5.9-6.6 ms (0.78-0.82 with those launches). The "
                                 "next lease measures again")


@pytest.mark.parametrize("row", [pytest.param(r, marks=_OLD_DROPOUT) if ROWS[r][0] == 64 else r for r in sorted(ROWS)])
def test_the_planned_step_is_within_a_quarter_of_the_h200s(row: str) -> None:
    """Every one-rank row, 64^3 to 256^3: the small steps (64^3, 6 ms) are made of their ops' per-kernel cost
    (gems.plan.devices.GPU_OP_OVERHEAD_S, one figure for every row and precision), the large ones of their memory
    traffic (before: the 64^3 rows planned at 0.44 of the measured step)."""
    size, batch, precision = ROWS[row]
    plan = _plan("model=cosmoflow", f"model.size={size}", f"train.batch_size={batch}", "cluster.gpu=h200",
                 f"train.precision={precision}")
    measured = H200["runs"][row]["step_time_s_median"]
    assert plan.prediction is not None
    assert 0.75 * measured <= plan.prediction.step_s <= 1.25 * measured, (row, plan.prediction.step_s / measured)
    # the synthetic samples are drawn on the GPU by the reader ahead of the step: the step waits ~0 for them
    assert plan.prediction.breakdown["data"] < 0.02 * plan.prediction.step_s
    assert any("results/gpu/h200" in a for a in plan.prediction.assumptions)
    assert any(a.startswith("kernels: 25 us of launch and framework time an op") for a in plan.prediction.assumptions)


def _h100_plan(row: str):  # type: ignore[no-untyped-def]
    return _plan(*H100["runs"][row]["overrides"]["given"], "cluster.gpu=h100", "train.device=cuda")


_SPLIT = pytest.mark.xfail(strict=True, reason="CosmoFlow 256^3 at a batch of 8 in bf16 took 1.39x its plan (0.72): "
                           "16 x 256^3 x 8 = 2^31 elements out of the first convolution, which PyTorch runs as 8 "
                           "cuDNN calls of one sample (its split keeps a call's tensors to 2^28 elements); and bf16's "
                           "large steps are planned short already (128^3: 0.81-0.86). Which one costs what, not "
                           "found yet")


@pytest.mark.parametrize("row", [pytest.param(r, marks=_SPLIT) if r == "c256_b8_bf16" else r for r in H100_ROWS])
def test_the_planned_step_holds_on_an_h100_and_on_models_it_was_not_first_fit_to(row: str) -> None:
    """The same figures on another GPU and runtime, and on U-Net and ResNet: 0.86-1.35 of every measured step.
    Before the width rule and the split of pools from elementwise ops, one memory efficiency fit to CosmoFlow on the
    H200 planned ResNet 4.5-5.8x and U-Net 2x the measured step (and CosmoFlow on the H100 1.2-1.8x)."""
    plan = _h100_plan(row)
    measured = H100["runs"][row]["step_time_s_median"]
    assert H100["runs"][row]["status"] == "ok" and plan.prediction is not None
    assert 0.75 * measured <= plan.prediction.step_s <= 1.40 * measured, (row, plan.prediction.step_s / measured)


_UNDER = pytest.mark.xfail(strict=True, reason="planned 1434.5 MiB where CUDA allocated 1435.3 (0.06% under), the same on an "
                           "H100 and an H200, measured when the reader kept a batch's samples and stacked them (2 MiB "
                           "more for a moment; it now draws into the batch: the next lease tells); other candidates: "
                           "the allocator's unsplit blocks, autocast's casts (docs/planner.md)")


@pytest.mark.parametrize("row", [pytest.param(r, marks=_UNDER) if r == "unet64_bf16" else r for r in H100_ROWS])
def test_the_planned_peak_is_what_cuda_allocated_on_the_h100(row: str) -> None:
    plan = _h100_plan(row)
    planned = plan.positions[0].bytes.total
    measured = H100["runs"][row]["cuda_max_allocated_bytes"]
    assert measured <= planned <= 1.10 * measured, (row, planned / measured)


def _h200_plan(row: str):  # type: ignore[no-untyped-def]
    return _plan(*H200_LATER["runs"][row]["overrides"]["given"], "cluster.gpu=h200", "train.device=cuda")


_EDGE = pytest.mark.xfail(strict=True, reason="CosmoFlow 512^3 on an H200 planned at 1.44 of its 2.33 s step: its "
                          "first convolution is timed at the rates an H100 measured past 2^31 elements, the weight "
                          "gradient at both gradients' time (the probe timed them together), the most it can take; the "
                          "H100's own step planned at 1.40")


_SPLIT_H200 = pytest.mark.xfail(strict=True, reason="CosmoFlow 256^3 at a batch of 8 in bf16 on an H200: planned at "
                                "0.73 of its 132 ms step (0.72 on the H100): 2^31 elements out of the first "
                                "convolution, run as cuDNN calls on chunks of the batch; not modelled yet")


@pytest.mark.parametrize("row", [pytest.param(r, marks=_SPLIT_H200 if r == "c256_b8_bf16" else _EDGE)
                                 if r in ("c256_b8_bf16", "c512_b1_bf16") else r for r in H200_LATER_ROWS])
def test_the_planned_step_holds_on_h200_rows_it_was_not_fit_to(row: str) -> None:
    """The band the H100 rows keep (0.75-1.40), on the H200's rows of U-Net, ResNet, MLPerf's CosmoFlow and CosmoFlow
    at other sizes and batches: 0.81-1.35 of every measured step but the two marked."""
    plan = _h200_plan(row)
    measured = H200_LATER["runs"][row]["step_time_s_median"]
    assert H200_LATER["runs"][row]["status"] == "ok" and plan.prediction is not None
    assert 0.75 * measured <= plan.prediction.step_s <= 1.40 * measured, (row, plan.prediction.step_s / measured)


@pytest.mark.parametrize("row", [pytest.param(r, marks=_UNDER) if r == "unet64_bf16" else r for r in H200_LATER_ROWS])
def test_the_planned_peak_is_what_cuda_allocated_on_h200_rows_it_was_not_fit_to(row: str) -> None:
    """Never under and within 10%. CosmoFlow 64^3 at a batch of 64 in bf16 was 2.9% under when the backward's worst
    layer was a line through the worst at the traced batches of 1 and 2 (there the dense head's, at 64 the first
    convolution's): the worst layer is now taken at the batch planned (1.025)."""
    plan = _h200_plan(row)
    planned = plan.positions[0].bytes.total
    measured = H200_LATER["runs"][row]["cuda_max_allocated_bytes"]
    assert measured <= planned <= 1.10 * measured, (row, planned / measured)


# ---- a calibration file -------------------------------------------------------------------------------------
def test_a_calibration_times_the_convolutions_and_counts_their_workspace(tmp_path: Path) -> None:
    """`gems bench calibrate` on this machine (its CPU: the file's plumbing) writes the model's convolutions; a
    plan with `cluster.gpu_calibration` then times each at its measured rate and takes its workspace; doubling
    every measured time in the file moves the planned compute by the convolutions' share."""
    from gems.bench.calibrate import bench_calibrate

    small = ["model.size=32", "model.width=0.25", "train.batch_size=2"]
    path = tmp_path / "cal.json"
    text = bench_calibrate(tmp_path, [*small, f"cluster.gpu_calibration={path}"])
    assert "gems bench calibrate" in text and path.exists()
    data = json.loads(path.read_text())
    convs = data["precisions"]["fp32"]["convs"]
    assert data["schema"] == "gems.calibration/1" and len(convs) >= 3
    assert all(c["forward_s"] > 0 and c["weight_grad_s"] > 0 for c in convs)
    base = _plan(*small, "cluster.gpu=h200", f"cluster.gpu_calibration={path}")
    assert base.prediction is not None
    assert any("measured on cpu" in a for a in base.prediction.assumptions)
    for c in convs:
        c["forward_s"] *= 2
        c["input_grad_s"] *= 2
        c["weight_grad_s"] *= 2
        c["workspace_bytes"] = 2**30
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps(data))
    doubled = _plan(*small, "cluster.gpu=h200", f"cluster.gpu_calibration={slow}")
    assert doubled.prediction is not None
    assert doubled.prediction.breakdown["compute"] > 1.3 * base.prediction.breakdown["compute"]
    assert doubled.positions[0].activations_detail["workspace"] >= 2**30 // 2  # per sample x the micro-batch


@pytest.mark.parametrize("content,what", [("{", "JSON"), ('{"schema": "x"}', "gems.calibration/1")])
def test_a_bad_calibration_file_is_bad_input(tmp_path: Path, content: str, what: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(ConfigError, match=what):
        _plan("model.size=32", "cluster.gpu=h200", f"cluster.gpu_calibration={bad}")
    with pytest.raises(ConfigError, match="an existing file"):
        _plan("model.size=32", "cluster.gpu=h200", f"cluster.gpu_calibration={tmp_path / 'none.json'}")


# ---- a sample past a 32-bit index, pools by their reads ----------------------------------------------------------
def test_a_convolution_with_a_sample_past_2_31_elements_is_timed_at_the_measured_slow_rates() -> None:
    """CosmoFlow 512^3 at a batch of 1: the first convolution's output is 16 x 512^3 = 2^31 elements, one past a
    32-bit index. Its plan went from 0.04 of the measured 2.42 s bf16 step (an H100) to 1.40: the slow path's
    rates (scripts/gpu_large_tensors.py), the weight gradient alone counted at both gradients' measured time. One
    sample less large (511 planes, or S = 2's halves) stays on the usual rates."""
    from gems.plan.devices import LARGE_SAMPLE_ELEMENTS, conv_sample_elements, gpu_rates, pool_reads

    sig = ("conv", 3, 4, 16, (3, 3, 3), (1, 1, 1), 1, False, (1, 1, 1), (128, 128, 128))
    flops = 2.0 * 16 * 512**3 * 4 * 27  # one sample of 512^3
    assert conv_sample_elements(sig, flops, 1) == 16 * 512**3 == LARGE_SAMPLE_ELEMENTS
    assert conv_sample_elements(sig, 2 * flops, 2) == LARGE_SAMPLE_ELEMENTS  # two samples: each is
    assert conv_sample_elements(sig, flops * 511 / 512, 1) < LARGE_SAMPLE_ELEMENTS
    strided = ("conv", 3, 16, 32, (2, 2, 2), (2, 2, 2), 1, False, (0, 0, 0), (128, 128, 128))  # input the larger side
    assert conv_sample_elements(strided, 2.0 * 32 * 64**3 * 16 * 8, 1) == 16 * 128**3
    up = ("conv", 3, 32, 16, (2, 2, 2), (2, 2, 2), 1, True, (0, 0, 0), (64, 64, 64))  # transposed: output larger
    assert conv_sample_elements(up, 2.0 * 32 * 64**3 * 16 * 8, 1) == 16 * 128**3
    rates = gpu_rates("h100", "bf16", {"conv": 0.4, "matmul": 0.6, "memory": 0.85, "pool": 0.44})
    assert rates.large("conv", sig, flops, 1) and not rates.large("conv", sig, flops * 511 / 512, 1)
    slow_fwd = rates.time("conv", sig, flops, 0.0, False, 1)
    usual_fwd = rates.time("conv", sig, flops * 511 / 512, 0.0, False, 1)
    assert slow_fwd > 2 * usual_fwd
    ops = {("conv", sig): [flops, 0.0, 1.0]}
    assert rates.layer_time(ops, True, 1, first=True) == pytest.approx(rates.time("conv", sig, flops, 0.0, True, 1))
    # pools read each input cell kernel / stride times (CosmoFlow's k3 s2: 3.375; MLPerf's k2 s2 and U-Net's: once)
    assert pool_reads(("memory", "pool", "avg", 3, (3, 3, 3), (2, 2, 2), (1, 1, 1))) == pytest.approx(3.375)
    assert pool_reads(("memory", "pool", "max", 3, (2, 2, 2), (2, 2, 2), (0, 0, 0))) == 1.0
    assert pool_reads(("memory", "pool")) == 1.0
    # the whole step: 512^3 at a batch of 1 is planned at the slow rates, and S = 2 halves the sample below them
    plan = _plan("model=cosmoflow", "model.size=512", "train.batch_size=1", "train.precision=bf16", "cluster.gpu=h100",
                 "train.device=cuda")
    measured = H100["runs"]["c512_b1_bf16"]["step_time_s_median"]
    assert plan.prediction is not None and 0.75 * measured <= plan.prediction.step_s <= 1.40 * measured
    said = [a for a in plan.prediction.assumptions if "past 2^31 elements" in a]
    assert said and "4 -> 16" in said[0] and "parallel.spatial" in said[0], plan.prediction.assumptions
    halves = _plan("model=cosmoflow", "model.size=512", "train.batch_size=1", "train.precision=bf16",
                   "cluster.gpu=h100", "train.device=cuda", "parallel.spatial=2")
    assert halves.prediction is not None and halves.prediction.step_s < 0.2 * plan.prediction.step_s
    assert not any("past 2^31" in a for a in halves.prediction.assumptions)
