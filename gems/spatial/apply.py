"""``apply_spatial``: a model's layers, converted one for one to their spatial versions.

The converted sequence has the same layers in the same order (nested
``nn.Sequential`` and registered residual containers converted recursively),
holding the same parameter objects under the same names, plus one gather
layer inserted before ``spatial_end``. What it does not know how to
partition is a :class:`gems.errors.ConfigError` naming the layer, never a
silently wrong result.
"""
from __future__ import annotations

import copy
import functools
from collections import OrderedDict
from typing import Any

from torch import nn

from gems.errors import ConfigError
from gems.models.layers import SampleDropout
from gems.spatial import layers as L
from gems.spatial.context import SpatialContext

POINTWISE: tuple[type, ...] = (
    nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish, nn.Hardsigmoid, nn.Softplus, nn.Softsign,
    nn.Tanhshrink, nn.LogSigmoid, nn.Threshold, nn.Dropout, nn.AlphaDropout,
)
_EXTRA_POINTWISE: list[type] = []
_CONTAINERS: list[type] = []

SUPPORTED = ("Conv1d/2d/3d, ConvTranspose1d/2d/3d, MaxPool1d/2d/3d, AvgPool1d/2d/3d, BatchNorm1d/2d/3d, "
             "GroupNorm, InstanceNorm (no running stats), Upsample, element-wise activations and dropout, "
             "SampleDropout, Softmax/LogSoftmax over channels, nn.Sequential, skip stash/concat/add, registered "
             "residual blocks; Flatten and Linear only after the gather (model.spatial_end)")


def register_pointwise(cls: type) -> type:
    """Declare a parameter-free layer that acts on each cell independently (usable as a decorator)."""
    _EXTRA_POINTWISE.append(cls)
    return cls


def register_container(cls: type) -> type:
    """Declare a block whose forward combines its children with element-wise
    operations only (a residual block: ``f(x) + g(x)``); its children are converted."""
    _CONTAINERS.append(cls)
    return cls


def _known_pointwise() -> tuple[type, ...]:
    extra: list[type] = []
    try:
        from gems.models.cosmoflow import Scale
        extra.append(Scale)
    except ImportError:  # pragma: no cover
        pass
    try:
        from gems.models.unet3d import PopAdd, PopConcat, Stash
        extra += [Stash, PopConcat, PopAdd]
    except ImportError:  # pragma: no cover
        pass
    return POINTWISE + tuple(extra) + tuple(_EXTRA_POINTWISE)


