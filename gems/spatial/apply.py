"""``apply_spatial``: a model's layers converted one for one to their spatial versions, by the registered rules.

The same layers in the same order (nested ``nn.Sequential`` and registered containers converted recursively), the same
parameter objects under the same names, plus one gather before ``spatial_end``. A layer it cannot cut is a
:class:`gems.errors.ConfigError` naming the layer, never a silently wrong result.
"""
from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from typing import Any

from torch import nn

from gems.cut_rules import (
    CONTAINER,
    POINTWISE,
    CannotCut,
    register_container,
    register_layer,
    register_pointwise,
    rule_for,
)
from gems.errors import ConfigError
from gems.layers import SampleDropout
from gems.shapes import GSHAPE
from gems.spatial.context import SpatialContext
from gems.spatial.layers.base import SpatialLayer, tag_output
from gems.spatial.layers.conv import SpatialConv
from gems.spatial.layers.gather import SpatialGather
from gems.spatial.layers.norm import SpatialNorm
from gems.spatial.layers.pointwise import SpatialPointwise, SpatialPReLU, SpatialSampleDropout
from gems.spatial.layers.pool import SpatialAvgPool, SpatialGlobalAvgPool, SpatialGlobalMaxPool, SpatialMaxPool
from gems.spatial.layers.transpose import SpatialConvTranspose
from gems.spatial.layers.upsample import SpatialUpsample

POINTWISE_TYPES: tuple[type, ...] = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign,
    nn.Tanhshrink, nn.LogSigmoid, nn.Threshold, nn.Dropout, nn.AlphaDropout,
)

SUPPORTED = ("Conv1d/2d/3d, ConvTranspose1d/2d/3d, MaxPool1d/2d/3d, AvgPool1d/2d/3d, AdaptiveAvgPool/"
             "AdaptiveMaxPool with output size 1, BatchNorm1d/2d/3d, GroupNorm, InstanceNorm (no running stats), "
             "Upsample, element-wise activations and dropout, SampleDropout, Softmax/LogSoftmax over channels, "
             "nn.Sequential and registered layers (gems.spatial.register_layer)")

__all__ = ["apply_spatial", "gather_point", "register_layer", "register_pointwise", "register_container", "SUPPORTED"]


def _ndim_of(m: nn.Module) -> int | None:
    """Spatial dims a layer works on, where its type says."""
    if isinstance(m, nn.modules.conv._ConvNd):
        return m.weight.dim() - 2
    name = type(m).__name__
    if name[-2:] in ("1d", "2d", "3d") and isinstance(m, (nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
                                                          nn.modules.batchnorm._BatchNorm,
                                                          nn.modules.instancenorm._InstanceNorm)):
        return int(name[-2])
    for child in m.children():
        nd = _ndim_of(child)
        if nd is not None:
            return nd
    return None


class _Converter:
    """Turns layers into their spatial versions by their registered rules (:mod:`gems.cut_rules`)."""

    def __init__(self, sctx: SpatialContext, bn_stats: str, nd: int) -> None:
        self.sctx, self.bn_stats, self.nd = sctx, bn_stats, nd
        self.trunk_ends = False  # set by a layer whose output is whole on every part (a global pooling)
        self.index = 0  # the top-level layer being converted (what model.spatial_end counts)

    def __call__(self, m: nn.Module, label: str) -> nn.Module:
        new = self.convert(m, label)
        new.training = m.training
        return new

    def convert(self, m: nn.Module, label: str) -> nn.Module:
        if isinstance(m, nn.Sequential):
            return nn.Sequential(OrderedDict((name, self(c, f"{label}.{name}")) for name, c in m.named_children()))
        rule = rule_for(m)
        if rule is None:
            raise CannotCut("")
        if rule == POINTWISE:
            if list(m.parameters(recurse=False)):
                raise CannotCut("a pointwise layer without parameters")
            return SpatialPointwise(m, self.sctx, label)
        if rule == CONTAINER:
            return self.container(m, label)
        assert callable(rule)
        return rule(m, self, label)

    def container(self, m: nn.Module, label: str) -> nn.Module:
        """A copy of ``m`` sharing its parameters, with converted children and a tagging hook."""
        new = copy.copy(m)
        new.__dict__ = {k: (copy.copy(v) if isinstance(v, dict) else v) for k, v in m.__dict__.items()}
        for name, child in m.named_children():
            new._modules[name] = self(child, f"{label}.{name}")
        new.register_forward_hook(functools.partial(tag_output, self.sctx, {}))
        return new


