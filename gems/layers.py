"""Building blocks the models and the strategies share, so that neither imports the other: the batch context, dropout
whose masks are a pure function of (seed, step, sample) so that every mesh and device draws the serial run's
(:class:`SampleDropout`), the evaluation mode, recomputation (:class:`Recompute`), an average pool whose backward is
deterministic on a GPU (:class:`AvgPool3d`), and bf16 3D convolutions on CPU kept clear of a oneDNN bug.
"""
from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn


@dataclass
class _BatchInfo:
    seed: int
    step: int
    sample_ids: tuple[int, ...]
    #: the samples' keys on the device (:func:`sample_keys`, shape (samples, 2)), where the caller made them (a CUDA
    #: graph's static input); None: made from the fields above where a layer needs them
    keys: torch.Tensor | None = None


_CURRENT: list[_BatchInfo] = []


def current_batch() -> _BatchInfo | None:
    """The innermost :func:`batch_context`'s samples (None outside one)."""
    return _CURRENT[-1] if _CURRENT else None


@contextlib.contextmanager
def batch_context(seed: int, step: int, sample_ids: Sequence[int], keys: torch.Tensor | None = None) -> Iterator[None]:
    """Declare which global samples the next forward passes carry; ``keys``: their :func:`sample_keys` already on
    the device (a graph's static input, refilled before each replay)."""
    _CURRENT.append(_BatchInfo(int(seed), int(step), tuple(int(i) for i in sample_ids), keys))
    try:
        yield
    finally:
        _CURRENT.pop()


