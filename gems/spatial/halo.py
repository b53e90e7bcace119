"""Halo exchange as autograd functions: the cells a rank needs but does not own, and their gradients sent back.

:func:`plan` intersects the input box each part's outputs read (gems.spatial.geometry) with what every part owns;
:class:`Pending` posts the pieces in one batch from detached data (on CUDA from a side stream), so the layer computes
its interior while they travel; :class:`Assemble` builds the windows, and its backward adds each halo gradient to the
owner's. Linear window ops take the no-copy route (:class:`Exchange`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gems import capture, timers
from gems.progress import waiting
from gems.spatial.context import SpatialContext
from gems.spatial.geometry import Box, intersect, is_empty, local_index, shape_of


@dataclass(frozen=True)
class Plan:
    """One rank's part of an exchange: what it owns, needs, sends and receives."""

    own: Box  # the box of the input this rank holds
    need: Box  # the (clipped) input box its outputs read
    recvs: tuple[tuple[int, Box], ...]  # (global rank of the owner, box) for each piece received
    sends: tuple[tuple[int, Box], ...]  # (global rank of the reader, box) for each piece sent

    @property
    def quiet(self) -> bool:
        return not self.recvs and not self.sends


def plan(sctx: SpatialContext, gshape: tuple[int, ...], needs: list[Box]) -> Plan:
    """The exchange when spatial index ``s`` needs ``needs[s]`` of a ``gshape`` activation."""
    owners = sctx.boxes(gshape)
    me = sctx.index
    recvs, sends = [], []
    for s in range(sctx.size):
        if s == me:
            continue
        r = intersect(owners[s], needs[me])
        if not is_empty(r):
            recvs.append((sctx.ranks[s], r))
        t = intersect(owners[me], needs[s])
        if not is_empty(t):
            sends.append((sctx.ranks[s], t))
    return Plan(owners[me], needs[me], tuple(recvs), tuple(sends))


def _region(x: torch.Tensor, box: Box, holder: Box) -> torch.Tensor:
    return x[local_index(box, holder)]


class Pending:
    """Halo messages in flight for one layer's forward (posted from detached data)."""

    def __init__(self, sctx: SpatialContext, x: torch.Tensor, p: Plan, label: str, tag: int = 0) -> None:
        t0 = timers.now(x.device)
        self.sctx, self.plan, self.label, self.tag = sctx, p, label, tag
        self.stream = None
        x = x.detach()
        if x.is_cuda:
            main = torch.cuda.current_stream(x.device)
            self.stream = sctx.comm_stream(x.device)
            capture.join(self.stream, main)  # x is ready on the compute stream (the buffers received before go)
            with torch.cuda.stream(self.stream):
                self._post(x)
            capture.keep(x, self.stream, main)  # (inside a graph: held until wait's join, not recorded: gems.capture)
        else:
            self._post(x)
        timers.add_since(sctx.halo_seconds, label, t0)

    def _post(self, x: torch.Tensor) -> None:
        n, c = x.shape[:2]
        self.bufs = [x.new_empty((n, c, *shape_of(box))) for _, box in self.plan.recvs]
        self.sent = [_region(x, box, self.plan.own).contiguous() for _, box in self.plan.sends]
        self.posted: Any = self.sctx.exchange([(peer, t) for (peer, _), t in zip(self.plan.sends, self.sent)],
                                         [(peer, t) for (peer, _), t in zip(self.plan.recvs, self.bufs)], self.tag)

    def wait(self) -> list[torch.Tensor]:
        """The received pieces, usable on the current stream: on CUDA the compute stream waits for the side stream
        (packing never queued behind the interior's kernel there); the host blocks only for backends that complete
        on the host, such as gloo."""
        t0 = timers.now(self.stream.device if self.stream is not None else None)
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                _wait([*self.posted.receives, *self.posted.sends])
            main = torch.cuda.current_stream(self.stream.device)
            capture.join(main, self.stream)  # (x goes: the sends that read it come before what main runs next)
            for b in self.bufs:  # made on the side stream, read on main: held until the next post's join
                capture.keep(b, main, self.stream)
        else:
            _wait([*self.posted.receives, *self.posted.sends])
        self.posted = None
        self.sent = []
        timers.add_since(self.sctx.halo_seconds, self.label, t0)
        return self.bufs


