"""The spatial library without processes: index rules against torch, the
partition, the conversion (same parameters, same state dict) and bad input."""
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gems.errors import ConfigError
from gems.models import build_model
from gems.spatial import SpatialContext, apply_spatial, split_bounds
from gems.spatial.geometry import Resample, Transposed, Window, boundary_slabs, nest


def _ctx(parts=(2,), dims=(0,), s=0):
    grid = np.unravel_index(s, parts)
    return SpatialContext(None, list(range(int(np.prod(parts)))), parts, dims, tuple(int(g) for g in grid))


def test_split_bounds_is_array_split():
    for n, p in itertools.product(range(0, 12), range(1, 6)):
        want = [(int(a[0]), int(a[-1]) + 1) if len(a) else None for a in np.array_split(np.arange(n), p)]
        got = split_bounds(n, p)
        assert [g if g[1] > g[0] else None for g in got] == want
        assert got[-1][1] == n


def test_local_slices_cover_the_sample_once():
    shape = (9, 7, 5)
    seen = np.zeros(shape, int)
    for s in range(6):
        sl = _ctx((3, 2), (0, 2), s).local_slices(shape)
        assert sl[1] == slice(0, 7)
        seen[sl] += 1
    assert (seen == 1).all()


def test_window_geometry_matches_torch():
    for n, k, s, p, d, ceil in itertools.product((5, 8, 11), (1, 2, 3, 4), (1, 2, 3), (0, 1), (1, 2), (False, True)):
        if p > k // 2 or d * (k - 1) + 1 > n + 2 * p:
            continue
        w = Window(k, s, d, p, p, ceil)
        x = torch.zeros(1, 1, n)
        assert F.max_pool1d(x, k, s, p, d, ceil).shape[-1] == w.out_size(n), (n, k, s, p, d, ceil)
        # each output reads exactly the inputs its window says: probe with one-hot inputs
        y_of = [F.max_pool1d(F.one_hot(torch.tensor(i), n).float().view(1, 1, n), k, s, p, d, ceil)[0, 0]
                for i in range(n)]
        for o in range(w.out_size(n)):
            reads = {i for i in range(n) if y_of[i][o] > 0}
            lo, hi = w.need(o, o + 1)
            assert reads == {i for i in range(max(lo, 0), min(hi, n)) if (i - lo) % d == 0}


def test_transposed_geometry_matches_torch():
    for n, k, s, p, op, d in itertools.product((3, 5), (1, 2, 3), (1, 2, 3), (0, 1), (0, 1), (1, 2)):
        if op >= max(s, d) or (n - 1) * s - 2 * p + d * (k - 1) + op + 1 < 1:
            continue
        t = Transposed(k, s, d, p, op)
        wgt = torch.ones(1, 1, k)
        outs = [F.conv_transpose1d(F.one_hot(torch.tensor(i), n).float().view(1, 1, n), wgt, None, s, p, op, 1, d)[0, 0]
                for i in range(n)]
        assert outs[0].shape[-1] == t.out_size(n)
        for a in range(t.out_size(n)):
            feeders = {i for i in range(n) if outs[i][a] != 0}
            lo, hi = t.need(a, a + 1, n)
            assert feeders <= set(range(lo, hi)), (n, k, s, p, op, d, a)


@pytest.mark.parametrize("mode,align", [("nearest", False), ("nearest-exact", False), ("linear", False), ("linear", True)])
def test_resample_index_rule_matches_torch(mode, align):
    for n, scale in itertools.product((3, 5, 7, 10), (1.0, 1.5, 2.0, 2.5, 3.0, 0.5, 1.7)):
        r = Resample(mode, align, scale)
        out = r.out_size(n)
        x = torch.arange(n, dtype=torch.float32).view(1, 1, n)
        kw = {} if mode.startswith("nearest") else {"align_corners": align}
        want = F.interpolate(x, scale_factor=scale, mode=mode, **kw)[0, 0]
        assert want.shape[-1] == out
        i0, i1, lam = r.sources(0, out, n)
        got = i0.float() * (1 - lam) + i1.float() * lam
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_boundary_slabs_and_nest_tile_the_output():
    out = ((0, 6), (2, 9), (0, 4))
    inner = ((1, 5), (3, 8), (0, 4))
    slabs = boundary_slabs(out, inner, [0, 1])
    cells = sum(int(np.prod([b - a for a, b in box])) for box in slabs)
    assert cells + 4 * 5 * 4 == 6 * 7 * 4
    full = torch.arange(6 * 7 * 4.0).view(1, 1, 6, 7, 4)

    def cut(box):
        return full[(slice(None), slice(None), *(slice(a - o[0], b - o[0]) for (a, b), o in zip(box, out)))]

    assert torch.equal(nest(out, inner, [0, 1], cut(inner), [cut(b) for b in slabs]), full)


