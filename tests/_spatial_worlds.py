"""Rank functions of the spatial transparency tests.

Each case builds a small model, runs it serially on every rank (the
reference), then partitioned over a spatial group, and compares outputs,
input gradients, summed parameter gradients and buffers. A 4-rank world
holds several groups at once (two of size 2, one of size 3, the whole world
of 4) so one spawn covers S = 2, 3 and 4, one and two cut dims; an 8-rank
world cuts 3D inputs into 2x2x2 cubes (halos through faces, edges and the
vertex corner). Failures are returned as text per case, so one bad case does
not hide the others.
"""
from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from gems.models.layers import SampleDropout, batch_context
from gems.replication import GradientReducer
from gems.spatial import SpatialContext, apply_spatial

# ---- spatial layouts: name -> (parts, dims) -----------------------------------------
LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "S2d0": ((2,), (0,)),
    "S2d1": ((2,), (1,)),
    "S3d0": ((3,), (0,)),
    "S3d2": ((3,), (2,)),
    "S4d0": ((4,), (0,)),
    "S4d1": ((4,), (1,)),
    "S22": ((2, 2), (0, 1)),
    "S22d12": ((2, 2), (1, 2)),
    "S222": ((2, 2, 2), (0, 1, 2)),  # the 8-rank world only
}


def _seq(*layers: nn.Module) -> nn.Sequential:
    return nn.Sequential(*layers)


def _unet_level(c: int) -> nn.Sequential:
    from gems.models.unet3d import PopConcat, SkipStore, Stash

    st = SkipStore()
    return _seq(nn.Conv3d(c, 3, 3, padding=1), Stash(st, "a"), nn.MaxPool3d(2), nn.Conv3d(3, 3, 3, padding=1),
                nn.ConvTranspose3d(3, 3, 2, stride=2), PopConcat(st, "a"), nn.Conv3d(6, 2, 1))


def _residual(c: int) -> nn.Sequential:
    from gems.models.unet3d import PopAdd, SkipStore, Stash

    st = SkipStore()
    return _seq(Stash(st, "r"), nn.Conv3d(c, c, 3, padding=1), nn.ReLU(), nn.Conv3d(c, c, 3, padding=1), PopAdd(st, "r"))


def _preact() -> nn.Sequential:
    from gems.models.resnet import PreActBottleneck

    return _seq(nn.Conv2d(2, 4, 3, padding=1), PreActBottleneck(4, 2, stride=2), PreActBottleneck(8, 2, stride=1))


