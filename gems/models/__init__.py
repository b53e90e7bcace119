"""Models: every model is a flat ``nn.Sequential`` plus what gems must know about it (input and target shapes,
loss, where the spatial trunk ends: :class:`ModelSpec`), registered by the module that defines it
(:mod:`gems.models.registry`).

``build_model(section(cfg, "model"))`` is the one entry point (it takes the typed section); ``model=custom``
(gems/models/custom.py) imports any callable named by ``model._target_`` that returns an ``nn.Sequential``.
"""
from __future__ import annotations

from typing import Any, Mapping

from gems.config import ModelConf, check_section, section
from gems.errors import ConfigError
from gems.models.registry import ModelKind, ModelSpec, first_flatten, register_model, registered, sized

__all__ = ["ModelSpec", "ModelKind", "build_model", "check_shapes", "first_flatten", "register_model", "registered",
           "sized"]


def check_shapes(spec: ModelSpec) -> None:
    """Trace the model layer by layer on meta tensors of its declared input (one sample, no memory, no
    compute); a layer that cannot take what reaches it, or an output that does not fit the targets, is a
    ConfigError naming the key to change, before any rank starts."""
    import copy

    import torch

    key, shape = spec.shape_key, spec.shape_value
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


def build_model(model: ModelConf | Mapping[str, Any]) -> ModelSpec:
    """Build the model named by ``model.name`` from the typed ``model`` section (``section(cfg, "model")``: an
    instance of the model's own dataclass, :attr:`ModelKind.options`), every key with its one default there. A
    mapping, a DictConfig or a section of another schema (the Python API: ``build_model({"name": "cosmoflow",
    "size": 32})``) is typed here, once, against the model's; either way each key is checked against its
    declaration (choices, bounds) before the builder sees it."""
    import dataclasses

    from gems.models.registry import find, names_text

    kind = find(model)
    if kind is None:
        name = model.name if isinstance(model, ModelConf) else model.get("name")
        raise ConfigError("model.name", name, names_text())
    if type(model) is kind.options:
        m: ModelConf = model  # type: ignore[assignment]
    else:
        node = dataclasses.asdict(model) if isinstance(model, ModelConf) else model
        m = section({"model": node}, "model")
    check_section("model", m)
    return kind.build(m)
