"""Spatial normalisation: BatchNorm, GroupNorm and InstanceNorm with statistics all-reduced over the parts."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gems.spatial.context import SpatialContext
from gems.spatial.layers.base import SpatialLayer


class SpatialNorm(SpatialLayer):
    """BatchNorm, GroupNorm and InstanceNorm with statistics over the whole sample.

    Per-channel (BatchNorm: over the batch too) or per-(sample, group) sums are
    all-reduced over the parts, differentiably; the running statistics of
    BatchNorm are updated from the global ones, exactly as the serial layer does.
    """

    def __init__(self, norm: nn.Module, sctx: SpatialContext, label: str) -> None:
        super().__init__(sctx, label)
        self._adopt(norm, ("weight", "bias"), ("running_mean", "running_var", "num_batches_tracked")
                    if not isinstance(norm, nn.GroupNorm) else ())
        instance = isinstance(norm, nn.modules.instancenorm._InstanceNorm)
        self.kind = "group" if isinstance(norm, nn.GroupNorm) else ("instance" if instance else "batch")
        self.eps = norm.eps
        self.momentum = getattr(norm, "momentum", None)
        self.track = bool(getattr(norm, "track_running_stats", False))
        self.groups = norm.num_groups if isinstance(norm, nn.GroupNorm) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sctx = self.sctx
        gin = sctx.global_shape(x)
        n, c = x.shape[:2]
        sp = [1] * (x.dim() - 2)
        if self.kind == "batch" and not self.training and self.track:
            y = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
            return sctx.mark(y, gin)
        if self.kind == "batch":
            xs, dims, count = x, [0, *range(2, x.dim())], n * math.prod(gin)
            stat_shape = (1, c, *sp)
        else:
            g = self.groups if self.kind == "group" else c
            xs = x.reshape(n, g, c // g, *x.shape[2:])
            dims, count = list(range(2, xs.dim())), (c // g) * math.prod(gin)
            stat_shape = (n, g, 1, *sp)
        mean = sctx.all_reduce(xs.sum(dims)) / count
        d = xs - mean.view(stat_shape)
        var = sctx.all_reduce((d * d).sum(dims)) / count
        y = (d * torch.rsqrt(var + self.eps).view(stat_shape)).reshape(x.shape)
        if self.weight is not None:
            y = y * self.weight.view(1, c, *sp) + self.bias.view(1, c, *sp)
        if self.training and self.track and self.running_mean is not None:
            with torch.no_grad():
                if self.kind == "instance":
                    mean, var = mean.mean(0), var.mean(0)
                self.num_batches_tracked += 1
                f = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var * (count / max(count - 1, 1))
                self.running_mean.mul_(1 - f).add_(mean.detach().reshape(-1), alpha=f)
                self.running_var.mul_(1 - f).add_(unbiased.detach().reshape(-1), alpha=f)
        return sctx.mark(y, gin)

    def extra_repr(self) -> str:
        return f"{self.label}, {self.kind}, global statistics"
