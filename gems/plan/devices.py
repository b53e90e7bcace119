"""The rates the performance model runs on: named GPUs from their vendors' data sheets, CPU ranks measured
on the spot, and the links of a cluster preset.

GPU figures are per device (per GCD for the MI250X), dense (no structured sparsity), in TFLOP/s and GB/s:

=============  =====  ======  ======  ======  ======  ========================================================
name           GiB    fp32    tf32    bf16    fp16    memory GB/s, source
=============  =====  ======  ======  ======  ======  ========================================================
v100-16gb      16     15.7    -       -       125     900: NVIDIA Tesla V100 data sheet (SXM2)
v100-32gb      32     15.7    -       -       125     900: same
a100-40gb      40     19.5    156     312     312     1555: NVIDIA A100 data sheet (SXM4 40 GB)
a100-64gb      64     19.5    156     312     312     1638: Leonardo's custom A100 SXM 64 GB (CINECA's Leonardo
                                                      user guide: 4 x A100 64 GB HBM2e per node)
a100-80gb      80     19.5    156     312     312     2039: NVIDIA A100 data sheet (SXM4 80 GB)
h100           80     67      494.5   989.5   989.5   3350: NVIDIA H100 data sheet (SXM5)
h200           141    67      494.5   989.5   989.5   4800: NVIDIA H200 data sheet (SXM)
gh200          96     67      494.5   989.5   989.5   4000: NVIDIA GH200 Grace Hopper data sheet (96 GB HBM3)
mi250x-gcd     64     47.9    -       191.5   191.5   1638: AMD Instinct MI250X data sheet (383 TFLOP/s bf16,
                                                      95.7 TFLOP/s fp32 matrix and 3.2 TB/s for the 2 GCDs)
=============  =====  ======  ======  ======  ======  ========================================================

PyTorch runs fp32 convolutions in TF32 by default on Ampere and later (``torch.backends.cudnn.allow_tf32``)
and fp32 matmuls in fp32 (``torch.backends.cuda.matmul.allow_tf32`` is off), so an fp32 convolution is timed
at the tf32 rate where there is one. What a kernel reaches of the peak is an efficiency per op class
(``plan.efficiency``: conv, matmul, memory; calibrated by ``gems bench plan``).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gems.bootstrap import keep_host_memory
from gems.errors import ConfigError

__all__ = ["GPUS", "Rates", "Link", "gpu_rates", "cpu_rates", "forget_cpu_rates", "conv_workspace",
           "synthetic_seconds", "links", "DEFAULT_EFFICIENCY", "efficiency"]


@dataclass(frozen=True)
class GPU:
    memory_gib: float
    fp32: float  # TFLOP/s
    tf32: float | None
    bf16: float | None
    fp16: float | None
    bandwidth: float  # GB/s


GPUS: dict[str, GPU] = {
    "v100-16gb": GPU(16, 15.7, None, None, 125.0, 900.0),
    "v100-32gb": GPU(32, 15.7, None, None, 125.0, 900.0),
    "a100-40gb": GPU(40, 19.5, 156.0, 312.0, 312.0, 1555.0),
    "a100-64gb": GPU(64, 19.5, 156.0, 312.0, 312.0, 1638.0),
    "a100-80gb": GPU(80, 19.5, 156.0, 312.0, 312.0, 2039.0),
    "h100": GPU(80, 67.0, 494.5, 989.5, 989.5, 3350.0),
    "h200": GPU(141, 67.0, 494.5, 989.5, 989.5, 4800.0),
    "gh200": GPU(96, 67.0, 494.5, 989.5, 989.5, 4000.0),
    "mi250x-gcd": GPU(64, 47.9, None, 191.5, 191.5, 1638.0),
}

#: what kernels reach of a GPU's peak, per op class (convolutions, matmuls, memory-bound ops)
DEFAULT_EFFICIENCY = {"conv": 0.5, "matmul": 0.6, "memory": 0.6}
#: per op: the launch and framework overhead of one kernel on a GPU (seconds)
GPU_OP_OVERHEAD_S = 6e-6


@dataclass
class Rates:
    """How fast one rank computes: ``time(op class, signature, flops, bytes, backward)`` in seconds."""

    kind: str  # "gpu" | "cpu"
    name: str
    flops: dict[str, float]  # op class -> FLOP/s reached (GPU: peak x efficiency)
    bandwidth: float  # bytes/s reached by memory-bound ops
    op_overhead_s: float
    measured: dict[tuple, tuple[float, float]] | None = None  # CPU: conv signature -> (forward, backward) FLOP/s
    about: str = ""
    threads: int = 1  # CPU: the rank's threads, for measuring
    crowd: int = 1  # CPU: ranks of a node that compute at once: ops are timed that many at a time (_crowded)
    in_step: float = 1.0  # CPU: how much longer ops take inside a training step than timed alone (cpu_rates)
    share: float = 1.0  # ranks that take turns on one core's worth of compute (oversubscribed CPU nodes)
    #: whether communication runs on resources of its own beside the compute (GPUs: copy engines, NCCL's
    #: kernels; CPU ranks only where the node has cores no rank computes on: else gloo's copies and sums
    #: take their time from the compute, and nothing is hidden behind it)
    spare: bool = True

    def time(self, cls: str, sig: tuple, flops: float, nbytes: float, backward: bool, batch: int = 1) -> float:
        """One op's time at micro-batch ``batch``. Measured rates (CPU) give forward and backward directly (a
        backward rate is the forward's work over the backward's time; a convolution is timed at its batch);
        data-sheet rates (GPU) give a roofline, the larger of compute and memory time, with a backward costing
        twice its forward (input and weight gradients)."""
        if self.measured is not None:
            work = flops if cls in ("conv", "matmul") else nbytes
            if cls == "conv":
                sig = (*sig, _measure_batch(sig, batch))
            elif cls == "memory":
                sig = (*sig, _memory_elements(nbytes))
            alone = work / self.measured_rate(sig, backward) + self.op_overhead_s * (2 if backward else 1)
            return self.share * self.in_step * alone
        k = 2.0 if backward else 1.0
        compute = flops / self.flops[cls] if cls in ("conv", "matmul") else 0.0
        return self.share * k * (max(compute, nbytes / self.bandwidth) + self.op_overhead_s)

    def shared(self, share: float) -> Rates:
        """These rates when ``share`` ranks' threads take turns on each core (measurements stay shared)."""
        from dataclasses import replace

        return replace(self, share=share, about=self.about + f"; {share:.3g} ranks' threads per core (oversubscribed)")

    def measured_rate(self, sig: tuple, backward: bool) -> float:
        """CPU: the rate of this signature (FLOP/s of a convolution or matmul, bytes/s of a kind of memory-bound
        op), measured the first time it is asked for, with the rank's threads."""
        assert self.measured is not None
        if sig not in self.measured:
            self.measured[sig] = _with_threads(self.threads, lambda: _crowded(self.crowd, lambda: _measure_op(sig)))
        fwd, bwd = self.measured[sig]
        return bwd if backward else fwd


