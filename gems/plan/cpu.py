"""This machine's CPU timed: a CPU rank's rates (:func:`cpu_rates`), each op's measured the first time a model
needs it, what a convolution's backward allocates for itself (:func:`conv_workspace`) and what synthetic data costs
to make on the host (:func:`synthetic_seconds`).

Times are the least of repeated short samples (:func:`_timed`), kept for other processes in gems's cache
(:mod:`gems.plan.store`, keyed by the CPU's model and instruction sets, its cores, the rank's threads, the ranks
computing at once and torch's version), so the same command plans alike in every process. They are measured
again after :data:`KEPT_FOR_S`, or where a reference convolution runs :data:`DRIFT` times faster than when they
were kept (they were taken in a loaded moment); where it runs slower (a loaded moment now), they stand, and a kernel
new to them is scaled to the kept moment's speed by the same reference.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gems.bootstrap import keep_host_memory
from gems.plan.devices import Rates
from gems.plan.store import cached, cpu_identity, keep, load

__all__ = ["CpuRates", "cpu_rates", "forget_cpu_rates", "conv_workspace", "synthetic_seconds", "matmul_rows",
           "conv_case", "reference_alone", "KEPT_FOR_S", "DRIFT"]

#: kept kernel times older than this are measured again
KEPT_FOR_S = 30 * 24 * 3600.0
#: kept kernel times are measured again where the reference convolution runs this many times faster than when they
#: were kept (they were taken in a loaded moment, or on a slower host of the same name)
DRIFT = 1.25
#: the kept record's layout (a new one starts where it changes)
_KEPT_FORMAT = 1


@dataclass
class _Kept:
    """This machine's kernel times for one rank's threads and crowd: rates by signature and part (``forward``,
    ``backward``, ``input``, ``weight``), the fixed figures (``overhead``, ``in_step``, ``split``, synthetic data's
    seconds by shape); when they were measured, the reference convolution's time then, and how it runs now (``pace``: now
    over then, by which a kernel measured now is scaled to the kept moment)."""

    key: tuple
    made: float
    reference: float
    rates: dict[tuple, dict[str, float]] = field(default_factory=dict)
    fixed: dict[Any, float] = field(default_factory=dict)
    pace: float = 1.0
    alone: bool = False  # (timed for this process only: neither read nor written, forget_cpu_rates)

    def save(self) -> None:
        """Written for the next process, with what another process kept of the same record meanwhile."""
        if self.alone:
            return
        there = load("cpu", self.key)
        if isinstance(there, _Kept) and there.made == self.made:
            for sig, parts in there.rates.items():
                self.rates[sig] = {**parts, **self.rates.get(sig, {})}
            self.fixed.update({k: v for k, v in there.fixed.items() if k not in self.fixed})
        pace, self.pace = self.pace, 1.0  # (the pace is this process's)
        try:
            keep("cpu", self.key, self)
        finally:
            self.pace = pace

    def figure(self, name: Any, measure: Any) -> float:
        """A fixed figure of seconds, kept, or measured now and scaled to the kept moment (as the in-step factor
        is: a block's time now over its ops' kept times); 0 where ``measure()`` cannot tell here (None: not kept)."""
        if name not in self.fixed:
            got = measure()
            if got is None:
                return 0.0
            self.fixed[name] = float(got) / self.pace
            self.save()
        return self.fixed[name]


@dataclass
class CpuRates(Rates):
    """A CPU rank's rates: each op's measured here with the rank's threads (:meth:`measured_rate`)."""

    #: signature (with the batch, rows or elements it is timed at) -> part -> FLOP/s, or bytes/s (kept: _Kept)
    measured: dict[tuple, dict[str, float]] = field(default_factory=dict)
    threads: int = 1  # the rank's threads, for measuring
    crowd: int = 1  # ranks of a node that compute at once: ops are timed that many at a time (_crowded)
    in_step: float = 1.0  # how much longer ops take inside a training step than timed alone (cpu_rates)
    kept: _Kept | None = None  # where the measurements are kept

    def time(self, cls: str, sig: tuple, flops: float, nbytes: float, backward: bool, batch: int = 1,
             part: str | None = None) -> float:
        """One op's time at micro-batch ``batch`` from the rates measured here: a backward rate is the forward's work
        over the backward's time (``part``: of its ``input`` or ``weight`` gradients alone, each timed on its own);
        a convolution is timed at its batch, a matmul at its rows."""
        work = flops if cls in ("conv", "matmul") else nbytes
        if cls == "conv":
            sig = (*sig, _measure_batch(sig, batch))
        elif cls == "matmul":
            sig = (*sig, matmul_rows(sig, flops))
        elif cls == "memory":
            sig = (*sig, _memory_elements(nbytes))
        which = "forward" if not backward else (part or "backward")
        alone = work / self.measured_rate(sig, which) + self.op_overhead_s * (2 if backward and part is None else 1)
        return self.share * self.in_step * alone

    def update(self, nbytes: float, factor: int) -> float:
        """Seconds of the optimizer's update of ``nbytes`` of parameters (:meth:`Rates.update`): torch's own fused
        update, as a run makes it (gems.rank.optim), timed here per byte past the caches (Adam, SGD with momentum,
        plain SGD); an average of the weights (``factor`` past Adam's 2) two passes more at the memory rate."""
        kind = min(2, max(0, factor))
        per_byte = self.kept.figure(("update", kind), lambda: _with_threads(self.threads, lambda: _update(kind))) \
            if self.kept is not None else _with_threads(self.threads, lambda: _update(kind))
        return self.share * (per_byte * nbytes + 2 * max(0, factor - 2) * nbytes / self.bandwidth)

    def measured_rate(self, sig: tuple, part: bool | str) -> float:
        """The rate of this signature (FLOP/s of a convolution or matmul, bytes/s of a kind of memory-bound op) for
        ``part`` (``forward``, ``backward``, or a backward's ``input`` or ``weight`` gradients alone; True and False:
        backward and forward), kept or measured the first time it is asked for, with the rank's threads."""
        which = part if isinstance(part, str) else ("backward" if part else "forward")
        got = self.measured.setdefault(sig, {})
        if which not in got:
            pair = ("input", "weight") if which in ("input", "weight") else ("forward", "backward")
            rates = _with_threads(self.threads, lambda: _crowded(self.crowd, lambda: _measure_op(sig, pair[0])))
            pace = self.kept.pace if self.kept is not None else 1.0
            got.update({k: v * pace for k, v in zip(pair, rates)})  # (a rate: measured slower now, kept faster)
            if self.kept is not None:
                self.kept.save()
        return got[which]


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


