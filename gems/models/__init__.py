"""Model registry: every model is a flat ``nn.Sequential`` plus what gems must
know about it (input and target shapes, loss, where the spatial trunk ends).

``build_model(section(cfg, "model"))`` is the one entry point (it takes the typed section); ``model=custom``
imports any callable named by ``model._target_`` that returns an ``nn.Sequential``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from torch import nn

from gems.config import ModelConf, section
from gems.errors import ConfigError


@dataclass
class ModelSpec:
    """A model and its contract with the data and the loss.

    ``target`` is ``"vector"`` (one vector of ``num_outputs`` per sample,
    e.g. CosmoFlow's 4 parameters) or ``"dense"`` (one class per voxel, shaped
    like the input's spatial dims, e.g. U-Net). ``spatial_end`` is the index of
    the first layer that needs the whole sample (spatial parallelism gathers
    the activation before it); None when the model is spatial to the end.
    """

    module: nn.Sequential
    name: str
    input_shape: tuple[int, ...]  # (C, *spatial)
    num_outputs: int
    loss: str  # "mse" | "cross_entropy"
    target: str = "vector"
    spatial_end: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def spatial_ndim(self) -> int:
        return len(self.input_shape) - 1


def check_shapes(spec: ModelSpec) -> None:
    """Trace the model layer by layer on meta tensors of its declared input (one sample, no memory, no
    compute); a layer that cannot take what reaches it, or an output that does not fit the targets, is a
    ConfigError naming the key to change, before any rank starts."""
    import copy

    import torch

    key = "model.input_shape" if spec.name == "custom" else "model.size"
    shape = list(spec.input_shape) if spec.name == "custom" else spec.input_shape[1]
    seq = copy.deepcopy(spec.module).to("meta").eval()
    x = torch.empty((1, *spec.input_shape), device="meta")
    for i, layer in enumerate(seq):
        try:
            x = layer(x)
        except Exception as e:  # the layer's own words say what it expected
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(key, shape, f"an input shape that every layer accepts: layer {i} "
                              f"({type(layer).__name__}) received {list(x.shape)} and said: {msg[:200]}") from None
    if not isinstance(x, torch.Tensor):
        raise ConfigError("model._target_", spec.name, f"a model whose output is a tensor (it returns {type(x).__name__})")
    if spec.target == "vector":
        if x.dim() != 2 or x.shape[1] != spec.num_outputs:
            raise ConfigError("model.num_outputs", spec.num_outputs, f"{x.shape[1] if x.dim() == 2 else 'a flat output'}: "
                              f"the model's output for one sample has shape {list(x.shape)} (batch, outputs)")
    else:
        if x.dim() != len(spec.input_shape) + 1 or tuple(x.shape[2:]) != tuple(spec.input_shape[1:]):
            raise ConfigError("model.target", "dense", f"vector, or a model whose output keeps the input's spatial "
                              f"shape {list(spec.input_shape[1:])} (it gives {list(x.shape[2:])})")


def _first_flatten(seq: nn.Sequential) -> int | None:
    for i, layer in enumerate(seq):
        if isinstance(layer, nn.Flatten):
            return i
    return None


def _sized(name: str, allowed: str, fn: Callable[..., nn.Sequential], size: int, **kw: Any) -> nn.Sequential:
    try:
        return fn(size=size, **kw)
    except ValueError:
        raise ConfigError("model.size", size, allowed) from None


def build_model(model: ModelConf | Mapping[str, Any]) -> ModelSpec:
    """Build the model named by ``model.name`` from the typed ``model`` section (``section(cfg, "model")``): every
    key has its one default there, and a key left null (``model.norm``) means the model's own, the default of
    its builder in its module. A mapping or DictConfig (the Python API: ``build_model({"name": "cosmoflow",
    "size": 32})``) is typed here, once, against the same schema."""
    m: ModelConf = model if isinstance(model, ModelConf) else section({"model": model}, "model")
    name = m.name
    if name in ("cosmoflow", "cosmoflow_mlperf"):
        from gems.models import cosmoflow as cf

        fn = getattr(cf, name)
        kw: dict[str, Any] = dict(width=float(m.width), dropout=float(m.dropout))
        if name == "cosmoflow" and m.norm is not None:
            kw["norm"] = m.norm
        allowed = ("a power of two >= 32 (the paper uses 128, 256, 512)" if name == "cosmoflow"
                   else "a power of two >= 32 (MLPerf uses 128)")
        seq = _sized(name, allowed, fn, int(m.size), **kw)
        return ModelSpec(seq, name, (4, *[int(m.size)] * 3), 4, "mse", "vector", _first_flatten(seq))
    if name == "unet3d":
        try:
            from gems.models.unet3d import build_unet3d
        except ImportError:
            raise ConfigError("model", name,
                              "one of cosmoflow, cosmoflow_mlperf, resnet, custom (unet3d is not built yet)") from None
        return build_unet3d(m)
    if name == "resnet":
        try:
            from gems.models.resnet import build_resnet
        except ImportError:
            raise ConfigError("model", name,
                              "one of cosmoflow, cosmoflow_mlperf, unet3d, custom (resnet is not built yet)") from None
        return build_resnet(m)
    if name == "custom":
        return _build_custom(m)
    raise ConfigError("model", name, "one of cosmoflow, cosmoflow_mlperf, unet3d, resnet, custom")


def _build_custom(m: ModelConf) -> ModelSpec:
    target = m._target_
    if not target or "." not in str(target):
        raise ConfigError("model._target_", target,
                          "a dotted path to a callable returning nn.Sequential, e.g. mypkg.models.make_net")
    mod_name, _, attr = str(target).rpartition(".")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError("model._target_", target, f"an importable callable ({type(e).__name__}: {e})") from None
    kwargs = dict(m.kwargs or {})
    seq = fn(**kwargs)
    if not isinstance(seq, nn.Sequential):
        raise ConfigError("model._target_", target, f"a callable that returns nn.Sequential (it returned {type(seq).__name__})")
    shape = m.input_shape
    if not shape or len(shape) < 2:
        raise ConfigError("model.input_shape", shape, "[C, *spatial], e.g. [1, 32, 32]")
    if m.loss not in ("mse", "cross_entropy"):  # the Python API's mapping is typed, not checked against choices
        raise ConfigError("model.loss", m.loss, "mse or cross_entropy")
    if m.target not in ("vector", "dense"):
        raise ConfigError("model.target", m.target, "vector or dense")
    end = m.spatial_end  # null: gather before the first Flatten, if any
    return ModelSpec(seq, "custom", tuple(int(s) for s in shape), int(m.num_outputs), m.loss, m.target,
                     _first_flatten(seq) if end is None else int(end))
