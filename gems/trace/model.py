"""The model's trace (the planner's, and the run's recomputed pieces'): the real (spatial) model run layer by
layer on fake tensors at a rank's local shapes, with a shape-only stand-in for its spatial context and CUDA
autocast's casting rules on GPU targets; what autograd saves, per layer (:mod:`gems.plan.memory` adds it up,
:mod:`gems.trace.ops` counts its ops, :func:`piece_costs` weighs the run's recomputed pieces on it).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gems.errors import ConfigError, RunError
from gems.models.skips import spans

# ============================================================================ precision
_LOW_OPS: set[Any] = {
    torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d,
    F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.bmm, torch.addmm,
    torch.baddbmm, torch.addbmm, torch.prelu, F.prelu, torch.einsum,
}
_FP32_OPS: set[Any] = {
    torch.exp, torch.log, torch.log1p, torch.expm1, torch.pow, torch.Tensor.pow, torch.rsqrt, torch.reciprocal,
    F.softplus, F.layer_norm, F.group_norm, F.mse_loss, F.l1_loss, F.smooth_l1_loss, F.nll_loss, F.cross_entropy,
    F.binary_cross_entropy_with_logits, F.kl_div, torch.cdist, torch.logsumexp,
}
_FP32_OUT_OPS: set[Any] = {  # CUDA autocast runs these with dtype=float32 (no copy of the input)
    torch.sum, torch.Tensor.sum, torch.prod, torch.Tensor.prod, torch.cumsum, torch.Tensor.cumsum,
    torch.softmax, torch.Tensor.softmax, F.softmax, torch.log_softmax, torch.Tensor.log_softmax, F.log_softmax,
}


class _CudaAutocast(torch.overrides.TorchFunctionMode):
    """CUDA autocast's casting rules on CPU (fake) tensors: a GPU plan on a machine without a GPU.

    ``torch.autocast("cuda")`` is disabled where CUDA is absent and CPU autocast
    follows other lists (``avg_pool3d``, for one, runs in fp32 on CPU only), so
    the ops that matter for CNNs are cast here as CUDA would: convolutions and
    matmuls in the low dtype (leaf weights cast once and cached, as autocast
    does), reductions, softmax, norms and losses in fp32, everything else in
    the dtype of its inputs.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.cache: dict[int, torch.Tensor] = {}

    def _cast(self, v: Any, dtype: torch.dtype) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != dtype and v.dtype != torch.float64:
            if v.is_leaf and v.requires_grad and dtype == self.dtype:
                key = id(v)
                if key not in self.cache:
                    self.cache[key] = v.to(dtype)
                return self.cache[key]
            return v.to(dtype)
        if isinstance(v, (list, tuple)):
            return type(v)(self._cast(a, dtype) for a in v)
        return v

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _LOW_OPS:
            args = tuple(self._cast(a, self.dtype) for a in args)
            kwargs = {k: self._cast(v, self.dtype) for k, v in kwargs.items()}
        elif func in _FP32_OPS:
            args = tuple(self._cast(a, torch.float32) for a in args)
            kwargs = {k: self._cast(v, torch.float32) for k, v in kwargs.items()}
        elif func in _FP32_OUT_OPS and args and isinstance(args[0], torch.Tensor) \
                and args[0].dtype in (torch.float16, torch.bfloat16) and kwargs.get("dtype") is None:
            kwargs["dtype"] = torch.float32
        return func(*args, **kwargs)