# ---- layer cases: name -> (builder, input shape (N, C, *spatial), layouts, options) ------
D3 = (2, 2, 9, 6, 5)
LAYER_CASES: dict[str, tuple[Callable[[], nn.Sequential], tuple[int, ...], tuple[str, ...], dict[str, Any]]] = {
    "conv3d_k3p1": (lambda: _seq(nn.Conv3d(2, 3, 3, padding=1)), D3, ("S2d0", "S4d0", "S22", "S3d2"), {}),
    "conv3d_k3s2p1": (lambda: _seq(nn.Conv3d(2, 3, 3, stride=2, padding=1)), D3, ("S2d0", "S4d0", "S22d12"), {}),
    "conv3d_k5d2p3_wide_halo": (lambda: _seq(nn.Conv3d(2, 2, 5, dilation=2, padding=3)), (1, 2, 11, 9, 4),
                                ("S4d0", "S3d0", "S22"), {}),
    "conv3d_k4s3p2": (lambda: _seq(nn.Conv3d(2, 2, 4, stride=3, padding=2)), (1, 2, 13, 10, 4), ("S4d0", "S22"), {}),
    "conv3d_same_k4": (lambda: _seq(nn.Conv3d(2, 2, 4, padding="same", bias=False)), D3, ("S2d0", "S22"), {}),
    "conv3d_valid_groups": (lambda: _seq(nn.Conv3d(2, 4, (3, 2, 1), groups=2)), D3, ("S3d0", "S22"), {}),
    "conv3d_no_overlap": (lambda: _seq(nn.Conv3d(2, 3, 3, padding=1), nn.Conv3d(3, 2, 3, stride=2, padding=1)), D3,
                          ("S22", "S3d0"), {"overlap": False}),
    "conv2d_k3p1": (lambda: _seq(nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)), (2, 2, 9, 7),
                    ("S2d1", "S4d1", "S22"), {}),
    "conv2d_k7s2p3": (lambda: _seq(nn.Conv2d(2, 2, 7, stride=2, padding=3)), (1, 2, 15, 11), ("S4d0", "S22"), {}),
    "conv1d_k3p2d2": (lambda: _seq(nn.Conv1d(2, 3, 3, padding=2, dilation=2), nn.Conv1d(3, 2, 2, stride=2)),
                      (2, 2, 17), ("S2d0", "S3d0", "S4d0"), {}),
    "convT3d_k2s2": (lambda: _seq(nn.ConvTranspose3d(2, 3, 2, stride=2)), (1, 2, 5, 4, 3), ("S2d0", "S4d0", "S22"), {}),
    "convT3d_k3s2p1op1": (lambda: _seq(nn.ConvTranspose3d(2, 2, 3, stride=2, padding=1, output_padding=1)),
                          (1, 2, 5, 4, 3), ("S3d0", "S22"), {}),
    "convT2d_k4s2p1d2_groups": (lambda: _seq(nn.ConvTranspose2d(2, 4, 4, stride=2, padding=1, dilation=2, groups=2)),
                                (1, 2, 7, 6), ("S2d0", "S4d0", "S22"), {}),
    "convT2d_k1s3_gaps": (lambda: _seq(nn.ConvTranspose2d(2, 2, 1, stride=3)), (1, 2, 5, 4), ("S4d0", "S22"), {}),
    "maxpool3d_k2": (lambda: _seq(nn.MaxPool3d(2)), D3, ("S2d0", "S4d0", "S22d12"), {}),
    "maxpool3d_k3s2p1_ceil_dil": (lambda: _seq(nn.MaxPool3d(3, 2, 1, ceil_mode=True), nn.MaxPool3d(2, 1, dilation=2)),
                                  (1, 2, 12, 9, 7), ("S2d0", "S3d0", "S22"), {}),
    "avgpool3d_k3s2p1": (lambda: _seq(nn.AvgPool3d(3, stride=2, padding=1)), D3, ("S2d0", "S4d0", "S22", "S3d2"), {}),
    "avgpool3d_nopad_ceil": (lambda: _seq(nn.AvgPool3d(3, 2, 1, ceil_mode=True, count_include_pad=False)),
                             (1, 2, 10, 7, 6), ("S4d0", "S22"), {}),
    "avgpool2d_divisor": (lambda: _seq(nn.AvgPool2d(3, 2, 1, divisor_override=4), nn.AvgPool2d(2)), (1, 2, 11, 9),
                          ("S2d1", "S3d0", "S22"), {}),
    "avgpool2d_k3s2p1_nopad": (lambda: _seq(nn.AvgPool2d(3, 2, 1, count_include_pad=False)), (2, 2, 9, 7),
                               ("S2d0", "S4d1"), {}),
    "maxpool2d_k3s2p1": (lambda: _seq(nn.MaxPool2d(3, 2, 1), nn.MaxPool2d((2, 3), 1, (1, 1))), (1, 4, 11, 7),
                         ("S2d1", "S3d0", "S4d0", "S22"), {"ramps": True}),
    "maxpool1d_k4s3p2_ceil": (lambda: _seq(nn.MaxPool1d(4, 3, 2, ceil_mode=True), nn.MaxPool1d(3, 1, 1)), (2, 2, 19),
                              ("S2d0", "S3d0", "S4d0"), {"ramps": True}),
    "batchnorm3d_train": (lambda: _seq(nn.Conv3d(2, 3, 3, padding=1), nn.BatchNorm3d(3), nn.ReLU()), D3,
                          ("S2d0", "S4d0", "S22"), {}),
    "batchnorm2d_eval": (lambda: _seq(nn.BatchNorm2d(2), nn.Conv2d(2, 2, 3, padding=1)), (2, 2, 8, 6), ("S22",),
                         {"train": False}),
    "batchnorm2d_cumulative": (lambda: _seq(nn.BatchNorm2d(2, momentum=None)), (2, 2, 8, 6), ("S4d0",), {}),
    "groupnorm_instancenorm": (lambda: _seq(nn.GroupNorm(2, 2), nn.Conv3d(2, 4, 1), nn.InstanceNorm3d(4, affine=True)),
                               D3, ("S2d0", "S22"), {}),
    "upsample_nearest2": (lambda: _seq(nn.Upsample(scale_factor=2)), (1, 2, 5, 4, 3), ("S2d0", "S4d0", "S22"), {}),
    "upsample_nearest_frac": (lambda: _seq(nn.Upsample(scale_factor=1.5), nn.Upsample(size=(9, 8))), (1, 2, 7, 5),
                              ("S3d0", "S22"), {}),
    "upsample_nearest_exact": (lambda: _seq(nn.Upsample(scale_factor=(2.5, 1.7), mode="nearest-exact")), (1, 2, 5, 6),
                               ("S4d0", "S22"), {}),
    "upsample_trilinear": (lambda: _seq(nn.Upsample(scale_factor=2, mode="trilinear")), (1, 2, 5, 4, 3),
                           ("S3d0", "S22"), {}),
    "upsample_bilinear_corners": (lambda: _seq(nn.Upsample(size=(13, 11), mode="bilinear", align_corners=True)),
                                  (1, 2, 6, 5), ("S4d0", "S22"), {}),
    "pointwise_chain": (lambda: _seq(nn.Conv3d(2, 3, 1), nn.LeakyReLU(0.3), nn.PReLU(3), nn.Tanh(), nn.Softmax(dim=1),
                                     nn.Identity()), D3, ("S22",), {}),
    "residual_add": (lambda: _residual(2), D3, ("S2d0", "S22"), {}),
    "unet_level_concat": (lambda: _unet_level(2), (1, 2, 8, 6, 4), ("S2d0", "S4d0", "S22"), {}),
    "preact_resnet_block": (_preact, (2, 2, 10, 9), ("S2d0", "S22"), {}),
    "sample_dropout_trunk": (lambda: _seq(nn.Conv3d(2, 3, 1), SampleDropout(0.4), nn.Conv3d(3, 2, 3, padding=1)), D3,
                             ("S22",), {}),
    "gather_head": (lambda: _seq(nn.Conv3d(2, 3, 3, padding=1), nn.AvgPool3d(2), nn.Flatten(), nn.Linear(3 * 4 * 3 * 2, 5),
                                 SampleDropout(0.3), nn.Linear(5, 4)), (2, 2, 8, 6, 5), ("S2d0", "S4d0", "S22"),
                    {"spatial_end": 2}),
    # global pooling (output size 1): local sums or maxima combined over the parts; the output is whole
    "global_avgpool3d_head": (lambda: _seq(nn.Conv3d(2, 3, 3, padding=1), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                                           nn.Linear(3, 4)), (2, 2, 7, 6, 5), ("S2d0", "S4d0", "S22", "S3d2"),
                              {"spatial_end": 2}),
    "global_maxpool2d_head": (lambda: _seq(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d((1, 1)),
                                           nn.Flatten(), nn.Linear(3, 4)), (2, 2, 9, 7), ("S2d0", "S4d0", "S22"),
                              {"spatial_end": 3}),
    "global_pools_1d": (lambda: _seq(nn.Conv1d(2, 3, 3, padding=1), nn.AdaptiveMaxPool1d(1), nn.Flatten(),
                                     nn.Linear(3, 2)), (2, 2, 11), ("S4d0",), {"spatial_end": 2}),
    "empty_parts_deep": (lambda: _seq(nn.AvgPool3d(2), nn.MaxPool3d(3, 2, 1), nn.Conv3d(2, 3, 3, padding=1),
                                      nn.BatchNorm3d(3), nn.Upsample(scale_factor=2), nn.Conv3d(3, 2, 1),
                                      nn.Flatten(), nn.Linear(2 * 4 * 4 * 4, 3)), (2, 2, 6, 8, 6), ("S4d0", "S22d12"),
                         {"spatial_end": 6}),
}

