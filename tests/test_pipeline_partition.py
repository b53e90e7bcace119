"""Partitioning, shape tracing, validation and the single-process runner (no process group)."""
from __future__ import annotations

import itertools
import random
import re
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gems.errors import ConfigError
from gems.mesh import Mesh
from gems.models.layers import SampleDropout, batch_context
from gems.models.resnet import resnet_v2
from gems.pipeline import apply_pipeline, make_schedule, split
from gems.pipeline.partition import balance_by_cost, balance_by_memory, boundary_shapes, check_balance, layer_memory, layer_times
from gems.pipeline.runtime import PipelineRunner


def small_net(norm: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6) if norm else nn.Identity(), nn.ReLU(),
        nn.Conv2d(6, 8, 3, stride=2, padding=1), nn.ReLU(), SampleDropout(0.3),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 5))


def ce(B: int):
    return lambda out, tgt, n: F.cross_entropy(out, tgt, reduction="sum") / B


def test_balance_by_cost_is_the_optimal_contiguous_cut():
    rng = random.Random(3)
    for _ in range(40):
        n, D = rng.randint(1, 9), rng.randint(1, 4)
        if D > n:
            continue
        costs = [rng.choice([0.5, 1.0, 2.0, 7.0]) for _ in range(n)]
        bal = balance_by_cost(costs, D)
        assert len(bal) == D and sum(bal) == n and min(bal) >= 1

        def worst(b):
            edges = [0, *itertools.accumulate(b)]
            return max(sum(costs[edges[i]:edges[i + 1]]) for i in range(len(b)))

        best = min(worst([e - s for s, e in zip((0, *cut), (*cut, n))])
                   for cut in itertools.combinations(range(1, n), D - 1))
        assert worst(bal) == pytest.approx(best)


def test_split_shares_modules_and_check_balance_names_the_key():
    seq = small_net()
    parts = split(seq, [3, 3, 2])
    assert [len(p) for p in parts] == [3, 3, 2]
    assert parts[1][0] is seq[3]
    for bad in ([3, 3], [4, 4, 1], [8, 0, 0], [2, 2, 2]):
        with pytest.raises(ConfigError) as e:
            check_balance(bad, len(seq), 3)
        assert e.value.key == "parallel.balance" and "8 layers" in str(e.value)
    with pytest.raises(ConfigError) as e:
        check_balance([1] * 9, len(seq), 9)
    assert e.value.key == "parallel.pipeline"


def test_boundary_shapes_on_fake_tensors_match_a_real_run():
    seq = small_net()
    parts = split(seq, [2, 3, 3])
    shapes = boundary_shapes(parts, (4, 3, 8, 8))
    with batch_context(0, 0, range(4)):
        x = torch.randn(4, 3, 8, 8)
        real = []
        for p in parts[:-1]:
            x = p(x)
            real.append((tuple(x.shape), x.dtype))
    assert shapes == real


def _peak_rss_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def test_fake_tracing_never_allocates_the_activations():
    seq = resnet_v2(110, width=1.0)
    # a real forward at this size would need about 2 x 64 x 2048^2 x 4 bytes = 2 GiB for one block output: the
    # process's peak resident memory (reset first: Linux's clear_refs) grows by far less across the trace
    Path("/proc/self/clear_refs").write_text("5")
    before = _peak_rss_kib()
    shapes = boundary_shapes(split(seq, [10, 10, 10, len(seq) - 30]), (2, 3, 2048, 2048))
    assert shapes[0][0] == (2, 64, 2048, 2048) and shapes[-1][0] == (2, 256, 512, 512)
    assert (_peak_rss_kib() - before) * 1024 < 2 * 64 * 2048 ** 2 * 4 / 4, _peak_rss_kib() - before
    mem = layer_memory(seq, (1, 3, 2048, 2048))
    assert len(mem) == len(seq) and mem[1] > 64 * 2048 ** 2 * 4 and all(m >= 0 for m in mem)
    assert all(m.training for m in seq.modules())  # tracing ran in eval mode and restored train mode


