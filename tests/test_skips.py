"""Skip connections carried across the pieces of a cut model (gems.models.skips), in one process: which skips
cross which cut, a checkpointed U-Net against the plain one (gradients to the bit, BatchNorm's running statistics
updated once a step), and a pipeline partition's packing in both memory formats."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from gems.models import build_model
from gems.models.skips import Carried, checkpointed, crossing, run_span, spans, store_of
from gems.pipeline.partition import split


def unet(norm: str = "batch") -> torch.nn.Sequential:
    torch.manual_seed(0)
    spec = build_model(dict(name="unet3d", size=16, width=0.0625, in_channels=1, num_classes=3, norm=norm))
    return spec.module


def test_spans_and_crossing_follow_the_stashes() -> None:
    seq = unet()
    sp = spans(list(seq))
    assert [name for name, _, _ in sp] == ["level0", "level1", "level2"]
    for name, s, p in sp:  # each pop after its stash, the deepest level's skip the shortest
        assert type(seq[s]).__name__ == "Stash" and type(seq[p]).__name__ == "PopConcat" and s < p
    (_, s0, p0), (_, s1, p1), _ = sp
    assert crossing(sp, s0) == [] and crossing(sp, s0 + 1) == ["level0"]
    assert crossing(sp, s1 + 1) == ["level0", "level1"] and crossing(sp, p0 + 1) == []
    assert crossing(sp, p1) == ["level0", "level1"] and crossing(sp, p1 + 1) == ["level0"]


def _pieces(n: int, how: str, norm: str) -> list[tuple[int, int]]:
    if how == "two":  # two layers a piece: every boundary crossed by skips
        return [(a, min(a + 2, n)) for a in range(0, n, 2)]
    if how == "uneven":
        return [(0, 1), (1, n // 2), (n // 2, n - 1), (n - 1, n)]
    from gems.mesh import Mesh
    from gems.models import build_model
    from gems.parallel import recompute_pieces

    spec = build_model(dict(name="unet3d", size=16, width=0.0625, in_channels=1, num_classes=3, norm=norm))
    pieces = recompute_pieces(spec, Mesh(1, 1))
    assert 2 < len(pieces) < n // 2  # neither one piece nor two layers a piece
    return pieces


@pytest.mark.parametrize("how", ["chosen", "two", "uneven"])
@pytest.mark.parametrize("norm", ["batch", "none"])
def test_checkpointed_unet_trains_like_the_plain_one(norm: str, how: str) -> None:
    base = unet(norm)
    x = torch.randn(2, 1, 16, 16, 16)
    y = torch.randint(0, 3, (2, 16, 16, 16))
    plain, ckpt = copy.deepcopy(base), copy.deepcopy(base)
    for m, fwd in ((plain, plain), (ckpt, checkpointed(ckpt, _pieces(len(base), how, norm)))):
        F.cross_entropy(fwd(x), y).backward()
    for a, b in zip(plain.parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    # recomputation puts the buffers back: running statistics move once a step, as without it
    moved = [not torch.equal(a, b) for a, b in zip(base.buffers(), plain.buffers())]
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), ckpt.buffers(), strict=True))
    assert any(moved) == (norm == "batch")
    assert len(store_of(list(ckpt))) == 0  # nothing left behind


def _peak(pieces: list[tuple[int, int]], saved: list[float], out: list[float]) -> float:
    """What checkpoint_pieces minimises: the largest, over pieces, of the earlier pieces' inputs, its own input,
    its saved set, and its output with that output's gradient."""
    inp = [0.0] + out[:-1]
    kept, worst = 0.0, 0.0
    for a, e in pieces:
        worst = max(worst, kept + inp[a] + sum(saved[a:e]) + 2 * out[e - 1])
        kept += inp[a]
    return worst


def test_the_recomputed_pieces_are_the_cut_with_the_smallest_peak() -> None:
    """Against every cut of small random networks (all 2^(n-1) of them): the pieces chosen reach the least peak,
    cover the layers in order, and are the same on every call; equal layers come out about sqrt(n) pieces."""
    import itertools
    import random

    from gems.models.skips import checkpoint_pieces

    rng = random.Random(5)
    for n in (1, 2, 5, 9):
        for _ in range(20):
            saved = [float(rng.choice([0, 1, 4, 16, 64])) for _ in range(n)]
            out = [float(rng.choice([1, 2, 8, 32])) for _ in range(n)]
            got = checkpoint_pieces(saved, out)
            assert got == checkpoint_pieces(saved, out)
            assert got[0][0] == 0 and got[-1][1] == n and all(e == a for (_, e), (a, _) in zip(got, got[1:]))
            best = min(_peak([(a, e) for a, e in zip((0, *c), (*c, n))], saved, out)
                       for k in range(n) for c in itertools.combinations(range(1, n), k))
            assert _peak(got, saved, out) <= best * (1 + 1e-9), (saved, out, got)
    even = checkpoint_pieces([1.0] * 100, [1.0] * 100)
    assert 7 <= len(even) <= 14 and max(e - a for a, e in even) <= 2 * 100 // len(even)


