"""The rates the performance model runs on: named GPUs from their vendors' data sheets, CPU ranks measured
on the spot, and the links of a cluster preset.

GPU figures are per device (per GCD for the MI250X), dense (no structured sparsity), in TFLOP/s and GB/s
(10^9 bytes/s, as data sheets give bandwidths):

=============  =====  ======  ======  ======  ======  ========================================================
name           GB     fp32    tf32    bf16    fp16    memory GB/s, source
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

GB: the memory figure the data sheet prints ("40 GB"). For HBM parts it is a binary size: an A100 "40 GB"
has 40 GiB = 40960 MiB (nvidia-smi's total), an H100 "80 GB" 81559 MiB. What a process can allocate in is
less: the total the CUDA (ROCm) runtime reports, ``cudaGetDeviceProperties().totalGlobalMem`` =
``torch.cuda.get_device_properties().total_memory``, which leaves out what the driver keeps. The planner
counts that total (:data:`GPUS` ``.memory_bytes``, :func:`gpu_memory_bytes`); the sources are at
:data:`GPUS`. The reserve the planner sets aside in it is modelled from its parts below
(:func:`gpu_reserve`).

PyTorch runs fp32 convolutions in TF32 by default on Ampere and later (``torch.backends.cudnn.allow_tf32``)
and fp32 matmuls in fp32 (``torch.backends.cuda.matmul.allow_tf32`` is off), so an fp32 convolution is timed
at the tf32 rate where there is one. What a kernel reaches of the peak is an efficiency per op class
(``plan.efficiency``: conv, matmul, memory, pool; measured by ``gems bench calibrate``).

Why one file of this length: it is a catalogue, the devices' table and each cluster preset's links one entry
each, with the CPU measured beside them; split, one table would live in several places.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from gems.bootstrap import keep_host_memory
from gems.errors import ConfigError
from gems.plan.store import cached, cpu_identity

__all__ = ["GPUS", "Rates", "Link", "gpu_rates", "cpu_rates", "forget_cpu_rates", "conv_workspace",
           "synthetic_seconds", "links", "DEFAULT_EFFICIENCY", "efficiency", "gpu_memory_bytes", "Communicator",
           "rank_communicators", "gpu_reserve", "Reserve"]


@dataclass(frozen=True)
class GPU:
    nominal_gb: float  # the data sheet's memory figure ("40 GB"); for HBM parts that many GiB of HBM
    memory_bytes: int  # the total CUDA/ROCm reports (torch total_memory): what the process allocates in
    fp32: float  # TFLOP/s
    tf32: float | None
    bf16: float | None
    fp16: float | None
    bandwidth: float  # GB/s


MiB = 2**20
#: what the driver keeps of an HBM GPU's memory, as a fraction, where no total reported by CUDA was found:
#: the largest seen among the GPUs below, an A100 40 GB's (40 GiB against the 42298834944 bytes deviceQuery
#: reports, 1.5%). The others keep 0.02% (MI250X GCD) to 1.4% (V100 16 GB) of their nominal GiB.
DRIVER_KEEPS = 1 - 42298834944 / (40 * 2**30)

# The totals CUDA (ROCm) reports, ``totalGlobalMem`` (torch's ``total_memory``; torch prints it in MiB and
# calls them "MB"). They move by a few MiB with the driver version.
# - v100-16gb: 16160 MiB: torch's _CudaDeviceProperties of a Tesla V100-SXM2-16GB (torch 1.7-1.8 logs in
#   public repositories, e.g. "Using torch 1.8.0+cu101 _CudaDeviceProperties(..., total_memory=16160MB)"),
#   the same as nvidia-smi's total in logs of that time (which then already left out what the driver keeps).
# - v100-32gb: 32480 MiB, nvidia-smi on Tesla V100-PCIE-32GB with driver 410 (quoted in
#   blog.cachecha.com/csdn/kunhe0512/126265050); V100-SXM2-32GB logs show 32510 MiB: the smaller is taken.
# - a100-40gb: 42298834944 bytes (40339 MiB), deviceQuery of an A100-SXM4-40GB, driver 535 (CUDA 12.2), in
#   github.com/bottlerocket-os/bottlerocket/pull/3873; PaddlePaddle's docs show 40536 MiB from an older
#   driver; nvidia-smi's total is 40960 MiB (thundergolfer.com/blog/nvidia-gpu-memory-capacity, Modal).
# - a100-64gb: none found: 64 GiB less DRIVER_KEEPS.
# - a100-80gb: 81251 MiB, deviceQuery of an A100-SXM4-80GB quoted in a public text found by search; nvidia-smi:
#   81920 MiB (Modal, above).
# - h100: 81089 MiB, torch 2.7 / CUDA 12.8 / NCCL 2.26.2 on an "NVIDIA H100 80GB HBM3" (the environment
#   line of the all_reduce benchmark of Stas Bekman's ML Engineering, as quoted in a public post; other
#   runs: 81082, 81090); nvidia-smi: 81559 MiB (Modal, above).
# - h200: 143156 MiB, torch's _CudaDeviceProperties of an "NVIDIA H200" in a public Modal example; nvidia-smi:
#   143771 MiB (Modal, above).
# - gh200: 102005473280 bytes (97280 MiB), deviceQuery of an "NVIDIA GH200 480GB" (CUDA 12.4, driver 12.2)
#   in a public log, whose nvidia-smi shows 97871 MiB.
# - mi250x-gcd: 68702699520 bytes (65520 MiB), rocminfo's pool of a gfx90a GCD, 67092480 KB, in
#   github.com/ROCm/rocm_smi_lib/issues/160.
GPUS: dict[str, GPU] = {
    "v100-16gb": GPU(16, 16160 * MiB, 15.7, None, None, 125.0, 900.0),
    "v100-32gb": GPU(32, 32480 * MiB, 15.7, None, None, 125.0, 900.0),
    "a100-40gb": GPU(40, 42298834944, 19.5, 156.0, 312.0, 312.0, 1555.0),
    "a100-64gb": GPU(64, int(64 * 2**30 * (1 - DRIVER_KEEPS)), 19.5, 156.0, 312.0, 312.0, 1638.0),
    "a100-80gb": GPU(80, 81251 * MiB, 19.5, 156.0, 312.0, 312.0, 2039.0),
    "h100": GPU(80, 81089 * MiB, 67.0, 494.5, 989.5, 989.5, 3350.0),
    "h200": GPU(141, 143156 * MiB, 67.0, 494.5, 989.5, 989.5, 4800.0),
    "gh200": GPU(96, 102005473280, 67.0, 494.5, 989.5, 989.5, 4000.0),
    "mi250x-gcd": GPU(64, 68702699520, 47.9, None, 191.5, 191.5, 1638.0),
}

GPU_EFFICIENCY_SOURCE = ("fit to 18 one-rank steps of CosmoFlow, 3D U-Net and ResNet measured on an H200 and an H100, "
                         "results/gpu/h200-2026-11-26.json and h100-2026-11-26.json, and held to 5 measured after "
                         "the fit, h100-2026-11-27.json")
#: what gems's steps reached of a Hopper GPU's peak, every precision alike, with the per-kernel cost and the convolutions'
#: width rule below (:func:`conv_width_factor`): fit to every one-rank row of results/gpu/h200-2026-11-26.json
#: (CosmoFlow 64^3-256^3, fp32/fp16/bf16) and h100-2026-11-26.json (the same, and 3D U-Net at 64^3, ResNet at
#: 512^2 and 256^2, other batches), the figures that bring the worst row's planned step nearest its measured one:
#: every row within 0.78-1.35 of measured (tests/test_plan_gpu.py). The physical reading:
#: - elementwise and normalising ops reach 85% of the data sheet's bandwidth (gems bench calibrate measured 83% for
#:   a leaky ReLU on the H100: results/gpu/calibration-h100-cosmoflow64.md);
#: - a pool reaches 44% a read, and reads each input cell kernel^d/stride^d times (:func:`pool_reads`): CosmoFlow's
#:   k3 s2 pools read each 3.375 times, 13% of the bandwidth for their bytes once; MLPerf's CosmoFlow and U-Net's
#:   k2 s2 pools read each once (with one rate for every pool, MLPerf's CosmoFlow, measured after the fit, was
#:   planned at 1.75x its step, now 1.22x: results/gpu/h100-2026-11-27.json); the pools and the narrow
#:   convolutions carry CosmoFlow's large steps;
#: - a convolution reaches 40% of the tensor cores' peak at 64 channels a side and more, less where it is narrower
#:   (CosmoFlow's first 4 -> 16 convolution: 1.8% by the rule, where calibrate timed its forward at 5%: the
#:   narrow layers' shortfall is made up by the pools beside them, as one fit over whole steps allows);
#: - a fixed cost a kernel (below) carries the small steps.
#: The H100 and H200 share the architecture, kernels and peak flops; only their memory differs. Before these
#: figures one memory-class efficiency (14%) lumped CosmoFlow's convolutions and pools with every elementwise op:
#: it fit CosmoFlow on the H200 and planned ResNet 4-6x and U-Net 2x too slow. ``plan.efficiency`` overrides them;
#: ``gems bench calibrate`` measures the convolutions and the bandwidth themselves.
_HOPPER_FIT = {"conv": 0.4, "matmul": 0.6, "memory": 0.85, "pool": 0.44}  # one fit, every precision
_HOPPER = {p: _HOPPER_FIT for p in ("fp32", "bf16", "fp16")}
GPU_EFFICIENCY: dict[str, dict[str, dict[str, float]]] = {"h200": _HOPPER, "h100": _HOPPER}
#: what kernels reach of a GPU's peak, per op class (convolutions at full width, matmuls, elementwise and
#: normalising ops, pools), for a GPU nothing was measured on: what gems's kernels reached on the GPUs that were,
#: the best guess until one of the kind is measured
DEFAULT_EFFICIENCY = dict(_HOPPER_FIT)
#: the channel width (the geometric mean of a convolution's input and output channels) from which a convolution
#: keeps the tensor cores as busy as it can, and how fast its rate falls below it (fit with the figures above)
CONV_FULL_WIDTH, CONV_WIDTH_POWER = 64.0, 1.5


def conv_width_factor(sig: tuple) -> float:
    """The share of a GPU convolution's full-width rate that a convolution of signature ``sig``
    (gems.trace.ops: ("conv", nd, cin, cout, ...)) reaches: an implicit GEMM whose channel dimensions are narrower
    than the tensor cores' tiles leaves them partly idle."""
    width = math.sqrt(max(1, int(sig[2])) * max(1, int(sig[3])))
    return min(1.0, (width / CONV_FULL_WIDTH) ** CONV_WIDTH_POWER)


