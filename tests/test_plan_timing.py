"""gems plan's performance model: each term against hand-computed values, the FLOPs it counts on the trace
against the formula, the schedule's simulated bubble against the textbook one, and its bad input."""
from __future__ import annotations

import json

import pytest
import torch
from _cli import gems_here

from gems.config import compose, section
from gems.errors import ConfigError
from gems.pipeline.schedules import make_schedule
from gems.plan import make_plan, to_json
from gems.plan.cpu import matmul_rows
from gems.plan.devices import GPUS, Link, Rates, gpu_rates
from gems.plan.timing import (
    TERMS,
    all_gather,
    allreduce,
    layer_time,
    message,
    pipeline_times,
    ring_allreduce,
    spatial_comm,
    tree_allreduce,
)

LINK = Link(bandwidth=10e9, latency=5e-6, name="test")


def test_a_message_and_a_halo_exchange_of_known_size():
    assert message(1e6, LINK) == pytest.approx(5e-6 + 1e-4)
    # a 64^3 volume cut in two along depth, 16 channels, fp32, halo of 1 plane: each part sends one
    # 16 x 64 x 64 plane (262144 bytes) to its one neighbour
    plane = 16 * 64 * 64 * 4
    assert spatial_comm([("halo", plane, 1)], 2, LINK) == pytest.approx(5e-6 + plane / 10e9)
    # a middle part sends to two neighbours at once over its one link: one latency, both planes' bytes
    assert spatial_comm([("halo", 2 * plane, 2)], 3, LINK) == pytest.approx(5e-6 + 2 * plane / 10e9)
    assert spatial_comm([], 2, LINK) == 0.0


def test_a_ring_all_reduce_and_all_gather():
    n = 100e6
    # p = 4: each rank sends 2 (p-1)/p of the data, in 2 (p-1) latency-bound steps
    assert ring_allreduce(n, 4, LINK) == pytest.approx(2 * 3 / 4 * n / 10e9 + 6 * 5e-6)
    assert ring_allreduce(n, 4, LINK, buckets=25) == pytest.approx(2 * 3 / 4 * n / 10e9 + 25 * 6 * 5e-6)
    assert ring_allreduce(n, 1, LINK) == 0.0
    # the tree: 2 bytes a rank whatever p, 2 log2(p) latencies a piece; the model takes the faster
    assert tree_allreduce(n, 512, LINK, buckets=9) == pytest.approx(2 * n / 10e9 + 9 * 2 * 9 * 5e-6)
    assert allreduce(n, 4, LINK) == ring_allreduce(n, 4, LINK)  # few ranks: the ring moves less
    assert allreduce(4e6, 512, LINK, 9) == tree_allreduce(4e6, 512, LINK, 9) < ring_allreduce(4e6, 512, LINK, 9)
    assert all_gather(n, 8, LINK) == pytest.approx(7 / 8 * n / 10e9 + 7 * 5e-6)


def test_the_simulated_1f1b_bubble_is_the_textbook_one():
    # unit forward, backward twice that, no transfers: D = 4, m = 8 takes (m + D - 1) x 3 and every rank
    # idles (D - 1) x 3 of it, the bubble fraction (D - 1) / (m + D - 1)
    D, m = 4, 8
    sched = make_schedule("1f1b", D, m)
    end, end0, busy = pipeline_times(sched, lambda a: 1.0 if a.kind == "F" else 2.0, lambda a: 0.0)
    assert max(end) == max(end0) == pytest.approx((m + D - 1) * 3)
    assert busy == [pytest.approx(3 * m)] * D
    assert 1 - busy[0] / max(end) == pytest.approx((D - 1) / (m + D - 1))


def test_transfers_lengthen_the_step_by_the_messages_on_its_critical_path():
    # D = 2, one micro-batch: F0 (1), activation (0.5), F1 (1), B1 (2), gradient (0.5), B0 (2): 7 against 6
    sched = make_schedule("1f1b", 2, 1)
    end, end0, busy = pipeline_times(sched, lambda a: 1.0 if a.kind == "F" else 2.0, lambda a: 0.5)
    assert max(end) == pytest.approx(7.0) and max(end0) == pytest.approx(6.0)
    assert busy == [pytest.approx(3.0), pytest.approx(3.0)]


def test_a_rank_starts_its_actions_once_its_data_is_made():
    # lp D = 2, one micro-batch, F 1 and B 2: rank 0 makes its input for 1.5 before F0, rank 1 its targets
    # for 0.25 (hidden: it waits for F0 anyway), so the whole step starts 1.5 later
    sched = make_schedule("lp", 2, 1)
    cost = lambda a: 1.0 if a.kind == "F" else 2.0  # noqa: E731
    end, end0, busy = pipeline_times(sched, cost, lambda a: 0.0, [1.5, 0.25])
    assert max(end) == max(end0) == pytest.approx(1.5 + 6.0)
    assert busy == [pytest.approx(3.0), pytest.approx(3.0)]
    # rank 1's targets take longer than rank 0's input and first forward: rank 1 starts late by the difference
    end, _, _ = pipeline_times(sched, cost, lambda a: 0.0, [0.5, 4.0])
    assert max(end) == pytest.approx(4.0 + 5.0)