# ---- torch's layers -------------------------------------------------------------------------------------------
def _conv(m: Any, c: _Converter, label: str) -> nn.Module:
    if m.padding_mode != "zeros":
        raise CannotCut("padding_mode='zeros' (the only padding the halo exchange reproduces)")
    return SpatialConv(m, c.sctx, label)


def _max_pool(m: Any, c: _Converter, label: str) -> nn.Module:
    if m.return_indices:
        raise CannotCut("return_indices=False")
    return SpatialMaxPool(m, c.sctx, label, _ndim_of(m) or c.nd)


def _batch_norm(m: Any, c: _Converter, label: str) -> nn.Module:
    return SpatialNorm(m, c.sctx, label) if c.bn_stats == "global" else _LocalNorm(m, c.sctx, label)


def _instance_norm(m: Any, c: _Converter, label: str) -> nn.Module:
    if m.track_running_stats:
        raise CannotCut("InstanceNorm with track_running_stats=False")
    return SpatialNorm(m, c.sctx, label)


def _upsample(m: Any, c: _Converter, label: str) -> nn.Module:
    if m.mode not in ("nearest", "nearest-exact", "linear", "bilinear", "trilinear"):
        raise CannotCut("Upsample mode nearest, nearest-exact, linear, bilinear or trilinear")
    return SpatialUpsample(m, c.sctx, label)


def _softmax(m: Any, c: _Converter, label: str) -> nn.Module:
    if m.dim != 1:
        raise CannotCut("Softmax/LogSoftmax over the channels (dim=1)")
    return SpatialPointwise(m, c.sctx, label)


def _global_pool(kind: Any) -> Any:
    def rule(m: Any, c: _Converter, label: str) -> nn.Module:
        size = m.output_size if isinstance(m.output_size, (tuple, list)) else (m.output_size,)
        if any(s != 1 for s in size if s is not None) or None in size:
            raise CannotCut("output_size=1 (a global pooling; other adaptive sizes need the whole sample)")
        if getattr(m, "return_indices", False):
            raise CannotCut("return_indices=False")
        c.trunk_ends = True  # the output is whole on every part: the spatial trunk ends here
        return kind(c.sctx, label)
    return rule


def _needs_whole(m: Any, c: _Converter, label: str) -> nn.Module:
    raise CannotCut(f"model.spatial_end <= {c.index} (the layer needs the whole sample)")


for _t, _rule in [
    (nn.modules.conv._ConvTransposeNd, lambda m, c, label: SpatialConvTranspose(m, c.sctx, label)),
    (nn.modules.conv._ConvNd, _conv),
    (nn.modules.pooling._MaxPoolNd, _max_pool),
    (nn.modules.pooling._AvgPoolNd, lambda m, c, label: SpatialAvgPool(m, c.sctx, label, _ndim_of(m) or c.nd)),
    (nn.modules.pooling._AdaptiveAvgPoolNd, _global_pool(SpatialGlobalAvgPool)),
    (nn.modules.pooling._AdaptiveMaxPoolNd, _global_pool(SpatialGlobalMaxPool)),
    (nn.modules.batchnorm._BatchNorm, _batch_norm),
    (nn.GroupNorm, lambda m, c, label: SpatialNorm(m, c.sctx, label)),
    (nn.modules.instancenorm._InstanceNorm, _instance_norm),
    (nn.Upsample, _upsample),
    (nn.PReLU, lambda m, c, label: SpatialPReLU(m, c.sctx, label)),
    (nn.Softmax, _softmax),
    (nn.LogSoftmax, _softmax),
    (SampleDropout, lambda m, c, label: SpatialSampleDropout(m, c.sctx, label)),
    (nn.Flatten, _needs_whole),
    (nn.Linear, _needs_whole),
]:
    register_layer(_t, _rule)
for _t in POINTWISE_TYPES:
    register_pointwise(_t)