#: per op (a kernel): its launch, torch's dispatch and cuDNN's plan lookup on the host, and a small kernel's own
#: least time on the GPU, in seconds; a backward op counts twice (its input and weight gradients), the
#: optimizer's foreach updates ten a partition. What a small step is made of: CosmoFlow 64^3 at batch 4 runs
#: ~110 such ops a step in fp32, ~170 in bf16 (autocast's casts); the H100 took 4.1-4.8 ms for it, the H200
#: (older gems, which read the device three times a step) 5.9-6.6 ms. Fit with the efficiencies above; gems plan
#: states it among its assumptions.
GPU_OP_OVERHEAD_S = 25e-6
#: per op of a model replayed from a CUDA graph (gems.rank.graphs): no launch, dispatch or plan lookup on the host,
#: only a small kernel's least time on the GPU and the graph's gap between kernels. Planned, not measured: no lease
#: has timed a replay yet (the next one does, scripts/gpu_check.sh); 3 us is a small kernel's few microseconds
GRAPH_OP_OVERHEAD_S = 3e-6
#: a convolution whose input or output holds 2^31 elements or more in one sample, past a 32-bit index: PyTorch
#: splits a batch into samples for cuDNN, but a single sample that large leaves cuDNN's usual kernels. On an H100
#: (torch 2.11, cuDNN 9; scripts/gpu_large_tensors.py: CosmoFlow's first 4 -> 16 convolution at 512^3 against
#: 511 x 512^2, whose output is one element under; results/gpu/h100-2026-11-27-large-tensors.json) a voxel's
#: forward took 2.4x (bf16) and 4.7x (fp32) its time, its backward 21.6x and 2.0x. CosmoFlow at 512^3 and a
#: batch of 1 took 2.42 s a bf16 step there where the plan without this rule said 0.11 s; spatial parts halve the
#: sample, and at S = 2 each part is under the limit. Other GPUs and libraries are assumed to do the same until
#: measured.
LARGE_SAMPLE_ELEMENTS = 2**31
#: the rates (FLOP/s, forward and backward) such a convolution ran at there: its forward's FLOPs over its forward's
#: time, and both gradients' FLOPs over the backward's time; the probe timed the two gradients together, so a
#: weight gradient alone (a model's first layer) is counted at the pair's time, the most it can take
LARGE_SAMPLE_CONV_FLOPS = {"fp32": (4.3e12, 1.6e12), "bf16": (3.9e12, 0.29e12), "fp16": (3.9e12, 0.29e12)}