def efficiency(cfg_eff: Any) -> dict[str, float]:
    """``plan.efficiency`` over the defaults; bad keys or values exit 2."""
    out = dict(DEFAULT_EFFICIENCY)
    if cfg_eff is None:
        return out
    items = dict(cfg_eff) if hasattr(cfg_eff, "items") else None
    if items is None:
        raise ConfigError("plan.efficiency", cfg_eff, "a mapping such as {conv: 0.5, matmul: 0.6, memory: 0.6}")
    for k, v in items.items():
        if k not in out:
            raise ConfigError(f"plan.efficiency.{k}", v, f"one of {sorted(out)}")
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = -1.0
        if not 0 < f <= 1:
            raise ConfigError(f"plan.efficiency.{k}", v, "a fraction of the peak in (0, 1]")
        out[k] = f
    return out


def gpu_rates(name: str, precision: str, eff: dict[str, float]) -> Rates:
    """A named GPU's rates at ``precision`` (``cluster.gpu``)."""
    g = GPUS.get(name)
    if g is None:
        raise ConfigError("cluster.gpu", name, f"one of {', '.join(GPUS)} (the figures gems plan has)")
    if precision == "fp32":
        conv, mm = g.tf32 or g.fp32, g.fp32
    else:
        peak = g.bf16 if precision == "bf16" else g.fp16
        if peak is None:
            raise ConfigError("train.precision", precision, f"fp32 or fp16 on {name} (it has no {precision} units)")
        conv = mm = peak
    tf = 1e12
    return Rates("gpu", name, {"conv": conv * tf * eff["conv"], "matmul": mm * tf * eff["matmul"]},
                 g.bandwidth * 1e9 * eff["memory"], GPU_OP_OVERHEAD_S,
                 about=f"{name}: {conv:g} TFLOP/s for convolutions, {mm:g} for matmuls at {precision}, "
                       f"{g.bandwidth:g} GB/s; efficiency {eff}")