def test_the_data_term_is_the_generators_time_and_a_first_stage_delays_the_ranks_after_it(monkeypatch):

    base = ["model=resnet", "model.depth=11", "model.width=0.25", "model.size=32", "model.norm=group",
            "train.batch_size=8", "parallel.pipeline=2", "parallel.schedule=lp"]
    asked: list[tuple] = []

    def per_sample(spec, part, inp, tgt, threads=1, kept=None):
        asked.append((tuple(part), inp, tgt))
        return (0.01 if inp else 0.0) + (0.001 if tgt else 0.0)

    import gems.plan.predict as predict  # the planner's prediction looks the generator's time up there

    monkeypatch.setattr(predict, "synthetic_seconds", per_sample)
    # data.prefetch=2 (the default), but this machine's every core computes: the reader takes the step's time
    ahead = make_plan(compose(base), suggest=False).prediction
    assert {p["pipeline"]: p["breakdown"]["data"] for p in ahead.per_position} == pytest.approx({0: 0.08, 1: 0.008})
    assert any("every core computes, so the reader's time is the step's" in a for a in ahead.assumptions)
    base = base + ["data.prefetch=0"]  # read in the step: the same here
    pr = make_plan(compose(base), suggest=False).prediction
    ranks = {p["pipeline"]: p["breakdown"] for p in pr.per_position}
    assert ranks[0]["data"] == pytest.approx(8 * 0.01)  # the first stage makes the inputs of all 8 samples
    assert ranks[1]["data"] == pytest.approx(8 * 0.001)  # the last one their targets
    assert ((3, 32, 32), True, False) in asked and ((3, 32, 32), False, True) in asked
    monkeypatch.setattr(predict, "synthetic_seconds", lambda spec, part, inp, tgt, threads=1, kept=None: 0.0)
    free = make_plan(compose(base), suggest=False).prediction
    # the last stage waits for the first's forward, which starts once its data is made: the step is longer
    # by the first stage's data (rank 1's targets are made while it waits)
    assert pr.step_s - free.step_s == pytest.approx(8 * 0.01, rel=1e-6)
    assert pr.step_s == pytest.approx(sum(pr.breakdown.values()))
    # files (data=hdf5) not here: their int16 counts at data.readers threads of gems bench data's rate each
    files = make_plan(compose(base + ["data=hdf5", "data.path=/staged"]), suggest=False).prediction
    assert {p["pipeline"]: p["breakdown"]["data"] for p in files.per_position}[0] == pytest.approx(
        2 * 3 * 32 * 32 * 8 / (4 * predict.READER_BYTES_PER_S))


def test_a_reader_ahead_hides_the_data_behind_a_gpu_step_and_the_plan_says_when_it_cannot():
    base = ["model=cosmoflow", "model.size=128", "train.batch_size=8", "cluster=perlmutter", "cluster.account=x",
            "data=hdf5", "data.path=/staged"]
    inline = make_plan(compose(base + ["data.prefetch=0"]), suggest=False).prediction
    ahead = make_plan(compose(base), suggest=False).prediction
    read = inline.breakdown["data"]
    assert read > 0 and ahead.breakdown["data"] == pytest.approx(max(0.0, read - (inline.step_s - read)), abs=1e-9)
    assert ahead.step_s == pytest.approx(inline.step_s - read + ahead.breakdown["data"])
    assert any("data read 2 step(s) ahead" in a for a in ahead.assumptions)


def test_synthetic_samples_drawn_on_the_gpu_cost_the_step_nothing_with_a_reader_ahead():
    """On GPU ranks the reader draws the synthetic samples on the GPU a step ahead, on a side stream beside the
    step's kernels: the step waits for none of it (an H200 measured 0.1 ms of a 30 ms step; the plan said 6 ms
    when it counted a kernel launch per plane in the step). Without a reader the step draws them itself:
    memory-bound, and a launch per plane."""
    base = ["model=cosmoflow", "model.size=512", "parallel.spatial=4", "cluster=perlmutter", "cluster.account=x"]
    ahead = make_plan(compose(base), suggest=False).prediction
    inline = make_plan(compose(base + ["data.prefetch=0"]), suggest=False).prediction
    assert ahead.breakdown["data"] == 0.0
    assert 0.01 < inline.breakdown["data"] / inline.step_s < 0.15, inline.breakdown
    assert any("made on the rank's device" in a for a in ahead.assumptions)
    assert any("the step waits for none of it" in a for a in ahead.assumptions)


def test_a_gpu_part_cut_in_plane_draws_the_whole_planes_in_the_step():
    """Without a reader, a part cut along height draws the sample's whole planes (the generator's blocks span
    them: gems.data.synthetic.most_drawn), so its draws cost about what the whole sample's do, S times a depth
    slab's."""
    base = ["model=cosmoflow", "model.size=512", "parallel.spatial=4", "cluster=perlmutter", "cluster.account=x",
            "data.prefetch=0"]
    slab = make_plan(compose(base), suggest=False).prediction.breakdown["data"]
    rows = make_plan(compose(base + ["parallel.spatial_dims=[1]"]), suggest=False).prediction.breakdown["data"]
    assert 3.5 < rows / slab < 6, (rows, slab)


