"""The backward split in two for zero-bubble schedules: input gradients in an ``I`` action, weight gradients in a later
``W`` that fills a bubble. A partition's convolutions and linear layers are made deferrable (:func:`make_deferrable`);
inside :func:`deferring` their backward computes the input gradient and queues what the weight gradient needs, which
``W`` accumulates through autograd (:meth:`WeightGrads.run`), so the gradient sum's hooks fire as for any backward.
Outside it, and for layers of cheap weight gradients (norms, gems's spatial layers), both come at once.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

Key = tuple[int, int, int]  # (pass, micro-batch, stage)

_ACTIVE: list[tuple["WeightGrads", Key]] = []  # the I running now (one per process: autograd may use threads)


class WeightGrads:
    """The weight-gradient work an ``I`` left for its ``W``, per (pass, micro-batch, stage)."""

    def __init__(self) -> None:
        self.pending: dict[Key, list[Callable[[], None]]] = {}

    def run(self, key: Key) -> int:
        """Do the weight gradients queued under ``key``; returns how many layers."""
        work = self.pending.pop(key, [])
        for fn in reversed(work):  # the order the backward met them in: last layer first
            fn()
        return len(work)

    def clear(self) -> None:
        self.pending.clear()


@contextlib.contextmanager
def deferring(store: WeightGrads, key: Key) -> Iterator[None]:
    """While inside, deferrable layers queue their weight gradients in ``store`` under ``key``."""
    store.pending.setdefault(key, [])
    _ACTIVE.append((store, key))
    try:
        yield
    finally:
        _ACTIVE.pop()


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _detached_operands(x: torch.Tensor, layer: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``x`` and the layer's weight and bias, detached, cast as autocast would cast them for the op (a deferrable
    layer casts under autocast itself, and returns gradients in the dtypes it was given)."""
    w, b = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    dt = _autocast_dtype(x.device.type)
    return (x, w, b) if dt is None else (x.to(dt), w.to(dt), None if b is None else b.to(dt))


class _Handed(torch.autograd.Function):
    """The W's weight gradients, made inside this backward and handed to the parameters' accumulators by autograd.
    Made here, the engine holds the only reference to each, so the accumulator takes it as it is; given to
    ``torch.autograd.backward`` from Python, each is referenced twice and the accumulator copies it (a 4096^2 dense
    layer's 64 MiB gradient copied at every W, with a second copy's memory)."""

    @staticmethod
    def forward(ctx: Any, make: Callable[[], list[torch.Tensor | None]], *params: torch.Tensor) -> torch.Tensor:
        ctx.make, ctx.dtypes = make, [q.dtype for q in params]
        return torch.zeros((), device=params[0].device)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[Any, ...]:
        make, ctx.make = ctx.make, None  # what it holds (the layer's input, its output's gradient) goes with it
        return (None, *(None if g is None else g.to(dt) for g, dt in zip(make(), ctx.dtypes)))


def _accumulate(params: list[torch.Tensor | None], make: Callable[[], list[torch.Tensor | None]]) -> None:
    """The gradients ``make()`` gives (one per parameter, None for none) accumulated into ``params``' ``.grad``
    through autograd, so their post-accumulate hooks fire; a parameter that is None or needs no gradient is left
    out (its entry made all the same, then dropped)."""
    held = [i for i, q in enumerate(params) if q is not None and q.requires_grad]
    if not held:
        return
    taken = [params[i] for i in held]

    def grads() -> list[torch.Tensor | None]:
        made = make()
        return [made[i] for i in held]

    with torch.enable_grad():  # (run inside a backward, outside deferring(): autograd turned grad mode off there)
        torch.autograd.backward(_Handed.apply(grads, *taken))


def _queue_or_run(weight_grad: Callable[[], None]) -> None:
    """Queue the weight gradients for the running I's W, or (a backward outside a split schedule's I, say
    the user's own) accumulate them now."""
    if _ACTIVE:
        store, key = _ACTIVE[-1]
        store.pending[key].append(weight_grad)
    else:
        weight_grad()