#: a sample of a kernel's time lasts at least this long (calls of a shorter kernel are timed together)
SAMPLE_S = 2e-4


def _timed(fn: Any, budget_s: float = 0.05, least: int = 5) -> float:
    """Seconds a call of ``fn`` takes: the least of repeated samples (each of as many calls as last
    :data:`SAMPLE_S`), ``least`` of them at least and as many more as ``budget_s`` allows. A shared machine only
    ever slows a call, and a short sample is more often left alone by a loaded moment than a long one."""
    fn()  # warm up (oneDNN picks and caches its kernel)
    t0 = time.perf_counter()
    fn()
    best = time.perf_counter() - t0
    calls = max(1, math.ceil(SAMPLE_S / max(best, 1e-9)))
    n, start = 0, time.perf_counter()
    while n < least or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
        n += 1
    return best


def _fwd_bwd(f: Any, inputs: list[torch.Tensor], pair: str = "forward") -> tuple[float, float]:
    """Seconds of ``f(*inputs)`` and of its backward (to every input that needs a gradient); with ``pair``
    ``input``, of the backward to the first input alone and to the others alone (a split backward's I and W)."""
    out = f(*inputs)
    g = torch.ones_like(out)
    need = [t for t in inputs if t.requires_grad]
    if pair == "input":
        return (_timed(lambda: torch.autograd.grad(out, need[:1], g, retain_graph=True)),
                _timed(lambda: torch.autograd.grad(out, need[1:], g, retain_graph=True)))
    fwd = _timed(lambda: f(*inputs))
    return fwd, _timed(lambda: torch.autograd.grad(out, need, g, retain_graph=True))


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


#: the most elements a memory-bound op is timed on (past a server's last cache)
MEMORY_ELEMENTS = 2**24