def test_balance_by_memory_is_deterministic_and_evens_bytes():
    seq = resnet_v2(38, width=0.5)
    a = balance_by_memory(seq, 4, (1, 3, 64, 64))
    assert a == balance_by_memory(seq, 4, (1, 3, 64, 64))
    costs = layer_memory(seq, (1, 3, 64, 64))

    def per_part(bal):
        edges = [0, *itertools.accumulate(bal)]
        return [sum(costs[edges[i]:edges[i + 1]]) for i in range(len(bal))]

    n = len(seq)
    by_count = [n // 4 + (1 if i < n % 4 else 0) for i in range(4)]
    assert max(per_part(a)) < max(per_part(by_count))  # the activations shrink along the net: counting layers is worse


def test_layer_times_leave_the_model_untouched():
    seq = small_net()
    before = [b.clone() for b in seq.buffers()]
    times = layer_times(seq, (2, 3, 8, 8))
    assert len(times) == len(seq) and all(t > 0 for t in times)
    assert all(torch.equal(a, b) for a, b in zip(before, seq.buffers()))
    assert all(p.grad is None for p in seq.parameters())


def test_bad_input_names_the_key():
    seq, mesh2 = small_net(), Mesh(1, 2)

    def err(**kw):
        args = dict(loss_fn=ce(8), batch_size=8, schedule="mast")
        args.update(kw)
        mesh = args.pop("mesh", mesh2)
        with pytest.raises(ConfigError) as e:
            apply_pipeline(seq, mesh, 0, **args)
        return e.value

    assert err(balance=[4, 3]).key == "parallel.balance"
    assert err(mesh=Mesh(1, 9)).key == "parallel.pipeline"
    assert err(mesh=Mesh(1, 1)).key == "parallel.schedule"
    assert err(batch_size=7).key == "train.batch_size"
    assert err(schedule="1f1b", micro_batches=3).key == "parallel.micro_batches"
    assert err(schedule="master", gems_replicas=3).key == "parallel.gems_replicas"
    assert err(schedule="master", gems_replicas=2, micro_batches=3).key == "parallel.micro_batches"
    assert err(schedule="mast", gems_replicas=3).key == "parallel.gems_replicas"
    e = err(batch_size=7)
    assert "7" in str(e) and "2" in str(e)


def serial_grads(seq: nn.Sequential, x, y, ids, chunks: int, B: int):
    k = B // chunks
    for p in seq.parameters():
        p.grad = None
    total = 0.0
    for j in range(chunks):
        sl = slice(j * k, (j + 1) * k)
        with batch_context(1, 0, ids[sl]):
            loss = ce(B)(seq(x[sl]), y[sl], k)
            loss.backward()
        total += loss.item()
    return total, [p.grad.clone() for p in seq.parameters()]


@pytest.mark.parametrize("schedule,m", [("lp", 1), ("gpipe", 4), ("1f1b", 2)])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_one_rank_runner_is_gradient_accumulation(schedule, m, checkpoint):
    B = 8
    g = torch.Generator().manual_seed(0)
    x, y, ids = torch.randn(B, 3, 8, 8, generator=g), torch.randint(0, 5, (B,), generator=g), list(range(B))
    ref = small_net()
    want_loss, want = serial_grads(ref, x, y, ids, m, B)
    seq = small_net()
    runner = apply_pipeline(seq, Mesh(1, 1), 0, loss_fn=ce(B), batch_size=B, schedule=schedule, micro_batches=m,
                            checkpoint=checkpoint, sample_shape=(3, 8, 8))
    assert runner.samples_per_step == B and runner.needs_inputs and runner.needs_targets
    loss = runner.step(x, y, ids, seed=1, step=0)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for p, w in zip(runner.parameters(), want):
        torch.testing.assert_close(p.grad, w)
    # BatchNorm statistics moved exactly as in the serial run (recomputation restores them)
    for a, b in zip(runner.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b)


def _dropout_grads(checkpoint: bool, plain: bool) -> list[torch.Tensor]:
    """One step of a net with torch's own ``nn.Dropout``, from one random state: a pipeline partition (one stage,
    1F1B over 2 micro-batches) or the plain path's pieces (gems.models.skips.checkpointed)."""
    from gems.models.skips import checkpointed

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Dropout(0.5), nn.Conv2d(6, 6, 3, padding=1),
                        nn.Dropout(0.5), nn.Flatten(), nn.Linear(6 * 8 * 8, 5))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 5, (4,), generator=g)
    torch.manual_seed(7)
    if plain:
        out = checkpointed(seq, [(0, 3), (3, 5), (5, 7)])(x) if checkpoint else seq(x)  # a dropout in each
        ce(4)(out, y, 4).backward()
    else:
        runner = apply_pipeline(seq, Mesh(1, 1), 0, loss_fn=ce(4), batch_size=4, schedule="1f1b", micro_batches=2,
                                checkpoint=checkpoint, sample_shape=(3, 8, 8))
        runner.step(x, y, list(range(4)), seed=1, step=0)
    return [p.grad.clone() for p in seq.parameters()] + [torch.get_rng_state()]


