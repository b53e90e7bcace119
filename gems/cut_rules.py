"""Which layer types the spatial converter knows, one registration each.

The spatial converter (:func:`gems.spatial.apply_spatial`) never imports the
models: it asks this registry. gems registers torch's layers
(``gems/spatial/apply.py``); each model module registers its own layer types
where it defines them (CosmoFlow's ``Scale``, the U-Net's skip layers, the
ResNet block), and a user registers theirs the same way::

    from gems.spatial import register_layer, register_pointwise, register_container

    register_pointwise(MyActivation)            # acts on each cell alone, no parameters
    register_container(MyResidualBlock)         # f(x) + g(x): its children are converted
    register_layer(MyLayer, lambda m, conv, label: MySpatialLayer(m, conv.sctx, label))

A rule receives the layer, the converter (``conv.sctx`` is the spatial context,
``conv.bn_stats`` the BatchNorm choice) and a label, and returns the layer's
spatial version, or raises :class:`CannotCut` saying why; a layer with no rule
cannot be cut either. Where a layer cannot be cut, gems gathers the activation
before it and runs the rest of the model whole on every part (the record says
so). This module imports nothing of gems and lies below every strategy, so any model can import it without
loading the spatial strategy (a model cut by a pipeline alone never does).
"""
from __future__ import annotations

from typing import Any, Callable

from torch import nn

POINTWISE = "pointwise"
CONTAINER = "container"

Rule = Callable[[nn.Module, Any, str], nn.Module]

_RULES: dict[type, Rule | str] = {}


class CannotCut(Exception):
    """A layer the spatial converter cannot cut into parts, and what would make it cuttable."""

    def __init__(self, why: str = "") -> None:
        self.why = why
        super().__init__(why)


def register_layer(cls: type, rule: Rule | str) -> type:
    """Register how layers of type ``cls`` (and its subclasses, unless they register their own) are cut:
    a rule ``(layer, converter, label) -> spatial layer``, or ``POINTWISE`` / ``CONTAINER``."""
    _RULES[cls] = rule
    return cls


def register_pointwise(cls: type) -> type:
    """Declare a parameter-free layer that acts on each cell independently (usable as a decorator)."""
    return register_layer(cls, POINTWISE)


def register_container(cls: type) -> type:
    """Declare a block whose forward combines its children with element-wise operations only (a residual
    block: ``f(x) + g(x)``); its children are converted (usable as a decorator)."""
    return register_layer(cls, CONTAINER)


def rule_for(m: nn.Module) -> Rule | str | None:
    """The rule of the most specific registered class of ``m`` (its own, else its nearest base's)."""
    for cls in type(m).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    return None


def registered() -> list[type]:
    return list(_RULES)