def _node(**kw):
    return kw


def test_conversion_keeps_parameters_and_state_dict():
    spec = build_model(_node(name="cosmoflow", size=32, width=0.125, dropout=0.2))
    sp = apply_spatial(spec.module, _ctx((2, 2), (0, 1), 3), spec.spatial_end)
    assert len(sp) == len(spec.module) + 1
    assert type(sp[spec.spatial_end]).__name__ == "SpatialGather"
    ids = {id(p) for p in spec.module.parameters()}
    assert {id(p) for p in sp.parameters()} == ids
    serial_keys = list(spec.module.state_dict())
    head = [k for k in serial_keys if int(k.split(".")[0]) < spec.spatial_end]
    assert [k for k in sp.state_dict() if int(k.split(".")[0]) < spec.spatial_end] == head
    un = build_model(_node(name="unet3d", size=16, width=0.0625, in_channels=1, num_classes=3, norm="batch"))
    su = apply_spatial(un.module, _ctx(), None)
    assert list(su.state_dict()) == list(un.module.state_dict())
    assert all(a is b for a, b in zip(su.buffers(), un.module.buffers()))


def test_unsupported_layer_names_it():
    seq = nn.Sequential(nn.Conv2d(1, 2, 3), nn.AdaptiveAvgPool2d(3))
    with pytest.raises(ConfigError, match=r"model='layer 1 AdaptiveAvgPool2d.*a layer gems can partition"):
        apply_spatial(seq, _ctx())
    with pytest.raises(ConfigError, match=r"layer 1 Flatten.*model.spatial_end <= 1"):
        apply_spatial(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(2, 2)), _ctx(), None)
    with pytest.raises(ConfigError, match="padding_mode"):
        apply_spatial(nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="circular")), _ctx())


def test_cut_dims_the_model_lacks_are_config_errors():
    with pytest.raises(ConfigError, match=r"parallel.spatial_dims=\[2\].*0..1"):
        apply_spatial(nn.Sequential(nn.Conv2d(1, 2, 3)), _ctx((2,), (2,)))
    with pytest.raises(ConfigError, match=r"parallel.spatial_dims"):
        _ctx((2,), (3,)).local_slices((8, 8, 8))
    with pytest.raises(ConfigError, match=r"parallel.spatial=5.*at most 4 parts along spatial dim 0"):
        _ctx((5,), (0,)).scatter(torch.zeros(1, 1, 4, 8))
    with pytest.raises(ConfigError, match="parallel.bn_stats"):
        apply_spatial(nn.Sequential(nn.Conv2d(1, 2, 3)), _ctx(), bn_stats="mean")


def test_unet3d_spec():
    spec = build_model(_node(name="unet3d", size=16, width=0.25, in_channels=2, num_classes=3, norm="batch"))
    assert spec.target == "dense" and spec.loss == "cross_entropy" and spec.spatial_end is None
    y = spec.module.eval()(torch.randn(1, 2, 16, 16, 16))
    assert y.shape == (1, 3, 16, 16, 16)
    assert sum(isinstance(m, nn.ConvTranspose3d) for m in spec.module) == 3
    with pytest.raises(ConfigError, match="model.size"):
        build_model(_node(name="unet3d", size=20))
    with pytest.raises(ConfigError, match="model.norm"):
        build_model(_node(name="unet3d", size=16, norm="layer"))