# The cases above run with overlap=True. These run the CPU default (overlap=None) and overlap=False
# on both routes of the window layers. Max pools and average pools that do not count padding take
# the window route (halo.Assemble); with overlap=None or False on CPU that is one whole window, not
# the interior-then-slabs path overlap=True takes. Average pools counting padding take the no-copy
# route (Exchange/Shell/AddInto), which waits for the halos before the op only with overlap=False.
# The linear cases' extents are aligned with the stride so every rank takes that route, the window
# cases' are uneven; "route" checks which route each layer took.
for _ov, _tag in ((None, "cpu_default"), (False, "no_overlap")):
    LAYER_CASES[f"maxpool3d_k3s2p1_{_tag}"] = (lambda: _seq(nn.MaxPool3d(3, 2, 1)), (2, 4, 9, 6, 5), ("S2d0", "S22"),
                                               {"overlap": _ov, "route": "window", "ramps": True})
    LAYER_CASES[f"avgpool3d_k3s2p1_nopad_{_tag}"] = (lambda: _seq(nn.AvgPool3d(3, 2, 1, count_include_pad=False)), D3,
                                                     ("S2d0", "S22"), {"overlap": _ov, "route": "window"})
    LAYER_CASES[f"avgpool3d_k3s2p1_{_tag}"] = (lambda: _seq(nn.AvgPool3d(3, 2, 1)), (2, 2, 8, 8, 5), ("S2d0", "S22"),
                                               {"overlap": _ov, "route": "linear"})
    LAYER_CASES[f"conv_pools_chain_{_tag}"] = (
        lambda: _seq(nn.Conv3d(2, 3, 3, padding=1), nn.AvgPool3d(3, 2, 1), nn.MaxPool3d(3, 2, 1), nn.Conv3d(3, 2, 3, padding=1)),
        (1, 2, 12, 8, 5), ("S2d0", "S22"), {"overlap": _ov})

