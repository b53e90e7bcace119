"""What every spatial layer shares: the base class, zeros that stay in the autograd graph, the marker of a
whole activation, and the hook that tags the outputs of converted containers with their global shape.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from gems.shapes import GSHAPE
from gems.spatial.context import SpatialContext


class _Zeros(torch.autograd.Function):
    """Zeros of ``shape`` that depend on ``deps`` (zero gradients flow back to them)."""

    @staticmethod
    def forward(ctx: Any, shape: tuple[int, ...], *deps: torch.Tensor) -> torch.Tensor:
        ctx.metas = [(d.shape, d.dtype, d.device) for d in deps]
        return deps[0].new_zeros(shape)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return (None, *[torch.zeros(s, dtype=t, device=dev) for s, t, dev in ctx.metas])


def zeros_out(shape: Sequence[int], *deps: torch.Tensor | None) -> torch.Tensor:
    return _Zeros.apply(tuple(int(s) for s in shape), *[d for d in deps if d is not None])


def ntuple(v: Any, nd: int) -> tuple[int, ...]:
    """``v`` per spatial dim: a tuple or list as ints, a scalar repeated ``nd`` times."""
    return tuple(int(a) for a in v) if isinstance(v, (tuple, list)) else (int(v),) * nd


class SpatialLayer(nn.Module):
    """Base of the spatial layers: the context and a label for halo timings."""

    def __init__(self, sctx: SpatialContext, label: str) -> None:
        super().__init__()
        self.sctx = sctx
        self.label = label
        self.tag = sctx.new_tag()

    def _adopt(self, layer: nn.Module, params: Sequence[str] = (), buffers: Sequence[str] = ()) -> None:
        """Register ``layer``'s own parameter and buffer objects under the same names."""
        for name in params:
            self.register_parameter(name, getattr(layer, name, None))
        for name in buffers:
            self.register_buffer(name, getattr(layer, name, None), persistent=name not in layer._non_persistent_buffers_set)


#: the attribute that says an activation is complete and the same on every part (after a global pooling)
WHOLE = "_gems_whole"


def tag_output(sctx: SpatialContext, cache: dict[tuple[int, ...], tuple[int, ...]], module: nn.Module,
               args: tuple[Any, ...], out: Any) -> None:
    """Forward hook of converted containers: tag the output with its global shape.

    The global output shape is a function of the global input shape, the same
    on every rank, so the one all-reduce that finds it happens on every rank
    at the same call and never again.
    """
    if not isinstance(out, torch.Tensor) or getattr(out, GSHAPE, None) is not None or not args:
        return
    gin = getattr(args[0], GSHAPE, None)
    if gin is None:
        return
    if gin in cache:
        sctx.mark(out, cache[gin])
    else:
        cache[gin] = sctx.global_shape(out)


tag_output.shape_neutral = True  # type: ignore[attr-defined]  # it tags, never reshapes: shape memos may replay it


LayerFactory = Callable[[nn.Module, SpatialContext, str], nn.Module]