_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF
#: the device hash's rounds: (shift, odd multiplier below 2^31, so that a 32-bit value times it stays below 2^63 and
#: int64 arithmetic is exact on every device: no overflow, no rounding)
_ROUNDS = ((16, 0x7FEB352D), (15, 0x2C1B3C6D), (16, 0x297A2D39))


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def sample_keys(seed: int, step: int, sample_ids: Sequence[int]) -> list[list[int]]:
    """Each sample's two 32-bit keys at ``step`` (host integers): a chain of splitmix64 over (seed, step, sample)."""
    base = _splitmix64(_splitmix64(int(seed) & _M64) ^ (int(step) & _M64))
    out = []
    for i in sample_ids:
        z = _splitmix64(base ^ (int(i) & _M64))
        out.append([z >> 32, z & _M32])
    return out


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of every value of ``x`` (int64 holding values in [0, 2^32))."""
    for shift, mult in _ROUNDS:
        x = x ^ (x >> shift)
        x = (x * mult) & _M32
    return x ^ (x >> 16)


def keep_masks(keys: torch.Tensor, numel: int, p: float) -> torch.Tensor:
    """Which of ``numel`` values of each sample dropout keeps (bool, (samples, numel)): a value's hash of its index
    under the sample's two keys (``keys``: (samples, 2) int64 on the device), its top 24 bits at or above
    ``p`` 2^24. Integers only, one batched computation: the same bits on every device, no host value inside."""
    if numel >= 2**32:
        raise ValueError(f"dropout over {numel} values a sample: at most 2^32 - 1")
    index = torch.arange(numel, dtype=torch.int64, device=keys.device).unsqueeze(0)
    h = _mix32(_mix32(index ^ keys[:, :1]) ^ keys[:, 1:])
    return (h >> 8) >= math.ceil(p * 2**24)


def host_keep_masks(keys: Sequence[Sequence[int]], numel: int, p: float) -> Any:
    """:func:`keep_masks` on the host (numpy, unsigned 64-bit integers: the same operations, the same bits)."""
    import numpy as np

    if numel >= 2**32:
        raise ValueError(f"dropout over {numel} values a sample: at most 2^32 - 1")
    k = np.array(keys, dtype=np.uint64).reshape(-1, 2)

    def mix(x: Any) -> Any:
        for shift, mult in _ROUNDS:
            x = x ^ (x >> np.uint64(shift))
            x = (x * np.uint64(mult)) & np.uint64(_M32)
        return x ^ (x >> np.uint64(16))

    h = mix(mix(np.arange(numel, dtype=np.uint64)[None, :] ^ k[:, :1]) ^ k[:, 1:])
    return (h >> np.uint64(8)) >= np.uint64(math.ceil(p * 2**24))


class SampleDropout(nn.Module):
    """Dropout with masks a pure function of (seed, step, sample) and each value's index, identical on every mesh
    and device, drawn for the whole batch at once (plain ``nn.Dropout`` draws from each rank's generator, so 4
    ranks and 1 would train different networks).

    An eager step hashes the masks on the host (:func:`host_keep_masks`) and copies them to the device at once;
    inside a CUDA graph the same hash runs on the device (:func:`keep_masks`), its one input the keys, a static
    tensor refilled before each replay (:func:`batch_context`'s ``keys``): the same bits. The runtime that calls
    the model names the batch's samples with :func:`batch_context`; pipeline runtimes set it again around a
    micro-batch's backward, so a recomputation draws the same masks."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if not _CURRENT:
            raise RuntimeError("SampleDropout needs gems.models.layers.batch_context(seed, step, sample_ids) around the forward")
        info = _CURRENT[-1]
        if len(info.sample_ids) != x.shape[0]:
            raise RuntimeError(f"batch_context names {len(info.sample_ids)} samples, the batch has {x.shape[0]}")
        return x * self.masks(info, x.shape, x.device, x.dtype) / (1.0 - self.p)

    def masks(self, info: _BatchInfo, shape: Sequence[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The batch's masks (one per sample of ``info``), 1 where a value is kept: hashed on the device from the
        keys a graph hands in, else on the host and copied over (to a GPU through pinned memory, without waiting
        for its queue)."""
        n = math.prod(shape[1:])
        if info.keys is not None:
            keep = keep_masks(info.keys, n, self.p)
        elif device.type == "meta" or _fake_mode():  # a traced or planned forward: shapes, not values (one copy)
            keep = torch.empty((len(info.sample_ids), n), dtype=torch.bool, device=device)
        else:
            keep = torch.from_numpy(host_keep_masks(sample_keys(info.seed, info.step, info.sample_ids), n, self.p))
            if device.type != "cpu":
                keep = keep.pin_memory().to(device, non_blocking=True)
        return keep.reshape(tuple(shape)).to(dtype=dtype)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def _fake_mode() -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


# ---- evaluation modes and BatchNorm's running statistics ------------------------------------------------------

def keeps_running_statistics(m: nn.Module) -> bool:
    """A normalisation layer that evaluates with running statistics (torch's BatchNorm, InstanceNorm with
    ``track_running_stats``, gems's SpatialNorm wrapping one): one rule for every runtime."""
    return isinstance(getattr(m, "running_mean", None), torch.Tensor) and hasattr(m, "momentum")


@contextlib.contextmanager
def evaluation_mode(modules: Sequence[nn.Module], batch_statistics: bool = False) -> Iterator[None]:
    """Every layer of ``modules`` in evaluation mode (dropout off, BatchNorm by its running statistics), each
    layer's mode restored after. With ``batch_statistics`` the layers that keep running statistics stay in
    training mode: they normalise by the batch's statistics and add them to their running ones
    (:func:`recalibrating`)."""
    modes = [(m, m.training) for root in modules for m in root.modules()]
    try:
        for m, _ in modes:
            m.training = batch_statistics and keeps_running_statistics(m)
        yield
    finally:
        for m, mode in modes:
            m.training = mode


@contextlib.contextmanager
def recalibrating(modules: Sequence[nn.Module]) -> Iterator[int]:
    """Recompute the running statistics of every normalisation layer of ``modules`` from the forwards run inside
    (with :func:`evaluation_mode` ``(batch_statistics=True)``): they start afresh and average the batches seen
    with equal weights (momentum None) rather than training's exponential average, which at small batches
    follows the last few batches and the weights of a few steps ago ("precise BatchNorm"). Yields how many
    layers it recalibrates; their momentum is restored after."""
    norms: list[Any] = [m for root in modules for m in root.modules() if keeps_running_statistics(m)]
    saved = [m.momentum for m in norms]
    with torch.no_grad():
        for m in norms:
            m.running_mean.zero_()
            m.running_var.fill_(1.0)
            if isinstance(getattr(m, "num_batches_tracked", None), torch.Tensor):
                m.num_batches_tracked.zero_()
            m.momentum = None
    try:
        yield len(norms)
    finally:
        for m, momentum in zip(norms, saved):
            m.momentum = momentum


class Recompute:
    """What a forward run again in the backward (recomputation: ``parallel.checkpoint``) must see as its first
    run did, captured at that first run: the autocast state, torch's random state (the CPU's and, on a GPU, the
    device's: a model's own ``nn.Dropout`` draws the same mask again) and the buffers it moves (BatchNorm's running
    statistics, put back after the backward through the recomputation so they move once a step). One rule for
    every recomputation: the plain path's pieces (:mod:`gems.models.skips`) and the pipeline's partitions
    (:mod:`gems.pipeline.runtime`)."""

    def __init__(self, device: torch.device | str, buffers: Sequence[torch.Tensor]) -> None:
        d = torch.device(device)
        dev = d.type
        self.buffers = list(buffers)
        self.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        self.cpu_rng = torch.get_rng_state()
        #: the GPU whose generator the forward draws from: the tensors' own, not whichever is current
        self.gpu = (d.index if d.index is not None else torch.cuda.current_device()) if dev == "cuda" else None
        self.cuda_rng = torch.cuda.get_rng_state(self.gpu) if self.gpu is not None else None
        self._kept: list[torch.Tensor] = []

    @staticmethod
    def device_bytes(gpu: bool) -> int:
        """What one of these holds, from its forward to the end of the step's backward, in the memory its rank
        computes in: a CPU rank's random state (a tensor of the CPU generator's 5056 bytes; the planner counts it,
        and one more while :meth:`replay` runs: ``fork_rng``'s copy); on a GPU nothing (both generators' states
        are host tensors)."""
        return 0 if gpu else torch.get_rng_state().numel()

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the forward again inside: with gradients, under the first run's autocast and random state (the
        rank's own random state is as it was after). Call :meth:`restore` after the backward through it."""
        self._kept = [b.detach().clone() for b in self.buffers]
        dev, enabled, dtype = self.autocast
        with torch.random.fork_rng(devices=[self.gpu] if self.gpu is not None else []):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state(self.cuda_rng, self.gpu or 0)
            with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled):
                yield

    def restore(self) -> None:
        """The buffers as the first run left them; after the backward (autograd saved them and checks their
        versions)."""
        with torch.no_grad():
            for b, v in zip(self.buffers, self._kept):
                b.copy_(v)
        self._kept = []


# ---- average pooling with a deterministic backward ------------------------------------------------------
class _AvgPoolDeterministic(torch.autograd.Function):
    """torch's average pool forward, and its backward as one add a kernel offset: each output's gradient divided by
    the window's cells, added into the strided view of the (padded) input's gradient that offset reads. Every add is
    one elementwise kernel over distinct cells, in the offsets' order: the same bits every run, where torch's CUDA
    backward adds with atomics and has no deterministic version. Zero padding counted, ``ceil_mode`` off."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernel: tuple[int, ...], stride: tuple[int, ...],
                padding: tuple[int, ...]) -> torch.Tensor:
        ctx.meta = (x.shape, kernel, stride, padding)
        return torch.nn.functional.avg_pool3d(x, kernel, stride, padding)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        shape, kernel, stride, padding = ctx.meta
        gx = g.new_zeros((*shape[:2], *(n + 2 * p for n, p in zip(shape[2:], padding))))
        share = g / math.prod(kernel)
        for offset in itertools.product(*(range(k) for k in kernel)):
            window = tuple(slice(o, o + s * (n - 1) + 1, s) for o, s, n in zip(offset, stride, g.shape[2:]))
            gx[(slice(None), slice(None), *window)].add_(share)
        inside = tuple(slice(p, p + n) for p, n in zip(padding, shape[2:]))
        return gx[(slice(None), slice(None), *inside)], None, None, None


class AvgPool3d(nn.AvgPool3d):
    """``nn.AvgPool3d`` (the same arguments and results) whose backward is deterministic on a GPU where torch's
    deterministic algorithms are on (``train.deterministic``): torch's CUDA kernel has none (it warns under
    ``warn_only`` and rounds differently from run to run). Elsewhere it is torch's pool; a pool that divides by the
    cells inside the sample only, rounds its extent up or overrides its divisor is torch's everywhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.is_cuda and x.requires_grad and torch.is_grad_enabled() and torch.are_deterministic_algorithms_enabled()
                and self.count_include_pad and not self.ceil_mode and self.divisor_override is None):
            return _AvgPoolDeterministic.apply(x, _triple(self.kernel_size), _triple(self.stride or self.kernel_size),
                                               _triple(self.padding))
        return super().forward(x)


def _triple(v: Any) -> tuple[int, ...]:
    return tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v),) * 3