class Assemble(torch.autograd.Function):
    """Windows (boxes inside ``plan.need``) built from the local part and the
    received pieces; backward returns the halo gradients to their owners."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, info: tuple[Any, ...],  # (sctx, plan, targets, label, fill, tag)
                *recvd: torch.Tensor) -> tuple[torch.Tensor, ...]:
        _, p, targets, _, fill, _ = info
        n, c = x.shape[:2]
        outs = []
        for tgt in targets:
            inside = intersect(tgt, p.need) == tgt
            out = x.new_empty((n, c, *shape_of(tgt))) if inside else x.new_full((n, c, *shape_of(tgt)), fill)
            for holder, src in [(p.own, x), *[(box, buf) for (_, box), buf in zip(p.recvs, recvd)]]:
                r = intersect(holder, tgt)
                if not is_empty(r):
                    out[local_index(r, tgt)] = _region(src, r, holder)
            outs.append(out)
        ctx.info, ctx.xshape, ctx.xdtype, ctx.xdevice = info, x.shape, x.dtype, x.device
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        sctx, p, targets, label, _, tag = ctx.info
        t_start = timers.now(ctx.xdevice)
        n, c = ctx.xshape[:2]
        kw: dict[str, Any] = dict(dtype=ctx.xdtype, device=ctx.xdevice)
        gx = torch.zeros(ctx.xshape, **kw)
        gbufs = [torch.zeros((n, c, *shape_of(box)), **kw) for _, box in p.recvs]
        for tgt, g in zip(targets, grads):
            if g is None:
                continue
            for holder, dst in [(p.own, gx), *[(box, gb) for (_, box), gb in zip(p.recvs, gbufs)]]:
                r = intersect(holder, tgt)
                if not is_empty(r):
                    dst[local_index(r, holder)] += g[local_index(r, tgt)]
        back = [torch.empty((n, c, *shape_of(box)), dtype=gx.dtype, device=gx.device) for _, box in p.sends]
        posted = sctx.exchange([(peer, gb) for (peer, _), gb in zip(p.recvs, gbufs)],
                               [(peer, b) for (peer, _), b in zip(p.sends, back)], tag + 1)
        _wait(posted.receives)  # the sends are waited for when the backward ends, their buffers held till then
        _after_backward(sctx, label, posted.sends, gbufs)
        for (_, box), b in zip(p.sends, back):
            gx[local_index(box, p.own)] += b
        timers.add_since(sctx.halo_seconds, label, t_start)
        return (gx, None, *([None] * len(p.recvs)))


def windows(sctx: SpatialContext, x: torch.Tensor, p: Plan, targets: list[Box], label: str,
            pending: Pending | None = None, fill: float = 0.0, tag: int = 0) -> tuple[torch.Tensor, ...]:
    """The input windows ``targets`` of the part ``x``: boxes inside ``p.need``
    or reaching past the sample's edges, where they hold ``fill`` (padding).
    ``tag``: the layer's message tag (forward ``tag``, backward ``tag + 1``), the
    same whichever route a rank takes, so ranks on different routes still match."""
    if p.quiet:  # nothing to exchange: slices of the local part (views), padded where asked
        out = []
        for t in targets:
            inner = intersect(t, p.own)
            w = _region(x, inner, p.own)
            pads: list[int] = []
            for (lo, hi), (ilo, ihi) in reversed(list(zip(t, inner))):
                pads += [ilo - lo, hi - ihi]
            out.append(F.pad(w, pads, value=fill) if any(pads) else w)
        return tuple(out)
    if pending is None:
        pending = Pending(sctx, x, p, label, tag)
    recvd = pending.wait()
    return Assemble.apply(x, (sctx, p, tuple(targets), label, fill, pending.tag), *recvd)


# ---- the route of linear ops: no copy of the part ------------------------------------------------
class Exchange(Pending):
    """One call of one layer's tagged exchange: halo values forward, their gradients backward.

    The no-copy route of linear window ops (convolution, average pooling; :class:`Source`, :class:`Shell`,
    :class:`AddInto`): the op runs on the local part as it is, with its own zero padding along the cut dims, and the
    few boundary planes are then corrected by adding the op applied to a *shell* window that holds only the received
    halo cells (zeros elsewhere); by linearity the sum equals the op on the assembled window. The gradient side is
    split over two nodes so that nothing of the part's size is allocated: the shell sends the halo gradients back,
    and the source, an identity upstream of the op, adds those it receives into the op's input gradient in place.
    Measured on CosmoFlow 128³ at S = 2 on CPU, the copy route spent more time assembling, zero-filling and
    scattering full-size windows than exchanging halos (gems bench spatial). The messages carry the layer's tags, so
    the two nodes may post and wait at different times without mismatching.

    Forward messages use ``tag``, backward ones ``tag + 1``. Backward, every
    rank posts all of this call's messages at its first node of the call
    (:class:`Shell` or :class:`Source`). A gloo send completes only once the
    receiver has posted its receive, so a rank never waits for its sends in
    the middle of the backward (where it would idle until the neighbour
    reaches the matching node): the received gradients are waited for where
    they are added, the sends at the end of the backward pass.
    """

    def __init__(self, sctx: SpatialContext, x: torch.Tensor, p: Plan, label: str, tag: int) -> None:
        self.meta = (x.shape[0], x.shape[1], x.dtype, x.device)
        self.bwd_recvs: list[Any] | None = None
        self.gsent: list[torch.Tensor] = []
        super().__init__(sctx, x, p, label, tag)

    def wait(self) -> list[torch.Tensor]:
        """The received pieces. On the host, this layer's sends are not waited for here (that
        would idle a rank whose neighbour has not reached the layer yet, e.g. one that only
        sends): they are waited for once a later exchange has received, by which time the
        neighbours have posted the matching receives."""
        if self.stream is not None:
            return super().wait()
        t0 = timers.now(None)  # the host's own wait (the CUDA route is Pending.wait's)
        posted = self.posted
        _wait(posted.receives)
        if posted.receives or not posted.sends:
            self.sctx.drain_sends()
        if posted.sends:  # waited for by a later exchange, their buffers held till then
            self.sctx.sends_in_flight.append((posted.sends, self.sent))
        self.posted, self.sent = None, []
        timers.add_since(self.sctx.halo_seconds, self.label, t0)
        return self.bufs

    def post_backward(self, gbufs: list[torch.Tensor] | None) -> None:
        """Send the gradients of the received halos (zeros when ``None``) and receive those of the sent cells."""
        if self.bwd_recvs is not None:
            return
        self.sctx.drain_sends()
        n, c, dtype, device = self.meta
        t0 = timers.now(device)
        p = self.plan
        if gbufs is None:
            gbufs = [torch.zeros((n, c, *shape_of(box)), dtype=dtype, device=device) for _, box in p.recvs]
        self.gsent = [torch.empty((n, c, *shape_of(box)), dtype=dtype, device=device) for _, box in p.sends]
        posted = self.sctx.exchange([(peer, g) for (peer, _), g in zip(p.recvs, gbufs)],
                                    [(peer, g) for (peer, _), g in zip(p.sends, self.gsent)], self.tag + 1)
        self.bwd_recvs = posted.receives
        _after_backward(self.sctx, self.label, posted.sends, gbufs)
        timers.add_since(self.sctx.halo_seconds, self.label, t0)

    def finish_backward(self, g: torch.Tensor | None) -> torch.Tensor | None:
        """Wait for the gradients of the sent cells; add them into ``g`` (the part's gradient) in place."""
        self.post_backward(None)
        t0 = timers.now(self.meta[3])
        _wait(self.bwd_recvs or [])
        if g is not None:
            for (_, box), gs in zip(self.plan.sends, self.gsent):
                g[local_index(box, self.plan.own)] += gs
        self.gsent, self.bwd_recvs = [], []
        timers.add_since(self.sctx.halo_seconds, self.label, t0)
        return g


def _wait(works: Any) -> None:
    """Wait for halo messages (the watchdog sees a rank that waits here as waiting for a neighbour)."""
    with waiting("halo"):
        for w in works:
            w.wait()


def _after_backward(sctx: SpatialContext, label: str, works: list[Any], keep: list[torch.Tensor]) -> None:
    """Wait for ``works`` (sends of ``keep``) when the current backward pass ends (now, outside one)."""
    if not works:
        return

    def finish() -> None:
        t0 = timers.now(keep[0].device if keep else None)
        _wait(works)
        keep.clear()
        timers.add_since(sctx.halo_seconds, label, t0)

    try:
        torch.autograd.Variable._execution_engine.queue_callback(finish)
    except RuntimeError:  # not inside a backward pass
        finish()


class Source(torch.autograd.Function):
    """Identity on a part whose cells other ranks read as halos; backward adds
    the gradients those ranks send back into the part's gradient, in place."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ex: Exchange) -> torch.Tensor:
        ctx.ex = ex
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        # g is the input gradient of the one op that reads the part (fresh, owned by this node)
        return ctx.ex.finish_backward(g), None


class Shell(torch.autograd.Function):
    """Windows ``targets`` (boxes, padding included) holding only the received
    halo cells, zeros elsewhere; backward sends the halo gradients to their owners.

    ``anchor`` (the part, through :class:`Source`) only places this node
    downstream of the source, so that it runs first in the backward.
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, ex: Exchange, targets: tuple[Box, ...],
                *recvd: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, c = anchor.shape[:2]
        p = ex.plan
        outs = []
        for tgt in targets:
            out = anchor.new_zeros((n, c, *shape_of(tgt)))
            for (_, box), buf in zip(p.recvs, recvd):
                r = intersect(box, tgt)
                if not is_empty(r):
                    out[local_index(r, tgt)] = _region(buf, r, box)
            outs.append(out)
        ctx.ex, ctx.targets = ex, targets
        ctx.set_materialize_grads(False)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ex: Exchange = ctx.ex
        p = ex.plan
        n, c, dtype, device = ex.meta
        gbufs = [torch.zeros((n, c, *shape_of(box)), dtype=dtype, device=device) for _, box in p.recvs]
        for tgt, g in zip(ctx.targets, grads):
            if g is None:
                continue
            for (_, box), gb in zip(p.recvs, gbufs):
                r = intersect(box, tgt)
                if not is_empty(r):
                    gb[local_index(r, box)] += g[local_index(r, tgt)]
        ex.post_backward(gbufs)
        return (None, None, None, *([None] * len(p.recvs)))


class AddInto(torch.autograd.Function):
    """``y[idx] += part`` for each (index, part), in place on ``y`` (an op's fresh output that its
    op does not save); backward passes the gradient through and hands each part its slice."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, idxs: tuple[tuple[slice, ...], ...], *parts: torch.Tensor) -> torch.Tensor:
        for idx, t in zip(idxs, parts):
            y[idx] += t
        ctx.mark_dirty(y)
        ctx.idxs = idxs
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return (g, None, *[g[idx] for idx in ctx.idxs])
