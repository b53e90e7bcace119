"""Where this rank's part of a sample lies, and the collectives over the parts.

A :class:`SpatialContext` is what a spatial layer knows of the mesh: the group of the S parts, the parts grid and
this rank's place in it. Every tensor a spatial layer returns is tagged with its global spatial shape, so the next
layer knows how the sample is split without asking (an untagged input costs one tiny all-reduce).
"""
from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gems import capture
from gems.errors import ConfigError
from gems.fake import is_fake
from gems.mesh import ravel, unravel
from gems.progress import waiting
from gems.shapes import GSHAPE, split_bounds
from gems.spatial.geometry import Box, shape_of

_AVG_POOL: dict[int, Callable[..., torch.Tensor]] = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


class SpatialContext:
    """The spatial parts of one sample and this rank's place among them.

    ``group``: the torch.distributed group of the parts (None: the default
    group, which must then be exactly ``ranks``); ``ranks``: the global rank
    of each spatial index ``s`` (row-major over ``parts``); ``parts``: parts
    per cut dim; ``dims``: which spatial dims are cut (0 = depth in 3D, height
    in 2D); ``grid``: this rank's coordinates in the parts grid. ``overlap``
    computes the interior of convolutions and pools while halos are in flight.
    Convolutions and average pools (the no-copy route of gems.spatial.halo)
    always run their op on the part while the halos travel unless ``overlap``
    is False; for the other window layers None means on for CUDA tensors, where
    it hides the exchange, and off on CPU, where the single-window path needs
    less memory (gems/bench/spatial.py).
    """

    def __init__(self, group: Any, ranks: Sequence[int], parts: Sequence[int], dims: Sequence[int],
                 grid: Sequence[int], overlap: bool | None = None) -> None:
        self.group = group
        self.ranks = [int(r) for r in ranks]
        self.parts = tuple(int(p) for p in parts)
        self.dims = tuple(int(d) for d in dims)
        self.grid = tuple(int(g) for g in grid)
        self.overlap = overlap
        if len(self.parts) != len(self.dims):
            raise ConfigError("parallel.spatial_dims", list(self.dims),
                              f"one dim per entry of parallel.spatial={list(self.parts)}")
        if len(set(self.dims)) != len(self.dims) or any(d < 0 for d in self.dims):
            raise ConfigError("parallel.spatial_dims", list(self.dims), "distinct non-negative dims, e.g. [0] or [0,1]")
        if any(p < 1 for p in self.parts):
            raise ConfigError("parallel.spatial", list(self.parts), "positive integers, e.g. 2 or [2,2]")
        if (len(self.ranks) != self.size or len(self.grid) != len(self.parts)
                or not all(0 <= g < p for g, p in zip(self.grid, self.parts))):
            raise ValueError(f"SpatialContext: {len(self.ranks)} ranks and grid {self.grid} do not fit parts {self.parts}")
        self.index = ravel(self.grid, self.parts)
        #: seconds spent exchanging halos (packing, waiting, backward), by layer label
        self.halo_seconds: dict[str, float] = defaultdict(float)
        self._comm_streams: dict[Any, Any] = {}
        #: forward halo sends not yet known complete, with their buffers (gems.spatial.halo.Exchange)
        self.sends_in_flight: list[tuple[list[Any], list[torch.Tensor]]] = []
        #: (local, global) spatial shape of the last activation tagged (what untagged fake parts are read by)
        self.last_mark: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._tags = 0

    # ---- what the halo code and the layers ask of the context (a shape-only stand-in, such as the
    # planner's, overrides these three instead of patching the modules that call them) ----------------
    def exchange(self, send: list[tuple[int, torch.Tensor]], recv: list[tuple[int, torch.Tensor]],
                 tag: int = 0) -> "Posted":
        """Post this part's halo messages as one batch (one NCCL group): at most one message each way per peer
        (global ranks), so that a pair's messages match by the order of its batches, the same on both sides
        whatever the tags (NCCL has none; ``tag`` keeps gloo's layers apart)."""
        if len({p for p, _ in send}) != len(send) or len({p for p, _ in recv}) != len(recv):
            raise ValueError(f"one halo message per peer and direction: sends to {[p for p, _ in send]}, "
                             f"receives from {[p for p, _ in recv]}")
        ops = [dist.P2POp(dist.irecv, t, peer, group=self.group, tag=tag) for peer, t in recv]
        ops += [dist.P2POp(dist.isend, t, peer, group=self.group, tag=tag) for peer, t in send]
        works = capture.launch(lambda: dist.batch_isend_irecv(ops), self.group) if ops else []  # one order inside a graph
        return Posted(works, len(recv), len(send), [t for _, t in [*recv, *send]])

    def avg_pool(self, nd: int) -> Callable[..., torch.Tensor]:
        """The average-pooling function the spatial pooling layers call for ``nd`` spatial dims."""
        return _AVG_POOL[nd]

    def index_math(self) -> contextlib.AbstractContextManager[Any]:
        """Where layers compute index tensors from shapes (upsampling sources): nothing to do here; a
        stand-in tracing on fake tensors computes them on real ones."""
        return contextlib.nullcontext()

    def drain_sends(self) -> None:
        """Wait for the forward halo sends still in flight and let their buffers go. Called by the next
        exchange, and by the worker before a step it profiles ends: a message still in flight when the
        profiler stops (its buffer allocated under the profiler, freed after it) corrupted the heap of
        gloo ranks when memory was profiled."""
        with waiting("halo"):
            for works, _ in self.sends_in_flight:
                for w in works:
                    w.wait()
        self.sends_in_flight.clear()

    def new_tag(self) -> int:
        """A message tag for a new spatial layer: the same on every rank, because
        every rank builds the same layers in the same order (0 is the untagged one)."""
        self._tags += 1
        return 4 * self._tags

    @classmethod
    def from_mesh(cls, mesh: Any, rank: int, overlap: bool | None = None) -> "SpatialContext":
        """The context of ``rank`` on a :class:`gems.mesh.Mesh` whose groups are built."""
        ranks = mesh.ranks("spatial") or [rank]
        return cls(mesh.group("spatial"), ranks, mesh.parts, mesh.spatial_dims, mesh.grid_of(mesh.coord(rank).spatial), overlap)

    # ---- the parts grid ------------------------------------------------------------
    @property
    def size(self) -> int:
        return math.prod(self.parts)

    @property
    def rank(self) -> int:
        return self.ranks[self.index]

    def coords(self, s: int) -> tuple[int, ...]:
        return unravel(s, self.parts)

    def boxes(self, gshape: Sequence[int]) -> list[Box]:
        """The box (per spatial dim ``[lo, hi)``) that each spatial index owns of a ``gshape`` activation."""
        splits = [split_bounds(int(gshape[d]), p) for d, p in zip(self.dims, self.parts)]
        out = []
        for s in range(self.size):
            c = self.coords(s)
            box = [(0, int(n)) for n in gshape]
            for k, d in enumerate(self.dims):
                box[d] = splits[k][c[k]]
            out.append(tuple(box))
        return out

    def box(self, gshape: Sequence[int]) -> Box:
        """This rank's box of a ``gshape`` activation."""
        return self.boxes(gshape)[self.index]

    def check_ndim(self, ndim: int) -> None:
        """A ConfigError when a cut dim is not among the ``ndim`` spatial dims."""
        bad = [d for d in self.dims if d >= ndim]
        if bad:
            raise ConfigError("parallel.spatial_dims", list(self.dims),
                              f"spatial dims of this {ndim}-D model, each in 0..{ndim - 1} "
                              f"(0 = {'depth' if ndim == 3 else 'height'})")

    def check_shape(self, spatial_shape: Sequence[int]) -> None:
        """A ConfigError when the sample cannot be cut as asked."""
        self.check_ndim(len(spatial_shape))
        for d, p in zip(self.dims, self.parts):
            if p > int(spatial_shape[d]):
                raise ConfigError("parallel.spatial", list(self.parts) if len(self.parts) > 1 else p,
                                  f"at most {spatial_shape[d]} parts along spatial dim {d}: the sample has "
                                  f"{spatial_shape[d]} cells there (shape {list(spatial_shape)})")

    def local_slices(self, spatial_shape: Sequence[int]) -> tuple[slice, ...]:
        """This rank's part of a sample of ``spatial_shape``, one slice per spatial dim."""
        self.check_shape(spatial_shape)
        return tuple(slice(lo, hi) for lo, hi in self.box(spatial_shape))

    # ---- global shapes --------------------------------------------------------------
    def mark(self, x: torch.Tensor, gshape: Sequence[int]) -> torch.Tensor:
        """Tag ``x`` (this rank's part) with the global spatial shape of the activation."""
        setattr(x, GSHAPE, tuple(int(n) for n in gshape))
        self.last_mark = (tuple(int(v) for v in x.shape[2:]), tuple(int(n) for n in gshape))
        return x

    def shapes_only(self) -> bool:
        """Whether this context moves no data: torch's fake process group (the dry run, gems.dryrun); the
        planner's shape-only stand-in says so too. Untagged fake parts then have their global shape inferred
        instead of summed over the parts."""
        return dist.is_initialized() and dist.get_backend(self.group) == "fake"

    def infer_global_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """The global shape of an untagged part ``x`` without a collective, for fake tensors (the planner's
        trace, the dry run: shapes without values): along each cut dim, the extent nearest the last tagged
        activation's ratio for which this rank's part of the split has ``x``'s local size."""
        local = [int(v) for v in x.shape[2:]]
        last = self.last_mark
        ref_l, ref_g = last if last is not None and len(last[0]) == len(local) else (local, local)
        out = list(local)
        for k, (d, p) in enumerate(zip(self.dims, self.parts)):
            est = ref_g[d] * local[d] / ref_l[d] if ref_l[d] else ref_g[d]
            lo = max(0, local[d] * p - p)
            cands = [n for n in range(lo, local[d] * p + p + 1)
                     if split_bounds(n, p)[self.grid[k]][1] - split_bounds(n, p)[self.grid[k]][0] == local[d]]
            out[d] = min(cands, key=lambda n: abs(n - est)) if cands else int(round(est))
        g = tuple(out)
        self.mark(x, g)
        return g

    def global_shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """The global spatial shape of the activation whose part is ``x``.

        Read from the tag when a spatial layer made ``x``; otherwise summed
        over the parts (every rank of the group must call this together, which
        holds because every rank runs the same layers on the same kind of input).
        """
        g = getattr(x, GSHAPE, None)
        if g is not None and len(g) == x.dim() - 2:
            return tuple(g)
        nd = x.dim() - 2
        self.check_ndim(nd)
        if is_fake(x) and self.shapes_only():
            return self.infer_global_shape(x)
        if self.size == 1:
            g = tuple(int(n) for n in x.shape[2:])
        else:
            v = [0] * nd
            for j in range(nd):
                if j in self.dims:
                    k = self.dims.index(j)
                    if all(c == 0 for i, c in enumerate(self.grid) if i != k):
                        v[j] = int(x.shape[2 + j])
                elif self.index == 0:
                    v[j] = int(x.shape[2 + j])
            t = torch.tensor(v, dtype=torch.int64, device=x.device)
            with waiting("spatial collective"):
                capture.launch(lambda: dist.all_reduce(t, group=self.group), self.group)
            g = tuple(int(n) for n in t.tolist())
        self.mark(x, g)
        return g

    def overlaps(self, x: torch.Tensor) -> bool:
        """Whether layers compute their interior while halos of ``x`` travel."""
        return x.is_cuda if self.overlap is None else bool(self.overlap)

    def comm_stream(self, device: torch.device) -> Any:
        """The side CUDA stream that packs and posts halo messages for ``device``."""
        if device not in self._comm_streams:
            self._comm_streams[device] = torch.cuda.Stream(device=device)
        return self._comm_streams[device]

    # ---- full sample <-> part ----------------------------------------------------------
    def scatter(self, x_full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full ``(N, C, *spatial)`` tensor (a copy; no communication)."""
        sl = self.local_slices(x_full.shape[2:])
        return self.mark(x_full[(slice(None), slice(None), *sl)].clone(), x_full.shape[2:])

    def gather(self, x_local: torch.Tensor) -> torch.Tensor:
        """The full activation on every part; backward sums the parts' gradients, then slices."""
        if self.size == 1:
            return x_local
        return _Gather.apply(x_local, self, self.global_shape(x_local))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Differentiable sum over the parts of a quantity every part then uses."""
        if self.size == 1:
            return x
        return _AllReduceSum.apply(x, self)

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum over the parts (no gradient: callers route it themselves)."""
        return self.reduce(x, dist.ReduceOp.MAX)

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        """The element-wise minimum over the parts (no gradient)."""
        return self.reduce(x, dist.ReduceOp.MIN)

    def all_reduce_sum_grad(self, g: torch.Tensor) -> torch.Tensor:
        """The sum over the parts of a gradient (inside a backward: not differentiable)."""
        return self.reduce(g, dist.ReduceOp.SUM)

    def reduce(self, x: torch.Tensor, op: Any) -> torch.Tensor:
        """``x`` reduced with ``op`` over the parts, as a new tensor (no gradient)."""
        y = x.detach().clone().contiguous()
        if self.size > 1:
            with waiting("spatial collective"):
                capture.launch(lambda: dist.all_reduce(y, op=op, group=self.group), self.group)  # on the rank's device
        return y


class Posted:
    """One batch of halo messages in flight. torch hands back one work per message (gloo) or one for the whole
    batch (NCCL's coalescing path); :attr:`receives` and :attr:`sends` are the works that cover each side either
    way (the one work stands for both), and :attr:`buffers` holds every tensor the batch moves, so that none is
    freed before a work that covers it has been waited for (the holder keeps the batch until then)."""

    def __init__(self, works: list[Any], n_recv: int, n_send: int, buffers: list[torch.Tensor]) -> None:
        if len(works) == n_recv + n_send:
            self.receives, self.sends = list(works[:n_recv]), list(works[n_recv:])
        else:  # one work for the batch: waiting for either side waits for the whole
            self.receives, self.sends = (list(works) if n_recv else []), (list(works) if n_send else [])
        self.buffers = buffers


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sctx: SpatialContext, gshape: tuple[int, ...]) -> torch.Tensor:
        boxes = sctx.boxes(gshape)
        big = [max(b[j][1] - b[j][0] for b in boxes) for j in range(len(gshape))]
        pad: list[int] = []
        for j in reversed(range(len(gshape))):
            pad += [0, big[j] - x.shape[2 + j]]
        xp = F.pad(x, pad).contiguous() if any(pad) else x.contiguous()
        bufs = [torch.empty_like(xp) for _ in range(sctx.size)]
        with waiting("spatial collective"):
            capture.launch(lambda: dist.all_gather(bufs, xp, group=sctx.group), sctx.group)
        full = x.new_empty((x.shape[0], x.shape[1], *gshape))
        for b, buf in zip(boxes, bufs):
            full[(slice(None), slice(None), *(slice(lo, hi) for lo, hi in b))] = \
                buf[(slice(None), slice(None), *(slice(0, n) for n in shape_of(b)))]
        ctx.sctx, ctx.box = sctx, boxes[sctx.index]
        return full

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        g = g.contiguous().clone()
        with waiting("spatial collective"):
            capture.launch(lambda: dist.all_reduce(g, group=ctx.sctx.group), ctx.sctx.group)
        return g[(slice(None), slice(None), *(slice(lo, hi) for lo, hi in ctx.box))].contiguous(), None, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sctx: SpatialContext) -> torch.Tensor:
        y = x.detach().clone().contiguous()
        with waiting("spatial collective"):
            capture.launch(lambda: dist.all_reduce(y, group=sctx.group), sctx.group)
        ctx.sctx = sctx
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        g = g.contiguous().clone()
        with waiting("spatial collective"):
            capture.launch(lambda: dist.all_reduce(g, group=ctx.sctx.group), ctx.sctx.group)
        return g, None
