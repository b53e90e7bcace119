"""This machine's CPU timed on the spot: a CPU rank's rates (:func:`cpu_rates`), each op's measured the first time
a model needs it, what a convolution's backward allocates for itself (:func:`conv_workspace`) and what synthetic
data costs to make on the host (:func:`synthetic_seconds`).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from gems.bootstrap import keep_host_memory
from gems.plan.devices import Rates
from gems.plan.store import cached, cpu_identity

__all__ = ["CpuRates", "cpu_rates", "forget_cpu_rates", "conv_workspace", "synthetic_seconds", "matmul_rows",
           "conv_case", "reference_alone"]


@dataclass
class CpuRates(Rates):
    """A CPU rank's rates: each op's measured here with the rank's threads (:meth:`measured_rate`)."""

    #: signature (with the batch, rows or elements it is timed at) -> (forward, backward) FLOP/s, or bytes/s
    measured: dict[tuple, tuple[float, float]] = field(default_factory=dict)
    threads: int = 1  # the rank's threads, for measuring
    crowd: int = 1  # ranks of a node that compute at once: ops are timed that many at a time (_crowded)
    in_step: float = 1.0  # how much longer ops take inside a training step than timed alone (cpu_rates)

    def time(self, cls: str, sig: tuple, flops: float, nbytes: float, backward: bool, batch: int = 1) -> float:
        """One op's time at micro-batch ``batch`` from the rates measured here: a backward rate is the forward's work
        over the backward's time; a convolution is timed at its batch, a matmul at its rows."""
        work = flops if cls in ("conv", "matmul") else nbytes
        if cls == "conv":
            sig = (*sig, _measure_batch(sig, batch))
        elif cls == "matmul":
            sig = (*sig, matmul_rows(sig, flops))
        elif cls == "memory":
            sig = (*sig, _memory_elements(nbytes))
        alone = work / self.measured_rate(sig, backward) + self.op_overhead_s * (2 if backward else 1)
        return self.share * self.in_step * alone

    def measured_rate(self, sig: tuple, backward: bool) -> float:
        """The rate of this signature (FLOP/s of a convolution or matmul, bytes/s of a kind of memory-bound op),
        measured the first time it is asked for, with the rank's threads."""
        if sig not in self.measured:
            self.measured[sig] = _with_threads(self.threads, lambda: _crowded(self.crowd, lambda: _measure_op(sig)))
        fwd, bwd = self.measured[sig]
        return bwd if backward else fwd


_CPU: dict[tuple, CpuRates] = {}


