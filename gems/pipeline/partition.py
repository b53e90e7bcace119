"""Cut a flat ``nn.Sequential`` into contiguous partitions: the costs a balance weighs (memory, measured time, the
activation crossing a cut), the cut that minimises the largest partition (:func:`balance_by_cost`), the partitions,
and the shape crossing each cut, traced on fake tensors (nothing full-size allocated: a 2048² ResNet-1001 traces on
a laptop), so that receivers post their buffers before the data arrives.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from gems.errors import ConfigError
from gems.models.skips import spans

__all__ = ["split", "check_balance", "balance_by_cost", "balance_by_comm", "balance_by_memory", "balance_by_time",
           "layer_memory", "boundary_shapes", "trace_shapes", "nbytes", "layer_costs", "smallest_crossing",
           "layer_times", "on_rank0"]


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
    """Contiguous cut of ``costs`` into ``D`` non-empty parts minimising the largest part's sum (dynamic
    programming over prefix sums)."""
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


# (structure of a layer, input shape, input dtype) -> output (shape, dtype): the blocks of a deep network
# repeat (ResNet-1001 has 333 blocks of a handful of kinds), and each fake run of one costs milliseconds
_SHAPE_MEMO: dict[tuple, tuple[tuple[int, ...], torch.dtype]] = {}
_SHAPE_MEMO_MAX = 100_000


class _Same:
    """Equal only to a wrapper of the very same object, which it keeps alive (so its id is not reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


_NO = object()  # not a plain value


def _plain(v: object, depth: int = 0) -> object:
    """A hashable value-form of ``v`` when it is made of scalars, dtypes, tuples, lists, dataclasses and
    modules (by structure); ``_NO`` otherwise."""
    if isinstance(v, (bool, int, float, str, type(None), torch.dtype)):
        return v
    if depth < 4 and isinstance(v, (tuple, list)):
        items = tuple(_plain(e, depth + 1) for e in v)
        return _NO if any(e is _NO for e in items) else (type(v).__qualname__, items)
    if depth < 4 and dataclasses.is_dataclass(v) and not isinstance(v, type):
        items = tuple(_plain(getattr(v, f.name), depth + 1) for f in dataclasses.fields(v))
        return _NO if any(e is _NO for e in items) else (type(v).__qualname__, items)
    if depth < 4 and isinstance(v, nn.Module):
        st = structure(v)
        return _NO if st is None else ("module", st)
    return _NO


# attributes of gems' spatial layers that name messages and errors, never shapes or bytes
_LABELS = ("label", "tag")


def _replayable(m: nn.Module) -> bool:
    """Whether a memo may stand in for running ``m``: not where ``m``, or a layer it keeps as an attribute (a spatial
    part's pointwise layer keeps its layer out of the module tree), says ``replayable = False``: a layer whose
    forward changes state beside its output, such as a skip connection's stash or pop (gems.models.skips), which a
    replay would skip (the pop's stash then stayed in the model's store, and a later trace of the same model in the
    process popped it in place of its own)."""
    if getattr(m, "replayable", True) is False:
        return False
    return all(_replayable(v) for v in vars(m).values() if isinstance(v, nn.Module) and v is not m)


def structure(layer: nn.Module) -> tuple | None:
    """A key equal for layers that map equal input shapes to equal output shapes: per submodule its
    class, its plain attributes (:func:`_plain`), and the shapes and dtypes of its parameters and
    buffers. Any other attribute is compared by identity. None (never memoised) for a module with
    hooks other than gems' own, which may change shapes unseen, and for one that is not
    :func:`_replayable`."""
    key = []
    for name, m in layer.named_modules():
        if m._forward_pre_hooks or getattr(m, "_forward_hooks_with_kwargs", None) or not _replayable(m):
            return None
        hooks = []
        for h in m._forward_hooks.values():
            # the one hook gems adds (spatial containers tag their output's global shape): what it does is
            # a function of the input's global shape and the context, which the planner's memo keys on
            if isinstance(h, functools.partial) and _shape_neutral(h.func) and h.args:
                hooks.append(("tag_output", _Same(h.args[0])))
            else:
                return None
        spatial = type(m).__module__.startswith("gems.spatial")
        attrs = []
        for k, v in vars(m).items():
            if k.startswith("_") or k == "training" or (spatial and k in _LABELS):
                continue
            c = _plain(v)
            # anything else (a context, a callable) may steer the shapes: only the same object is safe
            attrs.append((k, _Same(v) if c is _NO else c))
        tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in
                        [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)] if t is not None)
        key.append((name, type(m).__module__, type(m).__qualname__, tuple(attrs), tensors, tuple(hooks)))
    return tuple(key)


