"""The devices the performance model runs on: named GPUs from their vendors' data sheets, their rates and what
gems's kernels reach of them (:class:`Rates`), their memory, and the links of a cluster preset. A CPU rank's
rates are measured on the spot (:mod:`gems.plan.cpu`).

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
:data:`GPUS`. The reserve the planner sets aside in it is modelled from its parts in :mod:`gems.plan.reserve`.

PyTorch runs fp32 convolutions in TF32 by default on Ampere and later (``torch.backends.cudnn.allow_tf32``)
and fp32 matmuls in fp32 (``torch.backends.cuda.matmul.allow_tf32`` is off), so an fp32 convolution is timed
at the tf32 rate where there is one. What a kernel reaches of the peak is an efficiency per op class
(``plan.efficiency``: conv, matmul, memory, pool; measured by ``gems bench calibrate``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gems.errors import ConfigError

__all__ = ["GPUS", "Rates", "Link", "gpu_rates", "links", "DEFAULT_EFFICIENCY", "efficiency", "gpu_memory_bytes"]


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
    about: str = ""
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
    #: a split backward's bookkeeping a deferrable module, on the host, in its W (gems.pipeline.deferred: the weight
    #: gradients handed to autograd from Python); measured on CPU ranks (gems.plan.cpu), none counted on a GPU's
    split_overhead_s: float = 0.0
    #: host time a layer's call costs beyond its ops (the module's call and autograd's node, each direction), and a
    #: pipeline action's bookkeeping (gems.pipeline.runtime: its messages posted, its finite check): measured on CPU
    #: ranks (gems.plan.cpu), inside GPU_OP_OVERHEAD_S on a GPU's
    layer_overhead_s: float = 0.0
    action_overhead_s: float = 0.0

    def layer_time(self, ops: Any, backward: bool, batch: int, first: bool = False, part: str | None = None,
                   deferred: int = 0) -> float:
        """Seconds of one layer's ops (``gems.trace.ops.LayerOps``) at micro-batch ``batch``, forward or backward.
        ``first``: the model's first layer, whose input needs no gradient, so its convolutions' and matmuls' backward
        computes the weight gradients only. ``part``: of a split backward (gems.pipeline.deferred), the ``input``
        gradients' action (I) or the ``weight`` gradients' (W), where the layer has ``deferred`` deferrable modules
        (its convolutions and dense layers: their weight gradients wait for the W, with the W's bookkeeping a
        module, :attr:`split_overhead_s`); everything else of the layer's backward runs in the I."""
        if part == "weight" and not deferred:
            return 0.0
        t = 0.0 if part == "weight" else self.share * self.layer_overhead_s
        for (cls, sig), (flops, nbytes, n) in ops.items():
            if n <= 0:
                continue
            t += n * self.op_time(cls, sig, flops / n, nbytes / n, backward, batch, first, part if deferred else None)
        if part == "weight" and deferred:
            t += deferred * self.split_overhead_s
        return t

    def op_time(self, cls: str, sig: tuple, flops: float, nbytes: float, backward: bool, batch: int, first: bool,
                part: str | None) -> float:
        """One op's share of :meth:`layer_time` (``part`` None: the layer defers nothing, its whole backward is
        the I's)."""
        weights = cls in ("conv", "matmul")
        if not backward:
            return self.time(cls, sig, flops, nbytes, False, batch)
        if part == "weight":
            return self.time(cls, sig, flops, nbytes, True, batch, "weight") if weights else 0.0
        if not weights or not (first or part == "input"):
            return self.time(cls, sig, flops, nbytes, True, batch)
        if first and self.large(cls, sig, flops, batch):  # (timed with both gradients together: the pair's time)
            return 0.0 if part == "input" else self.time(cls, sig, flops, nbytes, True, batch)
        if first:  # no input gradient: the weight gradients alone, in the I where nothing defers them
            return 0.0 if part == "input" else self.time(cls, sig, flops, nbytes, True, batch, "weight")
        return self.time(cls, sig, flops, nbytes, True, batch, "input")

    def large(self, cls: str, sig: tuple, flops: float, batch: int) -> bool:
        """Whether a GPU convolution has a sample past a 32-bit index (LARGE_SAMPLE_ELEMENTS), which its own rates
        time (``large_sample``)."""
        return (self.large_sample is not None and cls == "conv"
                and conv_sample_elements(sig, flops, batch) >= LARGE_SAMPLE_ELEMENTS)

    def time(self, cls: str, sig: tuple, flops: float, nbytes: float, backward: bool, batch: int = 1,
             part: str | None = None) -> float:
        """One op's time at micro-batch ``batch``: data-sheet rates (GPU) give a roofline, the larger of compute and
        memory time, with a backward costing twice its forward (input and weight gradients; ``part``: ``input`` or
        ``weight``, one of the two); a convolution that ``gems bench calibrate`` timed, its measured rates. (A CPU's
        measured rates: :class:`gems.plan.cpu.CpuRates`.)"""
        half = 0.5 if backward and part is not None else 1.0
        if self.calibrated and cls == "conv" and sig in self.calibrated:
            # timed alone between CUDA events: the call's launches are in the measured time already
            fwd, bwd = self.calibrated[sig]
            return half * self.share * flops / (bwd if backward else fwd)
        k = half * (2.0 if backward else 1.0)
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

    def update(self, nbytes: float, factor: int) -> float:
        """Seconds of the optimizer's update of ``nbytes`` of parameters holding ``factor`` copies of state
        (gems.plan.memory.Setup.optimizer_factor: Adam 2, SGD with momentum 1, plain SGD 0; an average of the weights
        one more): memory-bound, SGD reading parameter and gradient and writing the parameter, momentum and Adam
        reading and writing their state too."""
        per_param = {0: 3, 1: 5, 2: 7}.get(factor, 7)
        return per_param * nbytes / self.bandwidth

    def shared(self, share: float) -> Rates:
        """These rates when ``share`` ranks' threads take turns on each core (measurements stay shared)."""
        from dataclasses import replace

        return replace(self, share=share, about=self.about + f"; {share:.3g} ranks' threads per core (oversubscribed)")


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


# ---- GPU memory: the device's total -----------------------------------------------------------------------------
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