def _known_containers() -> tuple[type, ...]:
    extra: list[type] = []
    try:
        from gems.models.resnet import PreActBottleneck
        extra.append(PreActBottleneck)
    except ImportError:
        pass
    return tuple(extra) + tuple(_CONTAINERS)


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
    def __init__(self, sctx: SpatialContext, bn_stats: str, nd: int) -> None:
        self.sctx, self.bn_stats, self.nd = sctx, bn_stats, nd
        self.pointwise = _known_pointwise()
        self.containers = _known_containers()

    def refuse(self, m: nn.Module, label: str, fix: str = "") -> ConfigError:
        """Bad input naming the layer (its index in the model and what it is) and what would work."""
        text = repr(m).replace("\n", " ")
        text = text if len(text) < 80 else text[:77] + "..."
        return ConfigError("model", f"layer {label.split(':')[0]} {text}",
                           (fix + "; or " if fix else "") + f"a layer gems can partition: {SUPPORTED}")

    def __call__(self, m: nn.Module, label: str) -> nn.Module:
        new = self.convert(m, label)
        new.training = m.training
        return new

    def convert(self, m: nn.Module, label: str) -> nn.Module:
        s = self.sctx
        nd = _ndim_of(m) or self.nd
        if isinstance(m, nn.Sequential):
            return nn.Sequential(OrderedDict((name, self(c, f"{label}.{name}")) for name, c in m.named_children()))
        if isinstance(m, self.containers):
            return self.container(m, label)
        if isinstance(m, nn.modules.conv._ConvTransposeNd):
            return L.SpatialConvTranspose(m, s, label)
        if isinstance(m, nn.modules.conv._ConvNd):
            if m.padding_mode != "zeros":
                raise self.refuse(m, label, "padding_mode='zeros' (the only padding the halo exchange reproduces)")
            return L.SpatialConv(m, s, label)
        if isinstance(m, nn.modules.pooling._MaxPoolNd):
            if m.return_indices:
                raise self.refuse(m, label, "return_indices=False")
            return L.SpatialMaxPool(m, s, label, nd)
        if isinstance(m, nn.modules.pooling._AvgPoolNd):
            return L.SpatialAvgPool(m, s, label, nd)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            return L.SpatialNorm(m, s, label) if self.bn_stats == "global" else _LocalNorm(m, s, label)
        if isinstance(m, nn.GroupNorm):
            return L.SpatialNorm(m, s, label)
        if isinstance(m, nn.modules.instancenorm._InstanceNorm):
            if m.track_running_stats:
                raise self.refuse(m, label, "InstanceNorm with track_running_stats=False")
            return L.SpatialNorm(m, s, label)
        if isinstance(m, nn.Upsample):
            if m.mode not in ("nearest", "nearest-exact", "linear", "bilinear", "trilinear"):
                raise self.refuse(m, label, "Upsample mode nearest, nearest-exact, linear, bilinear or trilinear")
            return L.SpatialUpsample(m, s, label)
        if isinstance(m, nn.PReLU):
            return L.SpatialPReLU(m, s, label)
        if isinstance(m, (nn.Softmax, nn.LogSoftmax)) and m.dim == 1:
            return L.SpatialPointwise(m, s, label)
        if isinstance(m, SampleDropout):
            return L.SpatialSampleDropout(m, s, label)
        if isinstance(m, self.pointwise) and not list(m.parameters(recurse=False)):
            return L.SpatialPointwise(m, s, label)
        if isinstance(m, (nn.Flatten, nn.Linear)):
            top = label.split(":")[0].split(".")[0]
            raise self.refuse(m, label, f"model.spatial_end <= {top} (it needs the whole sample: gather before it)")
        raise self.refuse(m, label)

    def container(self, m: nn.Module, label: str) -> nn.Module:
        """A copy of ``m`` sharing its parameters, with converted children and a tagging hook."""
        new = copy.copy(m)
        new.__dict__ = {k: (copy.copy(v) if isinstance(v, dict) else v) for k, v in m.__dict__.items()}
        for name, child in m.named_children():
            new._modules[name] = self(child, f"{label}.{name}")
        new.register_forward_hook(functools.partial(L.tag_output, self.sctx, {}))
        return new


class _LocalNorm(L.SpatialLayer):
    """BatchNorm with per-part statistics (``bn_stats="local"``): the serial layer on the part."""

    def __init__(self, norm: nn.Module, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        self._adopt(norm, ("weight", "bias"), ("running_mean", "running_var", "num_batches_tracked"))
        self.eps, self.momentum, self.track = norm.eps, norm.momentum, norm.track_running_stats

    def forward(self, x: Any) -> Any:
        import torch.nn.functional as F

        g = getattr(x, L.GSHAPE, None)
        f = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            f = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        keep = not self.training or self.track
        y = F.batch_norm(x, self.running_mean if keep else None, self.running_var if keep else None,
                         self.weight, self.bias, use_batch, f, self.eps)
        return self.sctx.mark(y, g) if g is not None else y


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
    out: list[nn.Module] = [conv(m, f"{names[i]}:{type(m).__name__}") for i, m in enumerate(layers[:end])]
    if spatial_end is not None:
        out.append(L.SpatialGather(ctx, "gather"))
        out += layers[end:]
    spatial = nn.Sequential(*out)
    spatial.training = seq.training
    return spatial