class _Deferred(torch.autograd.Function):
    """A deferrable layer's op, a convolution's or a linear layer's (its ``_op``, ``_input_grad`` and
    ``_weight_grads``; the last reads the weight only where ``_w_reads_weight``, so a W keeps no weight, nor its
    autocast copy, that it does not need). The parameters come in detached: autograd must not reach their
    accumulators in the I (it would run their post-accumulate hooks, and the gradient sum would start on gradients
    that are not there yet); the weight gradients are accumulated through autograd when the W runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: Any, anchor: Any) -> torch.Tensor:
        xc, wc, bc = _detached_operands(x, layer)
        with torch.autocast(x.device.type, enabled=False):
            y = layer._op(xc, wc, bc)
        ctx.save_for_backward(xc, wc)
        ctx.layer, ctx.xdtype = layer, x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        xc, wc = ctx.saved_tensors
        layer = ctx.layer
        gx = layer._input_grad(gy, xc, wc).to(ctx.xdtype) if ctx.needs_input_grad[0] else None
        w, b = layer.weight, layer.bias
        want = (w.requires_grad, b is not None and b.requires_grad)
        if any(want):
            kept = wc if layer._w_reads_weight else None

            def weight_grad() -> None:
                _accumulate([w, b], lambda: layer._weight_grads(gy, xc, kept, want))

            _queue_or_run(weight_grad)
        return gx, None, None


def _anchor(x: torch.Tensor, m: nn.Module) -> torch.Tensor | None:
    """A leaf that requires a gradient, for a layer whose input does not (the first layer of a model): the
    layer's output must still be part of the graph, or its backward (and weight gradient) never runs."""
    if x.requires_grad or not any(p.requires_grad for p in m.parameters(recurse=False)):
        return None
    return torch.zeros((), device=x.device, requires_grad=True)


class _DeferrableConv:
    """Mixin of the deferrable convolutions (forward through :class:`_Deferred`)."""

    _w_reads_weight = True

    def _op(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return self._conv_forward(x, w, b)  # type: ignore[attr-defined]

    def _backward(self, gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                  mask: tuple[bool, bool, bool]) -> tuple[Any, Any, Any]:
        m: Any = self
        pad = list(m.padding) if not isinstance(m.padding, str) else _same_padding(m)
        return torch.ops.aten.convolution_backward(gy, x, w, [w.shape[0]], list(m.stride), pad, list(m.dilation),
                                                   False, [0] * (w.dim() - 2), m.groups, list(mask))

    def _input_grad(self, gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self._backward(gy, x, w, (True, False, False))[0]

    def _weight_grads(self, gy: torch.Tensor, x: torch.Tensor, w: Any,
                      want: tuple[bool, bool]) -> list[torch.Tensor | None]:
        return list(self._backward(gy, x, w, (False, *want))[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m: Any = self
        if m.padding_mode != "zeros" or isinstance(m.padding, str) and m.padding == "same" and _uneven_same(m):
            base: Any = type(self).__mro__[2]
            return base.forward(self, x)  # the layer's own path (exact, not deferred)
        return _Deferred.apply(x, self, _anchor(x, m))


def _same_padding(m: Any) -> list[int]:
    if m.padding == "valid":
        return [0] * (m.weight.dim() - 2)
    return [d * (k - 1) // 2 for d, k in zip(m.dilation, m.kernel_size)]


def _uneven_same(m: Any) -> bool:
    return any((d * (k - 1)) % 2 for d, k in zip(m.dilation, m.kernel_size))


class _DeferrableLinear(nn.Linear):
    """The deferrable ``nn.Linear`` (forward through :class:`_Deferred`)."""

    _w_reads_weight = False

    def _op(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, w, b)

    def _input_grad(self, gy: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return gy @ w

    def _weight_grads(self, gy: torch.Tensor, x: torch.Tensor, w: Any,
                      want: tuple[bool, bool]) -> list[torch.Tensor | None]:
        g2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
        return [g2.t() @ x2 if want[0] else None, g2.sum(0) if want[1] else None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Deferred.apply(x, self, _anchor(x, self))


_SWAP: dict[type, type] = {}
for _base in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
    _SWAP[_base] = type(f"Deferrable{_base.__name__}", (_DeferrableConv, _base), {})
_SWAP[nn.Linear] = _DeferrableLinear


def deferrable(module: nn.Module) -> list[nn.Module]:
    """The modules of ``module`` that :func:`make_deferrable` makes deferrable (or made so): its convolutions
    (Conv1d/2d/3d) and linear layers of exactly those types; subclasses with their own forward, transposed
    convolutions and gems' spatial layers compute their weight gradients in ``I``. The planner counts what their W
    holds (gems.plan.memory)."""
    return [m for m in module.modules() if type(m) in _SWAP or type(m) in _SWAP.values()]


def make_deferrable(module: nn.Module) -> int:
    """Make ``module``'s :func:`deferrable` modules deferrable; returns how many. The same objects, parameters and
    state dict."""
    n = 0
    for m in deferrable(module):
        cls = _SWAP.get(type(m))
        if cls is not None:
            m.__class__ = cls
        n += 1
    return n