# ---- CPU ranks: measured here --------------------------------------------------------------------------------
_CPU: dict[tuple, Rates] = {}


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


#: the memory-bound kinds CPU ranks time (gems.plan.cost.memory_group), on about as many elements as the op
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
    """The batch a convolution of signature ``sig`` (gems.plan.cost) is timed at for micro-batch ``batch``: its
    own, or fewer samples where that many would pass MEASURE_ELEMENTS (the rate no longer depends on it)."""
    cin, extent = sig[2], sig[-1]
    return max(1, min(int(batch), MEASURE_ELEMENTS // max(1, cin * math.prod(extent))))


def _cube(elements: int, nd: int) -> list[int]:
    """``nd`` extents of about equal powers of two whose product is ``elements`` (a power of two)."""
    side = 2 ** max(2, round(math.log2(max(elements, 1)) / nd))
    return [side] * (nd - 1) + [max(1, elements // side ** (nd - 1))]


def _measure_op(sig: tuple) -> tuple[float, float]:
    """(forward rate, backward rate) of one signature on this machine: FLOP/s for a convolution or matmul
    (timed at its own channels, kernel and, up to gems.plan.cost.MEASURE_EXTENT, its own extent), bytes/s
    for a kind of memory-bound op; a backward rate is the forward's work over the backward's seconds."""
    kind = sig[0]
    if kind == "memory":
        f: Any
        if len(sig) > 3:  # a pool of known kernel, stride and padding (gems.plan.cost.memory_signature)
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
        _, k, n = sig
        a = torch.randn(256, k, requires_grad=True)
        w = torch.randn(k, n, requires_grad=True)
        flops = 2.0 * 256 * k * n
        fwd, bwd = _fwd_bwd(lambda a, w: a @ w, [a, w])
        return flops / fwd, flops / bwd
    f, inputs, flops = _conv_case(sig)
    fwd, bwd = _fwd_bwd(f, inputs)
    return flops / fwd, flops / bwd


def _conv_case(sig: tuple, input_grad: bool = True) -> tuple[Any, list[torch.Tensor], float]:
    """(f, inputs, FLOPs of one call) of the convolution of signature ``sig`` (gems.plan.cost, with the batch it
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
    # reference kernel where the full-size convolution gets oneDNN (gems.spatial.layers.conv_nd)
    from gems.spatial.layers import conv_nd

    w = torch.randn(cout, cin // groups, *kernel, requires_grad=True)
    ones = [1] * nd
    out = conv_nd(x, w, None, stride, padding, ones, groups)
    flops = 2.0 * (cin // groups) * math.prod(kernel) * out.numel()
    return (lambda x, w: conv_nd(x, w, None, stride, padding, ones, groups)), [x, w], flops


_WORKSPACE: dict[tuple, int] = {}


def conv_workspace(sig: tuple, batch: int, input_grad: bool, threads: int = 1) -> int:
    """Bytes a CPU convolution's backward allocates for itself at micro-batch ``batch``: its peak over the
    gradients it returns (oneDNN's scratchpad and weight-gradient buffers in its own layout: about 4x the
    weights for a 256-channel 3^3 convolution, whatever the extent and batch; torch's reference kernel, which
    it picks for one small sample: the unfolded input, 27x the input for a 3^3 one). A GPU's counterpart,
    cuDNN's workspace, is in ``plan.reserve_gb``.

    Measured on random tensors from the CPU allocator's events (:func:`gems.memory.step_peak_bytes`, as a
    run's record counts tensor memory), once per signature and input gradient at batches 1, 2 and 4 (those
    within MEASURE_ELEMENTS elements of input or output): exact there, on the line between them at 3, and
    beyond the last on the line through the last two, never decreasing."""
    per_sample = max(sig[2], sig[3]) * math.prod(sig[-1])  # the larger of its input and (stride 1) output
    points = [q for q in (1, 2, 4) if q == 1 or q * per_sample <= MEASURE_ELEMENTS]

    def at(q: int) -> int:
        key = (sig, q, input_grad, threads)
        if key not in _WORKSPACE:
            _WORKSPACE[key] = _with_threads(threads, lambda: _backward_workspace((*sig, q), input_grad))
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

    f, inputs, _ = _conv_case(sig, input_grad)
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
    as :meth:`SyntheticData.batch` makes them at every step, on the host (GPU ranks generate there too).

    Timed here with the real generator, which makes each plane along spatial dim 0 whole from its own seeded
    generator (so a cut along the other dims saves nothing): on as many of the part's planes as stay within
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


def cpu_rates(threads: int, crowd: int = 1) -> Rates:
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
    r = Rates("cpu", f"this machine's CPU, {threads} thread(s) a rank", {"conv": 1e10, "matmul": 1e10}, 1e10, over,
              measured={}, threads=threads, crowd=crowd)
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


def _in_step_factor(rates: Rates) -> float:
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

    from gems.plan.cost import OpCounter
    from gems.plan.timing import layer_time

    cur = [0]
    counter = OpCounter(cur)
    with FakeTensorMode(allow_non_fake_inputs=True):
        h = torch.empty(REFERENCE_BATCH, 8, 64, 64)
        block = _reference_block()
        with counter:
            for i, layer in enumerate(block):
                cur[0] = i
                h = layer(h)
    return sum(layer_time(counter.take(i), rates, False, REFERENCE_BATCH) +
               layer_time(counter.take(i), rates, True, REFERENCE_BATCH, first=i == 0) for i in range(len(block)))


# ---- links ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Link:
    """One rank's share of a link: bandwidth per direction (bytes/s) and the latency of a message (s)."""

    bandwidth: float
    latency: float
    name: str

    def message(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


def links(cluster: Any, nodes: int) -> tuple[Link, Link | None]:
    """(within a node, between nodes) from the preset's ``intra_node_*`` and ``inter_node_*`` keys; between
    nodes is None for a one-node job; a missing figure the job needs exits 2 naming its key."""
    def need(k: str) -> float:
        v = cluster.get(k)
        if v is None:
            raise ConfigError(f"cluster.{k}", None, f"the {k.replace('_', ' ')} figure of the {cluster.name} preset "
                                                    "(from its interconnect's data sheet), e.g. cluster."
                                                    f"{k}={25 if 'GBps' in k else 5}")
        return float(v)

    intra = Link(need("intra_node_GBps") * 1e9, need("intra_node_latency_us") * 1e-6, "intra-node")
    if nodes <= 1:
        return intra, None
    return intra, Link(need("inter_node_GBps") * 1e9, need("inter_node_latency_us") * 1e-6, "inter-node")
