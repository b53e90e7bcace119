"""What each layer of the planner's trace computes: FLOPs (torch's own formulas, ``torch.utils.flop_counter``) and bytes
per op, counted on the same fake-tensor forward that measures memory (:func:`gems.trace.model.trace_layers`), in
three classes: ``conv`` (with a signature CPU ranks time on the spot), ``matmul``, and ``memory`` (everything else that
moves data: its bytes read and written). Views and allocations are free.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ["OpCounter", "LayerOps", "scaled", "memory_signature"]

#: (op class, signature) -> [flops, bytes, ops] of one layer at one micro-batch
LayerOps = dict[tuple[str, tuple], list[float]]

_CONV = {"convolution", "_convolution", "convolution_overrideable", "cudnn_convolution", "_slow_conv2d_forward"}
_MATMUL = {"mm", "addmm", "bmm", "baddbmm"}
_FREE = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "detach", "lift_fresh",
         "alias"}


def _bytes(xs: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(xs)[0] if isinstance(t, torch.Tensor))


#: the spatial extent (per dim) up to which CPU ranks time a convolution at its real size; larger ones are
#: timed on this extent (their rate no longer depends on it)
MEASURE_EXTENT = {1: 65536, 2: 256, 3: 128}


def _signature(name: str, args: tuple) -> tuple:
    if name in _CONV:
        x, w = args[0], args[1]
        transposed = bool(args[6]) if len(args) > 6 else False
        groups = int(args[8]) if len(args) > 8 else 1
        nd = x.dim() - 2
        stride = tuple(int(s) for s in args[3]) if len(args) > 3 else (1,) * nd
        padding = tuple(int(s) for s in args[4]) if len(args) > 4 else (0,) * nd
        cin = int(x.shape[1])
        cout = int(w.shape[1]) * groups if transposed else int(w.shape[0])
        extent = tuple(min(int(v), MEASURE_EXTENT[nd]) for v in x.shape[2:])
        # no batch: the counts traced at two batches meet on one key and interpolate to any micro-batch (CPU
        # ranks time the convolution at the micro-batch it runs at: Rates.time)
        return ("conv", nd, cin, cout, tuple(int(k) for k in w.shape[2:]), stride, groups, transposed, padding,
                extent)
    a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
    return ("matmul", int(a.shape[-1]), int(b.shape[-1]))


#: the normalisations CPU ranks time as their own kinds (their kernels differ several-fold in speed per byte)
NORMS = ("batch_norm", "group_norm", "layer_norm")


def memory_group(name: str) -> str:
    """The kind of memory-bound op, for CPU ranks that time each kind: pool, one of NORMS or elementwise."""
    if "pool" in name:
        return "pool"
    return next((k for k in NORMS if k in name), "elementwise")


def _ints(v: Any, nd: int) -> tuple[int, ...]:
    v = [int(q) for q in v] if isinstance(v, (list, tuple)) else [int(v)]
    return tuple(v * nd if len(v) == 1 else v)


def memory_signature(name: str, args: tuple) -> tuple:
    """The signature a memory-bound op is timed by: its kind, and for an average or max pool its kernel,
    stride and padding too (a pool reads each input cell about kernel^d / stride^d times: CosmoFlow's 3^3
    stride-2 pools take 3-4x the time per byte of a 2^3 one)."""
    group = memory_group(name)
    base = name.removesuffix("_with_indices")
    if group != "pool" or base not in ("avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d",
                                       "max_pool3d") or len(args) < 2:
        return ("memory", group)
    nd = int(base[-2])
    kernel = _ints(args[1], nd)
    stride = _ints(args[2], nd) if len(args) > 2 and args[2] not in ([], ()) else kernel
    padding = _ints(args[3], nd) if len(args) > 3 else (0,) * nd
    return ("memory", "pool", base[:3], nd, kernel, stride, padding)


class OpCounter(TorchDispatchMode):
    """Accumulates every op's FLOPs and bytes under the layer ``cur[0]`` says is running."""

    def __init__(self, cur: list[int]) -> None:
        super().__init__()
        self.cur = cur
        self.layers: dict[int, LayerOps] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _FREE or getattr(func, "is_view", False) or func.namespace == "prim" or \
                not any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
            return out  # views, allocations, and queries (a tensor's device, size ...) move no data
        if name in _CONV or name in _MATMUL:
            cls = "conv" if name in _CONV else "matmul"
            sig = _signature(name, args)
            flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
        else:
            cls, sig, flops = "memory", memory_signature(name, args), 0.0
        nbytes = _bytes(args) + _bytes(out)
        acc = self.layers.setdefault(self.cur[0], {}).setdefault((cls, sig), [0.0, 0.0, 0.0])
        acc[0] += flops
        acc[1] += nbytes
        acc[2] += 1
        return out

    def take(self, layer: int) -> LayerOps:
        """The counts of ``layer`` so far (a copy)."""
        return {k: list(v) for k, v in self.layers.get(layer, {}).items()}

    def add(self, layer: int, ops: LayerOps) -> None:
        mine = self.layers.setdefault(layer, {})
        for k, v in ops.items():
            acc = mine.setdefault(k, [0.0, 0.0, 0.0])
            for j in range(3):
                acc[j] += v[j]


def scaled(a: LayerOps, b: LayerOps, ba: int, bb: int, batch: int) -> LayerOps:
    """The counts at micro-batch ``batch`` on the line through the counts at ``ba`` and ``bb`` (FLOPs, bytes and
    the number of ops: a layer may run some ops once a sample, as SampleDropout draws each sample's mask)."""
    out: LayerOps = {}
    for k in set(a) | set(b):
        va, vb = a.get(k, [0.0, 0.0, 0.0]), b.get(k, [0.0, 0.0, 0.0])
        if ba == bb:
            out[k] = [va[0] * batch / ba, va[1] * batch / ba, va[2]]
            continue
        t = (batch - ba) / (bb - ba)
        out[k] = [max(0.0, va[j] + t * (vb[j] - va[j])) for j in (0, 1, 2)]
    return out
