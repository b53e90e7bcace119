"""Skip connections as layers of a flat sequence (a :class:`Stash`, a later :class:`PopConcat` or :class:`PopAdd`, through
a :class:`SkipStore` the model's layers share), and the one rule that carries them across a cut of it: a
checkpointed piece that runs again in its backward (:func:`checkpointed`) and a pipeline partition on another rank
(:class:`Carried`) both take and hand on the skips crossing their bounds (:func:`run_span`).
"""
from __future__ import annotations

import contextlib
import math
from collections import deque
from typing import Any, Callable, Sequence

import torch
from torch import nn

from gems.cut_rules import register_pointwise
from gems.layers import Recompute
from gems.layout import format_for
from gems.shapes import GSHAPE

__all__ = ["SkipStore", "Stash", "PopConcat", "PopAdd", "spans", "crossing", "store_of", "run_span",
           "checkpoint_pieces", "checkpointed", "Carried", "carry", "cut_contents"]


class SkipStore:
    """Activations waiting for their skip connection, by name (FIFO)."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[torch.Tensor]] = {}

    def push(self, name: str, x: torch.Tensor) -> None:
        self._queues.setdefault(name, deque()).append(x)

    def pop(self, name: str) -> torch.Tensor:
        q = self._queues.get(name)
        if not q:
            raise RuntimeError(f"skip connection {name!r}: nothing stashed (run the layers from its Stash on, in order)")
        return q.popleft()

    def pending(self, names: Sequence[str]) -> list[torch.Tensor]:
        """What ``names`` (in order, a name as often as it is named) would pop, left in the store."""
        seen: dict[str, int] = {}
        out = []
        for n in names:
            out.append(self._queues[n][seen.get(n, 0)])
            seen[n] = seen.get(n, 0) + 1
        return out

    def clear(self) -> None:
        self._queues.clear()

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __getstate__(self) -> dict[str, Any]:  # activations never travel with the model
        return {"_queues": {}}


class _SkipLayer(nn.Module):
    """A layer of a skip connection: the model's shared store and the connection's name."""

    #: the planner's traces run it every time, never a memo of its output (gems.pipeline.partition.structure): its
    #: push or pop of the store is what the next layers of the trace need
    replayable = False

    def __init__(self, store: SkipStore, name: str) -> None:
        super().__init__()
        self.store, self.name = store, name

    def extra_repr(self) -> str:
        return repr(self.name)


@register_pointwise  # the spatial converter cuts it (gems/cut_rules.py)
class Stash(_SkipLayer):
    """Save the activation for a later :class:`PopConcat` / :class:`PopAdd`; pass it on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.store.push(self.name, x)
        return x


@register_pointwise  # the spatial converter cuts it (gems/cut_rules.py)
class PopConcat(_SkipLayer):
    """Concatenate the stashed activation (first) with the input along channels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.store.pop(self.name), x], dim=1)


@register_pointwise  # the spatial converter cuts it (gems/cut_rules.py)
class PopAdd(PopConcat):
    """Add the stashed activation to the input (a residual connection)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.store.pop(self.name)


def _skip_layer(layer: nn.Module, kind: type) -> Any:
    """The ``kind`` module a layer of the sequence is or wraps, else None (a spatial part's pointwise layer keeps
    it out of the module tree, as ``inner``: gems.spatial.layers.pointwise)."""
    for m in layer.modules():
        for c in (m, getattr(m, "inner", None)):
            if isinstance(c, kind):
                return c
    return None


def spans(layers: Sequence[nn.Module]) -> list[tuple[str, int, int]]:
    """Every skip connection of the flat sequence: (name, index of its stash, index of its pop), in the order of
    the stashes (each pop takes its name's oldest stash, as the store does)."""
    open_: dict[str, deque[int]] = {}
    out: list[tuple[str, int, int]] = []
    for i, layer in enumerate(layers):
        s = _skip_layer(layer, Stash)
        if s is not None:
            open_.setdefault(s.name, deque()).append(i)
        p = _skip_layer(layer, PopConcat)
        if p is not None and open_.get(p.name):
            out.append((p.name, open_[p.name].popleft(), i))
    return sorted(out, key=lambda t: t[1])


def crossing(sp: Sequence[tuple[str, int, int]], cut: int) -> list[str]:
    """The names of the skips that cross the boundary before layer ``cut`` (stashed before it, popped at or after
    it), in the order of their stashes: what a piece that starts or ends there receives or hands on."""
    return [name for name, s, p in sp if s < cut <= p]


def store_of(layers: Sequence[nn.Module]) -> SkipStore | None:
    """The store the sequence's skip layers share (None: no skip layers)."""
    for layer in layers:
        m = _skip_layer(layer, _SkipLayer)
        if m is not None:
            return m.store
    return None