# ---- the 8-rank world: 2x2x2 cubes of a 3D input ---------------------------------------
CUBE_CASES: dict[str, tuple[Callable[[], nn.Sequential], tuple[int, ...], tuple[str, ...], dict[str, Any]]] = {
    "cube_conv3d_k3p1": (lambda: _seq(nn.Conv3d(2, 2, 3, padding=1)), (2, 2, 5, 6, 7), ("S222",), {"route": "linear"}),
    "cube_conv3d_k3s2p1": (lambda: _seq(nn.Conv3d(2, 2, 3, stride=2, padding=1)), (1, 2, 7, 6, 5), ("S222",), {}),
    "cube_maxpool3d_k3s2p1": (lambda: _seq(nn.MaxPool3d(3, 2, 1)), (1, 8, 7, 6, 5), ("S222",),
                              {"route": "window", "ramps": True}),
    "cube_maxpool3d_k3s1p1_cpu_default": (lambda: _seq(nn.MaxPool3d(3, 1, 1)), (1, 8, 5, 6, 7), ("S222",),
                                          {"overlap": None, "ramps": True}),
    "cube_avgpool3d_k3s2p1": (lambda: _seq(nn.AvgPool3d(3, 2, 1)), (1, 2, 8, 8, 8), ("S222",), {"route": "linear"}),
    "cube_avgpool3d_k3s2p1_uneven": (lambda: _seq(nn.AvgPool3d(3, 2, 1)), (1, 2, 7, 6, 5), ("S222",), {}),
    "cube_batchnorm3d_global": (lambda: _seq(nn.Conv3d(2, 2, 3, padding=1), nn.BatchNorm3d(2), nn.ReLU()), (2, 2, 5, 6, 7),
                                ("S222",), {}),
    "cube_convT3d_k2s2": (lambda: _seq(nn.ConvTranspose3d(2, 2, 2, stride=2)), (1, 2, 5, 4, 3), ("S222",), {}),
}