def pool_reads(sig: tuple) -> float:
    """How many times a pool reads each input cell: its kernel's volume over its stride's (at least once), from
    its signature (gems.trace.ops.memory_signature: ("memory", "pool", kind, nd, kernel, stride, padding)); a kind
    of pool whose signature says less, once."""
    if len(sig) < 6:
        return 1.0
    return max(1.0, math.prod(int(k) for k in sig[4]) / max(1, math.prod(int(v) for v in sig[5])))


def conv_sample_elements(sig: tuple, flops: float, batch: int) -> int:
    """The larger of a convolution's input and output elements in one sample, from its signature (gems.trace.ops:
    ("conv", nd, cin, cout, kernel, stride, groups, transposed, ...)) and its FLOPs at micro-batch ``batch``:
    torch counts 2 x batch x cin x cout / groups x the kernel's volume a position of the output (a transposed
    convolution: of its input), and the other side has a position per stride's volume of those."""
    cin, cout, kernel, stride, groups, transposed = int(sig[2]), int(sig[3]), sig[4], sig[5], int(sig[6]), sig[7]
    per_position = 2.0 * max(1, batch) * cin * cout / max(1, groups) * math.prod(int(k) for k in kernel)
    positions = flops / per_position
    near, far = (cin, cout) if transposed else (cout, cin)  # the side the positions count, the strided side
    return int(max(near * positions, far * positions * math.prod(int(v) for v in stride)))