def _shape_neutral(fn: object) -> bool:
    """A forward hook that marks itself ``shape_neutral`` (the spatial containers' tagging hook) changes
    no shape: the memo may replay layers that carry it."""
    return bool(getattr(getattr(fn, "func", fn), "shape_neutral", False))


def trace_shapes(layers: Sequence[nn.Module], sample: tuple[int, ...],
                 dtype: torch.dtype, amp: Callable[[], Any] | None = None) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Output (shape, dtype) of every layer for an input of shape ``sample`` (batch included), on fake tensors.

    Layers run in eval mode (shapes are the same; BatchNorm buffers and dropout are left alone).
    A layer whose structure and input were seen before is not run again (:func:`structure`).
    ``amp``: the autocast region the run computes in (:func:`gems.precision.autocast`), so the dtypes are
    the run's (bf16 activations cross a cut at bf16's bytes); the input lives on the layers' device.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = next((p.device for layer in layers for p in layer.parameters()), torch.device("cpu"))
    region = amp() if amp is not None else contextlib.nullcontext()

    modes = [(m, m.training) for layer in layers for m in layer.modules()]
    for m, _ in modes:
        m.training = False
    out = []
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), region:
            amp_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
            shape, dt = tuple(int(v) for v in sample), dtype
            x = None
            for layer in layers:
                st = structure(layer)
                memo = None if st is None else (st, shape, dt, device.type, amp_dtype)
                if memo is not None and memo in _SHAPE_MEMO:
                    shape, dt = _SHAPE_MEMO[memo]
                    x = None
                else:
                    if x is None:
                        x = torch.empty(shape, dtype=dt, device=device)
                    x = layer(x)
                    if not isinstance(x, torch.Tensor):
                        raise TypeError(f"{type(layer).__name__} returned {type(x).__name__}; pipeline cuts carry one tensor")
                    shape, dt = tuple(int(v) for v in x.shape), x.dtype
                    if memo is not None and len(_SHAPE_MEMO) < _SHAPE_MEMO_MAX:
                        _SHAPE_MEMO[memo] = (shape, dt)
                out.append((shape, dt))
    finally:
        for m, mode in modes:
            m.training = mode
    return out


