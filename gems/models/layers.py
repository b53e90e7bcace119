"""Layers whose randomness is a pure function of (seed, step, sample), so that
every mesh draws the same dropout masks as the serial run.

Plain ``nn.Dropout`` draws from each rank's RNG, so a run on 4 ranks and a run
on 1 would train different networks. ``SampleDropout`` draws sample ``i``'s
mask at step ``t`` from a generator seeded with ``(seed, t, i)``. The runtime
that calls the model says which samples are in the batch with
:func:`batch_context`; pipeline runtimes set it again around the backward of a
micro-batch, so recomputation draws the same masks.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

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
    """Dropout with masks drawn per global sample, identical on every mesh."""

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
        masks = []
        for i in info.sample_ids:
            g = torch.Generator().manual_seed((info.seed * 1_000_003 + info.step) * 1_000_033 + i)
            masks.append(torch.rand(x.shape[1:], generator=g) >= self.p)
        mask = torch.stack(masks).to(device=x.device, dtype=x.dtype)
        return x * mask / (1.0 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}"
