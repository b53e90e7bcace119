"""ResNet-v2 (pre-activation, bottleneck) of depth 9n+2 (He et al., ECCV 2016: ResNet-110 and -1001), GEMS's model for
very large images (512² to 2048²), as one flat ``nn.Sequential`` of 3n+5 cut points: ``[stem, block x 3n, norm, relu,
pool, flatten, linear]``. A residual block is one module (no cut splits a skip) with named children that spatial
rewrites reach; ``spatial_end`` is the global pooling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gems.config import ModelConf, key
from gems.cut_rules import register_container
from gems.errors import ConfigError
from gems.models.registry import ModelSpec, register_model

#: the published model's normalisation (``model.norm``'s default)
DEFAULT_NORM = "batch"

__all__ = ["PreActBottleneck", "ResNetConf", "resnet_v2", "build_resnet"]

EXPANSION = 4


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        groups = next(g for g in (32, 16, 8, 4, 2, 1) if channels % g == 0)
        return nn.GroupNorm(groups, channels)
    return nn.Identity()


@register_container  # the spatial converter cuts it (gems/cut_rules.py)
class PreActBottleneck(nn.Module):
    """norm-relu-conv1x1, norm-relu-conv3x3 (stride), norm-relu-conv1x1, plus the (projected) input."""

    def __init__(self, c_in: int, planes: int, stride: int = 1, norm: str = "batch") -> None:
        super().__init__()
        c_out = planes * EXPANSION
        self.norm1 = _norm(norm, c_in)
        self.conv1 = nn.Conv2d(c_in, planes, 1, bias=norm == "none")
        self.norm2 = _norm(norm, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=norm == "none")
        self.norm3 = _norm(norm, planes)
        self.conv3 = nn.Conv2d(planes, c_out, 1, bias=norm == "none")
        self.relu = nn.ReLU()
        # projection when the shape changes, applied to the pre-activated input as in the v2 paper
        self.shortcut: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride=stride, bias=norm == "none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(x))
        skip = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(self.relu(self.norm2(out)))
        out = self.conv3(self.relu(self.norm3(out)))
        return out + skip


def resnet_v2(depth: int = 110, in_channels: int = 3, num_classes: int = 10, width: float = 1.0,
              norm: str = DEFAULT_NORM) -> nn.Sequential:
    """The flat sequence; ``depth`` must be 9n+2: a 3x3 stem convolution, three stages of ``n`` bottleneck blocks
    (three convolutions each) of 16, 32, 64 base channels (x4 at the block's output) and strides 1, 2, 2, and the
    final linear layer."""
    if depth < 11 or (depth - 2) % 9:
        raise ValueError("depth")
    n = (depth - 2) // 9
    base = [max(1, int(round(c * width))) for c in (16, 32, 64)]
    layers: list[nn.Module] = [nn.Conv2d(in_channels, base[0], 3, padding=1, bias=norm == "none")]
    c_in = base[0]
    for stage, planes in enumerate(base):
        for i in range(n):
            stride = 2 if stage > 0 and i == 0 else 1
            layers.append(PreActBottleneck(c_in, planes, stride, norm))
            c_in = planes * EXPANSION
    layers += [_norm(norm, c_in), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes)]
    return nn.Sequential(*layers)


@dataclass
class ResNetConf(ModelConf):
    """``model=resnet``'s own keys."""

    depth: int = key(110, "layers, 9n+2: n bottleneck blocks a stage (110, 1001)", ge=11)
    norm: str = key(DEFAULT_NORM, "normalisation before each convolution: batch (the paper's), group (GroupNorm) or "
                                  "none", choices=("batch", "group", "none"))


def build_resnet(m: ResNetConf) -> ModelSpec:
    """``model=resnet``: keys depth, size, in_channels, num_classes, width, norm."""
    depth = m.depth
    if not isinstance(depth, int) or depth < 11 or (depth - 2) % 9:
        raise ConfigError("model.depth", depth, "9n+2, e.g. 110 or 1001")
    size = m.size
    if not isinstance(size, int) or size < 4:
        raise ConfigError("model.size", size, "an image edge of at least 4 pixels (GEMS uses 512 to 2048)")
    in_channels, num_classes = int(m.in_channels), int(m.num_classes)
    seq = resnet_v2(depth, in_channels, num_classes, float(m.width), m.norm)
    pool = next(i for i, layer in enumerate(seq) if isinstance(layer, nn.AdaptiveAvgPool2d))
    return ModelSpec(seq, "resnet", (in_channels, size, size), num_classes, "cross_entropy", "vector", pool,
                     extra={"depth": depth, "blocks_per_stage": (depth - 2) // 9})


register_model("resnet", build_resnet, "ResNet-v2 of depth 9n+2 (110, 1001) on large 2D images, as GEMS trains "
               "it: pre-activation bottleneck blocks; one class a sample (cross-entropy)",
               "in_channels x N^2, N >= 4 (GEMS: 512 to 2048)",
               {"depth": 11, "size": 16, "in_channels": 3, "num_classes": 5, "width": 0.25}, options=ResNetConf)