class _LocalNorm(SpatialLayer):
    """BatchNorm with per-part statistics (``bn_stats="local"``): the serial layer on the part."""

    def __init__(self, norm: nn.Module, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        self._adopt(norm, ("weight", "bias"), ("running_mean", "running_var", "num_batches_tracked"))
        self.eps, self.momentum, self.track = norm.eps, norm.momentum, norm.track_running_stats

    def forward(self, x: Any) -> Any:
        import torch.nn.functional as F

        g = getattr(x, GSHAPE, None)
        f = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            f = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track
        y = F.batch_norm(x, self.running_mean if keep else None, self.running_var if keep else None,
                         self.weight, self.bias, use_batch, f, self.eps)
        return self.sctx.mark(y, g) if g is not None else y


def _describe(m: nn.Module) -> str:
    text = repr(m).replace("\n", " ")
    return text if len(text) < 80 else text[:77] + "..."


def gather_point(seq: nn.Sequential, spatial_end: int | None, parts: Any, dims: Any,
                 bn_stats: str = "global", gather_uncut: bool = True) -> tuple[int | None, str | None]:
    """Where the spatial trunk of ``seq`` really ends, and why when it is not ``spatial_end``.

    The layers before ``spatial_end`` (all of them when it is None) are converted in order on a stand-in
    context: the first layer gems cannot cut ends the trunk before it (the activation is gathered there
    and the rest runs whole on every part); a global pooling ends it after itself (its output is already
    whole). Returns ``(end, note)``: ``end`` is ``spatial_end`` itself when every layer before it is cut,
    with ``note`` None. Without ``gather_uncut`` (``parallel.gather_uncut=false``, the run's default) a layer that
    cannot be cut is refused, naming it: gathered silently, a block gems does not know would run whole on every
    part, and a check against one process would pass while nothing was cut.
    """
    layers = list(seq)
    end = len(layers) if spatial_end is None else int(spatial_end)
    n = 1
    for p in parts:
        n *= int(p)
    sctx = SpatialContext(None, list(range(n)), tuple(parts), tuple(dims), (0,) * len(tuple(parts)))
    nd = next((k for k in (_ndim_of(m) for m in layers[:end]) if k is not None), 1)
    conv = _Converter(sctx, bn_stats, nd)
    names = list(seq._modules.keys())
    for i, m in enumerate(layers[:end]):
        conv.index = i
        try:
            conv(m, f"{names[i]}:{type(m).__name__}")
        except CannotCut as e:
            why = f": {e.why}" if e.why else f" (gems cuts {SUPPORTED})"
            if not gather_uncut:
                raise ConfigError("parallel.gather_uncut", False,
                                  f"true to gather the activation before layer {i} and run layers {i}.. whole on "
                                  f"every part, or a rule that cuts it (gems.spatial.register_layer, "
                                  f"register_container): layer {i} {_describe(m)} cannot be cut into parts{why}")
            return i, (f"layer {i} {_describe(m)} cannot be cut into parts{why}; the activation is gathered "
                       f"before it and layers {i}.. run whole on every part (parallel.gather_uncut=true)")
        if conv.trunk_ends:
            if i + 1 == end:
                return end, None
            return i + 1, (f"layer {i} {_describe(m)} is a global pooling: its output is whole on every part, "
                           f"so the trunk ends after it")
    return spatial_end, None


def apply_spatial(seq: nn.Sequential, ctx: SpatialContext, spatial_end: int | None = None,
                  bn_stats: str = "global") -> nn.Sequential:
    """The spatial version of ``seq``: takes this rank's part of the input.

    Layers before ``spatial_end`` become their spatial versions (same
    parameter objects); a gather is inserted before ``spatial_end`` and the
    layers from there on run unchanged on the full activation. With
    ``spatial_end=None`` the output stays partitioned. Parameter gradients
    are this rank's share: the caller sums them over the spatial group.
    ``bn_stats``: ``"global"`` (statistics over the whole sample, exact) or
    ``"local"`` (per part).
    """
    if bn_stats not in ("global", "local"):
        raise ConfigError("parallel.bn_stats", bn_stats, "global or local")
    layers = list(seq)
    end = len(layers) if spatial_end is None else int(spatial_end)
    if not 0 <= end <= len(layers):
        raise ConfigError("spatial_end", spatial_end, f"a layer index in 0..{len(layers)}")
    nd = next((n for n in (_ndim_of(m) for m in layers[:end]) if n is not None), None)
    if nd is not None:
        ctx.check_ndim(nd)
    conv = _Converter(ctx, bn_stats, nd or 1)
    names = list(seq._modules.keys())
    out: list[nn.Module] = []
    for i, m in enumerate(layers[:end]):
        conv.index = i
        try:
            out.append(conv(m, f"{names[i]}:{type(m).__name__}"))
        except CannotCut as e:  # callers that want the automatic gather ask gather_point first
            raise ConfigError("model", f"layer {i} {_describe(m)}", (e.why + "; or " if e.why else "")
                              + f"a layer gems can partition: {SUPPORTED}") from None
    if spatial_end is not None:
        out.append(SpatialGather(ctx, "gather", whole=conv.trunk_ends))
        out += layers[end:]
    spatial = nn.Sequential(*out)
    spatial.training = seq.training
    return spatial