def run_span(store: SkipStore | None, layers: Sequence[nn.Module], x: torch.Tensor,
             skips_in: Sequence[tuple[str, torch.Tensor]], names_out: Sequence[str]
             ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One piece of the sequence: push ``skips_in`` (the boundary's, in order), run ``layers`` on ``x``, take the
    skips ``names_out`` names out of the store for the next piece. The store must be empty before and is after, so
    a recomputation, a micro-batch in flight or another partition of the same rank never sees what another left;
    autograd sees the skips as inputs and outputs of the piece, so their gradients come back the way they went."""
    if store is None:
        for layer in layers:
            x = layer(x)
        return x, []
    if len(store):
        raise RuntimeError(f"skip store holds {len(store)} activation(s) before a piece of the model runs: a piece "
                           f"left skips behind")
    try:
        for name, t in skips_in:
            store.push(name, t)
        for layer in layers:
            x = layer(x)
        out = [store.pop(name) for name in names_out]
        if len(store):
            raise RuntimeError(f"skip store holds {len(store)} activation(s) no later piece takes")
    finally:
        store.clear()
    return x, out


class _Recomputed(torch.autograd.Function):
    """One checkpointed piece: its forward without a graph; in the backward, once the gradients of all its outputs
    are complete, its forward again (under the first one's autocast state, random state and BatchNorm buffers,
    which are put back after it) and the backward through it. Explicit, as the pipeline runtime recomputes a
    partition: the recomputation's communication (halos, norms' sums) runs in forward order at one place of the
    backward on every spatial part, where torch's non-reentrant checkpoint recomputes at the first saved tensor
    each part's own graph unpacks (a part's one-sided halo node needs none: the parts diverged and hung)."""

    @staticmethod
    def forward(ctx: Any, run: Callable[..., tuple[torch.Tensor, ...]], buffers: list[torch.Tensor],
                anchor: torch.Tensor, *inputs: torch.Tensor) -> Any:
        ctx.run = run
        ctx.state = Recompute(inputs[0].device, buffers)
        ctx.save_for_backward(*inputs)
        ctx.tags = [getattr(t, GSHAPE, None) for t in inputs]  # a spatial part's global shape: no sum to learn it
        with torch.no_grad():
            out = run(*inputs)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        inputs = []
        for t, tag in zip(ctx.saved_tensors, ctx.tags):
            d = t.detach()
            d.requires_grad_(t.requires_grad)
            if tag is not None:
                setattr(d, GSHAPE, tag)
            inputs.append(d)
        with ctx.state.replay():
            out = ctx.run(*inputs)
        pairs = [(o, g) for o, g in zip(out, grads) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.state.restore()
        return (None, None, None, *[t.grad if t.requires_grad else None for t in inputs])


def checkpoint_pieces(saved: Sequence[float], out: Sequence[float]) -> list[tuple[int, int]]:
    """The layers [a, e) of each piece ``parallel.checkpoint`` cuts a plain path into, from each layer's bytes:
    ``saved[i]``, what autograd saves that layer ``i`` is the first to save, and ``out[i]``, its output
    (:func:`gems.parallel.recompute_pieces` traces them; the run, :func:`checkpointed`, and the memory plan,
    gems.plan.memory, both take its answer).

    Every piece but the last keeps only its input from its forward to its backward, where it runs again. The
    backward takes the pieces last to first, so while piece k runs again it holds the inputs of the pieces before
    it, its own input, its saved set and its output with that output's gradient. The pieces are the cut whose
    largest such sum is smallest (a search on that bound, each bound checked by a pass that keeps, for every layer a
    piece may start at, the least input bytes kept before it; ties keep the earliest cut, so every rank cuts the
    same). Pieces of two layers, as before, kept every other activation of a network of single ops (the U-Net's
    convolutions, norms and activations) and recomputed nothing worth it: the U-Net at 64^3 planned 2.38 GiB with
    them and without recomputation, 1.62 GiB with these."""
    n = len(saved)
    if n == 0:
        return []
    inf = float("inf")
    inp = [0.0] + [float(o) for o in out[:-1]]  # the first piece's input is the batch, kept anyway

    def cut(bound: float) -> list[tuple[int, int]] | None:
        kept = [inf] * (n + 1)  # kept[a]: the least input bytes the pieces before layer a keep
        kept[0], came = 0.0, [-1] * (n + 1)
        for a in range(n):
            if kept[a] == inf:
                continue
            held, own = kept[a] + inp[a], 0.0
            for e in range(a + 1, n + 1):
                own += float(saved[e - 1])
                if held + own > bound:
                    break
                if held + own + 2 * float(out[e - 1]) <= bound and held < kept[e]:
                    kept[e], came[e] = held, a
        if kept[n] == inf:
            return None
        pieces, e = [], n
        while e > 0:
            pieces.append((came[e], e))
            e = came[e]
        return pieces[::-1]

    lo, hi = 0.0, 2.0 * (sum(float(v) for v in saved) + sum(float(v) for v in out)) + 1.0
    best = cut(hi)
    for _ in range(48):
        mid = (lo + hi) / 2
        got = cut(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    assert best is not None
    return best


def checkpointed(seq: nn.Sequential, bounds: Sequence[tuple[int, int]]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``parallel.checkpoint`` on the plain path: the forward of ``seq`` in the pieces ``bounds``
    (:func:`checkpoint_pieces`), each but the last recomputed in its backward (:class:`_Recomputed`); a piece's
    inputs are the activation and the skips crossing its start, its outputs the activation and those crossing its
    end, so a recomputed piece stashes and pops as the first forward did."""
    layers = list(seq)
    if not bounds or bounds[0][0] != 0 or bounds[-1][1] != len(layers) \
            or any(e != a for (_, e), (a, _) in zip(bounds, bounds[1:])):
        raise ValueError(f"pieces {list(bounds)} do not cover the {len(layers)} layers in order")
    sp, store = spans(layers), store_of(layers)
    names = [crossing(sp, a) for a, _ in bounds] + [[]]

    def piece(a: int, e: int, k: int) -> Callable[..., tuple[torch.Tensor, ...]]:
        def run(x: torch.Tensor, *skips: torch.Tensor) -> tuple[torch.Tensor, ...]:
            y, out = run_span(store, layers[a:e], x, list(zip(names[k], skips)), names[k + 1])
            return (y, *out)
        return run

    pieces = [(piece(a, e, k), [b for layer in layers[a:e] for b in layer.buffers()]) for k, (a, e) in enumerate(bounds)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        skips: tuple[torch.Tensor, ...] = ()
        anchor = torch.empty(0, requires_grad=True)  # so a piece whose inputs need no gradient still gets a backward
        for k, (run, buffers) in enumerate(pieces):
            if k == len(pieces) - 1 or not torch.is_grad_enabled():  # the last piece's graph kept, as torch's
                y, *rest = run(x, *skips)
            else:
                y, *rest = _Recomputed.apply(run, buffers, anchor, x, *skips)
            x, skips = y, tuple(rest)
        return x

    return forward


Shapes = list[tuple[tuple[int, ...], torch.dtype]]


class Carried(nn.Sequential):
    """A pipeline partition across whose cuts skips travel: it takes and returns one tensor, the activation and
    the boundary's skips packed side by side, each flattened per sample (``(N, sum of their sizes)``, at the
    dtype ``torch.cat`` promotes them to; unpacked at each one's own dtype). The same layers, parameters and
    state-dict keys as the plain partition (a ``nn.Sequential`` of them).

    ``names_in``/``names_out``: the skips crossing the cut before / after the partition (empty: that side is one
    tensor). ``incoming``/``outgoing``: (shape per sample, dtype) of the activation and of each of those skips,
    traced on the sample; a spatial part's are not known before the first step: the partition records what it
    packs (:attr:`outgoing`), the runner sends it in the cut's first header, and the receiver's runner sets
    :attr:`incoming` from it (gems.pipeline.runtime). ``memory_format`` (set by the runner): the layout the
    partitions compute in; a channels-last piece is flattened in its own memory order, so packing and
    unpacking convert nothing."""

    def __init__(self, layers: Sequence[nn.Module], store: SkipStore, names_in: Sequence[str],
                 incoming: Shapes | None, names_out: Sequence[str], outgoing: Shapes | None) -> None:
        super().__init__(*layers)
        self._store = store
        self.names_in, self.incoming = list(names_in), incoming
        self.names_out, self.outgoing = list(names_out), outgoing
        self.memory_format = torch.contiguous_format

    def _last(self, ndim: int) -> bool:
        return format_for(self.memory_format, ndim) is not torch.contiguous_format

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        if self._last(t.dim()):
            t = t.movedim(1, -1)
        return t.reshape(t.shape[0], -1)

    def unpack(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The pieces of a packed input, views of it (each at its own dtype); the activation keeps the packed
        tensor's global spatial shape (a spatial part's)."""
        if self.incoming is None:
            raise RuntimeError("a packed activation arrived before its layout (the cut's first header)")
        sizes = [math.prod(shape) for shape, _ in self.incoming]
        out = []
        for piece, (shape, dtype) in zip(torch.split(x, sizes, dim=1), self.incoming):
            if self._last(1 + len(shape)):
                t = piece.reshape(x.shape[0], *shape[1:], shape[0]).movedim(-1, 1)
            else:
                t = piece.reshape(x.shape[0], *shape)
            out.append(t if t.dtype == dtype else t.to(dtype))
        g = getattr(x, GSHAPE, None)
        if g is not None:
            setattr(out[0], GSHAPE, g)
        return out

    def pack(self, pieces: Sequence[torch.Tensor]) -> torch.Tensor:
        """The pieces side by side (carrying the activation's global spatial shape); the first call records their
        layout where it was not traced."""
        if self.outgoing is None:
            self.outgoing = [(tuple(int(v) for v in t.shape[1:]), t.dtype) for t in pieces]
        out = torch.cat([self._flat(t) for t in pieces], dim=1)
        g = getattr(pieces[0], GSHAPE, None)
        if g is not None:
            setattr(out, GSHAPE, g)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        skips: list[tuple[str, torch.Tensor]] = []
        if self.names_in:
            x, *rest = self.unpack(x)
            skips = list(zip(self.names_in, rest))
        y, out = run_span(self._store, list(self), x, skips, self.names_out)
        return self.pack([y, *out]) if self.names_out else y


def cut_contents(layers: Sequence[nn.Module], sample: Sequence[int], dtype: torch.dtype,
                 amp: Callable[[], Any] | None = None) -> list[Shapes]:
    """For the boundary before each layer ``c`` (``c`` = 1 .. n-1): (shape per sample, dtype) of the activation
    and of each skip crossing it (:func:`crossing`'s order), from one forward of ``sample`` (C, *spatial) on
    fake tensors, in eval mode (BatchNorm's buffers untouched), under ``amp`` (the run's autocast region)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sp, store = spans(layers), store_of(layers)
    device = next((p.device for layer in layers for p in layer.parameters()), torch.device("cpu"))
    modes = [(m, m.training) for layer in layers for m in layer.modules()]
    out: list[Shapes] = []
    try:
        for m, _ in modes:
            m.training = False
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), \
                (amp() if amp is not None else contextlib.nullcontext()):
            x = torch.empty((1, *sample), dtype=dtype, device=device)
            for c, layer in enumerate(layers[:-1], start=1):
                x = layer(x)
                held = store.pending(crossing(sp, c)) if store is not None else []
                out.append([(tuple(int(v) for v in t.shape[1:]), t.dtype) for t in [x, *held]])
    finally:
        if store is not None:
            store.clear()
        for m, mode in modes:
            m.training = mode
    return out


def carry(parts: Sequence[nn.Sequential], balance: Sequence[int], sample: Sequence[int] | None, dtype: torch.dtype,
          amp: Callable[[], Any] | None = None) -> tuple[list[nn.Sequential], Shapes | None]:
    """The partitions with the skips that cross their cuts carried (:class:`Carried`), and the (shape, dtype) of
    each message leaving a partition but the last with the micro-batch of ``sample`` (batch first) where they
    changed, else None. Partitions whose cuts no skip crosses are returned as they are. Without ``sample`` (a
    spatial part's partitions, which talk while they run), or where the layers cannot be traced on fake
    tensors, the packed layouts are learnt in the first step (the cut's header) and None is returned."""
    layers = [layer for part in parts for layer in part]
    sp = spans(layers)
    cuts = [sum(balance[:i + 1]) for i in range(len(balance) - 1)]
    names = [crossing(sp, c) for c in cuts]
    if not any(names):
        return list(parts), None
    store = store_of(layers)
    assert store is not None
    at: list[Shapes | None] = [None] * len(cuts)
    if sample is not None:
        try:
            contents = cut_contents(layers, sample[1:], dtype, amp)
            at = [contents[c - 1] for c in cuts]  # per cut: activation, then the crossing skips
        except Exception:  # layers fake tensors cannot run: the layouts come in the first step's headers
            sample = None
    out: list[nn.Sequential] = []
    for i, part in enumerate(parts):
        before = names[i - 1] if i > 0 else []
        after = names[i] if i < len(cuts) else []
        if not before and not after:
            out.append(part)
            continue
        out.append(Carried(list(part), store, before, at[i - 1] if before else None,
                           after, at[i] if after else None))
    if sample is None:
        return out, None
    shapes: Shapes = []
    for i, c in enumerate(at):
        assert c is not None
        if names[i]:
            d = c[0][1]
            for _, t in c[1:]:
                d = torch.promote_types(d, t)
            shapes.append(((int(sample[0]), sum(math.prod(s) for s, _ in c)), d))
        else:
            shapes.append(((int(sample[0]), *c[0][0]), c[0][1]))
    return out, shapes
