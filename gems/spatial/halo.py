"""Halo exchange as an autograd function: the cells a rank needs but does not own.

A spatial layer says which input box each part needs for the outputs it owns
(:mod:`gems.spatial.geometry`). :func:`plan` intersects those boxes with what
every part owns: the pieces to send and to receive, edges and corners
included when several dims are cut, and wider than one neighbour when a layer
reads that far. :class:`Pending` posts them non-blocking
(``batch_isend_irecv``) from detached data, so the layer can compute the
interior of its output while they are in flight; :class:`Assemble` then builds
the windows the layer asked for, and its backward is the adjoint of the
exchange: each halo gradient goes back to the rank that owns the cells and is
*added* to that rank's gradient (the gradient of a cell is the sum over every
output that read it, wherever that output was computed).

On CUDA the boundary slices are packed and the messages posted on a side
stream, so packing never queues behind the interior kernel on the compute
stream; ``wait`` makes the compute stream wait for the side stream (the host
only blocks for backends that complete on the host, such as gloo). On CPU the
same code runs with gloo, whose transport threads move the data while the
interior is computed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

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


def _exchange(sctx: SpatialContext, send: list[tuple[int, torch.Tensor]], recv: list[tuple[int, torch.Tensor]]) -> list[Any]:
    ops = [dist.P2POp(dist.irecv, t, peer, group=sctx.group) for peer, t in recv]
    ops += [dist.P2POp(dist.isend, t, peer, group=sctx.group) for peer, t in send]
    return dist.batch_isend_irecv(ops) if ops else []


class Pending:
    """Halo messages in flight for one layer's forward (posted from detached data)."""

    def __init__(self, sctx: SpatialContext, x: torch.Tensor, p: Plan, label: str) -> None:
        t0 = time.perf_counter()
        self.sctx, self.plan, self.label = sctx, p, label
        self.stream = None
        x = x.detach()
        if x.is_cuda:
            main = torch.cuda.current_stream(x.device)
            self.stream = sctx.comm_stream(x.device)
            self.stream.wait_stream(main)  # x is ready on the compute stream
            with torch.cuda.stream(self.stream):
                self._post(x)
            x.record_stream(self.stream)
        else:
            self._post(x)
        sctx.halo_seconds[label] += time.perf_counter() - t0

    def _post(self, x: torch.Tensor) -> None:
        n, c = x.shape[:2]
        self.bufs = [x.new_empty((n, c, *shape_of(box))) for _, box in self.plan.recvs]
        self.sent = [_region(x, box, self.plan.own).contiguous() for _, box in self.plan.sends]
        self.works = _exchange(self.sctx, [(peer, t) for (peer, _), t in zip(self.plan.sends, self.sent)],
                               [(peer, t) for (peer, _), t in zip(self.plan.recvs, self.bufs)])

    def wait(self) -> list[torch.Tensor]:
        """The received pieces, usable on the current stream."""
        t0 = time.perf_counter()
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                for w in self.works:
                    w.wait()
            main = torch.cuda.current_stream(self.stream.device)
            main.wait_stream(self.stream)
            for b in self.bufs:
                b.record_stream(main)
        else:
            for w in self.works:
                w.wait()
        self.works = []
        self.sctx.halo_seconds[self.label] += time.perf_counter() - t0
        return self.bufs


class Assemble(torch.autograd.Function):
    """Windows (boxes inside ``plan.need``) built from the local part and the
    received pieces; backward returns the halo gradients to their owners."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, info: tuple[SpatialContext, Plan, tuple[Box, ...], str],
                *recvd: torch.Tensor) -> tuple[torch.Tensor, ...]:
        _, p, targets, _, fill = info
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
        sctx, p, targets, label, _ = ctx.info
        t_start = time.perf_counter()
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
        works = _exchange(sctx, [(peer, gb) for (peer, _), gb in zip(p.recvs, gbufs)],
                          [(peer, b) for (peer, _), b in zip(p.sends, back)])
        for w in works:
            w.wait()
        for (_, box), b in zip(p.sends, back):
            gx[local_index(box, p.own)] += b
        sctx.halo_seconds[label] += time.perf_counter() - t_start
        return (gx, None, *([None] * len(p.recvs)))


def windows(sctx: SpatialContext, x: torch.Tensor, p: Plan, targets: list[Box], label: str,
            pending: Pending | None = None, fill: float = 0.0) -> tuple[torch.Tensor, ...]:
    """The input windows ``targets`` of the part ``x``: boxes inside ``p.need``
    or reaching past the sample's edges, where they hold ``fill`` (padding)."""
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
        pending = Pending(sctx, x, p, label)
    recvd = pending.wait()
    return Assemble.apply(x, (sctx, p, tuple(targets), label, fill), *recvd)