def test_where_every_core_computes_the_whole_gradient_all_reduce_counts():
    # CosmoFlow replicated over 2 CPU ranks, 1 GB/s and 500 us a message: on a node of 2 cores both compute,
    # so gloo's all-reduce takes its time from them (the whole ring, in 256 KiB buckets, counts); on 8 cores it
    # runs beside the backward and only what outlasts it is exposed
    from gems.models import build_model
    from gems.plan.timing import allreduce

    base = ["model=cosmoflow", "model.size=32", "model.width=0.25", "train.batch_size=4", "parallel.replicas=2",
            "cluster=local_slurm", "cluster.intra_node_GBps=1", "cluster.intra_node_latency_us=500",
            "cluster.nodes=1", "cluster.tasks_per_node=2", "comm.bucket_mb=0.25", "cluster.jitter=0"]
    cfg = compose(base)
    grads = sum(p.numel() * 4 for p in build_model(section(cfg, "model")).module.parameters())
    full = allreduce(grads, 2, Link(bandwidth=1e9, latency=500e-6, name="test"), -(-grads // 2**18))
    busy = make_plan(cfg, suggest=False).prediction
    assert busy.breakdown["allreduce"] == pytest.approx(full, rel=1e-6)
    assert "every core of a node computes" in " ".join(busy.assumptions)
    spare = make_plan(compose(base + ["cluster.cpus_per_node=8"]), suggest=False).prediction
    assert spare.breakdown["allreduce"] < 0.5 * full


def test_ranks_that_meet_wait_for_the_slowests_noise():
    import math

    from gems.plan.timing import _with_waits, expected_max, rendezvous_wait

    # the expected largest of p standard normals: 1/sqrt(pi) for two, 3/(2 sqrt(pi)) for three
    assert expected_max(1) == 0.0
    assert expected_max(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-9)
    assert expected_max(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-9)
    assert expected_max(4) < expected_max(1024) < 3.3
    assert rendezvous_wait(2, 0.04, 0.05) == pytest.approx(0.05 * 0.2 / math.sqrt(math.pi))
    # the parts of a stage meet at the layers that exchange (1 and 3 here), after the compute since they last
    # met: forward 0+1 then 2+3, backward (in reverse) 3 then 2+1; layer 0's backward ends the stage unmet
    per = [(1.0, 2.0, 0.0, 0.0), (3.0, 4.0, 0.5, 0.5), (5.0, 6.0, 0.0, 0.0), (7.0, 8.0, 0.5, 0.5)]
    j, e = 0.01, expected_max(2)
    got = _with_waits(per, [False, True, False, True], 2, j)
    assert [x[:2] for x in got] == [x[:2] for x in per]
    assert [x[2] for x in got] == pytest.approx([0.0, 0.5 + e * j * math.sqrt(4), 0.0, 0.5 + e * j * math.sqrt(12)])
    assert [x[3] for x in got] == pytest.approx([0.0, 0.5 + e * j * math.sqrt(10), 0.0, 0.5 + e * j * math.sqrt(8)])


def test_jitter_adds_waits_at_exchanges_and_where_replicas_meet():
    # on GPUs (rates from data sheets: the same compute every plan) the waits are linear in cluster.jitter;
    # replicas meet once a step, after the same compute per rank at R = 2 and 4: the waits are e_2 : e_4
    from gems.plan.timing import expected_max

    gpu = ["cluster=perlmutter", "cluster.account=x", "model=cosmoflow", "model.size=128"]

    def pred(*extra: str) -> object:
        return make_plan(compose([*gpu, *extra]), suggest=False).prediction

    s2 = ["train.batch_size=1", "parallel.spatial=2"]
    h0, h1, h2 = (pred(*s2, f"cluster.jitter={j}").breakdown["halo"] for j in (0, 0.01, 0.02))
    assert h1 > h0 and h2 - h0 == pytest.approx(2 * (h1 - h0), rel=1e-9)
    waits = []
    for r in (2, 4):
        rep = [f"train.batch_size={r}", f"parallel.replicas={r}"]
        waits.append(pred(*rep, "cluster.jitter=0.01").breakdown["allreduce"] - pred(*rep).breakdown["allreduce"])
    assert waits[0] > 0 and waits[1] / waits[0] == pytest.approx(expected_max(4) / expected_max(2), rel=1e-6)
    assert "cluster.jitter" in " ".join(pred(*s2, "cluster.jitter=0.01").assumptions)


def test_synthetic_data_is_timed_on_the_generator_scaled_by_its_planes(monkeypatch):
    from types import SimpleNamespace

    import gems.plan.cpu as cpu
    from gems.data.synthetic import SyntheticData

    spec = SimpleNamespace(input_shape=(4, 64, 256, 256), target="vector", num_outputs=4, loss="mse")
    made: list[tuple] = []
    real = SyntheticData.batch

    def batch(self, indices, slices=None, want_input=True, want_target=True):
        x, y = real(self, indices, slices, want_input, want_target)
        made.append((tuple(x.shape) if x is not None else None, y is not None))
        return x, y

    monkeypatch.setattr(SyntheticData, "batch", batch)
    monkeypatch.setattr(cpu, "_timed", lambda fn: (fn(), 0.02)[1])  # one real call, a known time
    monkeypatch.setattr(cpu, "_ALONE", [False])  # (forgetting times this process alone: not past this test)
    cpu.forget_cpu_rates()
    # a plane is 4 x 256 x 256 elements: 16 planes stay within DATA_ELEMENTS, so 16 of a part's 64 are made
    # (the real generator, a new sample) and the time scaled by 64 / 16
    assert cpu.DATA_ELEMENTS // (4 * 256 * 256) == 16
    assert cpu.synthetic_seconds(spec, [4, 64, 256, 128], True, False) == pytest.approx(0.02 * 4)
    assert made == [((1, 4, 16, 256, 128), False)]
    # a part thinner than that is made whole; targets alone, and nothing when the rank needs neither
    assert cpu.synthetic_seconds(spec, [4, 8, 256, 256], True, True) == pytest.approx(0.02)
    assert made[-1] == ((1, 4, 8, 256, 256), True)
    assert cpu.synthetic_seconds(spec, [4, 8, 256, 256], False, True) == pytest.approx(0.02)
    assert made[-1] == (None, True)
    assert cpu.synthetic_seconds(spec, [4, 8, 256, 256], False, False) == 0.0
    assert len(made) == 3
    cpu.forget_cpu_rates()


def test_mast_fills_the_bubble_lp_leaves():
    cost = lambda a: 1.0 if a.kind == "F" else 2.0  # noqa: E731
    lp_end, _, _ = pipeline_times(make_schedule("lp", 2, 1), cost, lambda a: 0.0)
    mast_end, _, mast_busy = pipeline_times(make_schedule("mast", 2, 1), cost, lambda a: 0.0)
    # lp: one sample through 2 stages, 6 ticks for 1 pass; mast: two passes (mirrored) in 6 ticks, no idle
    assert max(lp_end) == pytest.approx(6.0)
    assert max(mast_end) == pytest.approx(6.0) and mast_busy == [pytest.approx(6.0)] * 2


def test_a_layer_on_a_named_gpu_is_its_roofline():
    r = gpu_rates("a100-40gb", "fp32", {"conv": 0.5, "matmul": 0.6, "memory": 0.6})
    # fp32 convolutions run in TF32 (156 TFLOP/s) at half the peak; memory-bound ops at 60% of 1555 GB/s
    conv = {("conv", ("conv", 2, 64, 64, (3, 3), (1, 1), 1, False)): [1e12, 1e6, 1]}
    assert layer_time(conv, r, False, 8) == pytest.approx(1e12 / (156e12 * 0.5) + r.op_overhead_s)
    assert layer_time(conv, r, True, 8) == pytest.approx(2 * (1e12 / (156e12 * 0.5) + r.op_overhead_s))
    relu = {("memory", ()): [0.0, 8e9, 2]}
    assert layer_time(relu, r, False, 8) == pytest.approx(2 * (4e9 / (1555e9 * 0.6) + r.op_overhead_s))
    # a convolution narrower than 64 channels a side keeps the tensor cores less busy: 16 -> 16 at (16/64)^1.5
    narrow = {("conv", ("conv", 2, 16, 16, (3, 3), (1, 1), 1, False)): [1e12, 1e6, 1]}
    assert layer_time(narrow, r, False, 8) == pytest.approx(1e12 / (156e12 * 0.5 * 0.125) + r.op_overhead_s)
    # pools at their own rate where the efficiencies name one, else at the memory class's, each input cell read
    # kernel / stride times (3.375 for a k3 s2 pool in 3D)
    pool = {("memory", ("memory", "pool", "max", 3, (3, 3, 3), (2, 2, 2), (1, 1, 1))): [0.0, 1e9, 1]}
    assert layer_time(pool, r, False, 8) == pytest.approx(3.375e9 / (1555e9 * 0.6) + r.op_overhead_s)
    pooled = gpu_rates("a100-40gb", "fp32", {"conv": 0.5, "matmul": 0.6, "memory": 0.6, "pool": 0.1})
    assert layer_time(pool, pooled, False, 8) == pytest.approx(3.375e9 / (1555e9 * 0.1) + r.op_overhead_s)
    assert layer_time(relu, pooled, False, 8) == layer_time(relu, r, False, 8)
    bf16 = gpu_rates("h100", "bf16", {"conv": 1.0, "matmul": 1.0, "memory": 1.0})
    assert bf16.flops["conv"] == pytest.approx(989.5e12)
    with pytest.raises(ConfigError) as e:
        gpu_rates("v100-16gb", "bf16", {"conv": 1.0, "matmul": 1.0, "memory": 1.0})
    assert e.value.key == "train.precision"
    assert set(GPUS) >= {"v100-16gb", "a100-40gb", "a100-80gb", "h100", "h200", "mi250x-gcd", "gh200"}


def test_the_trace_counts_a_convolutions_flops_by_the_formula():
    from gems.plan.memory import Planner, setup

    cfg = compose(["model=custom", "model._target_=_custom_models.tiny_cnn", "model.input_shape=[3,16,16]",
                   "model.num_outputs=4", "train.batch_size=2"])
    pl = Planner(setup(cfg))
    t1, t2 = pl.traced(0, 1), pl.traced(0, 2)
    layers, _, _ = pl._layers(0)
    conv = next(i for i, m in enumerate(layers) if isinstance(m, torch.nn.Conv2d))
    c = layers[conv]
    for t in (t1, t2):
        (flops, _nbytes, n), = [v for (cls, _), v in t.ops[conv].items() if cls == "conv"]
        out_hw = 16 * 16  # padding keeps the size
        assert flops == 2 * t.batch * c.out_channels * out_hw * c.in_channels * c.kernel_size[0] * c.kernel_size[1]
        assert n == 1


@pytest.mark.parametrize("model", [["model=resnet", "model.depth=11", "model.width=0.25", "model.size=32"],
                                   ["model=cosmoflow", "model.size=32", "model.width=0.25"]])
def test_the_counts_of_any_micro_batch_are_the_line_through_the_traced_ones(model):
    """The prediction traces batches 1 and 2 and scales every op's counts to the micro-batch: the same ops
    (one key each, whatever the batch) with the FLOPs and bytes a trace at that batch counts."""
    from gems.plan.memory import Planner, setup
    from gems.trace.ops import scaled

    pl = Planner(setup(compose([*model, "train.batch_size=4"])))
    t1, t2, t4 = pl.traced(0, 1), pl.traced(0, 2), pl.traced(0, 4)
    assert set(t4.ops) == set(t1.ops) and any(cls == "conv" for ops in t4.ops.values() for cls, _ in ops)
    for j, ops in t4.ops.items():
        line = scaled(t1.ops[j], t2.ops[j], 1, 2, 4)
        assert set(line) == set(ops), j
        for k, (flops, nbytes, n) in ops.items():
            assert line[k] == pytest.approx([flops, nbytes, n], rel=1e-9), (j, k)


def test_plan_predicts_a_step_with_every_term_and_the_json_fields():
    cfg = compose(["model=cosmoflow", "model.size=32", "model.width=0.25", "train.batch_size=4", "parallel.replicas=2",
                   "parallel.spatial=2"])
    plan = make_plan(cfg, suggest=False)
    pr = plan.prediction
    assert pr is not None and set(pr.breakdown) == set(TERMS)
    assert pr.breakdown["compute"] > 0 and pr.breakdown["halo"] > 0 and pr.breakdown["allreduce"] > 0
    assert pr.step_s == pytest.approx(sum(pr.breakdown.values()))
    obj = json.loads(json.dumps(to_json(plan)))
    assert obj["predicted_throughput_samples_per_s"] == pytest.approx(4 / obj["predicted_step_time_s"]["total"])
    assert len(obj["peak_memory_bytes"]["per_rank"]) == 4


def test_more_spatial_parts_predict_less_compute_per_rank_on_a_gpu():
    """A quarter of the volume per rank at 512^3; the small deep layers cost their kernels whatever the cut, and a
    cut layer runs more of them (its halo's shells, each op with its fixed cost,
    gems.plan.devices.GPU_OP_OVERHEAD_S), so the gain is below the volume's: no GPU has timed a spatial run alone
    yet."""
    base = ["model=cosmoflow", "model.size=512", "train.batch_size=1", "cluster=perlmutter", "cluster.account=x"]
    one = make_plan(compose(base), suggest=False).prediction
    four = make_plan(compose(base + ["parallel.spatial=4"]), suggest=False).prediction
    assert four.breakdown["compute"] < 0.6 * one.breakdown["compute"]
    assert four.breakdown["halo"] > 0 and one.breakdown["halo"] == 0


def test_bad_input_for_the_prediction_exits_2_with_one_line(tmp_path):
    cases = [
        (["cluster.gpu_memory_gb=40", "cluster.gpu=a100-13gb"], "cluster.gpu"),
        (["cluster=slurm", "cluster.nodes=1", "cluster.tasks_per_node=2", "parallel.replicas=2"],
         "cluster.intra_node_GBps"),
        (["plan.efficiency={conv: 2}"], "plan.efficiency.conv"),
        (["plan.efficiency={tensor: 0.5}"], "plan.efficiency.tensor"),
    ]
    for extra, key in cases:
        out = gems_here("plan", "model=cosmoflow", "model.size=32", "model.width=0.25", "train.batch_size=2", *extra,
                        cwd=tmp_path)
        assert out.returncode == 2, (extra, out.stderr[-1500:])
        assert key in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    # a configuration that does not fit is an answer, not an error
    out = gems_here("plan", "model=cosmoflow", "model.size=512", "cluster.gpu_memory_gb=16", "cluster.gpu=v100-16gb",
                    "train.batch_size=8", "plan.format=json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["fits"] is False and obj["predicted_step_time_s"]["total"] > 0


def test_without_a_gpu_model_the_plan_says_how_to_get_a_prediction():
    plan = make_plan(compose(["model=cosmoflow", "model.size=32", "model.width=0.25", "cluster.gpu_memory_gb=40",
                              "train.batch_size=2"]), suggest=False)
    assert plan.prediction is None and any("cluster.gpu" in n for n in plan.notes)


def test_cpu_rates_are_measured_here(monkeypatch, tmp_path):
    import gems.plan.cpu as dv
    from gems.plan.cpu import cpu_rates

    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))  # (measured here, not read from the suite's kept times)
    monkeypatch.setattr(dv, "_CPU", {})
    r = cpu_rates(1)
    assert isinstance(r, Rates) and r.kind == "cpu" and 0 < r.op_overhead_s < 1e-3
    sig = ("conv", 2, 8, 8, (3, 3), (1, 1), 1, False, (1, 1), (32, 32))
    fwd, bwd = r.measured_rate((*sig, 2), False), r.measured_rate((*sig, 2), True)
    assert 1e7 < fwd < 1e13 and 1e7 < bwd < 1e13  # FLOP/s
    for kind in ("elementwise", "pool", "batch_norm", "group_norm", "layer_norm"):
        assert 1e7 < r.measured_rate(("memory", kind, 2**16), False) < 1e12  # bytes/s
    # a convolution's time is its FLOPs at the rate measured at its micro-batch, plus its overhead; the first
    # layer's backward (no input gradient) half of a full one
    # ... times how much longer ops take inside a step than alone (measured on a reference block, bounded)
    assert 0.5 <= r.in_step <= 3.0 and "inside a step" in r.about
    # ... and a layer's call costs the host its own time, each way
    t = layer_time({("conv", sig): [1e9, 0.0, 1]}, r, True, 2)
    assert t == pytest.approx(r.in_step * (1e9 / bwd + 2 * r.op_overhead_s) + r.layer_overhead_s)
    weight = r.measured_rate((*sig, 2), "weight")  # (the weight gradient alone, timed on its own)
    assert layer_time({("conv", sig): [1e9, 0.0, 1]}, r, True, 2, first=True) == pytest.approx(
        r.in_step * (1e9 / weight + r.op_overhead_s) + r.layer_overhead_s)
    # a split backward's I takes the input gradient, its W the weight gradient and the W's bookkeeping
    i = layer_time({("conv", sig): [1e9, 0.0, 1]}, r, True, 2, part="input", deferred=1)
    w = layer_time({("conv", sig): [1e9, 0.0, 1]}, r, True, 2, part="weight", deferred=1)
    assert i == pytest.approx(r.in_step * (1e9 / r.measured_rate((*sig, 2), "input") + r.op_overhead_s)
                              + r.layer_overhead_s)
    assert w == pytest.approx(r.in_step * (1e9 / weight + r.op_overhead_s) + r.split_overhead_s)
    assert r.split_overhead_s > 0 and r.action_overhead_s > 0 and r.layer_overhead_s >= 0
    assert (*sig, 2) in r.measured and (*sig, 16) not in r.measured
    layer_time({("conv", sig): [1e9, 0.0, 1]}, r, False, 16)
    assert (*sig, 16) in r.measured  # timed at the batch it runs at
    # a matmul is timed at its own rows (a dense layer's: the micro-batch), at the nearest power of two up to 256:
    # a few rows read the whole weight for little work, so its rate there is not the rate at many
    mm = ("matmul", 512, 256)
    assert [matmul_rows(mm, 2.0 * rows * 512 * 256) for rows in (1, 3, 4, 5, 6, 100, 256, 4096)] == \
        [1, 4, 4, 4, 8, 128, 256, 256]
    t2 = layer_time({("matmul", mm): [2.0 * 2 * 512 * 256, 0.0, 1]}, r, False, 2)
    assert (*mm, 2) in r.measured and (*mm, 256) not in r.measured
    assert t2 == pytest.approx(r.in_step * (2.0 * 2 * 512 * 256 / r.measured_rate((*mm, 2), False) + r.op_overhead_s)
                               + r.layer_overhead_s)


def test_ranks_that_compute_at_once_are_timed_at_once(monkeypatch):
    import threading

    import gems.plan.cpu as dv
    from gems.plan.cpu import _crowded

    meet, lock, seen = threading.Barrier(3, timeout=30), threading.Lock(), []

    def measure() -> tuple[float, float]:
        meet.wait()  # raises unless all three run at the same time
        with lock:
            seen.append(threading.get_ident())
            n = len(seen)
        return float(n), 2.0

    assert _crowded(3, measure) == (2.0, 2.0) and len(set(seen)) == 3  # the mean over the three
    # a node's ranks compute at once, except a pipeline's stages where its schedule has them take turns:
    # lp's stages one at a time, mast's and 1F1B's at once (its steady state), spatial parts at once
    # (each op is run once by each thread, as many threads at once as the plan says ranks compute at once: the
    # threads are what this asserts, not the times, so one call each instead of the best of three averages; rates
    # so measured stay this test's)
    timed_by: list[bool] = []  # by this thread (the plan's), or by another beside it

    def once(fn, budget_s: float = 0.05, least: int = 5) -> float:  # noqa: ARG001
        fn()
        with lock:
            timed_by.append(threading.current_thread() is threading.main_thread())
        return 1e-3

    monkeypatch.setattr(dv, "_timed", once)
    monkeypatch.setenv("GEMS_CACHE_DIR", "")  # (timed here: no times kept from another test or for one)
    monkeypatch.setattr(dv, "_CPU", {})
    monkeypatch.setattr(dv, "_DATA", {})
    resnet = ["model=resnet", "model.depth=29", "model.width=0.5", "model.size=32", "model.norm=group",
              "train.batch_size=8", "parallel.pipeline=2"]
    cosmoflow = ["model=cosmoflow", "model.size=32", "model.width=0.5", "parallel.spatial=2", "train.batch_size=2"]
    for over, crowd in (([*resnet, "parallel.schedule=lp"], False), ([*resnet, "parallel.schedule=mast"], True),
                        ([*resnet, "parallel.schedule=1f1b", "parallel.micro_batches=4"], True), (cosmoflow, True)):
        extra = over[len(resnet):]
        timed_by.clear()
        about = make_plan(compose(over), suggest=False).prediction.assumptions[0]
        assert ("2 ranks computing at once" in about) == crowd, (extra, about)
        # the ops (each at its micro-batch, new to every plan here) timed on the plan's thread alone, or by a second
        # thread beside it too
        assert timed_by and (False in timed_by) == crowd, (extra, timed_by.count(True), timed_by.count(False))


def test_a_pool_is_counted_and_timed_with_its_kernel_and_stride():
    from gems.plan.cpu import cpu_rates
    from gems.trace.ops import OpCounter

    cur = [0]
    x3, x2 = torch.randn(1, 2, 8, 8, 8), torch.randn(1, 2, 8, 8)
    with OpCounter(cur) as oc:
        torch.nn.AvgPool3d(3, stride=2, padding=1)(x3)
        cur[0] = 1
        torch.nn.MaxPool2d(2)(x2)
    assert list(oc.take(0)) == [("memory", ("memory", "pool", "avg", 3, (3, 3, 3), (2, 2, 2), (1, 1, 1)))]
    assert list(oc.take(1)) == [("memory", ("memory", "pool", "max", 2, (2, 2), (2, 2), (0, 0)))]
    # timed as it runs: a 3^3 window read at every cell costs several times per byte what 2^3 windows
    # side by side do (CosmoFlow's pools were timed as the latter)
    r = cpu_rates(1)
    wide = r.measured_rate(("memory", "pool", "avg", 3, (3, 3, 3), (1, 1, 1), (1, 1, 1), 2**18), False)
    tiled = r.measured_rate(("memory", "pool", "avg", 3, (2, 2, 2), (2, 2, 2), (0, 0, 0), 2**18), False)
    assert wide < tiled / 2


def test_a_padded_part_thinner_than_its_kernel_is_timed_at_its_own_extent():
    # CosmoFlow's 256-channel layers at S = 2 run on 1x2x2 parts with a 3^3 kernel and padding 1: timed on a
    # 3^3 input they did 27 outputs' work where the part has 4, at several times the real rate
    from gems.plan.cpu import conv_case

    sig = ("conv", 3, 8, 8, (3, 3, 3), (1, 1, 1), 1, False, (1, 1, 1), (1, 2, 2), 2)
    f, (x, w), flops = conv_case(sig)
    assert tuple(x.shape) == (2, 8, 1, 2, 2)
    assert f(x, w).shape == (2, 8, 1, 2, 2) and flops == 2 * 8 * 27 * (2 * 8 * 1 * 2 * 2)
    # unpadded along a dim, the input is as large as the kernel needs there, and no larger
    _, (x, _), flops = conv_case((*sig[:8], (0, 1, 1), (1, 2, 2), 2))
    assert tuple(x.shape) == (2, 8, 3, 2, 2) and flops == 2 * 8 * 27 * (2 * 8 * 1 * 2 * 2)


def test_the_reference_block_is_counted_layer_by_layer_as_a_model_is():
    # the in-step factor divides the block trained for real by its ops timed alone; at rates where only a
    # convolution's FLOPs cost (1 PFLOP/s at full width, memory free, no overhead) "alone" is the four
    # convolutions' forwards, each at its channels' share of the rate, their backwards at twice that, except the
    # first layer's, which computes no input gradient
    from gems.plan.cpu import REFERENCE_BATCH, reference_alone
    from gems.plan.devices import conv_width_factor

    rates = Rates("gpu", "test", {"conv": 1e15, "matmul": 1e15}, 1e30, 0.0)
    n = REFERENCE_BATCH
    width = [conv_width_factor(("conv", 2, cin, cout)) for cin, cout in ((8, 16), (16, 16), (16, 32), (32, 32))]
    assert width[0] < width[1] < width[2] < width[3] < 1
    flops = [f / w for f, w in zip([2 * n * 16 * 64 * 64 * 8 * 9, 2 * n * 16 * 64 * 64 * 16 * 9,
                                    2 * n * 32 * 32 * 32 * 16, 2 * n * 32 * 32 * 32 * 32 * 9], width)]
    fwd = sum(flops) / 1e15
    bwd = (flops[0] + 2 * sum(flops[1:])) / 1e15
    assert reference_alone(rates) == pytest.approx(fwd + bwd, rel=1e-9)


def test_a_study_is_predicted_point_by_point_into_the_table_gems_results_writes(tmp_path):
    """gems plan +experiment=NAME: every point planned as gems plan plans it alone, written as records that
    gems results reads (table, plot, efficiency), marked predicted; planning it again replaces the prediction."""
    from _cli import records

    # files, not synthetic samples: their generation is timed on the spot, so two plans would differ by its noise
    files = ["data=hdf5", "data.path=/staged"]
    args = ["plan", "+experiment=cosmoflow512_weak", "cluster=perlmutter", "cluster.account=x", *files]
    for _ in range(2):
        out = gems_here(*args, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-2000:]
    # the assumptions behind every point, said once for the study (not once a point)
    said = [ln.strip() for ln in out.stdout.splitlines() if ln.startswith("  ")]
    assert said and len(said) == len(set(said)) and any("a100-40gb" in a for a in said), out.stdout
    folder = tmp_path / "results" / "cosmoflow512_weak-predicted"
    recs = sorted(records(str(folder)), key=lambda r: r["world_size"])
    assert [r["world_size"] for r in recs] == [4 * r for r in (1, 2, 4, 8, 16, 32, 64)]  # once each
    table = (folder / "table.md").read_text()
    assert table.count("predicted by gems plan") == 7 and (folder / "scaling.png").exists()
    cfg = compose(["+experiment=cosmoflow512_weak", "cluster=perlmutter", "cluster.account=x", *files,
                   "parallel.replicas=16"])
    alone = to_json(make_plan(cfg, suggest=False))
    r16 = next(r for r in recs if r["world_size"] == 64)
    assert r16["step_time_s"]["median"] == pytest.approx(alone["predicted_step_time_s"]["total"])
    assert r16["throughput_samples_per_s"] == pytest.approx(alone["predicted_throughput_samples_per_s"])


def test_spatial_parts_meet_at_every_layer_so_a_stage_is_the_sum_of_its_slowest_layers():
    """An uneven cut (32 planes in 3 parts: 11, 11, 10, then 6, 5, 5 ...) makes a different part the slowest at
    different layers; the parts meet at each layer's exchange, so the stage takes the sum over layers of the
    slowest part there, which is more than the slowest part's own sum."""
    from gems.plan.devices import efficiency
    from gems.plan.memory import Planner, setup
    from gems.plan.timing import _meet, _stage_times

    cfg = compose(["model=cosmoflow", "model.size=32", "parallel.spatial=3", "train.batch_size=1",
                   "cluster.gpu_memory_gb=80"])
    pl = Planner(setup(cfg))
    _, classes = pl.profile(1)
    assert len(classes) == 3
    rates = gpu_rates("a100-40gb", "fp32", efficiency(None))
    parts = []
    for members, *_ in classes:
        t1, t2 = pl.traced(members[0], 1), pl.traced(members[0], 2)
        n = len(t1.out_bytes) - 1
        parts.append(_stage_times(t1.ops, t2.ops, 1, 2, 1, t1.comm, t2.comm, 0, n, True, n, rates, 3, LINK, False))
    met = _meet(parts)
    layers = list(zip(*(p.layers for p in parts)))
    assert met.fwd == pytest.approx(sum(max(x[0] for x in layer) for layer in layers))
    assert met.bwd == pytest.approx(sum(max(x[1] for x in layer) for layer in layers))
    assert met.fwd + met.comm_fwd == pytest.approx(sum(max(x[0] + x[2] for x in layer) for layer in layers))
    slowest_sum = max(p.fwd + p.bwd + p.comm_fwd + p.comm_bwd for p in parts)
    assert met.fwd + met.bwd + met.comm_fwd + met.comm_bwd > 1.01 * slowest_sum
    # one part alone is its own time
    assert _meet(parts[:1]) is parts[0]


def test_staging_is_counted_once_per_job_from_the_files_there_are(tmp_path):
    """data.stage=node: every node copies the data set's files once (its ranks' network together), a figure of its
    own beside the step, not part of it."""
    from gems.data.synth import write_synthetic

    write_synthetic(tmp_path / "train", 3, (4, 32, 32, 32))
    write_synthetic(tmp_path / "val", 1, (4, 32, 32, 32), seed=1)
    nbytes = sum(p.stat().st_size for p in tmp_path.glob("*/*.h5"))
    base = ["model=cosmoflow", "model.size=32", "cluster=perlmutter", "cluster.account=x", "data=hdf5",
            f"data.path={tmp_path / 'train'}", f"data.val_path={tmp_path / 'val'}", "parallel.replicas=4"]
    staged = make_plan(compose(base + ["data.stage=node"]), suggest=False).prediction
    plain = make_plan(compose(base), suggest=False).prediction
    c = compose(base).cluster
    assert staged.staging_s == pytest.approx(nbytes / (c.inter_node_GBps * 1e9 * 4) + 4 * c.inter_node_latency_us * 1e-6)
    assert plain.staging_s == 0 and staged.step_s == pytest.approx(plain.step_s)
    assert any("once per job" in a for a in staged.assumptions)
    assert staged.as_json()["staging_once_s"] == staged.staging_s


def test_read_files_wait_by_the_readers_rate_timed_on_them(tmp_path):
    """data=hdf5 on a GPU rank: the reader's rate is timed on the files of data.path (data.readers threads, the
    configured symmetries, from the page cache), its batch's bytes over that rate are what the step waits for
    without a reader ahead, and what outlasts the step with one; without files, a stated rate a thread."""
    from gems.data.synth import write_synthetic
    from gems.plan import predict

    write_synthetic(tmp_path / "d", 8, (4, 64, 64, 64))
    base = ["model=cosmoflow", "model.size=64", "train.batch_size=4", "data=hdf5", f"data.path={tmp_path / 'd'}",
            "cluster.gpu=h100", "data.augment=cube"]
    plan = make_plan(compose([*base, "data.prefetch=0", "data.readers=2"]), suggest=False)
    pr = plan.prediction
    assert pr is not None
    (said,) = [a for a in pr.assumptions if a.startswith("data read by 2 reader thread(s) timed here")]
    rate = float(said.rsplit(": ", 1)[1].split(" GB/s")[0]) * 1e9
    batch_bytes = 4 * 4 * 64 ** 3 * 2  # int16 counts
    assert pr.breakdown["data"] == pytest.approx(batch_bytes / rate, rel=0.01)  # (rate printed to 3 digits)
    ahead = make_plan(compose([*base, "data.readers=2"]), suggest=False).prediction
    assert ahead is not None and ahead.breakdown["data"] == pytest.approx(
        max(0.0, pr.breakdown["data"] - (ahead.step_s - ahead.breakdown["data"])), abs=2e-3)
    far = make_plan(compose([*base[:4], "data.path=/nowhere/files", *base[5:], "data.prefetch=0", "data.readers=3"]),
                    suggest=False).prediction
    assert far is not None
    assert any(a.startswith("data read by 3 reader thread(s) at 4.4 GB/s each") for a in far.assumptions)
    assert far.breakdown["data"] == pytest.approx(batch_bytes / (3 * predict.READER_BYTES_PER_S), rel=1e-6)


def test_recomputation_is_timed_as_the_forward_of_every_layer_it_runs_again():
    """parallel.checkpoint runs a layer's forward again before its backward: on the plain path the layers of every
    piece but the last (the run's pieces), on a pipeline every layer and the loss. The plan adds that forward, and its
    halo exchanges, to the layer's backward (before, it added nothing: the U-Net at 64^3 on a CPU rank planned 2%
    slower recomputing and ran 35% slower)."""
    from gems.parallel import recompute_pieces
    from gems.plan.devices import efficiency
    from gems.plan.memory import Planner, setup
    from gems.plan.timing import _stage_times

    base = ["model=unet3d", "model.size=32", "model.width=0.25", "train.batch_size=2", "parallel.spatial=2",
            "cluster.gpu=a100-40gb"]
    st = setup(compose([*base, "parallel.checkpoint=true"]))
    pl = Planner(st)
    _, classes = pl.profile(1)
    t1, t2 = pl.traced(classes[0][0][0], 1), pl.traced(classes[0][0][0], 2)
    n = len(t1.out_bytes) - 1
    again = pl.recomputed(n)
    pieces = recompute_pieces(st.spec, st.mesh)
    assert len(pieces) > 1 and again == {j for a, e in pieces[:-1] for j in range(a, e)} and n not in again
    rates = gpu_rates("a100-40gb", "fp32", efficiency(None))
    args = (t1.ops, t2.ops, t1.batch, t2.batch, 1, t1.comm, t2.comm, 0, n, True, n, rates, 2, LINK, False)
    once, twice = _stage_times(*args), _stage_times(*args, again=again)
    for j, (p, q) in enumerate(zip(once.layers, twice.layers)):
        assert q == ((p[0], p[1] + p[0], p[2], p[3] + p[2]) if j in again else p), j
    assert sum(once.layers[j][2] for j in again) > 0  # halos of the recomputed layers exchanged again
    assert twice.bwd == pytest.approx(once.bwd + sum(once.layers[j][0] for j in again))
    # a split backward's I replays that forward whole before its input gradients; the W does none of it
    from gems.pipeline.schedules import Kind

    replay = sum(once.layers[j][0] for j in again)
    assert twice.replay == pytest.approx(replay) and twice.backward(Kind.B) == (twice.bwd, twice.comm_bwd)
    deferred = [1] * (n + 1)  # (as if every layer deferred its weight gradients: on a GPU, half of its own backward)
    once, twice = _stage_times(*args, deferred=deferred), _stage_times(*args, again=again, deferred=deferred)
    assert twice.backward(Kind.I)[0] == pytest.approx(once.backward(Kind.I)[0] + replay)
    assert twice.backward(Kind.W) == once.backward(Kind.W) and 0 < once.backward(Kind.W)[0] < once.bwd / 2
    assert sum(twice.backward(Kind.I)) + sum(twice.backward(Kind.W)) == pytest.approx(twice.bwd + twice.comm_bwd)
    piped = Planner(setup(compose([*base, "parallel.spatial=1", "parallel.pipeline=2", "parallel.checkpoint=true"])))
    assert piped.recomputed(n) == frozenset(range(n + 1))  # each partition replayed whole, the loss too
    assert Planner(setup(compose(base))).recomputed(n) == frozenset()
    plain, recomputing = (make_plan(compose([*base, f"parallel.checkpoint={c}"]), suggest=False)
                          for c in ("false", "true"))
    assert recomputing.prediction.breakdown["compute"] > 1.1 * plain.prediction.breakdown["compute"]