def precision_context(precision: str, gpu: bool) -> Callable[[], Any]:
    """A factory of the context that applies ``train.precision`` as the target device would."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    if gpu:
        return lambda: _CudaAutocast(dtype)
    return lambda: torch.autocast("cpu", dtype=dtype)  # fp16 too: CPU ranks autocast to it (gems.precision)


# ============================================================================ the spatial stand-in
def spatial_stand_in(parts: Sequence[int], dims: Sequence[int], grid: Sequence[int], overlap: bool | None) -> Any:
    """A SpatialContext for one part whose collectives only make tensors of the right shapes."""
    from gems.spatial.context import Posted, SpatialContext

    class _Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, sctx: Any, gshape: tuple[int, ...]) -> torch.Tensor:
            boxes = sctx.boxes(gshape)
            big = [max(b[j][1] - b[j][0] for b in boxes) for j in range(len(gshape))]
            part = x.shape[0] * x.shape[1] * math.prod(big) * x.element_size()
            full = x.shape[0] * x.shape[1] * math.prod(gshape) * x.element_size()
            sctx.comm_log.append((sctx.layer[0], sctx.size * part + full))
            sctx.times.append((sctx.layer[0], "gather", full, sctx.size - 1))
            ctx.shape = x.shape
            return x.new_empty((x.shape[0], x.shape[1], *gshape))

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
            return g.new_empty(ctx.shape), None, None

    class _AllReduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, sctx: Any) -> torch.Tensor:
            sctx.times.append((sctx.layer[0], "allreduce", x.numel() * x.element_size(), 1))
            return x.detach().clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
            return g.clone(), None

    class StandIn(SpatialContext):
        def __init__(self) -> None:
            n = math.prod(parts)
            super().__init__(None, list(range(n)), parts, dims, grid, overlap)
            self.layer = [0]  # index of the top-level layer running now
            self.comm_log: list[tuple[int, int]] = []  # (layer, bytes) of gather buffers
            self.halo_log: list[tuple[int, int]] = []  # (layer, bytes) of halo send + receive buffers
            # (layer, "halo" | "allreduce" | "gather", bytes sent (gather: the whole tensor), messages): for the
            # time model
            self.times: list[tuple[int, str, int, int]] = []

        def shapes_only(self) -> bool:
            return True

        def gather(self, x: torch.Tensor) -> torch.Tensor:
            if self.size == 1:
                return x
            return _Gather.apply(x, self, self.global_shape(x))

        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            return x if self.size == 1 else _AllReduce.apply(x, self)

        def reduce(self, x: torch.Tensor, op: Any) -> torch.Tensor:
            # the maxima and minima of global max pooling, and its gradient's sum: logged, not sent
            if self.size > 1:
                self.times.append((self.layer[0], "allreduce", x.numel() * x.element_size(), 1))
            return x.detach().clone().contiguous()

        def exchange(self, send: list[tuple[int, torch.Tensor]], recv: list[tuple[int, torch.Tensor]],
                     tag: int = 0) -> Posted:
            # no messages: a log of their sizes (the buffers are still made by the real halo code)
            self.halo_log.append((self.layer[0], sum(t.numel() * t.element_size() for _, t in [*send, *recv])))
            self.times.append((self.layer[0], "halo", sum(t.numel() * t.element_size() for _, t in send), len(send)))
            return Posted([], 0, 0, [])

        def avg_pool(self, nd: int) -> Callable[..., torch.Tensor]:
            return _meta_safe_pool(super().avg_pool(nd))

        def index_math(self) -> contextlib.AbstractContextManager[Any]:
            # index arithmetic that reads values (upsampling sources) runs on real tensors: tiny, shapes only
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            return unset_fake_temporarily()

    return StandIn()


def _meta_safe_pool(fn: Any) -> Any:
    """Wrap ``F.avg_poolNd(x, kernel, stride, padding, ...)`` so that inputs smaller than the kernel (a thin
    halo window deep in the trunk, padded by the op) pass the meta kernel, which checks the unpadded size
    where the CPU and CUDA ones do not: the input is padded up to the kernel and the output cropped to the
    real op's size (same memory within a few cells)."""
    def call(x: torch.Tensor, k: Any, s: Any, pads: Any, *rest: Any) -> torch.Tensor:
        nd = x.dim() - 2
        ks, ss, ps = (v if isinstance(v, (tuple, list)) else (v,) * nd for v in (k, s, pads))
        sizes = [int(v) for v in x.shape[2:]]
        small = [max(0, int(ks[j]) - sizes[j]) for j in range(nd)]
        if not any(small) or nd == 1:
            return fn(x, k, s, pads, *rest)
        outs = [(sizes[j] + 2 * int(ps[j]) - int(ks[j])) // int(ss[j]) + 1 for j in range(nd)]
        grow: list[int] = []
        for j in reversed(range(nd)):
            grow += [0, small[j]]
        y = fn(F.pad(x, grow), k, s, pads, *rest)
        return y[(slice(None), slice(None), *(slice(0, o) for o in outs))]

    return call


# ============================================================================ the trace
#: the caching allocator hands out blocks in multiples of 512 bytes (c10/cuda/CUDACachingAllocator.cpp,
#: kMinBlockSize, round_size): what CUDA counts as allocated for a tensor is its size rounded up to them
ALLOCATOR_BLOCK = 512


def allocated(nbytes: int) -> int:
    """The bytes the caching allocator counts for a request of ``nbytes`` (rounded up to its block)."""
    return -(-int(nbytes) // ALLOCATOR_BLOCK) * ALLOCATOR_BLOCK


def _key(t: torch.Tensor) -> tuple[int, int]:
    st = t.untyped_storage()
    return st._cdata, allocated(st.nbytes())


@dataclass
class Trace:
    """One training-mode forward of the whole (spatial) model at one micro-batch, on fake tensors."""

    batch: int
    in_key: int
    in_bytes: int
    out_keys: list[int]  # storage of each layer's output
    out_bytes: list[int]  # bytes of each layer's output (the last: the loss pseudo-layer's output)
    saved: dict[int, tuple[int, set[int]]]  # storage -> (bytes, layers that saved it); parameters left out
    halo: dict[int, int]  # layer -> largest halo exchange (send + receive bytes)
    gather: dict[int, int]  # layer -> gather buffers
    target_bytes: int
    ops: dict[int, Any] = field(default_factory=dict)  # layer -> its ops' FLOPs and bytes (gems.trace.ops)
    comm: list[tuple[int, str, int, int]] = field(default_factory=list)  # the spatial messages (StandIn.times)
    in_grad: list[bool] = field(default_factory=list)  # whether each layer's input needs a gradient
    skips: list[tuple[int, int]] = field(default_factory=list)  # (stash, pop) layer of each skip (models.skips)

    def carried(self, cut: int) -> int:
        """Bytes of the skips that cross the boundary before layer ``cut`` (a stash's output is its skip)."""
        return sum(self.out_bytes[s] for s, p in self.skips if s < cut <= p)

    def kept_skips(self, cuts: Sequence[int]) -> int:
        """Bytes of the skips that cross any of ``cuts``, each once: inputs of the checkpointed pieces they cross,
        alive until the backward of their pop's piece."""
        return sum(self.out_bytes[s] for s, p in self.skips if any(s < c <= p for c in cuts))

    def stage_by_layer(self, a: int, e: int, last: bool, packed: bool = True) -> tuple[int, int, list[int], int]:
        """:meth:`_stage_by_layer`, kept per trace (a trace is a value once made, never changed after: the mesh
        search asks for the same stages of one trace thousands of times; a changed trace is a new one,
        ``dataclasses.replace``)."""
        memo = self.__dict__.setdefault("_stages_memo", {})
        key = (a, e, last, packed)
        if key not in memo:
            memo[key] = self._stage_by_layer(a, e, last, packed)
        total, in_b, work, out_b = memo[key]
        return total, in_b, list(work), out_b

    def _stage_by_layer(self, a: int, e: int, last: bool, packed: bool = True) -> tuple[int, int, list[int], int]:
        """(saved bytes kept by layers [a, e) incl. its input and output, input bytes, each layer's working set,
        output bytes).

        ``packed``: a pipeline partition's input and output carry the skips crossing its cuts packed with the
        activation (gems.models.skips.Carried: a copy of them on each side of a cut); a checkpointed piece of the
        plain path takes them as they are (the caller counts them once: :meth:`kept_skips`).

        The working set of layer ``j`` is what its backward holds on top of the stage's saved set: its output and
        input gradients, while the storages saved only by layers after ``j`` are already freed (alive_j + grads_j,
        less that set; the large gradients of a CNN's first layers come when little is still saved), before any
        workspace of its own ops (which the planner adds per layer on CPU ranks). The planner takes the worst layer
        at the batch it plans. The first partition's input is a view of the input batch (counted once, as the
        batch), and needs no gradient."""
        keys: dict[int, int] = {}
        first: dict[int, int] = {}  # storage -> the first layer of [a, e) that saved it: freed after its backward
        for k, (nb, layers) in self.saved.items():
            mine = [i for i in layers if a <= i < e]
            if mine or (last and len(self.out_bytes) - 1 in layers):
                keys[k] = nb
                first[k] = min(mine) if mine else e - 1
        if a == 0:  # a view of the line's input batch, which is counted as such
            keys.pop(self.in_key, None)
            in_b = 0
        else:
            in_b = self.out_bytes[a - 1] + (self.carried(a) if packed else 0)
            keys[self.out_keys[a - 1]] = in_b
            first[self.out_keys[a - 1]] = a - 1  # the partition's input lives through its backward
        out_b = self.out_bytes[e - 1] + (self.carried(e) if packed and not last else 0)
        if not last:
            out_key = self.out_keys[e - 1]
            if out_b > self.out_bytes[e - 1] and out_key in keys:
                # the packed output (Carried.pack's cat) is a storage of its own, kept for the backward beside
                # the last layers' output, which they saved (a ReLU's)
                out_key = -1 - e
            keys[out_key] = out_b
            first[out_key] = a - 1
        total = sum(keys.values())
        ins = [in_b] + self.out_bytes[a:e - 1]
        # a partition that sends its output gets that output's gradient as one received buffer (packed with the
        # skips' where they travel with it), held through its whole backward: the output gradient of its last
        # layer, and beside every layer's working set before it
        outs = self.out_bytes[a:e - 1] + [out_b]
        received = 0 if last else out_b
        work = []
        by_first = sorted((first[k], nb) for k, nb in keys.items())  # the storages alive at layer j: first <= j
        n = alive = 0
        for j, (i, o) in zip(range(a, e), zip(ins, outs)):
            while n < len(by_first) and by_first[n][0] <= j:
                alive += by_first[n][1]
                n += 1
            work.append(alive + i + (o if j == e - 1 else o + received) - total)
        return total, in_b, work, out_b


def saved_bytes(fn: Callable[[], Any], exclude: Sequence[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs (real or fake tensors).

    ``exclude``: tensors (e.g. parameters) whose storages are not counted.
    The measure the planner uses, exposed for checking it against real runs.
    """
    skip = {_key(t)[0] for t in exclude}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        k, nb = _key(t)
        if k not in skip:
            seen[k] = nb
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def _loss(spec: Any, out: torch.Tensor, local_spatial: Sequence[int]) -> tuple[torch.Tensor, int]:
    """The training loss on ``out`` with a fake target; returns (loss, target bytes per sample)."""
    b = out.shape[0]
    if spec.target == "dense":
        spatial = [int(v) for v in out.shape[2:]]
        if spec.loss == "cross_entropy":
            y = torch.empty((b, *spatial), dtype=torch.int64)
            return F.cross_entropy(out.float(), y, reduction="sum"), 8 * math.prod(spatial)
        y = torch.empty(out.shape, dtype=torch.float32)
        return F.mse_loss(out.float(), y, reduction="sum"), 4 * math.prod(out.shape[1:])
    if spec.loss == "cross_entropy":
        return F.cross_entropy(out.float(), torch.empty((b,), dtype=torch.int64), reduction="sum"), 8
    y = torch.empty(out.shape, dtype=torch.float32)
    return F.mse_loss(out.float(), y, reduction="sum"), 4 * math.prod(out.shape[1:])


# What one layer saves for its backward, by the structure of the layer and its input (see trace_layers's
# ``memo``): deep networks repeat a few kinds of block hundreds of times (ResNet-1001: 333 blocks).
_LAYER_MEMO: dict[tuple, tuple] = {}
_LAYER_MEMO_MAX = 100_000


def trace_layers(spec: Any, layers: Sequence[nn.Module], batch: int, local: Sequence[int], gshape: Sequence[int],
                 sctx: Any, amp: Callable[[], Any], memo: Any = None) -> Trace:
    """``memo``: a key for what ``amp`` does (e.g. the precision and the device kind). With it, a serial
    layer whose structure (:func:`gems.pipeline.partition.structure`) and input (shape, dtype, whether it
    needs a gradient) were traced before is not run again: its output and the storages it saves (its
    input, its output, or new ones, with their bytes) are replayed, and for spatial layers also the
    global shape of the output, the halo and gather buffers it logs and the stand-in's shape state. A
    layer that saves a storage an earlier layer made (a shared weight's cast) or returns its input's
    storage is always run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gems.layers import batch_context

    tr = _Tracer(sctx, memo)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = tr.fake_parameters(layers)
        x = torch.empty((batch, *local), dtype=torch.float32)
        in_key, in_bytes = _key(x)
        if sctx is not None:
            sctx.mark(x, gshape)
        with torch.autograd.graph.saved_tensors_hooks(tr.pack, lambda t: t), \
                batch_context(0, 0, range(batch)), amp(), tr.counter:
            tr.known = {in_key} | {_key(t)[0] for d in fake for t in d.values()}
            hold = [x]  # every layer's input and output stays alive: a freed storage's address (its key) is reused
            for i, (layer, d) in enumerate(zip(layers, fake)):
                x = tr.layer(i, layer, d, x)
                hold.append(x)
                tr.out_keys.append(_key(x)[0])
                tr.out_bytes.append(allocated(x.numel() * x.element_size()))
            tr.cur[0] = len(layers)
            loss, target = _loss(spec, x, local[1:])
            tr.out_bytes.append(allocated(loss.numel() * loss.element_size()))
        del loss, x, hold
    halo, gather, comm = _spatial_logs(sctx)
    counter = tr.counter
    return Trace(batch, in_key, in_bytes, tr.out_keys, tr.out_bytes, tr.saved, halo, gather, batch * target,
                 {i: counter.take(i) for i in counter.layers}, comm, tr.in_grad,
                 [(st, po) for _, st, po in spans(layers)])


def piece_costs(spec: Any) -> tuple[list[int], list[int]]:
    """Per layer of ``spec``'s serial model, one sample in fp32 on fake tensors: the bytes of the storages autograd
    saves that the layer is the first to save (parameters and the input batch left out), and of its output. What
    the plain path's recomputed pieces are cut by (:func:`gems.parallel.recompute_pieces`)."""
    layers = list(spec.module)
    shape = [int(v) for v in spec.input_shape]
    with torch.enable_grad():  # (the same pieces when the caller builds its model under no_grad)
        t = trace_layers(spec, layers, 1, shape, shape[1:], None, contextlib.nullcontext, memo=("fp32", False))
    saved = [0] * len(layers)
    for k, (nb, by) in t.saved.items():
        first = min(by)
        if k != t.in_key and first < len(layers):  # (the loss's own saves come after the last layer)
            saved[first] += nb
    return saved, list(t.out_bytes[:len(layers)])


class _Tracer:
    """What :func:`trace_layers` gathers while the layers run on fake tensors: the storages autograd saves and
    which layers save them, every layer's output, and the layers it replays from :data:`_LAYER_MEMO`."""

    def __init__(self, sctx: Any, memo: Any) -> None:
        from gems.trace.ops import OpCounter

        self.sctx, self.memo = sctx, memo
        self.saved: dict[int, tuple[int, set[int]]] = {}
        self.cur = [0]
        self.out_keys: list[int] = []
        self.out_bytes: list[int] = []
        self.in_grad: list[bool] = []
        self.params: set[int] = set()
        self.known: set[int] = set()
        self.fresh = 0  # replayed new storages get keys -1, -2, ...: no real storage has a negative address
        self.counter = OpCounter(self.cur)

    def fake_parameters(self, layers: Sequence[nn.Module]) -> list[dict[str, torch.Tensor]]:
        """Fake stand-ins of every layer's parameters and buffers (what the layers are called with)."""
        fake: list[dict[str, torch.Tensor]] = []
        for layer in layers:
            d: dict[str, torch.Tensor] = {}
            for name, p in layer.named_parameters():
                f = torch.empty(p.shape, dtype=p.dtype).requires_grad_(p.requires_grad)
                d[name] = f
                self.params.add(_key(f)[0])
            for name, b in layer.named_buffers():
                if b is not None:
                    d[name] = torch.empty(b.shape, dtype=b.dtype)
            fake.append(d)
        return fake

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        k, nb = _key(t)
        if k not in self.params:
            self.saved.setdefault(k, (nb, set()))[1].add(self.cur[0])
        return t

    def layer(self, i: int, layer: nn.Module, d: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """Layer ``i`` on ``x``: replayed when a layer like it on an input like this was traced before, else run."""
        from gems.pipeline.partition import structure
        from gems.shapes import GSHAPE

        sctx = self.sctx
        self.cur[0] = i
        self.in_grad.append(bool(x.requires_grad))
        if sctx is not None:
            sctx.layer[0] = i
        st = structure(layer) if self.memo is not None else None
        # a spatial layer also depends on its input's global shape and the stand-in's last tagged one
        spatial_in = (getattr(x, GSHAPE, None), sctx.last_mark) if sctx is not None else None
        mkey = None if st is None else (self.memo, st, tuple(x.shape), x.dtype, x.requires_grad, spatial_in)
        if mkey is not None and mkey in _LAYER_MEMO:
            return self.replay(i, x, _LAYER_MEMO[mkey])
        return self.run(i, layer, d, x, mkey)

    def replay(self, i: int, x: torch.Tensor, memo: tuple) -> torch.Tensor:
        from gems.shapes import GSHAPE

        shape, dtype, grad, entries, spatial_out, ops = memo
        kx = _key(x)[0]
        y = torch.empty(shape, dtype=dtype, requires_grad=grad)
        x = y.clone() if grad else y  # not a leaf: a next in-place layer may write it
        self.counter.layers.pop(i, None)  # the clone above is not the layer's
        self.counter.add(i, ops)
        sctx = self.sctx
        if sctx is not None:
            gs, sctx.last_mark, halos, gathers, times = spatial_out
            if gs is not None:
                setattr(x, GSHAPE, gs)
            sctx.halo_log += [(i, nb) for nb in halos]
            sctx.comm_log += [(i, nb) for nb in gathers]
            sctx.times += [(i, *e) for e in times]
        ky = _key(x)[0]
        for kind, nb in entries:
            if kind == "new":
                self.fresh -= 1
                k = self.fresh
            else:
                k = kx if kind == "in" else ky
            self.saved.setdefault(k, (nb, set()))[1].add(i)
        return x

    def run(self, i: int, layer: nn.Module, d: dict[str, torch.Tensor], x: torch.Tensor, mkey: Any) -> torch.Tensor:
        sctx = self.sctx
        kx = _key(x)[0]
        before = set(self.saved)
        logs = (len(sctx.halo_log), len(sctx.comm_log), len(sctx.times)) if sctx is not None else (0, 0, 0)
        try:
            x = torch.func.functional_call(layer, d, (x,)) if d else layer(x)
        except (ConfigError, RunError):
            raise
        except Exception as e:  # the model (a user's layer, often) on this part: the ranks would too
            where = f" on spatial part {sctx.index} of {sctx.size}" if sctx is not None else ""
            name = type(getattr(layer, "inner", layer)).__name__  # a spatial wrapper's own layer
            raise RunError(f"layer {i} ({name}){where} raised on its input of shape {list(x.shape)}: "
                           f"{type(e).__name__}: {e} (gems run would fail the same way on the ranks that run it)") from e
        if not isinstance(x, torch.Tensor):
            raise ConfigError("model", type(layer).__name__, "layers that return one tensor (a flat nn.Sequential)")
        ky = _key(x)[0]
        entries, alone = self.entries(i, kx, ky, before, {_key(t)[0] for t in d.values()})
        spatial_out = self.spatial_out(i, x, logs)
        if spatial_out is None and sctx is not None:
            alone = False  # logged under another layer's index: not the layer alone
        if mkey is not None and alone and ky != kx and len(_LAYER_MEMO) < _LAYER_MEMO_MAX:
            _LAYER_MEMO[mkey] = (tuple(x.shape), x.dtype, x.requires_grad, tuple(entries), spatial_out,
                                 self.counter.take(i))
        return x

    def entries(self, i: int, kx: int, ky: int, before: set[int], own: set[int]) -> tuple[list[tuple[str, int]], bool]:
        """What layer ``i`` saved, as its input, its output or new storages (a replay's recipe), and whether it
        saved only those (not an earlier layer's storage: then it is not the layer alone and is not kept).
        ``own``: its buffers (BatchNorm's running statistics)."""
        entries, alone = [], True
        for k, (nb, ls) in self.saved.items():
            if i not in ls:
                continue
            if k == kx:
                entries.append(("in", nb))
            elif k == ky:
                entries.append(("out", nb))
            elif k in own and k not in before:
                entries.append(("new", nb))
            elif k in before or k in self.known or k in self.out_keys:
                alone = False
            else:
                entries.append(("new", nb))
        return entries, alone

    def spatial_out(self, i: int, x: torch.Tensor, logs: tuple[int, int, int]) -> tuple | None:
        """A spatial layer's output state for a replay (its global shape, the stand-in's, the buffers it logged);
        None where something was logged under another layer's index."""
        from gems.shapes import GSHAPE

        sctx = self.sctx
        if sctx is None:
            return None
        out = (getattr(x, GSHAPE, None), sctx.last_mark,
               tuple(nb for j, nb in sctx.halo_log[logs[0]:] if j == i),
               tuple(nb for j, nb in sctx.comm_log[logs[1]:] if j == i),
               tuple(e[1:] for e in sctx.times[logs[2]:] if e[0] == i))
        if len(out[2]) != len(sctx.halo_log) - logs[0] or len(out[3]) != len(sctx.comm_log) - logs[1] or \
                len(out[4]) != len(sctx.times) - logs[2]:
            return None
        return out


def _spatial_logs(sctx: Any) -> tuple[dict[int, int], dict[int, int], list[tuple[int, str, int, int]]]:
    """Per layer, the largest halo buffer and the gathered bytes the stand-in logged, and its timed messages;
    the logs are emptied for the next trace."""
    halo: dict[int, int] = {}
    gather: dict[int, int] = {}
    if sctx is None:
        return halo, gather, []
    for i, nb in sctx.halo_log:
        halo[i] = max(halo.get(i, 0), nb)
    for i, nb in sctx.comm_log:
        gather[i] = gather.get(i, 0) + nb
    comm = list(sctx.times)
    sctx.halo_log.clear()
    sctx.comm_log.clear()
    sctx.times.clear()
    return halo, gather, comm