#: gems's own host time a step beyond a plain PyTorch loop's, which the GPU would wait through: none measurable
#: (`gems bench overhead`: gems's loop at 1.03x a plain loop's throughput on this CPU; its step reads the device
#: once, after the update is queued). Its GPU mode measures it on a GPU (the H200 measured 0.89x of a plain loop
#: when gems's step read the device three times).
GPU_HOST_STEP_S = 0.0


@dataclass
class Rates:
    """How fast one rank computes: ``time(op class, signature, flops, bytes, backward)`` in seconds."""

    kind: str  # "gpu" | "cpu"
    name: str
    flops: dict[str, float]  # op class -> FLOP/s reached (GPU: peak x efficiency)
    bandwidth: float  # bytes/s reached by memory-bound ops
    op_overhead_s: float
    #: GPU: bytes/s pools reach (None: ``bandwidth``), counted as their input and output once
    pool_bandwidth: float | None = None
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
    #: GPU: convolution signature -> (forward, backward) FLOP/s measured by gems bench calibrate
    calibrated: dict[tuple, tuple[float, float]] | None = None
    #: GPU: gems's own host time a step (its loop, hooks and bookkeeping), which the GPU waits through
    host_step_s: float = 0.0
    #: GPU: the rates (FLOP/s, forward and backward) of a convolution with a sample of LARGE_SAMPLE_ELEMENTS or more
    large_sample: tuple[float, float] | None = None
    #: the convolutions (nd, cin, cout) these rates timed on that path, for the plan's assumptions
    large_seen: set[tuple] = field(default_factory=set)

    def layer_time(self, ops: Any, backward: bool, batch: int, first: bool = False) -> float:
        """Seconds of one layer's ops (``gems.trace.ops.LayerOps``) at micro-batch ``batch``, forward or backward.
        ``first``: the model's first layer, whose input needs no gradient, so its convolutions' backward computes
        the weight gradient only (half)."""
        t = 0.0
        for (cls, sig), (flops, nbytes, n) in ops.items():
            if n <= 0:
                continue
            per = self.time(cls, sig, flops / n, nbytes / n, backward, batch)
            half = backward and first and cls in ("conv", "matmul") and not self.large(cls, sig, flops / n, batch)
            t += n * per * (0.5 if half else 1.0)
        return t

    def large(self, cls: str, sig: tuple, flops: float, batch: int) -> bool:
        """Whether a GPU convolution has a sample past a 32-bit index (LARGE_SAMPLE_ELEMENTS), which its own rates
        time (``large_sample``)."""
        return (self.large_sample is not None and cls == "conv"
                and conv_sample_elements(sig, flops, batch) >= LARGE_SAMPLE_ELEMENTS)

    def time(self, cls: str, sig: tuple, flops: float, nbytes: float, backward: bool, batch: int = 1) -> float:
        """One op's time at micro-batch ``batch``. Measured rates (CPU) give forward and backward directly (a
        backward rate is the forward's work over the backward's time; a convolution is timed at its batch);
        data-sheet rates (GPU) give a roofline, the larger of compute and memory time, with a backward costing
        twice its forward (input and weight gradients)."""
        if self.calibrated and cls == "conv" and sig in self.calibrated:
            # timed alone between CUDA events: the call's launches are in the measured time already
            fwd, bwd = self.calibrated[sig]
            return self.share * flops / (bwd if backward else fwd)
        if self.measured is not None:
            work = flops if cls in ("conv", "matmul") else nbytes
            if cls == "conv":
                sig = (*sig, _measure_batch(sig, batch))
            elif cls == "matmul":
                sig = (*sig, matmul_rows(sig, flops))
            elif cls == "memory":
                sig = (*sig, _memory_elements(nbytes))
            alone = work / self.measured_rate(sig, backward) + self.op_overhead_s * (2 if backward else 1)
            return self.share * self.in_step * alone
        k = 2.0 if backward else 1.0
        if self.large_sample is not None and self.large(cls, sig, flops, batch):
            self.large_seen.add(tuple(sig[1:4]))
            return self.share * (k * flops / self.large_sample[1 if backward else 0] + k * self.op_overhead_s)
        compute = flops / self.flops[cls] if cls in ("conv", "matmul") else 0.0
        if cls == "conv":
            compute /= conv_width_factor(sig)
        bandwidth, traffic = self.bandwidth, nbytes
        if cls == "memory" and len(sig) > 1 and sig[1] == "pool":  # a cell read kernel / stride times
            bandwidth, traffic = self.pool_bandwidth or self.bandwidth, nbytes * pool_reads(sig)
        return self.share * k * (max(compute, traffic / bandwidth) + self.op_overhead_s)

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