def model_cases() -> dict[str, tuple[Callable[[], nn.Sequential], tuple[int, ...], tuple[str, ...], dict[str, Any]]]:
    from gems.models import build_model

    def spec(**kw: Any) -> Any:
        return build_model(kw)

    cf = dict(name="cosmoflow", size=32, width=0.125, dropout=0.2)
    cfbn = dict(cf, norm="batch")  # model.norm=batch: BatchNorm after each convolution, global statistics
    ml = dict(name="cosmoflow_mlperf", size=32, width=0.0625, dropout=0.5)
    un = dict(name="unet3d", size=16, width=0.0625, in_channels=1, num_classes=3, norm="batch")
    cf256 = dict(name="cosmoflow", size=256, width=0.125, dropout=0.2)

    def cf256_head() -> nn.Sequential:
        """The first layers of the paper's 256^3 CosmoFlow: conv1, LeakyReLU, two AvgPool3d k3s2p1
        back to back, conv2, LeakyReLU (run on a small input whose parts stay aligned with the
        pools' stride, as 256^3 at S=4 and S22 does: every window layer takes the no-copy route)."""
        head = nn.Sequential(*list(spec(**cf256).module)[:6])
        assert [type(m).__name__ for m in head] == ["Conv3d", "LeakyReLU", "AvgPool3d", "AvgPool3d", "Conv3d", "LeakyReLU"]
        return head

    return {  # models are built inside the case, after the seed: the same on every rank
        "cosmoflow": (lambda: spec(**cf).module, (2, 4, 32, 32, 32), ("S2d0", "S4d0", "S22", "S3d2"),
                      {"spatial_end": spec(**cf).spatial_end}),
        # BatchNorm of 2-channel layers divides by small batch deviations: the serial float32 gradients of conv2
        # are themselves 5.7e-6 from float64's (of 0.38 at most), so two float32 runs differ by about twice that
        "cosmoflow_bn": (lambda: spec(**cfbn).module, (2, 4, 32, 32, 32), ("S2d0", "S22"),
                         {"spatial_end": spec(**cfbn).spatial_end, "grad_noise": 4.0}),
        "cosmoflow_mlperf": (lambda: spec(**ml).module, (2, 4, 32, 32, 32), ("S2d0", "S22d12", "S4d1"),
                             {"spatial_end": spec(**ml).spatial_end}),
        # S4d0: the bottom levels (4^3, 2^3) leave parts of one cell and empty parts
        "unet3d": (lambda: spec(**un).module, (2, 1, 16, 16, 16), ("S2d0", "S22", "S3d0", "S4d0"),
                   {"spatial_end": spec(**un).spatial_end}),
        "cosmoflow256_pool_pair": (cf256_head, (1, 4, 48, 24, 8), ("S4d0", "S22"), {"route": "linear"}),
    }


def case_names(cases: dict[str, Any]) -> list[str]:
    return [f"{name}[{lay}]" for name, (_, _, lays, _) in cases.items() for lay in lays]


# ---- comparison -----------------------------------------------------------------------
def _close(what: str, got: torch.Tensor, want: torch.Tensor, scale: float | None = None) -> str | None:
    """float32 rounding: rtol 1e-5 and atol 2e-6 x the magnitude of the quantity
    (for parameter gradients the largest gradient of the model: a gradient that
    is zero in exact arithmetic, like a bias before BatchNorm, is rounding noise
    of sums of that size)."""
    if scale is None:
        scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    try:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * scale)
    except AssertionError as e:
        return f"{what}: {str(e).splitlines()[0:4]}"
    return None


def make_groups(world: int) -> dict[str, Any]:
    """Every group the layouts use, created in the same order on every rank."""
    groups = {}
    for name, ranks in (("01", [0, 1]), ("23", [2, 3]), ("012", [0, 1, 2])):
        groups[name] = (dist.new_group(ranks), ranks)
    groups["all"] = (None, list(range(world)))
    return groups


def context_for(rank: int, layout: str, groups: dict[str, Any], overlap: bool | None = True) -> SpatialContext | None:
    parts, dims = LAYOUTS[layout]
    size = 1
    for p in parts:
        size *= p
    world = dist.get_world_size()
    if size != world and not (world == 4 and size in (2, 3)):
        raise ValueError(f"layout {layout} ({size} parts) has no group in a {world}-rank world")
    if size == 2:
        group, ranks = groups["01"] if rank < 2 else groups["23"]
    elif size == 3:
        if rank == 3:
            return None
        group, ranks = groups["012"]
    else:
        group, ranks = groups["all"]
    s = ranks.index(rank)
    grid = []
    for p in reversed(parts):
        grid.append(s % p)
        s //= p
    return SpatialContext(group, ranks, parts, dims, tuple(reversed(grid)), overlap=overlap)


