"""Which layer types the spatial converter knows, one registration each (docs/parallelism.md, "Adding a layer type").

The converter (:func:`gems.spatial.apply_spatial`) asks this registry and never imports the models; this module
imports nothing of gems, so a model registers its own layer types where it defines them without loading the spatial
strategy (a model cut by a pipeline alone never does).
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
    a rule ``(layer, converter, label) -> spatial layer``, or ``POINTWISE`` / ``CONTAINER``. A rule is given the
    converter's spatial context (``conv.sctx``) and BatchNorm choice (``conv.bn_stats``), and raises
    :class:`CannotCut` saying why where it cannot cut the layer (a layer with no rule cannot be cut either)."""
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