def efficiency(cfg_eff: Any, gpu: str | None = None, precision: str = "fp32") -> dict[str, float]:
    """``plan.efficiency`` over the GPU's measured efficiencies (:data:`GPU_EFFICIENCY`) where it has some,
    else over the defaults; bad keys or values exit 2."""
    out = dict(GPU_EFFICIENCY.get(str(gpu), {}).get(precision, DEFAULT_EFFICIENCY))
    if cfg_eff is None:
        return out
    items = dict(cfg_eff) if hasattr(cfg_eff, "items") else None
    if items is None:
        raise ConfigError("plan.efficiency", cfg_eff, "a mapping such as {conv: 0.4, matmul: 0.6, memory: 0.85, pool: 0.13}")
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


def gpu_rates(name: str, precision: str, eff: dict[str, float], calibration: Any = None) -> Rates:
    """A named GPU's rates at ``precision`` (``cluster.gpu``); ``calibration`` (gems.plan.calibration): the
    convolutions and the memory bandwidth measured on such a GPU, which replace the data sheet's where given."""
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
    bandwidth = g.bandwidth * 1e9 * eff["memory"]
    about = (f"{name}: {conv:g} TFLOP/s for convolutions, {mm:g} for matmuls at {precision}, {g.bandwidth:g} GB/s; "
             f"efficiency {eff}" + (f" ({GPU_EFFICIENCY_SOURCE})" if name in GPU_EFFICIENCY else ""))
    calibrated = None
    if calibration is not None:
        calibrated = calibration.conv_rates(precision) or None
        measured = calibration.memory_bandwidth(precision)
        bandwidth = measured or bandwidth
        about += (f"; {len(calibrated or {})} convolution(s) and "
                  f"{'the' if measured else 'no'} memory bandwidth measured on {calibration.gpu} "
                  f"({calibration.path})")
    return Rates("gpu", name, {"conv": conv * tf * eff["conv"], "matmul": mm * tf * eff["matmul"]},
                 bandwidth, GPU_OP_OVERHEAD_S, g.bandwidth * 1e9 * eff["pool"] if "pool" in eff else None,
                 about=about, calibrated=calibrated, host_step_s=GPU_HOST_STEP_S,
                 large_sample=LARGE_SAMPLE_CONV_FLOPS.get(precision))


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
    f, inputs, flops = _conv_case(sig)
    fwd, bwd = _fwd_bwd(f, inputs)
    return flops / fwd, flops / bwd


def _conv_case(sig: tuple, input_grad: bool = True) -> tuple[Any, list[torch.Tensor], float]:
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


# ---- GPU memory: the device's total and the reserve set aside in it -------------------------------------------
GiB = 2**30


def gpu_memory_bytes(nominal_gb: float, gpu: str | None) -> tuple[int, str]:
    """(bytes a process allocates in, where that figure comes from) for a GPU whose data sheet says
    ``nominal_gb`` "GB" (``cluster.gpu_memory_gb``): the total CUDA reports for ``cluster.gpu`` when it names a
    GPU of that nominal size (:data:`GPUS`), else ``nominal_gb`` GiB (HBM comes in binary sizes: the "GB" of
    a data sheet is a GiB here) less what a driver keeps (:data:`DRIVER_KEEPS`)."""
    g = GPUS.get(str(gpu)) if gpu else None
    if g is not None and float(g.nominal_gb) == float(nominal_gb):
        return g.memory_bytes, f"{gpu}'s total as CUDA reports it"
    return (int(nominal_gb * GiB * (1 - DRIVER_KEEPS)),
            f"{nominal_gb:g} GiB less the {100 * DRIVER_KEEPS:.1f}% a driver keeps")


# The reserve: what a GPU rank's process holds beside the tensors the plan counts, from its parts. Each part is
# per rank and in bytes; gpu_reserve adds them up.

#: (a) The CUDA context: the driver's state, the kernels of torch, cuDNN and cuBLAS it loads, the handles.
#: torch sets CUDA_MODULE_LOADING=LAZY unless the user did (github.com/pytorch/pytorch/pull/86509, since
#: 1.13), so kernels load as they are first used. Measured with lazy loading: 287047680 bytes after one tensor
#: (that pull request; 666632192 eager), "~300MB" and "around 400MB if CUDA >= 11.7 is used and lazy module
#: loading enabled" (torch's ptrblck in pytorch/pytorch#107667 and #109888), 426 MiB on an RTX 6000 Ada with
#: torch 2.10 / CUDA 13.0 (unslothai/unsloth-zoo#1053); before CUDA 11.7 (every kernel loaded) over 1000 MB.
#: No figure per GPU generation was found; a training step also loads cuDNN's and cuBLAS's kernels for its
#: shapes, so the largest measured figure is rounded up to 512 MiB for every GPU (an assumption: no GPU here).
CUDA_CONTEXT_BYTES = 512 * MiB