def boundary_shapes(parts: Sequence[nn.Sequential], sample: tuple[int, ...],
                    dtype: torch.dtype = torch.float32,
                    amp: Callable[[], Any] | None = None) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of the activation leaving each partition but the last, for input ``sample`` (batch first),
    computed under ``amp`` (the run's autocast region, :func:`trace_shapes`).

    Runs on fake tensors: no memory for the activations, no communication
    (so partitions whose layers talk to other ranks, such as spatial layers,
    cannot be traced this way; the runtime then learns shapes at the first send).
    """
    shapes = []
    x_shape, x_dtype = tuple(sample), dtype
    for part in parts[:-1]:
        last = trace_shapes(list(part), x_shape, x_dtype, amp)[-1]
        shapes.append(last)
        x_shape, x_dtype = last
    return shapes


def layer_memory(seq: nn.Sequential, sample: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[float]:
    """Bytes per layer: parameters x 3 (weights, gradient, optimizer state) + output activation."""
    return layer_costs(seq, [nbytes(shape, dt) for shape, dt in trace_shapes(list(seq), tuple(sample), dtype)])


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> float:
    """Bytes of a tensor of ``shape`` and ``dtype``."""
    return float(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())


def layer_costs(seq: Iterable[nn.Module], acts: Sequence[float]) -> list[float]:
    """:func:`layer_memory` from the bytes of each layer's output activation."""
    return [float(3 * sum(p.numel() * p.element_size() for p in layer.parameters()) + a)
            for layer, a in zip(seq, acts)]


def resolve_balance_by(by: str, sched: Any) -> str:
    """``parallel.balance_by=auto``: ``comm`` where every rank holds the whole model whatever the cut (two
    stages on two ranks that hold copies of both: GEMS mast/master at D = 2, each rank running partition 0
    of one replica and partition 1 of the other, so only the traffic on the critical path depends on the
    cut, and the smallest crossing wins); ``memory`` everywhere else, which is what lets a model that does
    not fit one device run. ``sched``: the :class:`~gems.pipeline.schedules.Schedule` (None: no pipeline)."""
    if by != "auto":
        return by
    return "comm" if sched is not None and sched.ranks == 2 and sched.stages == 2 and sched.holds_copies else "memory"


def balance_by_comm(seq: nn.Sequential, sample: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[int]:
    """Two partitions cut where the activation crossing the cut is smallest (ties: the most even memory).

    For GEMS at D = 2 (``mast``, ``master``) the cut decides nothing but the
    traffic: each rank runs partition 0 of one replica and partition 1 of the
    other, so every rank computes the whole model once per replica pass and
    holds all parameters, whatever the cut. The activations and their
    gradients cross the cut on the critical path (the mirrored forwards wait
    for each other), so the smallest crossing is the fastest cut. ``lp`` at
    D = 2 runs the partitions one after the other, so it too only pays the
    traffic; ``1f1b``/``gpipe`` need time balance instead. A skip connection that crosses the cut crosses with
    the activation (gems.models.skips.Carried): its bytes count too.
    """
    outs = trace_shapes(list(seq), tuple(sample), dtype)
    if len(outs) < 2:
        raise ConfigError("parallel.pipeline", 2, f"at most the model's {len(outs)} layers")
    acts = [nbytes(shape, dt) for shape, dt in outs]
    sp = spans(list(seq))
    crossing = [a + sum(acts[s] for _, s, p in sp if s < i + 1 <= p) for i, a in enumerate(acts)]
    return smallest_crossing(layer_costs(seq, acts), crossing)


def smallest_crossing(mem: Sequence[float], crossing: Sequence[float]) -> list[int]:
    """The two-partition balance whose cut has the smallest ``crossing[i]`` (bytes leaving layer ``i``),
    ties broken by the most even ``mem`` (bytes per layer)."""
    total = sum(mem)
    cut = min(range(1, len(mem)), key=lambda i: (crossing[i - 1], abs(total - 2 * sum(mem[:i]))))
    return [cut, len(mem) - cut]


def balance_by_memory(seq: nn.Sequential, D: int, sample: tuple[int, ...],
                      dtype: torch.dtype = torch.float32) -> list[int]:
    """Balance that evens out parameter, gradient, optimizer and activation bytes (deterministic)."""
    return balance_by_cost(layer_memory(seq, sample, dtype), D)


def layer_times(seq: nn.Sequential, sample: tuple[int, ...], repeat: int = 2,
                device: torch.device | str | None = None,
                inputs: Sequence[tuple[int, ...]] | None = None) -> list[float]:
    """Forward + backward seconds of every layer on one real input of shape ``sample`` (batch included),
    on ``device`` (default: where the layers' parameters are). With ``inputs``, layer ``i`` runs on its
    own random input of shape ``inputs[i]`` instead of the previous layer's output.

    Buffers (BatchNorm statistics) are restored and gradients cleared afterwards.
    """
    from gems.layers import batch_context

    if device is None:
        device = next((q.device for q in seq.parameters()), torch.device("cpu"))
    saved = [b.detach().clone() for b in seq.buffers()]
    times = []
    x = torch.randn(sample, device=device)
    with batch_context(0, 0, range(sample[0])):
        for i, layer in enumerate(seq):
            if inputs is not None:
                x = torch.randn(inputs[i], device=device)
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
    for q in seq.parameters():
        q.grad = None
    with torch.no_grad():
        for b, v in zip(seq.buffers(), saved):
            b.copy_(v)
    return times


def on_rank0(compute: Callable[[], list[int]]) -> list[int]:
    """``compute()`` on rank 0, broadcast to every rank when torch.distributed is up (measurements differ)."""
    import torch.distributed as dist

    shared = dist.is_available() and dist.is_initialized()
    bal: list[int] = []
    if not shared or dist.get_rank() == 0:
        bal = compute()
    if shared:
        box: list[object] = [bal]
        dist.broadcast_object_list(box, src=0)
        bal = list(box[0])  # type: ignore[call-overload]
    return bal


def balance_by_time(seq: nn.Sequential, D: int, sample: tuple[int, ...],
                    device: torch.device | str | None = None) -> list[int]:
    """Balance that evens out measured compute time (one micro-batch's forward and backward, layer by layer: the
    largest single activation is the only one alive); rank 0's measurement wins when torch.distributed is up, since
    timings differ between ranks."""
    return on_rank0(lambda: balance_by_cost(layer_times(seq, sample, device=device), D))
