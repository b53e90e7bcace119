"""Building blocks the models and the strategies share (so that neither imports the other).

Layers whose randomness is a pure function of (seed, step, sample), so that
every mesh draws the same dropout masks as the serial run.

Plain ``nn.Dropout`` draws from each rank's RNG, so a run on 4 ranks and a run
on 1 would train different networks. ``SampleDropout`` draws sample ``i``'s
mask at step ``t`` from a generator seeded with ``(seed, t, i)``, on the
activation's device (CPU runs and GPU runs draw different masks; every mesh of
one kind of device draws the same). The runtime
that calls the model says which samples are in the batch with
:func:`batch_context`; pipeline runtimes set it again around the backward of a
micro-batch, so recomputation draws the same masks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn


@dataclass
class _BatchInfo:
    seed: int
    step: int
    sample_ids: tuple[int, ...]


_CURRENT: list[_BatchInfo] = []


@contextlib.contextmanager
def batch_context(seed: int, step: int, sample_ids: Sequence[int]) -> Iterator[None]:
    """Declare which global samples the next forward passes carry."""
    _CURRENT.append(_BatchInfo(int(seed), int(step), tuple(int(i) for i in sample_ids)))
    try:
        yield
    finally:
        _CURRENT.pop()


class SampleDropout(nn.Module):
    """Dropout with masks drawn per global sample, identical on every mesh.

    Under a CUDA graph (gems.rank.graphs) the step's masks cannot be drawn inside the replay (the seeds are the
    step's and the samples'): ``static_mask`` then holds them, drawn by :meth:`fill` before each replay with the
    same generators, and the forward reads it."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p = p
        self.static_mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.static_mask is not None:
            return x * self.static_mask / (1.0 - self.p)
        if not _CURRENT:
            raise RuntimeError("SampleDropout needs gems.models.layers.batch_context(seed, step, sample_ids) around the forward")
        info = _CURRENT[-1]
        if len(info.sample_ids) != x.shape[0]:
            raise RuntimeError(f"batch_context names {len(info.sample_ids)} samples, the batch has {x.shape[0]}")
        return x * self.masks(info, x.shape, x.device, x.dtype) / (1.0 - self.p)

    def masks(self, info: _BatchInfo, shape: Sequence[int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The batch's masks (one per sample of ``info``), 1 where a value is kept."""
        masks = []
        for i in info.sample_ids:  # drawn on the device: its generator (CUDA's is Philox), no host copy
            g = torch.Generator(device=device).manual_seed((info.seed * 1_000_003 + info.step) * 1_000_033 + i)
            masks.append(torch.rand(tuple(shape[1:]), generator=g, device=device) >= self.p)
        return torch.stack(masks).to(dtype=dtype)

    def fill(self, seed: int, step: int, sample_ids: Sequence[int]) -> None:
        """Draw the masks of (``seed``, ``step``, ``sample_ids``) into ``static_mask`` (a graph's replay reads them)."""
        assert self.static_mask is not None
        info = _BatchInfo(int(seed), int(step), tuple(int(i) for i in sample_ids))
        self.static_mask.copy_(self.masks(info, self.static_mask.shape, self.static_mask.device,
                                          self.static_mask.dtype))

    def extra_repr(self) -> str:
        return f"p={self.p}"


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