#: (b) cuBLAS's workspace, per (handle, stream), when CUBLAS_WORKSPACE_CONFIG is unset: torch's default is
#: ":4096:8" (32 MiB) on sm90 GPUs (Hopper) and ":4096:2:16:8" (8 MiB + 128 KiB) on the others
#: (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize); cuBLASLt shares it
#: (TORCH_CUBLASLT_UNIFIED_WORKSPACE, on by default), while torch's ROCm builds give hipBLASLt 76 MiB of its
#: own (parseCUDABlasLtWorkspaceSize, same file). It comes from the caching allocator, so CUDA counts it as
#: allocated: the plan adds it to the peak of a rank whose model runs matmuls (``activations_detail.blas_workspace``),
#: not to the reserve. The H200's 64^3 rows (results/gpu/h200-2026-11-26.json) allocated 55-69 MB more than the
#: plan counted without it, 2 x 32 MiB.
CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLAS_WORKSPACE_SM90_BYTES = 4096 * 1024 * 8
HIPBLASLT_WORKSPACE_BYTES = 76 * MiB
#: handles a rank's matmuls run on: cuBLAS handles are per thread (CublasHandlePool.cpp's thread-local pool),
#: and a step runs its forward on the main thread and its backward on autograd's thread for the device
BLAS_HANDLES = 2
SM90 = frozenset({"h100", "h200", "gh200"})
ROCM = frozenset({"mi250x-gcd"})
ARM_HOSTS = frozenset({"gh200"})  # Grace: NCCL's SIMPLE buffer is 1 MiB on Arm hosts (below)

#: cuDNN's convolution workspace is not reserved apart: torch allocates it through the caching allocator for the
#: call that needs it (aten/src/ATen/native/cudnn/Conv_v8.cpp), so it counts in ``max_memory_allocated`` at the
#: layer that runs, and the activation model adds it there (:func:`cudnn_workspace`,
#: ``activations_detail.workspace``) rather than to the reserve.
CUDNN_WORKSPACE_BYTES = 0
#: cuDNN's workspace of a convolution's forward or backward, as a fraction of the larger of its input and output
#: at the micro-batch, where ``gems bench calibrate`` has not measured it on the GPU at hand: fit to the H200's
#: figures (results/gpu/h200-2026-11-26.json: the six one-rank rows, CosmoFlow 64^3 at batch 4 in fp32, fp16 and
#: bf16, 128^3 at batch 8 in fp32 and bf16, 256^3 at batch 4, with cuBLAS's workspaces and the allocator's
#: rounding counted: the smallest fraction that leaves none of the six planned peaks under what CUDA allocated,
#: set by the 64^3 fp16 row, whose 10 MB over the bf16 row's nothing else here explains).
CUDNN_WORKSPACE_FRACTION = 0.30


def cudnn_workspace(sig: tuple, batch: int, input_grad: bool, elem_bytes: int, calibration: Any = None,
                    precision: str | None = None) -> int:
    """Bytes cuDNN's workspace takes for the convolution of signature ``sig`` (gems.trace.ops) at micro-batch
    ``batch``: measured on the GPU by ``gems bench calibrate`` where the calibration has its signature (per
    sample, so scaled by the batch), else :data:`CUDNN_WORKSPACE_FRACTION` of its larger operand."""
    per_sample = None if calibration is None else calibration.workspace_per_sample(sig, precision)
    if per_sample is None:
        per_sample = CUDNN_WORKSPACE_FRACTION * max(sig[2], sig[3]) * math.prod(sig[-1]) * elem_bytes
    return int(per_sample * max(1, int(batch)))

#: (c) The caching allocator's fragmentation, as a fraction of the rank's tensor peak: an assumption (no GPU run
#: of gems measured reserved against allocated memory). The allocator rounds requests above 1 MiB up to
#: 2 MiB, serves 1-10 MiB ones from 20 MiB segments and keeps freed blocks cached
#: (c10/cuda/CUDACachingAllocator.cpp: kRoundLarge, kLargeBuffer, kMinLargeAlloc); cuDNN's workspaces go in
#: the gaps.
FRAGMENTATION = 0.10