@pytest.mark.parametrize("plain", [False, True])
def test_recomputation_draws_torch_dropouts_mask_again(plain):
    """A recomputed forward replays the first one's random state: ``nn.Dropout`` (which draws from torch's
    generator, not from the batch context) keeps the same mask, so the gradients are the run's without
    recomputation, to the bit; the rank's random state after the step is as if nothing were recomputed."""
    want = _dropout_grads(False, plain)
    got = _dropout_grads(True, plain)
    assert any(w.abs().sum() > 0 for w in want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_runner_roles_and_batch_split():
    parts = {i: nn.Sequential(nn.Linear(2, 2)) for i in range(4)}
    sched = make_schedule("master", 4, micro_batches=2, gems_replicas=4)
    held = {i: parts[i] for i in sched.partitions_of(1)}
    r = PipelineRunner(held, sched, 1, [0, 1, 2, 3], None, 32, ce(32))
    assert sorted(r.partitions) == [1, 2] and r.samples_per_step == 32
    assert not r.needs_inputs and not r.needs_targets
    # eta x m chunks of 4: pass p, micro-batch i covers samples [(2p + i) * 4, (2p + i + 1) * 4)
    assert r.chunk_slice(0, 0) == slice(0, 4) and r.chunk_slice(1, 1) == slice(12, 16) and r.chunk_slice(3, 1) == slice(28, 32)
    ends = make_schedule("mast", 4)
    r0 = PipelineRunner({0: parts[0], 3: parts[3]}, ends, 0, [0, 1, 2, 3], None, 8, ce(8))
    assert r0.needs_inputs and r0.needs_targets  # stage 0 of A and stage 3 of B
    assert r0.chunk_slice(0, 0) == slice(0, 4) and r0.chunk_slice(1, 0) == slice(4, 8)  # A: first half, B: second
    assert r0.parameters() == [*parts[0].parameters(), *parts[3].parameters()]



def test_comm_cut_is_the_smallest_crossing_activation():
    from torch import nn

    from gems.pipeline.partition import balance_by_comm, layer_memory

    # crossings per sample after layers 0..3: 8x32x32, 8x8x8 (the smallest), 32x8x8, 2048
    seq = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.MaxPool2d(4), nn.Conv2d(8, 32, 1), nn.Flatten(),
                        nn.Linear(2048, 4))
    assert balance_by_comm(seq, (2, 3, 32, 32)) == [2, 3]
    # equal crossings everywhere: the most even memory wins
    flat = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
    mem = layer_memory(flat, (2, 64))
    cut, rest = balance_by_comm(flat, (2, 64))
    assert cut + rest == 6
    assert abs(sum(mem) - 2 * sum(mem[:cut])) == min(abs(sum(mem) - 2 * sum(mem[:i])) for i in range(1, 6))


def _trunk_and_head(big_head: bool = False) -> tuple[nn.Sequential, int]:
    """Three activation-heavy 3D layers, then the gather point (before layer 3) and a dense head."""
    torch.manual_seed(0)
    trunk = [nn.Conv3d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 4, 3, padding=1)]
    head = [nn.Flatten(), nn.Linear(4 * 5 * 8 * 8, 3)] if big_head else [nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                                                                          nn.Linear(4, 3)]
    return nn.Sequential(*trunk, *head), 3


def test_spatial_balance_without_cuts_is_the_serial_balance():
    from gems.pipeline.balance import spatial_balance
    from gems.pipeline.partition import balance_by_comm

    seq, _ = _trunk_and_head()
    sample = (2, 1, 8, 8, 8)
    for D in (2, 3):
        assert spatial_balance(seq, D, "memory", sample, (1,), (0,), None) == balance_by_memory(seq, D, sample)
    assert spatial_balance(seq, 2, "comm", sample, (1,), (0,), None) == balance_by_comm(seq, sample)