# ---- a guard against a torch CPU bug in bf16 3D convolutions --------------------------------------------
# torch 2.13's oneDNN kernel for the weight gradient of a bf16 Conv3d on CPU reads memory it never wrote when
# the input is 2 cells deep (k3 p1 at any width and channel count): the gradient changes from run to run and
# is NaN when the recycled memory held NaN. CosmoFlow's last convolutions run on 2^3 at every sample size,
# so bf16 training of it on CPU ranks diverged at random. These convolutions are tiny: gems computes them in
# fp32 and rounds the output to bf16, as autocast would have returned it.

def _autocast_bf16_cpu() -> bool:
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def bf16_conv3d_needs_fp32(x: torch.Tensor, first: int = 0) -> bool:
    """Whether a 3D convolution of ``x`` on CPU would run in bf16 on an input 2 cells deep, when spatial
    dim ``first`` of ``x`` is put first (as :func:`gems.spatial.conv_backend.conv_nd` may permute)."""
    return (x.device.type == "cpu" and x.dim() == 5 and x.shape[2 + first] == 2
            and (x.dtype == torch.bfloat16 or (x.is_floating_point() and _autocast_bf16_cpu())))


def conv3d_in_fp32(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, stride: Any, padding: Any,
                   dilation: Any, groups: int) -> torch.Tensor:
    """``F.conv3d`` computed in fp32 (autocast off), returned in bf16."""
    with torch.autocast("cpu", enabled=False):
        y = torch.nn.functional.conv3d(x.float(), w.float(), None if b is None else b.float(), stride, padding,
                                       dilation, groups)
    return y.to(torch.bfloat16)


class _GuardedConv3d(nn.Conv3d):
    """An ``nn.Conv3d`` (same parameters, same state dict) that avoids the bf16 CPU bug above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.padding_mode == "zeros" and bf16_conv3d_needs_fp32(x):
            return conv3d_in_fp32(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)
        return super().forward(x)


def guard_bf16_conv3d(model: nn.Module) -> int:
    """Route ``model``'s Conv3d layers around the bf16 CPU bug (for bf16 runs on CPU ranks); returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is nn.Conv3d:
            m.__class__ = _GuardedConv3d
            n += 1
    return n