#: (d) NCCL's buffers. Per communicator, every channel connects to its peers, and each connection holds one
#: buffer per protocol: SIMPLE, NCCL_BUFFSIZE, 4 MiB by default (NCCL's environment-variable documentation,
#: docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-buffsize; src/init.cc computeBuffSizes:
#: DEFAULT_BUFFSIZE 1 << 22, DEFAULT_BUFFSIZE_ARM 1 << 20 on Arm hosts); LL128,
#: NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x 8 = 120 x 640 x 8 x 8 bytes; LL,
#: NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x sizeof(ncclLLFifoLine) = 8 x 512 x 8 x 16
#: bytes (src/include/device.h). "The memory usage is linearly tied to the number of channels", "Ring uses a
#: limited amount of memory as it only has 2 connections regardless of the scale", and more communicators
#: use more memory unless split with shared resources (NCCL's sjeaugey in NVIDIA/nccl#864, quoted in #986;
#: that issue measured about 1.6 GB for one communicator with an all-reduce, 6 GB for three).
NCCL_BUFFSIZE = 4 * MiB
NCCL_BUFFSIZE_ARM = 1 * MiB
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16
#: channels per communicator: NCCL picks them from the topology, up to MAXCHANNELS = 64 (src/include/device.h;
#: NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS bound them) and prints them with NCCL_DEBUG=INFO ("N coll
#: channels"): 24-32 in logs of 8-GPU NVLink/NVSwitch nodes, 2-8 between nodes with a NIC or two
#: (NVIDIA/nccl#687: 2; #1189: 8). Assumed: 16, between the two (a rank's groups span 4-GPU nodes or nodes).
NCCL_CHANNELS = 16
#: connections a channel of a collective communicator holds: a ring's two, from the previous rank and to the
#: next (trees, which NCCL picks for small messages, add up to three more: left out). On the pipeline's
#: communicator each directed link a rank sends or receives on is one point-to-point connection a channel
#: (its point-to-point channels to the peer, "p2p channels per peer" in NCCL_DEBUG=INFO's log, taken as many
#: as NCCL_CHANNELS).
NCCL_CONNECTIONS = 2
NCCL_LINK_CONNECTIONS = 1
#: NCCL connects a communicator's peers when an operation first needs them, not when it is created
#: (NCCL_RUNTIME_CONNECT, on by default since NCCL 2.22, listed in the environment-variable documentation
#: above; torch 2.7 ships NCCL 2.26.2), so a communicator the rank joins but never uses holds no buffers
#: (TensorRT-LLM sets NCCL_RUNTIME_CONNECT=0 "for accurate KV cache size estimation" for that reason). With an
#: older NCCL, or NCCL_RUNTIME_CONNECT=0, the idle ones hold buffers too: plan.reserve_gb then.


def nccl_communicator_bytes(arm_host: bool = False, connections: int = NCCL_CONNECTIONS,
                            channels: int = NCCL_CHANNELS) -> int:
    """Bytes of NCCL buffers one communicator a rank uses holds on its GPU: channels x connections x the three
    protocols' buffers."""
    simple = NCCL_BUFFSIZE_ARM if arm_host else NCCL_BUFFSIZE
    return channels * connections * (simple + NCCL_LL128_BUFFSIZE + NCCL_LL_BUFFSIZE)


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a rank joins: what it is for, its ranks, whether gems runs anything on it."""

    name: str
    size: int
    used: bool
    why: str = ""
    connections: int = NCCL_CONNECTIONS  # a channel's connections (a ring's two; a one-way pipeline link's one)


def rank_communicators(replicas: int, pipeline: int, spatial: int, grad_size: int,
                       links: Sequence[tuple[int, int]] = ()) -> list[Communicator]:
    """The NCCL communicators a rank joins (:meth:`gems.mesh.Mesh.build_groups`), each only where it has more
    than one rank. gems binds each rank's device when it creates the world (``device_id``, gems.bootstrap), so
    torch creates every group's communicator at once, split from the world's, for the ranks in it
    (torch.distributed.distributed_c10d: ``eager_connect_single_device``, ``split_from``): the world, the
    spatial, pipeline and replica groups and the gradient group. ``links``: the directed (sending, receiving)
    pipeline positions this rank's schedule sends or receives on (:meth:`gems.pipeline.schedules.Schedule.links`):
    every pipeline message goes on the line's ``pipeline`` group in exchange rounds (gems.pipeline.exchange),
    each directed link one point-to-point connection a channel there; the halo exchange batches its operations
    on the spatial group's."""
    world = replicas * pipeline * spatial
    out = [
        Communicator("world", world, True, "the step-time all-reduce and the record's all-gather (gems.worker)"),
        Communicator("spatial", spatial, True, "halo exchanges, the spatial all-reduces and the gather"),
        Communicator("pipeline", pipeline, bool(links),
                     "the stages' messages, exchange rounds" if links else "created, but this schedule sends nothing",
                     NCCL_LINK_CONNECTIONS * max(1, len(set(links)))),
        Communicator("replica", replicas, False, "created, but gradients are summed over the gradient group"),
        Communicator("grad", grad_size, True, "the gradient all-reduce (gems.replication)"),
    ]
    return [c for c in out if c.size > 1]