def _memory_elements(nbytes: float) -> int:
    """The elements a memory-bound op of ``nbytes`` (read and written) is timed on: a power of two near its
    fp32 operand's size, from 16 Ki (below, the per-op overhead dominates) to 16 Mi (64 MiB, past a server's last
    cache: at 4 Mi, 16 MiB fit this project's VM's 32 MiB and a dense head's gradients were added at cache speed)."""
    return min(MEMORY_ELEMENTS, 2 ** max(14, round(math.log2(max(nbytes, 1.0) / 8))))


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


def _measure_op(sig: tuple, pair: str = "forward") -> tuple[float, float]:
    """(forward rate, backward rate) of one signature on this machine, or with ``pair`` ``input`` (a convolution's
    or matmul's) the rates of its backward's input and weight gradients alone: FLOP/s for a convolution or matmul
    (timed at its own channels, kernel and, up to gems.trace.ops.MEASURE_EXTENT, its own extent), bytes/s for a
    kind of memory-bound op; a backward rate is the forward's work over the backward's seconds."""
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
        fwd, bwd = _fwd_bwd(lambda a, w: a @ w, [a, w], pair)
        return flops / fwd, flops / bwd
    f, inputs, flops = conv_case(sig)
    fwd, bwd = _fwd_bwd(f, inputs, pair)
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


