"""``model=custom``: any callable named by ``model._target_`` that returns an ``nn.Sequential``, with its input
shape (``model.input_shape``), outputs, loss and target given by the user (its own keys: :class:`CustomConf`)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional

from torch import nn

from gems.config import ModelConf, key
from gems.errors import ConfigError
from gems.models.registry import ModelSpec, first_flatten, register_model


@dataclass
class CustomConf(ModelConf):
    """``model=custom``'s own keys."""

    _target_: Optional[str] = key(None, "dotted path of a callable returning nn.Sequential")
    kwargs: Any = key(None, "arguments of that callable, e.g. {n:8} (a mapping)")
    input_shape: Optional[list] = key(None, "[C, *spatial] of one sample")
    num_outputs: int = key(4, "outputs per sample (vector targets)", ge=1)
    loss: str = key("mse", "the loss", choices=("mse", "cross_entropy"))
    target: str = key("vector", "vector (one per sample) or dense (one class per voxel)", choices=("vector", "dense"))
    spatial_end: Optional[int] = key(None, "first layer that needs the whole sample (null: the first Flatten)", ge=0)


def build_custom(m: CustomConf) -> ModelSpec:
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
    end = m.spatial_end  # null: gather before the first Flatten, if any
    return ModelSpec(seq, "custom", tuple(int(s) for s in shape), int(m.num_outputs), m.loss, m.target,
                     first_flatten(seq) if end is None else int(end), shape_key="model.input_shape",
                     source_known=False)


def example(channels: int = 4, outputs: int = 4) -> nn.Sequential:
    """A small 3D network to start a ``model=custom`` from (``model._target_=gems.models.custom.example
    model.input_shape=[1,16,16,16]``): two convolutions, a pooling between, a global pooling, a dense head."""
    return nn.Sequential(nn.Conv3d(1, channels, 3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
                         nn.Conv3d(channels, channels, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1),
                         nn.Flatten(), nn.Linear(channels, outputs))


register_model("custom", build_custom, "any callable returning nn.Sequential (model._target_), with its input shape, "
               "outputs, loss and target given", "model.input_shape: [C, *spatial], 1D to 3D",
               {"_target_": "gems.models.custom.example", "input_shape": [1, 16, 16, 16], "num_outputs": 4},
               {"num_outputs": 1}, options=CustomConf)