def test_conv_nd_avoids_the_slow_kernel_and_stays_exact():
    """A depth-halved slab that torch sends to its slow reference kernel goes to oneDNN through
    a permutation of the spatial dims, with the same values and gradients."""
    from gems.spatial.conv_backend import conv_nd, perm_for

    torch.manual_seed(0)
    x = torch.randn(1, 32, 16, 32, 32, requires_grad=True)
    w = torch.randn(8, 32, 3, 3, 3, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    assert "Slow" in str(torch._C._select_conv_backend(x, w, b, [1] * 3, [0, 1, 1], [1] * 3, False, [0] * 3, 1, None))
    assert perm_for(x, w, b, (1, 1, 1), (0, 1, 1), (1, 1, 1), 1) is not None
    y = conv_nd(x, w, b, (1, 1, 1), (0, 1, 1), (1, 1, 1), 1)
    gy = torch.randn_like(y)
    got = torch.autograd.grad(y, (x, w, b), gy)
    want_y = F.conv3d(x, w, b, 1, (0, 1, 1))
    want = torch.autograd.grad(want_y, (x, w, b), gy)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-4)
    for g, h in zip(got, want):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("layer,route", [
    (nn.Conv3d(2, 3, 3, padding=1), True),
    (nn.Conv3d(2, 3, 3, stride=2, padding=1), True),
    (nn.AvgPool3d(3, stride=2, padding=1), True),
    (nn.AvgPool3d(3, stride=2, padding=1, count_include_pad=False), False),  # divisor depends on padding
    (nn.MaxPool3d(3, stride=2, padding=1), False),  # not linear
    (nn.Conv3d(2, 3, (3, 3, 3), padding=(1, 0, 1)), True),
])
def test_linear_layers_take_the_no_copy_route(layer, route):
    """Convolutions and count-include-pad average pools of a depth cut never copy the part: the op
    runs on it with its own padding and the boundary planes get the halo correction."""
    for s in range(2):
        sp = apply_spatial(nn.Sequential(layer), _ctx((2,), (0,), s))[0]
        setup = sp._setup((16, 8, 8))
        assert (setup[-1] is not None) is route
        if route:
            pads, _, fixes = setup[-1]
            # one boundary plane, facing the other part, where this part receives a halo
            assert pads[0] == 1 and len(fixes) == len(setup[1].recvs) == (1 if s == 1 or _tuple3(layer.stride)[0] == 1 else 0)


def _tuple3(v):
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * 3


def test_halo_plan_of_a_cube_cut_reaches_all_seven_neighbours():
    """A 2x2x2 cut of a 5x6x7 activation, a k3 s1 p1 window: every part receives from all 7
    others: 3 faces (one cell thick), 3 edges (one cell thick in two dims), the vertex corner
    (one cell in all three). Sends mirror the receives, and the part plus what it receives is
    exactly its (clipped) window, each cell once."""
    from gems.spatial.geometry import Window, clip
    from gems.spatial.halo import plan

    gshape = (5, 6, 7)
    cuts = [((0, 3), (3, 5)), ((0, 3), (3, 6)), ((0, 4), (4, 7))]  # np.array_split of 5, 6, 7 in two
    w = Window(3, 1, 1, 1, 1)
    ranks = [10 + s for s in range(8)]  # global ranks differ from the spatial indices

    def ctx(s):
        return SpatialContext(None, ranks, (2, 2, 2), (0, 1, 2), tuple(int(g) for g in np.unravel_index(s, (2, 2, 2))))

    needs = [tuple(clip(w.need(a, b), n) for (a, b), n in zip(ctx(s).box(gshape), gshape)) for s in range(8)]
    plans = [plan(ctx(s), gshape, needs) for s in range(8)]
    for s, p in enumerate(plans):
        g = np.unravel_index(s, (2, 2, 2))
        assert p.own == tuple(cuts[j][g[j]] for j in range(3))
        assert p.need == tuple((max(lo - 1, 0), min(hi + 1, n)) for (lo, hi), n in zip(p.own, gshape))
        want = {}
        for t in range(8):
            if t == s:
                continue
            h = np.unravel_index(t, (2, 2, 2))
            # along a dim where the neighbour sits above: my hi plane; below: the plane under my lo
            want[ranks[t]] = tuple(cuts[j][g[j]] if h[j] == g[j] else
                                   ((cuts[j][g[j]][1], cuts[j][g[j]][1] + 1) if h[j] > g[j] else
                                    (cuts[j][g[j]][0] - 1, cuts[j][g[j]][0])) for j in range(3))
        assert dict(p.recvs) == want and len(p.recvs) == 7, (s, p.recvs)
        kinds = sorted(sum(hi - lo == 1 for lo, hi in box) for _, box in p.recvs)
        assert kinds == [1, 1, 1, 2, 2, 2, 3]  # faces, edges, the vertex corner
        # what s sends to t is what t receives from s
        assert dict(p.sends) == {ranks[t]: dict(plans[t].recvs)[ranks[s]] for t in range(8) if t != s}
        cells = np.zeros(gshape, int)
        for box in [p.own, *(b for _, b in p.recvs)]:
            cells[tuple(slice(lo, hi) for lo, hi in box)] += 1
        inside = tuple(slice(lo, hi) for lo, hi in p.need)
        assert (cells[inside] == 1).all() and cells.sum() == int(np.prod([hi - lo for lo, hi in p.need]))
    # rank 0's corner is the single cell diagonally across the cut centre, from the last part
    assert dict(plans[0].recvs)[ranks[7]] == ((3, 4), (3, 4), (4, 5))
    assert dict(plans[7].recvs)[ranks[0]] == ((2, 3), (2, 3), (3, 4))