def _with_threads(threads: int, fn: Any) -> Any:
    """``fn()`` with torch using ``threads`` threads (a rank's), as before afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _crowded(k: int, fn: Any) -> Any:
    """``fn()`` (a measurement returning a tuple of rates, or one time) run by ``k`` threads at once, each
    on tensors of its own, as ``k`` ranks of a node compute at once: they share its memory bandwidth and
    caches (two ranks of CosmoFlow 64^3 on this project's VM each ran 1.3x slower than one alone). The mean
    over the threads; ``k = 1``: ``fn()``."""
    if k <= 1:
        return fn()
    import threading

    start = threading.Barrier(k)
    out: list[Any] = [None] * k

    def run(i: int) -> None:
        start.wait()
        out[i] = fn()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(1, k)]
    for w in workers:
        w.start()
    run(0)
    for w in workers:
        w.join()
    if isinstance(out[0], tuple):
        return tuple(sum(o[j] for o in out) / k for j in range(len(out[0])))
    return sum(out) / k


def _timed(fn: Any, min_s: float = 0.02, reps: int = 3) -> float:
    """The best of ``reps`` averages over at least ``min_s`` each (a shared machine only ever slows a call)."""
    fn()  # warm up (oneDNN picks and caches its kernel)
    best = math.inf
    for _ in range(reps):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_s:
                break
        best = min(best, dt / n)
    return best


def _fwd_bwd(f: Any, inputs: list[torch.Tensor]) -> tuple[float, float]:
    """Seconds of ``f(*inputs)`` and of its backward (to every input that needs a gradient)."""
    fwd = _timed(lambda: f(*inputs))
    out = f(*inputs)
    g = torch.ones_like(out)
    need = [t for t in inputs if t.requires_grad]
    bwd = _timed(lambda: torch.autograd.grad(out, need, g, retain_graph=True))
    return fwd, bwd


#: the memory-bound kinds CPU ranks time (gems.trace.ops.memory_group), on about as many elements as the op
#: moves (in the caches or past them: 2-3x apart) in 16 channels, with the affine weights a model's
#: normalisation layers have: f(x, channel weight, channel bias)
_MEMORY_OPS: dict[str, Any] = {
    "elementwise": lambda x, w, b: F.leaky_relu(x, 0.01),
    "pool": lambda x, w, b: F.avg_pool3d(x, 2),
    "batch_norm": lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
    "group_norm": lambda x, w, b: F.group_norm(x, 8, w, b),
    "layer_norm": lambda x, w, b: F.layer_norm(x.view(-1, 16), (16,), w, b),
}


#: the most input elements a convolution is timed on (its batch is cut to stay within it): 32 MiB of fp32
MEASURE_ELEMENTS = 2**23


def _memory_elements(nbytes: float) -> int:
    """The elements a memory-bound op of ``nbytes`` (read and written) is timed on: a power of two near its
    fp32 operand's size, from 16 Ki (below, the per-op overhead dominates) to 4 Mi (past every cache)."""
    return 2 ** min(22, max(14, round(math.log2(max(nbytes, 1.0) / 8))))


def _measure_batch(sig: tuple, batch: int) -> int:
    """The batch a convolution of signature ``sig`` (gems.trace.ops) is timed at for micro-batch ``batch``: its
    own, or fewer samples where that many would pass MEASURE_ELEMENTS (the rate no longer depends on it)."""
    cin, extent = sig[2], sig[-1]
    return max(1, min(int(batch), MEASURE_ELEMENTS // max(1, cin * math.prod(extent))))


#: the most rows a matmul is timed at (its rate no longer grows with them)
MEASURE_ROWS = 256


def matmul_rows(sig: tuple, flops: float) -> int:
    """The rows a matmul of signature ``("matmul", k, n)`` and ``flops`` is timed at on CPU ranks: its own (the
    micro-batch's samples, for a dense layer), at the power of two nearest them, up to :data:`MEASURE_ROWS`. A few
    rows read the whole ``k x n`` weight for little work: a 4096^2 dense layer at 4 rows ran at a fraction of its
    rate at 256, so a step of two micro-batches of 2 rows took longer than one of 4, which a rate timed at 256 rows
    (the planner's before) could not see."""
    _, k, n = sig[:3]
    rows = max(1.0, flops / (2.0 * k * n))
    return int(min(MEASURE_ROWS, 2 ** round(math.log2(rows))))


def _cube(elements: int, nd: int) -> list[int]:
    """``nd`` extents of about equal powers of two whose product is ``elements`` (a power of two)."""
    side = 2 ** max(2, round(math.log2(max(elements, 1)) / nd))
    return [side] * (nd - 1) + [max(1, elements // side ** (nd - 1))]


def _measure_op(sig: tuple) -> tuple[float, float]:
    """(forward rate, backward rate) of one signature on this machine: FLOP/s for a convolution or matmul
    (timed at its own channels, kernel and, up to gems.trace.ops.MEASURE_EXTENT, its own extent), bytes/s
    for a kind of memory-bound op; a backward rate is the forward's work over the backward's seconds."""
    kind = sig[0]
    if kind == "memory":
        f: Any
        if len(sig) > 3:  # a pool of known kernel, stride and padding (gems.trace.ops.memory_signature)
            _, _, pool, nd, kernel, stride, padding, elements = sig
            op = getattr(F, f"{pool}_pool{nd}d")
            inputs = [torch.randn(1, 16, *_cube(elements // 16, nd), requires_grad=True)]
            f = lambda x: op(x, kernel, stride, padding)  # noqa: E731
        else:
            f = _MEMORY_OPS[sig[1]]
            inputs = [torch.randn(1, 16, 4, 4, sig[2] // 256, requires_grad=True),
                      *(torch.randn(16, requires_grad=sig[1].endswith("_norm")) for _ in range(2))]
        nbytes = 4.0 * (inputs[0].numel() + f(*inputs).numel())
        fwd, bwd = _fwd_bwd(f, inputs)
        return nbytes / fwd, nbytes / bwd
    if kind == "matmul":
        _, k, n, rows = sig
        a = torch.randn(rows, k, requires_grad=True)
        w = torch.randn(k, n, requires_grad=True)
        flops = 2.0 * rows * k * n
        fwd, bwd = _fwd_bwd(lambda a, w: a @ w, [a, w])
        return flops / fwd, flops / bwd
    f, inputs, flops = conv_case(sig)
    fwd, bwd = _fwd_bwd(f, inputs)
    return flops / fwd, flops / bwd


def conv_case(sig: tuple, input_grad: bool = True) -> tuple[Any, list[torch.Tensor], float]:
    """(f, inputs, FLOPs of one call) of the convolution of signature ``sig`` (gems.trace.ops, with the batch it
    is measured at appended), on random tensors: what its rate and its backward's workspace are measured on.
    ``input_grad``: whether its input needs a gradient (a model's first layer does not)."""
    _, nd, cin, cout, kernel, stride, groups, transposed, padding, extent, batch = sig
    # its own extent: only a convolution whose padded input is smaller than its kernel is timed on the
    # smallest input it accepts (timing a 1x2x2 part on 3x3x3 counted 27 outputs' work where it has 4, at a
    # rate several times the real one: CosmoFlow's 256-channel layers at S = 2)
    size = [max(e, 1 if transposed else k - 2 * p) for e, k, p in zip(extent, kernel, padding)]
    x = torch.randn(batch, cin, *size, requires_grad=input_grad)
    if transposed:
        conv = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
        w = torch.randn(cin, cout // groups, *kernel, requires_grad=True)
        flops = 2.0 * (cout // groups) * math.prod(kernel) * x.numel()
        return (lambda x, w: conv(x, w, None, stride, 0, 0, groups)), [x, w], flops
    # through the spatial layers' kernel choice: at a reduced extent torch's heuristic can pick its slow
    # reference kernel where the full-size convolution gets oneDNN (gems.spatial.conv_backend.conv_nd)
    from gems.spatial.conv_backend import conv_nd

    w = torch.randn(cout, cin // groups, *kernel, requires_grad=True)
    ones = [1] * nd
    out = conv_nd(x, w, None, stride, padding, ones, groups)
    flops = 2.0 * (cin // groups) * math.prod(kernel) * out.numel()
    return (lambda x, w: conv_nd(x, w, None, stride, padding, ones, groups)), [x, w], flops


_WORKSPACE: dict[tuple, int] = {}


def _onednn_isa_cap() -> tuple[str, ...]:  # oneDNN reads a cap on the instruction sets it uses from these
    return tuple(os.environ.get(v, "") for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"))


def conv_workspace(sig: tuple, batch: int, input_grad: bool, threads: int = 1) -> int:
    """Bytes a CPU convolution's backward allocates for itself at micro-batch ``batch``: its peak over the
    gradients it returns (oneDNN's scratchpad and weight-gradient buffers in its own layout: about 4x the
    weights for a 256-channel 3^3 convolution, whatever the extent and batch; torch's reference kernel, which
    it picks for one small sample: the unfolded input, 27x the input for a 3^3 one). A GPU's counterpart,
    cuDNN's workspace, takes what the caching allocator has free (:data:`CUDNN_WORKSPACE_BYTES`).

    Measured on random tensors from the CPU allocator's events (:func:`gems.memory.step_peak_bytes`, as a
    run's record counts tensor memory), once per signature and input gradient at batches 1, 2 and 4 (those
    within MEASURE_ELEMENTS elements of input or output): exact there, on the line between them at 3, and
    beyond the last on the line through the last two, never decreasing. Kept on disk between processes
    (:mod:`gems.plan.store`), keyed by the CPU's model and instruction sets and by any cap set on oneDNN's."""
    per_sample = max(sig[2], sig[3]) * math.prod(sig[-1])  # the larger of its input and (stride 1) output
    points = [q for q in (1, 2, 4) if q == 1 or q * per_sample <= MEASURE_ELEMENTS]

    def at(q: int) -> int:
        key = (sig, q, input_grad, threads)
        if key not in _WORKSPACE:  # bytes, not time: kept on disk for this CPU (gems.plan.store)
            _WORKSPACE[key] = cached(("conv_workspace", *key, cpu_identity(), _onednn_isa_cap()),
                                     lambda: _with_threads(threads, lambda: _backward_workspace((*sig, q), input_grad)))
        return _WORKSPACE[key]

    batch = max(1, int(batch))
    if batch in points:
        return at(batch)
    if len(points) == 1:
        return at(1) * batch
    lo, hi = (2, 4) if batch < points[-1] else (points[-2], points[-1])
    slope = (at(hi) - at(lo)) / (hi - lo)
    if batch > hi:
        slope = max(0.0, slope)
    return int(round(at(hi) + slope * (batch - hi)))


def _backward_workspace(sig: tuple, input_grad: bool) -> int:
    from gems.memory import step_peak_bytes

    f, inputs, _ = conv_case(sig, input_grad)
    need = [t for t in inputs if t.requires_grad]
    out = f(*inputs)
    g = torch.ones_like(out)
    torch.autograd.grad(out, need, g, retain_graph=True)  # oneDNN picks and caches its kernel
    # the profiler's start and stop lines on stderr are not the planner's output
    sys.stderr.flush()
    err = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            peak = step_peak_bytes(lambda: torch.autograd.grad(out, need, g, retain_graph=True))
    finally:
        os.dup2(err, 2)
        os.close(err)
    return max(0, peak - sum(t.numel() * t.element_size() for t in need))


#: the most input elements :func:`synthetic_seconds` generates to time a part (whole planes: at least one)
DATA_ELEMENTS = 2**22
_DATA: dict[tuple, float] = {}


def synthetic_seconds(spec: Any, part: list[int], want_input: bool, want_target: bool, threads: int = 1) -> float:
    """Seconds to make one sample of synthetic data (:mod:`gems.data.synthetic`) for a rank whose spatial part
    has the extents ``part`` = (C, *spatial): its input part (``want_input``) and target (``want_target``),
    as :meth:`SyntheticData.batch` makes them at every step, on the host (CPU ranks; GPU ranks draw on their GPU:
    :func:`gems.plan.predict.gpu_synthetic`).

    Timed here with the real generator, which makes each aligned block of planes along spatial dim 0 whole from
    its own seeded generator (so a cut along the other dims saves nothing): on as many of the part's planes as stay within
    DATA_ELEMENTS, scaled to all of them. Memoised per shape."""
    key = (tuple(spec.input_shape), spec.target, tuple(part), want_input, want_target, threads)
    if not (want_input or want_target):
        return 0.0
    if key not in _DATA:
        from gems.data.synthetic import SyntheticData

        plane = max(1, math.prod(spec.input_shape) // max(1, spec.input_shape[1]))
        planes = max(1, int(part[1]))
        timed = max(1, min(planes, DATA_ELEMENTS // plane))
        slices = [slice(0, timed), *[slice(0, int(n)) for n in part[2:]]]
        data = SyntheticData(spec, 0, 1 << 20)
        idx = iter(range(1 << 20))  # a new sample each call, as a step draws new ones
        t = _with_threads(threads, lambda: _timed(
            lambda: data.batch([next(idx)], slices, want_input=want_input, want_target=want_target)))
        _DATA[key] = t * planes / timed
    return _DATA[key]


def cpu_rates(threads: int, crowd: int = 1) -> CpuRates:
    """This machine's rates for a rank of ``threads`` threads, ``crowd`` ranks of a node computing at once
    (ops and the reference block timed that many at a time: :func:`_crowded`): the per-op overhead measured
    now; each convolution shape and kind of memory-bound op when the model first needs it (tens of
    milliseconds each).

    Ops are timed with freed host memory kept in the process (:func:`gems.bootstrap.keep_host_memory`, from
    the first measurement on), as a training step reuses the memory of the one before: timed with glibc's
    defaults, an op whose output is past its mmap threshold faults each output page in anew, which on this
    project's VM made a 1x1 convolution 8x slower than inside a step (a run under ``train.host_memory=keep``
    or ``auto`` reuses it; one that gives memory back also pays those faults for tensors past glibc's 32 MiB
    limit, which the prediction does not count)."""
    # ranks of several threads each are timed alone: one process has one intra-op pool, so threads standing
    # for such ranks would share it rather than each have their own cores
    crowd = max(1, crowd) if threads <= 1 else 1
    key = (threads, crowd)
    if key in _CPU:
        return _CPU[key]
    keep_host_memory()  # from now on, as a training step reuses its memory (the docstring's why)
    small = torch.randn(8)
    over = _with_threads(threads, lambda: _timed(lambda: torch.relu(small), min_s=0.005))
    r = CpuRates("cpu", f"this machine's CPU, {threads} thread(s) a rank", {"conv": 1e10, "matmul": 1e10}, 1e10,
                 over, threads=threads, crowd=crowd)
    r.in_step = _with_threads(threads, lambda: _in_step_factor(r))
    r.about = (f"CPU measured here per convolution shape and kind of op, {over * 1e6:.1f} us per op ({threads} "
               f"thread(s) a rank, freed host memory reused as a step reuses it"
               + (f", {crowd} ranks computing at once" if crowd > 1 else "") + "); ops inside a step take "
               f"{r.in_step:.2f}x their time alone (a reference convolution block, measured now)")
    _CPU[key] = r
    return r


def forget_cpu_rates() -> None:
    """Time this machine anew at the next :func:`cpu_rates` (a benchmark times them beside each run)."""
    _CPU.clear()
    _WORKSPACE.clear()
    _DATA.clear()


def _reference_block() -> torch.nn.Sequential:
    """The block :func:`_in_step_factor` trains: convolutions, normalisations and activations of a small CNN."""
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.ReLU(),
                         nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.LeakyReLU(0.1),
                         nn.Conv2d(16, 32, 1, stride=2), nn.GroupNorm(8, 32), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1), nn.ReLU())


#: the batch :func:`_reference_block` is trained at (of 8 channels, 64^2 pixels)
REFERENCE_BATCH = 8


def _in_step_factor(rates: CpuRates) -> float:
    """How much longer a forward and backward take than the sum of their ops timed alone (the rates' own
    measurements): inside a step the autograd engine runs between ops, caches hold other tensors and
    layouts are converted, which no op timed alone sees. Measured on :func:`_reference_block` at a batch of 8
    and 64^2 pixels, its ops counted by the planner's own op counter layer by layer, as a model's are (the
    first layer's backward computes no input gradient); kept within [0.5, 3] so a disturbed measurement
    cannot dominate a prediction."""
    def real() -> float:
        block, x = _reference_block(), torch.randn(REFERENCE_BATCH, 8, 64, 64)
        return _timed(lambda: block(x).sum().backward(), min_s=0.05, reps=3)

    return min(3.0, max(0.5, _crowded(rates.crowd, real) / reference_alone(rates)))


def reference_alone(rates: Rates) -> float:
    """Seconds the forward and backward of :func:`_reference_block`'s ops take at these rates, timed alone: its
    ops counted on a fake run, layer by layer as the planner counts a model's (the first layer's backward
    computes no input gradient: only its convolution's backward is halved)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gems.trace.ops import OpCounter

    cur = [0]
    counter = OpCounter(cur)
    with FakeTensorMode(allow_non_fake_inputs=True):
        h = torch.empty(REFERENCE_BATCH, 8, 64, 64)
        block = _reference_block()
        with counter:
            for i, layer in enumerate(block):
                cur[0] = i
                h = layer(h)
    return sum(rates.layer_time(counter.take(i), False, REFERENCE_BATCH) +
               rates.layer_time(counter.take(i), True, REFERENCE_BATCH, first=i == 0) for i in range(len(block)))