@dataclass
class Reserve:
    """The reserve of a GPU rank, from its parts (bytes), or ``plan.reserve_gb`` when set."""

    source: str  # "modelled" or "plan.reserve_gb"
    cuda_context: int = 0
    cublas_workspace: int = 0
    cudnn_workspace: int = 0
    nccl: int = 0
    fragmentation: int = 0  # FRAGMENTATION x the tensor peak (set once the peak is known)
    fragmentation_fraction: float = 0.0
    override: int = 0  # plan.reserve_gb, which replaces the parts
    communicators: list[Communicator] | None = None
    arm_host: bool = False  # NCCL's SIMPLE buffer is NCCL_BUFFSIZE_ARM
    pipeline_position: int = 0  # where the communicators were counted (the position whose buffers are largest)

    @property
    def fixed(self) -> int:
        """The parts that do not grow with the tensors."""
        return self.override + self.cuda_context + self.cublas_workspace + self.cudnn_workspace + self.nccl

    @property
    def total(self) -> int:
        return self.fixed + self.fragmentation

    def parts(self) -> dict[str, int]:
        if self.source != "modelled":
            return {"plan.reserve_gb": self.override}
        return {"cuda_context": self.cuda_context, "cublas_workspace": self.cublas_workspace,
                "cudnn_workspace": self.cudnn_workspace, "nccl": self.nccl, "fragmentation": self.fragmentation}

    def communicator_bytes(self, c: Communicator) -> int:
        """NCCL buffers of one of this rank's communicators: none unless gems runs something on it."""
        return nccl_communicator_bytes(self.arm_host, c.connections) if c.used else 0

    def with_peak(self, peak: int) -> Reserve:
        """The reserve once the tensor peak is known (its fragmentation part)."""
        self.fragmentation = int(math.ceil(self.fragmentation_fraction * peak))
        return self

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "bytes": self.total, "parts": self.parts()}
        if self.source == "modelled":
            comms = self.communicators or []
            out.update({
                "fragmentation_fraction": self.fragmentation_fraction,
                "pipeline_position": self.pipeline_position,
                "communicators": [{"name": c.name, "size": c.size, "used": c.used, "why": c.why,
                                   "connections": c.connections, "bytes": self.communicator_bytes(c)}
                                  for c in comms],
                "assumed": {"nccl_channels": NCCL_CHANNELS, "nccl_connections_per_channel": NCCL_CONNECTIONS,
                            "nccl_link_connections_per_channel": NCCL_LINK_CONNECTIONS,
                            "cuda_context_bytes": CUDA_CONTEXT_BYTES, "blas_handles": BLAS_HANDLES},
            })
        return out


def blas_workspace_bytes(gpu: str | None, sm90: bool | None = None, rocm: bool | None = None) -> int:
    """cuBLAS (and hipBLASLt) workspaces of one rank: BLAS_HANDLES x torch's default for the GPU."""
    sm90 = (gpu in SM90) if sm90 is None else sm90
    rocm = (gpu in ROCM) if rocm is None else rocm
    per = (CUBLAS_WORKSPACE_SM90_BYTES if sm90 else CUBLAS_WORKSPACE_BYTES) + (HIPBLASLT_WORKSPACE_BYTES if rocm else 0)
    return BLAS_HANDLES * per


def gpu_reserve(communicators_by_position: dict[int, list[Communicator]], gpu: str | None = None,
                override_gib: float | None = None, sm90: bool | None = None, rocm: bool | None = None) -> Reserve:
    """A GPU rank's reserve: ``plan.reserve_gb`` GiB when set (``override_gib``), else the CUDA context, the BLAS
    workspaces, NCCL's buffers of the communicators the rank uses (at the pipeline position that uses the
    most) and a fragmentation part, FRAGMENTATION x the tensor peak (filled in by :meth:`Reserve.with_peak`)."""
    if override_gib is not None:
        return Reserve("plan.reserve_gb", override=int(float(override_gib) * GiB))
    r = Reserve("modelled", cuda_context=CUDA_CONTEXT_BYTES, cublas_workspace=0,  # in the peak (above)
                cudnn_workspace=CUDNN_WORKSPACE_BYTES, fragmentation_fraction=FRAGMENTATION, arm_host=gpu in ARM_HOSTS)
    nccl = {d: sum(r.communicator_bytes(c) for c in comms) for d, comms in communicators_by_position.items()}
    if nccl:
        r.pipeline_position = max(nccl, key=lambda d: (nccl[d], -d))
        r.communicators, r.nccl = communicators_by_position[r.pipeline_position], nccl[r.pipeline_position]
    return r