def test_spatial_balance_weighs_the_trunk_by_the_part_and_counts_the_gather():
    """Before the gather a rank holds its part of each activation (the largest part: 3 of 5 planes at S=2, 2 of 5
    at S=3), the gather and the head hold the whole; parameters are whole everywhere."""
    from gems.pipeline.balance import spatial_balance

    seq, end = _trunk_and_head(big_head=True)
    sample = (1, 1, 5, 8, 8)
    act = [4 * 5 * 64 * 4] * 3 + [4 * 5 * 64 * 4, 3 * 4]  # output bytes of each serial layer (flatten, linear)
    params = [3 * 4 * sum(q.numel() for q in layer.parameters()) for layer in seq]
    for parts, share in (((2,), 3 / 5), ((3,), 2 / 5), ((1,), 1.0)):
        costs = [params[i] + act[i] * share for i in range(end)] + [act[end - 1]] + \
                [params[i] + act[i] for i in range(end, len(seq))]
        for D in (2, 3, 4):
            got = spatial_balance(seq, D, "memory", sample, parts, (0,), end)
            assert sum(got) == len(seq) + 1, "the gather is a layer of the spatial model"
            assert got == balance_by_cost(costs, D), (parts, D)
    # comm: the trunk's crossings are parts, the gather's and the flatten's the whole activation, so the cut falls
    # in the trunk; of the three equal trunk cuts the one that evens memory most (the head holds the parameters)
    assert spatial_balance(seq, 2, "comm", sample, (2,), (0,), end) == [3, 3]
    # time: every rank gets rank 0's measured cut, a valid balance of the spatial model
    got = spatial_balance(seq, 3, "time", sample, (2,), (0,), end)
    assert sum(got) == len(seq) + 1 and len(got) == 3 and min(got) >= 1


def test_auto_balance_is_the_comm_cut_for_mirrored_schedules_at_d2_only():
    from gems.parallel import balance_rule as resolve_balance_by

    assert resolve_balance_by("auto", "mast", 2) == resolve_balance_by("auto", "master", 2) == "comm"
    for schedule, D in (("mast", 4), ("master", 3), ("lp", 2), ("1f1b", 2), ("gpipe", 4)):
        assert resolve_balance_by("auto", schedule, D) == "memory", (schedule, D)
    assert resolve_balance_by("time", "mast", 2) == "time" and resolve_balance_by("memory", "mast", 2) == "memory"


class _Slow(nn.Module):
    """An identity that takes 20 ms forward (a layer far costlier than its neighbours)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return x * 1.0


def test_balance_by_time_separates_the_slow_layers():
    from gems.pipeline.partition import balance_by_time

    torch.manual_seed(0)
    seq = nn.Sequential(_Slow(), nn.Linear(8, 8), _Slow(), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8),
                        nn.ReLU())
    bal = balance_by_time(seq, 2, (4, 8))
    assert sum(bal) == len(seq) and bal[0] in (1, 2), f"the 20 ms layers 0 and 2 must land on different ranks: {bal}"
    # neither a split by count nor the memory balance (the slow layers hold nothing) would do that
    assert balance_by_memory(seq, 2, (4, 8))[0] not in (1, 2)


class _Crop(nn.Module):
    """Drops ``n`` cells at each end of the last dim; ``n`` is an attribute its repr does not show."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x):
        return x[..., self.n:x.shape[-1] - self.n]


class _Steered(nn.Module):
    """Its output shape follows an object attribute: only the same object may share a memo entry."""

    def __init__(self, box: list) -> None:
        super().__init__()
        self.box = box

    def forward(self, x):
        return x[..., :self.box[0]]


def test_shape_memo_tells_apart_layers_whose_repr_is_the_same():
    from gems.pipeline.partition import _SHAPE_MEMO
    from gems.pipeline.partition import trace_shapes as _fake_run

    _SHAPE_MEMO.clear()
    layers = [_Crop(1), _Crop(2), _Crop(1), _Steered([5]), _Steered([3]), nn.Conv1d(2, 2, 3), nn.Conv1d(2, 2, 3, padding=1)]
    want = [38, 36, 38, 5, 3, 38, 40]
    for _ in range(2):  # the second time, every layer comes from the memo
        got = [_fake_run([m], (2, 2, 40), torch.float32)[0][0][-1] for m in layers]
        assert got == want
    assert len(_SHAPE_MEMO) == 6  # the two Crop(1) share an entry


def test_shape_memo_reuses_the_repeated_blocks_of_a_deep_resnet():
    from gems.pipeline import partition as P

    net = resnet_v2(depth=110, width=0.25, num_classes=4)
    P._SHAPE_MEMO.clear()
    keep = P._SHAPE_MEMO_MAX
    try:
        P._SHAPE_MEMO_MAX = 0
        plain = P.trace_shapes(list(net), (2, 3, 32, 32), torch.float32)
        P._SHAPE_MEMO_MAX = keep
        memo = P.trace_shapes(list(net), (2, 3, 32, 32), torch.float32)
    finally:
        P._SHAPE_MEMO_MAX = keep
    assert memo == plain
    # 110 = 9 x 12 + 2: 36 bottleneck blocks, of a handful of distinct (structure, input) kinds
    assert len(net) > 36 and len(P._SHAPE_MEMO) <= 12, len(P._SHAPE_MEMO)