def ramps(shape: tuple[int, ...]) -> torch.Tensor:
    """Channel ``c`` is a ramp over the spatial coordinates, falling along dim ``j`` where bit ``j``
    of ``c`` is 0, rising where it is 1: every window of a max pool takes its value (and its
    gradient goes) to one corner of the window, in the direction of the channel's bits. With
    2**nd channels every halo piece's outermost cell (faces, edges, vertex corners in every
    direction) is some window's max, so a missing or misplaced one shows; on random input it
    would only show when it happens to be the max."""
    coords = torch.meshgrid(*[torch.arange(n, dtype=torch.float32) for n in shape[2:]], indexing="ij")
    chans = [sum(x_j * (1.0 if (c >> j) & 1 else -1.0) for j, x_j in enumerate(coords)) for c in range(shape[1])]
    return torch.stack(chans).unsqueeze(0).expand(shape).contiguous()


def run_case(build: Callable[[], nn.Sequential], shape: tuple[int, ...], sctx: SpatialContext,
             opts: dict[str, Any]) -> list[str]:
    """Serial vs spatial on this rank's group: a list of mismatches (empty when exact)."""
    torch.manual_seed(1234)
    model = build()
    train = opts.get("train", True)
    if not train:  # give BatchNorm non-trivial running statistics
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    model.train(train)
    serial = copy.deepcopy(model)
    end = opts.get("spatial_end")
    spatial = apply_spatial(model, sctx, end, opts.get("bn_stats", "global"))
    g = torch.Generator().manual_seed(99)
    x = torch.randn(shape, generator=g)
    if opts.get("ramps"):
        x = 0.01 * x + ramps(shape)
    ids = list(range(10, 10 + shape[0]))

    xs = x.clone().requires_grad_()
    with batch_context(7, 3, ids):
        y = serial(xs)
    w = torch.randn(y.shape, generator=g)
    (y * w).sum().backward()

    # the parts' gradients summed by the run's own reducer, a bucket a parameter: its sums start in the backward,
    # at its points, between the halos, so the replay (gems.commlog) sees them where a run issues them
    reducer = GradientReducer(spatial, sctx.group or dist.group.WORLD, bucket_mb=1e-6)
    reducer.start_step()
    xl = sctx.scatter(x).requires_grad_()
    with batch_context(7, 3, ids):
        yl = spatial(xl)
    if end is not None:
        loss = (yl * w).sum() / sctx.size
        y_full = yl.detach()
    else:
        box = sctx.box(y.shape[2:])
        loss = (yl * w[(slice(None), slice(None), *(slice(a, b) for a, b in box))]).sum()
        y_full = sctx.gather(yl.detach())
    loss.backward()
    reducer.finish()
    reducer.remove()

    bad = []
    bad.append(_close("output", y_full, y.detach()))
    bad.append(_close("input grad", sctx.gather(xl.grad), xs.grad))
    gscale = max([1.0] + [float(p.grad.abs().max()) for p in serial.parameters() if p.grad is not None])
    for (name, p_ser), p_sp in zip(serial.named_parameters(), model.parameters()):
        bad.append(_close(f"grad {name}", p_sp.grad, p_ser.grad, gscale * opts.get("grad_noise", 1.0)))
    for (name, b_ser), b_sp in zip(serial.named_buffers(), model.buffers()):
        if b_ser.is_floating_point():
            bad.append(_close(f"buffer {name}", b_sp, b_ser))
        elif not torch.equal(b_ser, b_sp):
            bad.append(f"buffer {name}: {b_sp} != {b_ser}")
    if opts.get("route") is not None:
        bad += _route_check(spatial, opts["route"])
    if [n for n, _ in serial.state_dict().items()] != [n for n, _ in spatial.state_dict().items()][:len(serial.state_dict())] \
            and end is None:
        bad.append(f"state dict keys differ: {list(spatial.state_dict())[:6]}...")
    return [b for b in bad if b]


