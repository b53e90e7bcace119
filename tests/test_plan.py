"""gems plan: the planned bytes against real measurements, monotonicity, the batch search, bad input."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from _cli import gems_here

from gems.config import compose, section
from gems.errors import ConfigError
from gems.plan import GiB, make_plan, saved_bytes, to_json

SMALL = ["model=cosmoflow", "model.size=32", "model.width=0.25", "train.batch_size=2"]


def _position(plan, d: int, s: int):
    return next(p for p in plan.positions if p.pipeline == d and s in p.spatial)


def _params(spec) -> int:
    return sum(p.numel() * p.element_size() for p in spec.module.parameters())


def _close(planned: float, real: float, tol: float = 0.03) -> None:
    assert abs(planned - real) <= tol * real, f"planned {planned} vs measured {real}"


def _real_saved(seq, x, last: bool, y=None) -> int:
    """Bytes of distinct storages kept for backward by a real forward of ``seq`` on ``x``, incl. its input
    (when it needs a gradient) and output (when it is sent on), excluding parameters."""
    params = list(seq.parameters())
    keep = {}

    def run():
        out = seq(x)
        if last:
            out = F.mse_loss(out.float(), y, reduction="sum")
        keep["out"] = out
        return out

    n = saved_bytes(run, exclude=params)
    st = {x.untyped_storage()._cdata} if x.requires_grad else set()
    extra = x.untyped_storage().nbytes() if x.requires_grad else 0
    # input and output, when autograd did not save them already, are kept by the runtime too
    seen = set()

    def pack(t):
        seen.add(t.untyped_storage()._cdata)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = seq(x)
    if x.requires_grad and x.untyped_storage()._cdata in seen:
        extra = 0
    if not last and out.untyped_storage()._cdata not in seen:
        extra += out.untyped_storage().nbytes()
    del st
    return n + extra


def test_serial_plan_matches_the_real_saved_set_and_parameter_state():
    cfg = compose(SMALL)
    plan = make_plan(cfg)
    from gems.models import build_model

    spec = build_model(section(cfg, "model"))
    spec.module.train()
    x = torch.randn(2, *spec.input_shape)
    from gems.models.layers import batch_context

    with batch_context(0, 0, range(2)):
        real = _real_saved(spec.module, x, last=True, y=torch.randn(2, 4))
    p = _position(plan, 0, 0)
    det = p.activations_detail
    # the plan counts the input as the batch, the real saved set holds it (conv1 saves its input)
    planned = det["saved"] + det["constant"] + x.numel() * 4
    _close(planned, real)
    n = _params(spec)
    assert (p.bytes.parameters, p.bytes.gradients, p.bytes.optimizer) == (n, n, 2 * n)  # Adam


def _spatial_rank(rank: int, world: int) -> int:
    from gems.models import build_model
    from gems.models.layers import batch_context
    from gems.spatial import SpatialContext, apply_spatial

    cfg = compose(SMALL + ["parallel.spatial=2"])
    spec = build_model(section(cfg, "model"))
    torch.manual_seed(0)
    ctx = SpatialContext(None, [0, 1], [2], [0], [rank])
    seq = apply_spatial(spec.module, ctx, spec.spatial_end)
    seq.train()
    x = ctx.scatter(torch.randn(2, *spec.input_shape))
    with batch_context(0, 0, range(2)):
        return _real_saved(seq, x, last=True, y=torch.randn(2, 4))


def test_spatial_plan_matches_a_real_two_part_run():
    from gems.launch.world import run_world

    real = run_world(_spatial_rank, 2, timeout=120)
    plan = make_plan(compose(SMALL + ["parallel.spatial=2"]))
    for s in (0, 1):
        p = _position(plan, 0, s)
        det = p.activations_detail
        local_in = 4 * math.prod(p.local_input_shape) * 2
        _close(det["saved"] + det["constant"] + local_in, real[s])
        assert p.local_input_shape == [4, 16, 32, 32]
        assert p.bytes.halo > 0 and p.bytes.communication > 0  # halo slabs; gradient buckets and the gather


def test_mast_plan_holds_two_partitions_and_their_real_saved_sets():
    cfg = compose(SMALL + ["parallel.pipeline=2", "parallel.schedule=mast"])
    plan = make_plan(cfg)
    from gems.models import build_model
    from gems.models.layers import batch_context
    from gems.pipeline.partition import split

    spec = build_model(section(cfg, "model"))
    spec.module.train()
    parts = split(spec.module, plan.balance)
    chunk = plan.micro_batch
    assert chunk == 1  # batch 2 over passes A and B
    x = torch.randn(chunk, *spec.input_shape)
    per = []
    with batch_context(0, 0, range(chunk)):
        for i, part in enumerate(parts):
            xi = x.detach().requires_grad_(i > 0)
            per.append(_real_saved(part, xi, last=i == len(parts) - 1, y=torch.randn(chunk, 4)))
            x = part(xi)
    for d in (0, 1):
        p = _position(plan, d, 0)
        # one micro-batch per direction: at the peak each partition keeps at most one
        assert p.partitions == [0, 1] and set(p.in_flight) <= {0, 1} and set(p.in_flight.values()) == {1}
        n = _params(spec)  # both mirrored partitions: the whole model's parameters
        assert p.bytes.parameters == n and p.bytes.optimizer == 2 * n
        det = p.activations_detail
        alive = sum(per[q] for q in p.in_flight)
        _close(det["saved"] + det["constant"] + (chunk * 4 * math.prod(spec.input_shape) if 0 in p.in_flight else 0),
               alive)


def test_peak_falls_with_spatial_parts_for_cosmoflow_512():
    peaks = []
    for S in (1, 2, 4):
        plan = make_plan(compose(["model=cosmoflow", "model.size=512", f"parallel.spatial={S}",
                                  "cluster.gpu_memory_gb=80", "train.batch_size=1"]), suggest=False)
        peaks.append(plan.worst.bytes.total)
        assert plan.fits
    assert peaks[0] > peaks[1] > peaks[2], [p / GiB for p in peaks]
    assert peaks[0] / peaks[2] > 3.5  # nearly 1/S: the halos are thin


def test_max_batch_is_the_largest_that_fits():
    base = ["model=cosmoflow", "model.size=64", "model.width=0.5", "cluster.gpu_memory_gb=1.5", "plan.reserve_gb=0",
            "parallel.replicas=2", "train.batch_size=2"]
    plan = make_plan(compose(base))
    b = plan.max_global_batch
    assert b >= 2 and b % 2 == 0
    assert make_plan(compose(base[:-1] + [f"train.batch_size={b}"]), suggest=False).fits
    over = make_plan(compose(base[:-1] + [f"train.batch_size={b + 2}"]), suggest=False)
    assert not over.fits and "does not fit" in over.verdict


def test_cpu_verdict_counts_what_the_host_memory_policy_keeps():
    """On CPU ranks kept freed memory is resident: train.host_memory=keep must fit at KEEP_GROWTH x the tensor
    peak, auto keeps only where that fits (the runtime's own rule) and otherwise releases, so a configuration
    the planner says fits is not killed for the memory its policy keeps."""
    from gems.bootstrap import KEEP_GROWTH

    base = ["model=cosmoflow", "model.size=64", "model.width=0.5", "train.batch_size=8", "plan.predict=false",
            "plan.reserve_gb=0"]
    peak = make_plan(compose(base + ["train.host_memory=release"]), suggest=False).worst.bytes.total
    roomy = f"cluster.mem_gb={2 * KEEP_GROWTH * peak / GiB}"  # room for kept memory
    tight = f"cluster.mem_gb={1.2 * peak / GiB}"  # the tensor peak fits, kept memory would not
    keep_tight = make_plan(compose(base + [tight, "train.host_memory=keep"]), suggest=False)
    assert not keep_tight.fits and "train.host_memory=keep keeps freed memory" in keep_tight.verdict
    assert keep_tight.device["host_memory"] == {"policy": "keep", "keeps_freed_memory": True,
                                                "resident_factor": KEEP_GROWTH}
    for policy in ("release", "auto"):
        plan = make_plan(compose(base + [tight, f"train.host_memory={policy}"]), suggest=False)
        assert plan.fits and plan.worst.bytes.total == peak
        assert plan.device["host_memory"]["keeps_freed_memory"] is False
    assert "auto will release" in make_plan(compose(base + [tight]), suggest=False).verdict
    auto_roomy = make_plan(compose(base + [roomy]), suggest=False)
    assert auto_roomy.fits and auto_roomy.device["host_memory"]["keeps_freed_memory"] is True
    # the batch search under keep stops where the kept memory stops fitting
    keep_roomy = make_plan(compose(base + [roomy, "train.host_memory=keep"]))
    release_roomy = make_plan(compose(base + [roomy, "train.host_memory=release"]))
    assert keep_roomy.max_global_batch < release_roomy.max_global_batch


def test_does_not_fit_suggests_a_change_that_fits():
    base = ["model=cosmoflow", "model.size=512", "cluster.gpu_memory_gb=40", "train.batch_size=2"]
    plan = make_plan(compose(base))
    assert not plan.fits and plan.suggestion
    assert plan.verdict.startswith("does not fit") and plan.suggestion in plan.verdict
    fixed = make_plan(compose(base + plan.suggestion.split()), suggest=False)
    assert fixed.fits


def test_bf16_activations_are_smaller_on_gpu_targets():
    base = ["model=cosmoflow", "model.size=128", "cluster.gpu_memory_gb=80", "train.batch_size=1"]
    fp32 = make_plan(compose(base), suggest=False).worst.bytes.activations
    bf16 = make_plan(compose(base + ["train.precision=bf16"]), suggest=False).worst.bytes.activations
    assert 0.4 * fp32 < bf16 < 0.75 * fp32


def test_json_and_table_from_the_cli_at_a_large_world():
    out = gems_here("plan", "model=resnet", "model.depth=110", "model.size=512", "cluster=slurm", "cluster.nodes=256",
               "cluster.tasks_per_node=4", "parallel.replicas=256", "parallel.pipeline=4", "parallel.schedule=mast",
               "train.batch_size=512", "cluster.gpu_memory_gb=80", "plan.format=json", "cluster.gpu=h100",
               "cluster.intra_node_GBps=300", "cluster.intra_node_latency_us=3", "cluster.inter_node_GBps=25",
               "cluster.inter_node_latency_us=8")
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["schema"] == "gems.plan/1" and obj["world_size"] == 1024 and obj["fits"] in (True, False)
    assert {p["pipeline"] for p in obj["positions"]} == {0, 1, 2, 3}
    assert set(obj["positions"][0]["bytes"]) == {"parameters", "gradients", "optimizer", "activations", "halo",
                                                   "communication", "total"}
    assert obj["verdict"].startswith(("fits:", "does not fit:"))
    assert len(obj["peak_memory_bytes"]["per_rank"]) == 1024 and \
        max(obj["peak_memory_bytes"]["per_rank"]) == obj["peak_memory_bytes"]["max"] == obj["peak"]["bytes"]
    pred = obj["predicted_step_time_s"]
    assert set(pred["breakdown"]) == {"compute", "halo", "pipeline_comm", "allreduce", "bubble_or_wait", "data"}
    assert pred["total"] == pytest.approx(sum(pred["breakdown"].values()))
    assert obj["predicted_throughput_samples_per_s"] == pytest.approx(512 / pred["total"])
    assert pred["breakdown"]["allreduce"] > 0  # 256 replicas over nodes
    out = gems_here("plan", *SMALL, "parallel.spatial=2")
    assert out.returncode == 0, out.stderr
    assert "d=0,s=0" in out.stdout and "total GiB" in out.stdout and "fits: peak" in out.stdout


def test_bad_input_names_the_key():
    with pytest.raises(ConfigError) as e:
        make_plan(compose(["model.name=nope"]))
    assert e.value.key == "model.name"  # (the registry owns the key: gems.models.registry)
    with pytest.raises(ConfigError) as e:
        compose(["cluster=slurm", "cluster.nodes=2", "cluster.tasks_per_node=3", "parallel.spatial=4"])
    assert e.value.key == "cluster.tasks_per_node"
    with pytest.raises(ConfigError) as e:
        make_plan(compose(SMALL + ["parallel.spatial=64"]))
    assert e.value.key == "parallel.spatial"
    out = gems_here("plan", "model.name=nope")
    assert out.returncode == 2 and "model" in out.stderr and "Traceback" not in out.stderr


def test_to_json_round_trips():
    plan = make_plan(compose(SMALL))
    obj = json.loads(json.dumps(to_json(plan)))
    assert obj["peak"]["bytes"] == plan.worst.bytes.total and obj["max_global_batch"] == plan.max_global_batch


@pytest.mark.parametrize("extra", [["parallel.pipeline=2", "parallel.schedule=mast"],
                                   ["train.precision=bf16", "parallel.checkpoint=true"],
                                   ["parallel.pipeline=4", "parallel.schedule=1f1b", "parallel.micro_batches=4"],
                                   ["parallel.spatial=2"],
                                   ["parallel.spatial=[2,2]", "parallel.spatial_dims=[0,1]", "parallel.pipeline=2",
                                    "parallel.schedule=mast"]],
                         ids=["mast D=2", "bf16 checkpoint", "1f1b D=4", "S=2", "2x2 pencils mast D=2"])
def test_the_layer_memo_plans_exactly_what_tracing_every_layer_plans(extra, monkeypatch):
    # ResNet-110's 36 blocks are a handful of kinds; the planner traces each kind once and replays the
    # rest (spatial blocks with their halo and gather logs and global shapes). The plan must be the one
    # a trace of every layer gives, and the same on every call: the memo empty, and the memo as the call
    # before left it (a process that plans again, as a sweep's points and the suggestion's variants do).
    from gems.models import resnet
    from gems.pipeline import partition as Q
    from gems.plan import memory as P
    from gems.trace import model as T

    monkeypatch.setenv("GEMS_CACHE_DIR", "")  # trace in this process: the traces kept on disk are not read
    runs = [0]
    real = resnet.PreActBottleneck.forward

    def counted(self, x):
        runs[0] += 1
        return real(self, x)

    monkeypatch.setattr(resnet.PreActBottleneck, "forward", counted)
    cfg = ["model=resnet", "model.depth=110", "model.width=0.25", "model.size=32", "train.batch_size=8", *extra]
    keep = T._LAYER_MEMO_MAX, Q._SHAPE_MEMO_MAX
    plans, blocks = [], []
    try:
        for on, warm in ((False, False), (True, False), (True, True)):
            P._CACHE.clear()
            if not warm:
                T._LAYER_MEMO.clear(), Q._SHAPE_MEMO.clear()
            T._LAYER_MEMO_MAX, Q._SHAPE_MEMO_MAX = keep if on else (0, 0)
            runs[0] = 0
            d = to_json(make_plan(compose(cfg)))
            d.pop("seconds", None)
            plans.append(json.dumps(d, sort_keys=True, default=str))
            blocks.append(runs[0])
    finally:
        T._LAYER_MEMO_MAX, Q._SHAPE_MEMO_MAX = keep
    assert plans[1] == plans[0] and plans[2] == plans[0]
    assert blocks[1] * 3 < blocks[0] and blocks[2] <= blocks[1], blocks  # most blocks replayed, not run


def test_conv_workspace_is_measured_at_1_2_4_and_drawn_on_lines_between_and_beyond(monkeypatch, tmp_path):
    """The batches conv_workspace measures and how it fills in the rest (the measurement itself is checked
    against real runs in test_memory_record)."""
    import gems.plan.cpu as dv

    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))  # (the suite's store may hold these shapes, measured)
    asked = []

    def fake(sig, input_grad):
        asked.append(sig[-1])
        return {1: 900, 2: 100, 4: 300}[sig[-1]]

    monkeypatch.setattr(dv, "_backward_workspace", fake)
    monkeypatch.setattr(dv, "_WORKSPACE", {})
    small = ("conv", 3, 8, 8, (3, 3, 3), (1, 1, 1), 1, False, (1, 1, 1), (4, 4, 4))
    got = {b: dv.conv_workspace(small, b, True) for b in (1, 2, 3, 4, 8)}
    # exact where measured (1 may run another kernel than 2 and 4), on the line between, rising beyond
    assert got == {1: 900, 2: 100, 3: 200, 4: 300, 8: 700}
    assert sorted(set(asked)) == [1, 2, 4]
    # where 4 samples would pass MEASURE_ELEMENTS, the last two measured (1 and 2) give the line, never falling
    big = ("conv", 3, 8, 8, (3, 3, 3), (1, 1, 1), 1, False, (1, 1, 1), (64, 64, 64 + 1))
    assert 2 * 8 * 64 * 64 * 65 <= dv.MEASURE_ELEMENTS < 4 * 8 * 64 * 64 * 65
    asked.clear()
    assert dv.conv_workspace(big, 6, True) == 100 and sorted(set(asked)) == [1, 2]


def test_gpu_targets_count_cudnns_workspace_and_cpu_targets_onednns():
    """CPU ranks measure oneDNN's backward workspace on the spot; GPU ranks count cuDNN's, modelled as a fraction
    of the largest convolution's larger operand (gems.plan.reserve.cudnn_workspace), not the CPU's."""
    from gems.plan.reserve import CUDNN_WORKSPACE_FRACTION

    cpu = make_plan(compose(SMALL + ["plan.predict=false"]), suggest=False)
    gpu = make_plan(compose(SMALL + ["plan.predict=false", "cluster.gpu_memory_gb=16"]), suggest=False)
    assert cpu.worst.activations_detail["workspace"] > 0
    ws = gpu.worst.activations_detail["workspace"]
    assert ws > 0 and ws != cpu.worst.activations_detail["workspace"]
    # the model's first convolution, at the full extent with its channels, has the largest operand of the model
    from torch import nn

    from gems.config import section
    from gems.models import build_model

    spec = build_model(section(compose(SMALL), "model"))
    conv = next(m for m in spec.module.modules() if isinstance(m, nn.Conv3d))
    size = spec.input_shape[1]
    assert ws == int(CUDNN_WORKSPACE_FRACTION * max(conv.in_channels, conv.out_channels) * size ** 3 * 4) * gpu.micro_batch


def test_recomputation_is_planned_where_it_saves_memory_and_said_where_it_does_not():
    """The plain path's recomputed pieces are weighed (gems.parallel.recompute_pieces): the U-Net at 64^3 plans a
    third less with them (pieces of two layers planned no less than no recomputation); CosmoFlow, whose first
    layers set its peak however it is cut, plans no less, and the plan says so in a note."""
    from gems.config import compose
    from gems.plan.make import make_plan

    def plan(*o):
        return make_plan(compose([*o, "cluster.gpu=h200", "plan.predict=false"]), suggest=False)

    unet = ["model=unet3d", "model.size=64", "train.batch_size=2"]
    on, off = plan(*unet, "parallel.checkpoint=true"), plan(*unet)
    assert on.worst.bytes.total < 0.75 * off.worst.bytes.total
    assert not any("saves no memory" in n for n in on.notes)
    cosmo = plan("model=cosmoflow", "model.size=128", "train.batch_size=4", "parallel.checkpoint=true")
    assert any(n.startswith("parallel.checkpoint=true saves no memory here") for n in cosmo.notes), cosmo.notes