@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last_3d])
def test_a_partition_packs_and_unpacks_its_skips(fmt: torch.memory_format) -> None:
    from gems.models.skips import carry

    seq = unet("none").to(memory_format=fmt)
    n = len(seq)
    x = torch.randn(2, 1, 16, 16, 16).to(memory_format=fmt)
    ref = copy.deepcopy(seq)(x)
    parts, shapes = carry(split(seq, [n // 2, n - n // 2]), [n // 2, n - n // 2], (2, 1, 16, 16, 16),
                          torch.float32)
    assert all(isinstance(p, Carried) for p in parts) and shapes is not None
    for p in parts:
        p.memory_format = fmt
    packed = parts[0](x)
    assert tuple(packed.shape) == shapes[0][0] and packed.is_contiguous()
    act, *skips = parts[1].unpack(packed)
    assert len(skips) == len(parts[1].names_in) == 3  # every level's skip crosses the middle
    if fmt is torch.channels_last_3d:  # unpacked in the layout the layers compute in: nothing converted
        assert act.is_contiguous(memory_format=fmt) or act.stride(1) == 1
        assert all(s.stride(1) == 1 for s in skips)
    out = parts[1](packed)
    assert torch.equal(out, ref)
    # the same layers and state-dict keys as the plain partitions
    assert list(parts[0].state_dict()) == list(split(copy.deepcopy(seq), [n // 2, n - n // 2])[0].state_dict())


def test_a_piece_that_leaves_a_skip_behind_is_an_error() -> None:
    seq = unet("none")
    layers = list(seq)
    (_, s, _), *_ = spans(layers)
    with pytest.raises(RuntimeError, match="no later piece takes"):
        run_span(store_of(layers), layers[:s + 1], torch.randn(1, 1, 16, 16, 16), [], [])
    assert len(store_of(layers)) == 0


def test_the_comm_cut_counts_the_skips_that_cross_it() -> None:
    """mast/master at D = 2 cut where the least crosses: the activation and every skip over the cut."""
    from gems.pipeline.partition import balance_by_comm, nbytes, trace_shapes

    seq = unet("none")
    sample = (1, 1, 16, 16, 16)
    acts = [nbytes(s, d) for s, d in trace_shapes(list(seq), sample, torch.float32)]
    sp = spans(list(seq))
    total = [a + sum(acts[s] for _, s, p in sp if s < i + 1 <= p) for i, a in enumerate(acts)]
    cut = balance_by_comm(seq, sample)[0]
    assert total[cut - 1] == min(total[:-1])
    # the activation alone would cut at the bottleneck, which the level-0..2 skips all cross
    alone = min(range(1, len(acts)), key=lambda i: acts[i - 1])
    assert total[alone - 1] > total[cut - 1]


@pytest.mark.parametrize("overrides,chunks", [
    ([], 0),  # one process, the whole batch
    (["parallel.replicas=2"], 2),
    (["parallel.pipeline=2", "parallel.schedule=mast"], 2),
    (["parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=2", "train.batch_size=8"], 2),
    (["parallel.pipeline=2"], 0),  # lp: one chunk
    (["parallel.replicas=2", "model.norm=none"], 0),  # no BatchNorm
])
def test_a_run_says_when_batchnorm_normalises_over_chunks(overrides: list[str], chunks: int) -> None:
    """BatchNorm over a micro-batch, a replica's or a pass's share is not the serial run on the whole batch, but
    gradient accumulation over those chunks (the transparency tests' reference): the run says so."""
    from gems.config import compose, typed
    from gems.parallel import resolve

    cfg = typed(compose(["model=unet3d", "model.size=16", "model.width=0.0625", *overrides]))
    note = resolve(cfg).norm_note(build_model(cfg.model).module)
    assert (f"({chunks} chunks a step" in note) if chunks else note == ""


class _Untraceable(torch.nn.Module):
    """Reads a value (fake tensors cannot): the cuts' layout must come from the first step's header."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 + 0.0 * float(x.detach().sum()))


def test_partitions_fake_tensors_cannot_run_learn_their_layout_at_the_first_pack() -> None:
    from gems.models.skips import PopConcat, SkipStore, Stash, carry

    store = SkipStore()
    seq = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), Stash(store, "a"), _Untraceable(),
                              torch.nn.Conv2d(2, 2, 3, padding=1), PopConcat(store, "a"), torch.nn.Conv2d(4, 1, 1))
    x = torch.randn(2, 1, 6, 6)
    ref = seq(x)
    parts, shapes = carry(split(seq, [3, 3]), [3, 3], (2, 1, 6, 6), torch.float32)
    assert shapes is None and parts[1].incoming is None  # left to the header
    packed = parts[0](x)
    assert parts[0].outgoing == [((2, 6, 6), torch.float32), ((2, 6, 6), torch.float32)]
    parts[1].incoming = parts[0].outgoing  # what the runner's header carries
    assert torch.equal(parts[1](packed), ref)


def test_the_plan_keeps_a_packed_output_beside_the_output_its_last_layer_saved() -> None:
    """A partition conv -> stash -> ReLU sends [ReLU's output | skip] packed in one new tensor (Carried.pack's cat)
    and keeps it for its backward, while the ReLU keeps its own output: both count (100 + 200 bytes)."""
    from gems.trace.model import Trace

    t = Trace(batch=1, in_key=0, in_bytes=100, out_keys=[1, 1, 2, 3, 4], out_bytes=[100, 100, 100, 100, 4],
              saved={0: (100, {0}), 2: (100, {2}), 3: (100, {4})}, halo={}, gather={}, target_bytes=4,
              skips=[(1, 3)])
    assert t.carried(3) == 100
    total, _, _, out_b = t.stage_by_layer(0, 3, last=False)
    assert out_b == 200 and total == 300
    # without the ReLU's own saving, the packed tensor is the only copy kept (a trace is a value, its stages kept:
    # another trace, not this one changed)
    import dataclasses

    alone = dataclasses.replace(t, saved={k: v for k, v in t.saved.items() if k != 2})
    assert alone.stage_by_layer(0, 3, last=False)[0] == 200
