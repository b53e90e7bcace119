"""Which layers go to which pipeline partition: the one place a balance is decided (:func:`decide`), for the run and
for the planner alike, so that a run and its plan cut the model the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from gems.config import check_comm_cut
from gems.errors import ConfigError
from gems.pipeline.partition import (
    balance_by_comm,
    balance_by_cost,
    balance_by_memory,
    balance_by_time,
    check_balance,
    layer_costs,
    layer_times,
    nbytes,
    on_rank0,
    smallest_crossing,
    trace_shapes,
)
from gems.shapes import largest_part, split_bounds

__all__ = ["Cut", "decide", "spatial_balance"]


@dataclass(frozen=True)
class Cut:
    """The spatial cut a pipeline's layers run under: ``parts`` along spatial ``dims``, gathered before layer
    ``end`` of the serial model (None: the output stays cut)."""
    parts: tuple[int, ...]
    dims: tuple[int, ...]
    end: int | None


def decide(seq: nn.Sequential, stages: int, by: str, sample: tuple[int, ...] | None, *,
           given: Sequence[int] | None = None, cut: Cut | None = None, dtype: torch.dtype = torch.float32,
           device: torch.device | str | None = None) -> list[int]:
    """Layers per partition of ``seq`` in ``stages`` partitions.

    ``by``: memory, time or comm (``auto`` already resolved: :func:`gems.pipeline.partition.resolve_balance_by`);
    ``sample``: one micro-batch's input shape, batch first (None: count the layers out evenly); ``given``: a
    balance to check and keep; ``cut``: the spatial cut, under which ``seq`` is the serial model and the
    balance counts the gather as one more layer where ``cut.end`` is set; ``device``: where ``time`` measures
    (default: where the layers are). The rules in order: a balance given is checked and kept; one partition
    takes every layer; without a sample shape the layers are counted out evenly; a spatial cut balances the serial
    layers as each rank runs them (:func:`spatial_balance`); otherwise ``by`` on the layers themselves.
    """
    n = len(seq) + (1 if cut is not None and cut.end is not None else 0)
    if given is not None:
        return check_balance(given, n, stages)
    if stages == 1:
        return [n]
    if sample is None:
        return [n // stages + (1 if i < n % stages else 0) for i in range(stages)]
    if cut is not None:
        return spatial_balance(seq, stages, by, sample, cut.parts, cut.dims, cut.end, dtype,
                               "cpu" if device is None else device)
    if by == "memory":
        return balance_by_memory(seq, stages, sample, dtype)
    if by == "time":
        return balance_by_time(seq, stages, sample, device=device)
    if by == "comm":
        check_comm_cut(stages)
        return balance_by_comm(seq, sample, dtype)
    raise ConfigError("parallel.balance_by", by, "auto, memory, time or comm")


# ---- pipelines of spatial layers: balanced on the serial layers as each rank runs them -------------------
def _reach(layer: nn.Module, d: int) -> int:
    """Halo cells a window layer reads along spatial dim ``d`` beyond its part: (kernel - 1) x dilation."""
    k, dil = getattr(layer, "kernel_size", None), getattr(layer, "dilation", 1)
    if k is None:
        return 0
    k = k[d] if isinstance(k, (tuple, list)) else k
    dil = dil[d] if isinstance(dil, (tuple, list)) else dil
    return (int(k) - 1) * int(dil)


def spatial_balance(serial: nn.Sequential, D: int, by: str, sample: tuple[int, ...], parts: Sequence[int],
                    dims: Sequence[int], end: int | None, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> list[int]:
    """The balance, by ``by`` (memory, time or comm), of the spatial version of ``serial``.

    ``sample``: one micro-batch of the whole sample (batch first); ``parts``
    cuts along spatial ``dims``; costs are taken on the largest part (every
    rank balances on the same numbers, so the cuts agree); ``end``: the model's gather index (None: the
    output stays partitioned). :func:`gems.spatial.apply_spatial` inserts the
    gather before layer ``end``, so the returned balance counts one more layer
    than ``serial`` has when ``end`` is set. Costs per layer as each rank pays
    them: before the gather the activation bytes (memory), the crossing bytes
    (comm) and the time on the part; the gather's output and everything after
    it full size; parameters whole on every rank. ``"time"`` runs copies of
    the layers on ``device`` (rank 0 measures, every rank gets its result).
    """
    layers = list(serial)
    n = len(layers)
    e = n if end is None else int(end)
    outs = trace_shapes(layers, tuple(sample), dtype)
    part = largest_part(sample[2:], parts, dims)
    share = math.prod(part) / max(1, math.prod(sample[2:]))

    # bytes of each layer's output as a rank holds it (leaving spatial layer i: the crossing)
    crossing = [nbytes(*outs[i]) * (share if i < e else 1.0) for i in range(n)]
    mem = layer_costs(layers, crossing)
    if end is not None and 0 < e:  # the gather: the full activation of layer e - 1
        full = crossing[e - 1] / share
        mem.insert(e, full)
        crossing.insert(e, full)
    elif end is not None:  # gather of the input itself
        full = nbytes(sample, dtype)
        mem.insert(0, full)
        crossing.insert(0, full)
    if len(mem) < D:
        raise ConfigError("parallel.pipeline", D, f"at most the model's {len(mem)} layers (gather included)")
    if by == "memory":
        return balance_by_cost(mem, D)
    if by == "comm":
        check_comm_cut(D)
        return smallest_crossing(mem, crossing)
    if by == "time":
        def measure() -> list[int]:
            import copy

            # each layer on the input a rank holds: its part of the global input (the largest part) plus the
            # halo its window reads, i.e. the part widened to the kernel's reach (capped at the whole extent)
            ins = [tuple(sample)] + [shape for shape, _ in outs[:-1]]
            local = []
            for i, given in enumerate(ins):
                shape = list(given)
                if i < e:
                    for k, d in zip(parts, dims):
                        lo, hi = split_bounds(shape[2 + d], int(k))[0]
                        shape[2 + d] = min(shape[2 + d], hi - lo + _reach(layers[i], d))
                local.append(tuple(shape))
            seq = copy.deepcopy(serial).to(device)
            times = layer_times(seq, local[0], device=device, inputs=local)
            if end is not None:
                times.insert(e, 0.0)  # the gather: communication only
            return balance_by_cost(times, D)

        return on_rank0(measure)
    raise ConfigError("parallel.balance_by", by, "memory, time or comm")