def synthetic_seconds(spec: Any, part: list[int], want_input: bool, want_target: bool, threads: int = 1,
                      kept: _Kept | None = None) -> float:
    """Seconds to make one sample of synthetic data (:mod:`gems.data.synthetic`) for a rank whose spatial part
    has the extents ``part`` = (C, *spatial): its input part (``want_input``) and target (``want_target``),
    as :meth:`SyntheticData.batch` makes them at every step, on the host (CPU ranks; GPU ranks draw on their GPU:
    :func:`gems.plan.predict.gpu_synthetic`).

    Timed here with the real generator, which makes each aligned block of planes along spatial dim 0 whole from
    its own seeded generator (so a cut along the other dims saves nothing): on as many of the part's planes as stay within
    DATA_ELEMENTS, scaled to all of them. Memoised per shape, and kept with the rates' times (``kept``: a rank's
    :attr:`CpuRates.kept`) under the generator's source."""
    key = (tuple(spec.input_shape), spec.target, tuple(part), want_input, want_target, threads)
    if not (want_input or want_target):
        return 0.0
    if key not in _DATA:
        from gems.data.synthetic import SyntheticData

        plane = max(1, math.prod(spec.input_shape) // max(1, spec.input_shape[1]))
        planes = max(1, int(part[1]))
        timed = max(1, min(planes, DATA_ELEMENTS // plane))
        slices = [slice(0, timed), *[slice(0, int(n)) for n in part[2:]]]

        def measure() -> float:
            data = SyntheticData(spec, 0, 1 << 20)
            idx = iter(range(1 << 20))  # a new sample each call, as a step draws new ones
            return float(_with_threads(threads, lambda: _timed(
                lambda: data.batch([next(idx)], slices, want_input=want_input, want_target=want_target))))

        if kept is None:
            _DATA[key] = measure() * planes / timed
        else:
            _DATA[key] = kept.figure(("data", _generator_digest(), *key), measure) * planes / timed
    return _DATA[key]


def _generator_digest() -> str:
    """A digest of the synthetic data's generator (gems/data/synthetic.py): what its kept times are a function of."""
    import hashlib

    import gems.data.synthetic as synthetic

    return hashlib.sha256(Path(synthetic.__file__).read_bytes()).hexdigest()[:16]


def cpu_rates(threads: int, crowd: int = 1) -> CpuRates:
    """This machine's rates for a rank of ``threads`` threads, ``crowd`` ranks of a node computing at once
    (ops and the reference block timed that many at a time: :func:`_crowded`): the per-op overhead, how much
    longer ops take in a step, a split backward's bookkeeping, and each convolution shape and kind of memory-bound
    op when the model first needs it (tens of milliseconds each), kept for other processes (the module's rule).

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
    kept, whence = _kept_times(threads, crowd)
    small = torch.randn(8)
    over = kept.figure("overhead", lambda: _with_threads(threads, lambda: _timed(lambda: torch.relu(small))))
    r = CpuRates("cpu", f"this machine's CPU, {threads} thread(s) a rank", {"conv": 1e10, "matmul": 1e10}, 1e10,
                 over, threads=threads, crowd=crowd, measured=kept.rates, kept=kept)
    # memory-bound work the trace does not count op by op (the optimizer's update): an elementwise op's rate past
    # the caches (before, a fixed 10 GB/s: a dense head's update planned at several times what it took)
    r.bandwidth = r.measured_rate(("memory", "elementwise", MEMORY_ELEMENTS), False)
    r.in_step = kept.figure("in_step", lambda: _with_threads(threads, lambda: _in_step_factor(r)))
    r.layer_overhead_s = kept.figure("layer", lambda: _with_threads(threads, lambda: _layer_overhead(r)))
    r.split_overhead_s = kept.figure("split", lambda: _with_threads(threads, _split_overhead))
    r.action_overhead_s = kept.figure("action", lambda: _with_threads(threads, _action_overhead))
    r.about = (f"CPU measured per convolution shape and kind of op, {over * 1e6:.1f} us per op ({threads} "
               f"thread(s) a rank, freed host memory reused as a step reuses it"
               + (f", {crowd} ranks computing at once" if crowd > 1 else "") + "); ops inside a step take "
               f"{r.in_step:.2f}x their time alone (a reference convolution block); a layer's call "
               f"{r.layer_overhead_s * 1e6:.0f} us each way, a pipeline action's bookkeeping "
               f"{r.action_overhead_s * 1e6:.0f} us, a split backward's W {r.split_overhead_s * 1e6:.0f} us a "
               f"deferrable layer; kernel times {whence}")
    _CPU[key] = r
    return r


#: the next cpu_rates times for this process alone (forget_cpu_rates)
_ALONE: list[bool] = [False]


def forget_cpu_rates() -> None:
    """Time this machine anew at the next :func:`cpu_rates`, for this process alone: the times kept for other
    processes are neither read nor replaced (a benchmark times them beside each run it predicts)."""
    _CPU.clear()
    _WORKSPACE.clear()
    _DATA.clear()
    _ALONE[0] = True


def _times_key(threads: int, crowd: int) -> tuple:
    """What kept kernel times are a function of: this machine (its CPU's model and instruction sets, its cores, a
    cap on oneDNN's instruction sets), the rank's threads, the ranks computing at once, and torch's version."""
    return ("cpu times", _KEPT_FORMAT, cpu_identity(), os.cpu_count(), _onednn_isa_cap(), threads, crowd,
            torch.__version__)


def _kept_times(threads: int, crowd: int) -> tuple[_Kept, str]:
    """The kernel times of a rank of ``threads`` threads and ``crowd`` ranks at once: those kept, where the rule
    keeps them (the module's docstring), else a record to measure them in; and where they came from, in words."""
    key = _times_key(threads, crowd)
    old = None if _ALONE[0] else load("cpu", key)
    why = "nothing kept for this machine, threads and torch"
    now = None
    if isinstance(old, _Kept):
        age = time.time() - old.made
        if age > KEPT_FOR_S:
            why = f"those kept were {age / 86400:.0f} days old (measured again after {KEPT_FOR_S / 86400:.0f})"
        else:
            now = _with_threads(threads, _reference_seconds)
            if old.reference / now > DRIFT:
                why = (f"the reference convolution ran {old.reference / now:.2f}x faster than when those kept were "
                       f"measured, more than {DRIFT:g}x: they were taken in a loaded moment")
            else:
                old.pace = now / old.reference
                made = time.strftime("%Y-%m-%d %H:%M", time.localtime(old.made))
                return old, (f"kept from {made} ({len(old.rates)} kernels; the reference convolution at "
                             f"{old.pace:.2f}x its time then; measured again after {KEPT_FOR_S / 86400:.0f} days, or "
                             f"where it runs {DRIFT:g}x faster)")
    if _ALONE[0]:
        why = "for this process alone (gems.plan.cpu.forget_cpu_rates)"
    now = now or _with_threads(threads, _reference_seconds)
    return _Kept(key, time.time(), now, alone=_ALONE[0]), f"measured now ({why})"


def _reference_seconds() -> float:
    """The drift check's kernel: a 16 -> 16 channel 3 x 3 convolution of 8 images of 32^2, forward (a few ms)."""
    x, w = torch.randn(8, 16, 32, 32), torch.randn(16, 16, 3, 3)
    return float(_timed(lambda: F.conv2d(x, w, padding=1), budget_s=0.05, least=5))


def _layer_overhead(rates: CpuRates) -> float:
    """Host time a layer's call costs each way beyond its ops (the module's call, autograd's node and engine): the
    reference block on 4 x 4 pixels, where little but that is left, trained for real against its ops at these
    rates, per layer and direction."""
    block, x = _reference_block(), torch.randn(1, 8, 4, 4)
    real = _timed(lambda: block(x).sum().backward(), budget_s=0.1, least=5)
    return max(0.0, (real - reference_alone(rates, 1, 4)) / (2 * len(block)))


def _action_overhead() -> float | None:
    """A pipeline action's bookkeeping on the host beyond its partition's ops (gems.pipeline.runtime: what it
    receives and sends posted, its finite check, its clock): the second of a line of two positions, a dense layer
    of one weight each, 1F1B over eight micro-batches, its step over torch's fake process group (messages complete
    at once), less its partition's forwards and backwards, over its actions. None where this process has a
    process group already (it cannot start the fake one)."""
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return None
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gems.pipeline.runtime import PipelineRunner
    from gems.pipeline.schedules import make_schedule

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        sched = make_schedule("1f1b", 2, 8)
        part = torch.nn.Sequential(torch.nn.Linear(1, 1))
        runner = PipelineRunner({1: part}, sched, 1, [0, 1], dist.group.WORLD, 8, lambda y, t, c: y.sum(),
                                shapes=[((1, 1), torch.float32)], device=torch.device("cpu"))
        x = torch.randn(8, 1)
        step = _timed(lambda: runner.step(None, x, list(range(8)), 0, 0), budget_s=0.1, least=5)
        own = _timed(lambda: part(x[:1]).sum().backward(), budget_s=0.05)
        actions = len(sched.actions[1])
        return max(0.0, (step - own * actions / 2) / actions)
    finally:
        dist.destroy_process_group()


def _update(kind: int) -> float:
    """Seconds a byte of parameters takes in torch's fused update (gems.rank.optim's: ``kind`` 2 Adam, 1 SGD with
    momentum, 0 SGD), on a parameter of MEMORY_ELEMENTS values (past the caches)."""
    p = torch.nn.Parameter(torch.zeros(MEMORY_ELEMENTS))
    p.grad = torch.ones_like(p)
    opt = (torch.optim.Adam([p], lr=1e-3, fused=True) if kind == 2 else
           torch.optim.SGD([p], lr=1e-3, momentum=0.9 if kind == 1 else 0.0, fused=True))
    return float(_timed(opt.step, budget_s=0.1)) / (4.0 * p.numel())


def _split_overhead() -> float:
    """What a split backward adds a deferrable layer beyond its ops (gems.pipeline.deferred: its forward and input
    gradient through a Python autograd function, its weight gradients queued and handed to autograd in the W):
    a dense layer of one weight, its forward, I and W against its forward and backward whole."""
    from gems.pipeline.deferred import WeightGrads, deferring, make_deferrable

    plain, split = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    make_deferrable(split)
    x = torch.randn(1, 1, requires_grad=True)
    store = WeightGrads()

    def parts() -> None:
        with deferring(store, (0, 0, 0)):
            split(x).sum().backward()
        store.run((0, 0, 0))

    return max(0.0, _timed(parts) - _timed(lambda: plain(x).sum().backward()))


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
        return _timed(lambda: block(x).sum().backward(), budget_s=0.2, least=5)

    return min(3.0, max(0.5, _crowded(rates.crowd, real) / reference_alone(rates)))


def reference_alone(rates: Rates, batch: int = REFERENCE_BATCH, size: int = 64) -> float:
    """Seconds the forward and backward of :func:`_reference_block`'s ops take at these rates, timed alone (at
    ``batch`` images of ``size``^2 pixels): its ops counted on a fake run, layer by layer as the planner counts a
    model's (the first layer's backward computes no input gradient: its convolution's weight gradient alone)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gems.trace.ops import OpCounter

    cur = [0]
    counter = OpCounter(cur)
    with FakeTensorMode(allow_non_fake_inputs=True):
        h = torch.empty(batch, 8, size, size)
        block = _reference_block()
        with counter:
            for i, layer in enumerate(block):
                cur[0] = i
                h = layer(h)
    return sum(rates.layer_time(counter.take(i), False, batch) +
               rates.layer_time(counter.take(i), True, batch, first=i == 0) for i in range(len(block)))
