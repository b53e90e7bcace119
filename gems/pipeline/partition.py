"""Cut a flat ``nn.Sequential`` into D contiguous partitions.

Pipelines need three things from the model before any rank runs a step: how
many layers go to each partition (``parallel.balance``, or a balance computed
here from a per-layer cost), the partitions themselves, and the shape of the
activation that crosses each cut, so that receivers can post their buffers
before the data arrives. Shapes come from running the layers on fake tensors
(:class:`torch._subclasses.fake_tensor.FakeTensorMode`): nothing of the
full-size activation is allocated, so this works for a 2048^2 ResNet-1001 on
a laptop.

Costs for automatic balancing:

* ``"memory"`` (deterministic, no compute): per layer, parameter bytes x 3
  (weights, gradient, one optimizer state) + the bytes of its output
  activation at the given micro-batch, from the fake run;
* ``"time"``: forward + backward seconds per layer, measured on real tensors
  of one micro-batch, layer by layer (the largest single activation is the
  only one alive). Timings differ between ranks, so :func:`balance_by_time`
  broadcasts rank 0's result when torch.distributed is up.

The cut minimises the largest partition cost (contiguous linear partition,
dynamic programming over prefix sums).
"""
from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import nn

from gems.errors import ConfigError

__all__ = ["split", "check_balance", "balance_by_cost", "balance_by_comm", "balance_by_memory", "balance_by_time",
           "layer_memory", "boundary_shapes"]


def check_balance(balance: Sequence[int] | None, n_layers: int, D: int) -> list[int]:
    """Validate ``parallel.balance`` against the model and the pipeline size."""
    if D > n_layers:
        raise ConfigError("parallel.pipeline", D, f"at most the model's {n_layers} layers")
    if balance is None:
        raise ValueError("check_balance needs a balance")
    bal = [int(b) for b in balance]
    if len(bal) != D or any(b < 1 for b in bal) or sum(bal) != n_layers:
        raise ConfigError("parallel.balance", list(balance),
                          f"{D} positive layer counts summing to the model's {n_layers} layers, "
                          f"e.g. {balance_by_cost([1.0] * n_layers, D)}")
    return bal


def split(seq: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """The partitions of ``seq`` by ``balance``; they share modules (and parameters) with ``seq``."""
    bal = check_balance(balance, len(seq), len(balance))
    layers = list(seq)
    parts, start = [], 0
    for b in bal:
        parts.append(nn.Sequential(*layers[start:start + b]))
        start += b
    return parts


def balance_by_cost(costs: Sequence[float], D: int) -> list[int]:
    """Contiguous cut of ``costs`` into ``D`` non-empty parts minimising the largest part's sum."""
    n = len(costs)
    if D > n:
        raise ConfigError("parallel.pipeline", D, f"at most the model's {n} layers")
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + float(c))
    inf = float("inf")
    # best[k][i]: minimal bottleneck cutting the first i layers into k parts
    best = [[inf] * (n + 1) for _ in range(D + 1)]
    cut = [[0] * (n + 1) for _ in range(D + 1)]
    best[0][0] = 0.0
    for k in range(1, D + 1):
        for i in range(k, n - (D - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], pre[i] - pre[j])
                if v < best[k][i]:  # strict: ties keep the earliest cut, so the result is deterministic
                    best[k][i], cut[k][i] = v, j
    bal, i = [], n
    for k in range(D, 0, -1):
        j = cut[k][i]
        bal.append(i - j)
        i = j
    return bal[::-1]