def _route_check(spatial: nn.Module, route: str) -> list[str]:
    """Every convolution and pool of this rank that exchanges halos took ``route`` ("linear": the
    no-copy route of gems.spatial.halo, "window": assembled windows), so the case tests what it says."""
    from gems.spatial.geometry import is_empty
    from gems.spatial.layers.window import WindowLayer

    took = []
    for m in spatial.modules():
        if isinstance(m, WindowLayer):
            for _, p, box, _, _, r in m.__dict__.get("_plans", {}).values():
                if not p.quiet and not is_empty(box):
                    took.append((m.label, "window" if r is None else "linear"))
    if not took:
        return [f"route {route}: no layer exchanged halos"]
    return [f"route: {label} took the {r} route, not the {route} one" for label, r in took if r != route]


EXTRA_CASES = {"layers": ["bn_local[S22]"], "models": ["cosmoflow_from_mesh[R2xS2]"], "cubes": []}


def _bn_local(rank: int, groups: dict[str, Any]) -> list[str]:
    """bn_stats="local": each part normalises with its own statistics (the serial layer on the part)."""
    sctx = context_for(rank, "S22", groups)
    assert sctx is not None
    torch.manual_seed(5)
    bn = nn.BatchNorm3d(2)
    serial = copy.deepcopy(bn)
    spatial = apply_spatial(nn.Sequential(bn), sctx, None, bn_stats="local")
    x = torch.randn(D3, generator=torch.Generator().manual_seed(3))
    xl = sctx.scatter(x)
    bad = [_close("local-statistics output", spatial(xl), serial(xl))]
    full = sctx.gather(spatial(xl).detach())
    if torch.allclose(full, nn.BatchNorm3d(2)(x), atol=1e-3):
        bad.append("local statistics equal the global ones: the test shows nothing")
    return [b for b in bad if b]


def _from_mesh(rank: int, world: int) -> list[str]:
    """A context built from an R=2 x S=2 mesh runs CosmoFlow exactly."""
    from gems.mesh import Mesh

    mesh = Mesh(replicas=2, pipeline=1, parts=(2,), spatial_dims=(0,), world_size=world)
    mesh.build_groups(rank)
    sctx = SpatialContext.from_mesh(mesh, rank)
    build, shape, _, opts = model_cases()["cosmoflow"]
    return run_case(build, shape, sctx, opts)


COMM = "comm log"  # the key under which cases_world returns what the rank issued (gems.commlog)
RAN = "cases run"  # the key under which cases_world returns the cases this rank ran (a case no rank ran fails)


def cases_world(rank: int, world: int, which: str, only: list[str] | None = None) -> dict[str, Any]:
    """Run every case of ``which`` ("layers", "models": 4 ranks; "cubes": 8 ranks); return failures
    of this rank by case, and under :data:`COMM` every message and collective it issued, in order."""
    from gems.commlog import Recorder

    recorder = Recorder(device=torch.device("cpu"))
    ran: list[str] = []
    with recorder:
        out: dict[str, Any] = _cases_world(rank, world, which, only, ran)
    out[COMM] = recorder.events
    out[RAN] = ran
    return out


def _cases_world(rank: int, world: int, which: str, only: list[str] | None, ran: list[str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    cases = {"layers": LAYER_CASES, "cubes": CUBE_CASES}.get(which) or model_cases()
    groups = make_groups(world)
    out: dict[str, str] = {}
    extra = _bn_local(rank, groups) if which == "layers" else _from_mesh(rank, world) if which == "models" else []
    if extra:
        out[EXTRA_CASES[which][0]] = f"rank {rank}: " + "\n".join(extra)
    if which in EXTRA_CASES:
        ran.extend(EXTRA_CASES[which])
    for name, (build, shape, lays, opts) in cases.items():
        for lay in lays:
            if only is not None and f"{name}[{lay}]" not in only and name not in only:
                continue
            sctx = context_for(rank, lay, groups, opts.get("overlap", True))
            if lay.startswith("S3"):  # rank 3 sits out; keep every rank's collectives in step
                dist.barrier()
            if sctx is None:
                continue
            ran.append(f"{name}[{lay}]")
            try:
                bad = run_case(build, shape, sctx, opts)
            except Exception as e:  # the group is out of step now: stop here, naming the case
                raise RuntimeError(f"case {name}[{lay}] raised on rank {rank}") from e
            if bad:
                out[f"{name}[{lay}]"] = f"rank {rank}: " + "\n".join(bad)
    return out
