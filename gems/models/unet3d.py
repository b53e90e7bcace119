"""The 3D U-Net of the strong-scaling paper, as one flat ``nn.Sequential`` whose skip connections are layers too
(gems.models.skips), so that pipeline cuts and spatial parts see every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gems.config import ModelConf, key
from gems.errors import ConfigError
from gems.models.registry import ModelSpec, register_model
from gems.models.skips import PopAdd, PopConcat, SkipStore, Stash

__all__ = ["unet3d", "build_unet3d", "UNetConf", "SkipStore", "Stash", "PopConcat", "PopAdd"]

#: the paper's normalisation (``model.norm``'s default)
DEFAULT_NORM = "batch"


def _ch(c: int, width: float) -> int:
    return max(1, int(round(c * width)))


def _conv(c_in: int, c_out: int, norm: str) -> list[nn.Module]:
    layers: list[nn.Module] = [nn.Conv3d(c_in, c_out, 3, padding=1, bias=norm == "none")]
    if norm == "batch":
        layers.append(nn.BatchNorm3d(c_out))
    return layers + [nn.ReLU()]


def unet3d(in_channels: int = 1, num_classes: int = 3, width: float = 1.0, norm: str = DEFAULT_NORM) -> nn.Sequential:
    """The flat layer sequence (input edge: a multiple of 8). Down blocks of two Conv3d k=3 'same' (+ norm + ReLU)
    of [32, 64], [64, 128], [128, 256] channels, each followed by MaxPool3d(2); a bottom block [256, 512]; up blocks
    of a ConvTranspose3d (k=2, s=2, channels kept), the level's skip concatenated along channels and two
    convolutions, [256, 256], [128, 128], [64, 64]; a 1x1x1 convolution to ``num_classes`` (3 in the paper).
    ``width`` scales every channel count; ``norm``: ``batch`` (global statistics over spatial parts) or ``none``."""
    store = SkipStore()
    w = lambda c: _ch(c, width)  # noqa: E731
    layers: list[nn.Module] = []
    c = in_channels
    for level, (c1, c2) in enumerate([(32, 64), (64, 128), (128, 256)]):
        layers += _conv(c, w(c1), norm) + _conv(w(c1), w(c2), norm)
        layers += [Stash(store, f"level{level}"), nn.MaxPool3d(2)]
        c = w(c2)
    layers += _conv(c, w(256), norm) + _conv(w(256), w(512), norm)
    c = w(512)
    for level, (c1, skip) in reversed(list(enumerate([(64, 64), (128, 128), (256, 256)]))):
        layers += [nn.ConvTranspose3d(c, c, 2, stride=2), PopConcat(store, f"level{level}")]
        layers += _conv(c + w(skip), w(c1), norm) + _conv(w(c1), w(c1), norm)
        c = w(c1)
    layers.append(nn.Conv3d(c, num_classes, 1))
    return nn.Sequential(*layers)


@dataclass
class UNetConf(ModelConf):
    """``model=unet3d``'s own keys."""

    norm: str = key(DEFAULT_NORM, "normalisation after each convolution: batch (global statistics over spatial "
                                  "parts) or none", choices=("batch", "none"))


def build_unet3d(m: UNetConf) -> ModelSpec:
    """``model=unet3d``: keys size, width, in_channels, num_classes, norm."""
    size = m.size
    if not isinstance(size, int) or size < 8 or size % 8:
        raise ConfigError("model.size", size, "a multiple of 8 (three 2x poolings), e.g. 64 or 128")
    in_channels, num_classes = int(m.in_channels), int(m.num_classes)
    seq = unet3d(in_channels, num_classes, float(m.width), m.norm)
    return ModelSpec(seq, "unet3d", (in_channels, size, size, size), num_classes, "cross_entropy", "dense", None)


register_model("unet3d", build_unet3d, "the 3D U-Net of the strong-scaling paper: four levels down and up, skips "
               "concatenated; one class per voxel (cross-entropy)", "in_channels x N^3, N a multiple of 8",
               {"size": 16, "width": 0.0625, "in_channels": 1, "num_classes": 3}, options=UNetConf)