def _fake_run(layers: Sequence[nn.Module], sample: tuple[int, ...], dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Output (shape, dtype) of every layer for an input of shape ``sample`` (batch included), on fake tensors.

    Layers run in eval mode (shapes are the same; BatchNorm buffers and dropout are left alone).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    modes = [(m, m.training) for layer in layers for m in layer.modules()]
    for m, _ in modes:
        m.training = False
    out = []
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            x = torch.empty(sample, dtype=dtype)
            for layer in layers:
                x = layer(x)
                if not isinstance(x, torch.Tensor):
                    raise TypeError(f"{type(layer).__name__} returned {type(x).__name__}; pipeline cuts carry one tensor")
                out.append((tuple(int(v) for v in x.shape), x.dtype))
    finally:
        for m, mode in modes:
            m.training = mode
    return out


def boundary_shapes(parts: Sequence[nn.Sequential], sample: tuple[int, ...],
                    dtype: torch.dtype = torch.float32) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of the activation leaving each partition but the last, for input ``sample`` (batch first).

    Runs on fake tensors: no memory for the activations, no communication
    (so partitions whose layers talk to other ranks, such as spatial layers,
    cannot be traced this way; the runtime then learns shapes at the first send).
    """
    shapes = []
    x_shape, x_dtype = tuple(sample), dtype
    for part in parts[:-1]:
        last = _fake_run(list(part), x_shape, x_dtype)[-1]
        shapes.append(last)
        x_shape, x_dtype = last
    return shapes


def layer_memory(seq: nn.Sequential, sample: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[float]:
    """Bytes per layer: parameters x 3 (weights, gradient, optimizer state) + output activation."""
    return _layer_memory(seq, _fake_run(list(seq), tuple(sample), dtype))


def _layer_memory(seq: nn.Sequential, outs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[float]:
    """:func:`layer_memory` from the layers' traced outputs."""
    costs = []
    for layer, (shape, dt) in zip(seq, outs):
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        act = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
        costs.append(float(3 * params + act))
    return costs


def check_comm_cut(D: int) -> None:
    """``parallel.balance_by=comm`` picks the one cut of D = 2; anything else is bad input."""
    if D != 2:
        raise ConfigError("parallel.balance_by", "comm", f"memory or time at parallel.pipeline={D} "
                          "(comm picks the one cut of D = 2)")


def balance_by_comm(seq: nn.Sequential, sample: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[int]:
    """Two partitions cut where the activation crossing the cut is smallest (ties: the most even memory).

    For GEMS at D = 2 (``mast``, ``master``) the cut decides nothing but the
    traffic: each rank runs partition 0 of one replica and partition 1 of the
    other, so every rank computes the whole model once per replica pass and
    holds all parameters, whatever the cut. The activations and their
    gradients cross the cut on the critical path (the mirrored forwards wait
    for each other), so the smallest crossing is the fastest cut. ``lp`` at
    D = 2 runs the partitions one after the other, so it too only pays the
    traffic; ``1f1b``/``gpipe`` need time balance instead.
    """
    outs = _fake_run(list(seq), tuple(sample), dtype)
    if len(outs) < 2:
        raise ConfigError("parallel.pipeline", 2, f"at most the model's {len(outs)} layers")
    mem = _layer_memory(seq, outs)
    total = sum(mem)

    def cost(i: int) -> tuple[int, float]:  # cut after layer i - 1: partition 0 = layers[:i]
        shape, dt = outs[i - 1]
        return torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size(), abs(total - 2 * sum(mem[:i]))

    cut = min(range(1, len(outs)), key=cost)
    return [cut, len(outs) - cut]


def balance_by_memory(seq: nn.Sequential, D: int, sample: tuple[int, ...],
                      dtype: torch.dtype = torch.float32) -> list[int]:
    """Balance that evens out parameter, gradient, optimizer and activation bytes (deterministic)."""
    return balance_by_cost(layer_memory(seq, sample, dtype), D)


def layer_times(seq: nn.Sequential, sample: tuple[int, ...], repeat: int = 2,
                device: torch.device | str = "cpu") -> list[float]:
    """Forward + backward seconds of every layer on one real input of shape ``sample`` (batch included).

    Buffers (BatchNorm statistics) are restored and gradients cleared afterwards.
    """
    from gems.models.layers import batch_context

    saved = [b.detach().clone() for b in seq.buffers()]
    times = []
    x = torch.randn(sample, device=device)
    with batch_context(0, 0, range(sample[0])):
        for layer in seq:
            best, y = float("inf"), x
            for _ in range(repeat):
                xi = x.detach().requires_grad_(x.is_floating_point())
                t0 = time.perf_counter()
                y = layer(xi)
                if y.requires_grad:
                    y.backward(torch.ones_like(y))
                if x.device.type == "cuda":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            times.append(best)
            x = y.detach()
    for p in seq.parameters():
        p.grad = None
    with torch.no_grad():
        for b, v in zip(seq.buffers(), saved):
            b.copy_(v)
    return times


def balance_by_time(seq: nn.Sequential, D: int, sample: tuple[int, ...], device: torch.device | str = "cpu") -> list[int]:
    """Balance that evens out measured compute time; rank 0's measurement wins when torch.distributed is up."""
    import torch.distributed as dist

    shared = dist.is_available() and dist.is_initialized()
    bal: list[int] = []
    if not shared or dist.get_rank() == 0:
        bal = balance_by_cost(layer_times(seq, sample, device=device), D)
    if shared:
        box: list[object] = [bal]
        dist.broadcast_object_list(box, src=0)
        bal = list(box[0])  # type: ignore[call-overload]
    return bal
