"""CosmoFlow, the 3D CNN of the strong-scaling paper (LBANN's), and its MLPerf HPC variant, each one flat
``nn.Sequential`` so that spatial parts and pipeline cuts see every layer; the trunk ends at the ``Flatten``
(``spatial_end``), where spatial parallelism gathers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from gems.config import ModelConf, key
from gems.cut_rules import register_pointwise
from gems.layers import AvgPool3d, SampleDropout
from gems.models.registry import ModelSpec, first_flatten, register_model, sized


@register_pointwise  # the spatial converter cuts it (gems/cut_rules.py)
class Scale(nn.Module):
    """Multiply by a constant (MLPerf's tanh x 1.2 output)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor}"


def _ch(c: int, width: float) -> int:
    return max(1, int(round(c * width)))


def _norm(kind: str, channels: int) -> list[nn.Module]:
    """After each convolution: nothing (the paper's model), BatchNorm (global statistics over a sample's spatial
    parts) or GroupNorm."""
    if kind == "batch":
        return [nn.BatchNorm3d(channels)]
    if kind == "group":
        return [nn.GroupNorm(next(g for g in (8, 4, 2, 1) if channels % g == 0), channels)]
    return []


def cosmoflow(size: int = 128, width: float = 1.0, dropout: float = 0.2, slope: float = 0.3,
              in_channels: int = 4, num_outputs: int = 4, norm: str = "none") -> nn.Sequential:
    """The paper's variant: 4 x N³ input, N in {128, 256, 512}; Conv3d k=3 of 16, 32, 64, 128 (stride 2), 256, 256,
    256 channels, LeakyReLU; AvgPool3d (k=3, s=2, p=1) after conv1-5, one pool more at 256³ and two at 512³ (right
    after the first, where the activation is largest), so the flattened size is 2048 at every N; dense 2048 -> 256
    -> 4 with dropout; MSE. Smaller N (32, 64: tests and the default job) drop the pools that would see fewer than 3
    cells. ``width`` scales every channel count; ``norm`` (none in the paper) adds a BatchNorm or GroupNorm after
    each convolution (with BatchNorm, one without affine parameters on the input too); He's initialisation."""
    if size < 32 or size & (size - 1):
        raise ValueError("size")
    extra_pools = max(0, int(math.log2(size // 128))) if size >= 128 else 0
    chans = [16, 32, 64, 128, 256, 256, 256]
    # with BatchNorm the input is normalised too, by the data's own running statistics (no affine part): log counts
    # average about 2, and a first convolution on so large a mean moves its BatchNorm's running mean faster than
    # it can follow, so the model evaluated far worse than it trained
    layers: list[nn.Module] = [nn.BatchNorm3d(in_channels, affine=False)] if norm == "batch" else []
    c_in, n = in_channels, size
    for i, c in enumerate(chans):
        stride = 2 if i == 3 else 1
        layers += [nn.Conv3d(c_in, _ch(c, width), 3, stride=stride, padding=1, bias=norm == "none"),
                   *_norm(norm, _ch(c, width)), nn.LeakyReLU(slope)]
        c_in = _ch(c, width)
        n = (n + 2 - 3) // stride + 1
        if i < 5:
            pools = 1 + (extra_pools if i == 0 else 0)
            for _ in range(pools):
                if n < 3:  # only below the paper's sizes: torch pools need input >= kernel
                    break
                layers.append(AvgPool3d(3, stride=2, padding=1))  # deterministic on a GPU where asked
                n = (n + 2 - 3) // 2 + 1
    flat = c_in * n ** 3
    layers += [nn.Flatten(), nn.Linear(flat, _ch(256, width)), nn.LeakyReLU(slope), SampleDropout(dropout),
               nn.Linear(_ch(256, width), num_outputs)]
    return _he_init(nn.Sequential(*layers), slope)


def _he_init(seq: nn.Sequential, slope: float) -> nn.Sequential:
    """He initialisation for the LeakyReLU of ``slope``, zero biases. torch's default (a uniform of 1/sqrt(fan_in))
    shrinks what tells samples apart about 4x at every convolution: after the 7 of the paper's trunk every sample
    gave nearly the same output (1e-5 apart at half width), and training did not start within the sample-size
    study's budget (docs/science.md)."""
    for layer in seq:
        if isinstance(layer, (nn.Conv3d, nn.Linear)):
            nn.init.kaiming_normal_(layer.weight, a=slope, nonlinearity="leaky_relu")
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)
    return seq


def cosmoflow_mlperf(size: int = 128, width: float = 1.0, dropout: float = 0.5, slope: float = 0.3,
                     in_channels: int = 4, num_outputs: int = 4) -> nn.Sequential:
    """MLPerf HPC's variant: 4 x 128³; five Conv3d k=3 'same' of 32..512 channels, each LeakyReLU and MaxPool3d(2);
    dense -> 128 -> 64 -> 4, dropout 0.5, tanh x 1.2."""
    if size < 32 or size & (size - 1):
        raise ValueError("size")
    layers: list[nn.Module] = []
    c_in, n = in_channels, size
    for c in (32, 64, 128, 256, 512):
        layers += [nn.Conv3d(c_in, _ch(c, width), 3, padding=1), nn.LeakyReLU(slope), nn.MaxPool3d(2)]
        c_in, n = _ch(c, width), n // 2
    layers += [nn.Flatten(), nn.Linear(c_in * n ** 3, _ch(128, width)), nn.LeakyReLU(slope), SampleDropout(dropout),
               nn.Linear(_ch(128, width), _ch(64, width)), nn.LeakyReLU(slope), SampleDropout(dropout),
               nn.Linear(_ch(64, width), num_outputs), nn.Tanh(), Scale(1.2)]
    return nn.Sequential(*layers)


@dataclass
class CosmoFlowConf(ModelConf):
    """``model=cosmoflow``'s own keys."""

    dropout: float = key(0.2, "dropout probability of the dense head", ge=0, lt=1)
    norm: str = key("none", "normalisation after each convolution: none (the paper's model), batch (BatchNorm, the "
                            "input normalised too) or group (GroupNorm)", choices=("batch", "group", "none"))


@dataclass
class MLPerfConf(ModelConf):
    """``model=cosmoflow_mlperf``'s own keys."""

    dropout: float = key(0.5, "dropout probability of the two hidden dense layers (MLPerf's reference: 0.5)", ge=0,
                         lt=1)


def _spec(seq: nn.Sequential, name: str, size: int) -> ModelSpec:
    """4 x size^3 in, 4 parameters out, MSE; the trunk ends at the Flatten."""
    return ModelSpec(seq, name, (4, size, size, size), 4, "mse", "vector", first_flatten(seq))


def build_cosmoflow(m: CosmoFlowConf) -> ModelSpec:
    seq = sized("a power of two >= 32 (the paper uses 128, 256, 512)", cosmoflow, int(m.size), width=float(m.width),
                dropout=float(m.dropout), norm=m.norm)
    return _spec(seq, "cosmoflow", int(m.size))


def build_cosmoflow_mlperf(m: MLPerfConf) -> ModelSpec:
    seq = sized("a power of two >= 32 (MLPerf uses 128)", cosmoflow_mlperf, int(m.size), width=float(m.width),
                dropout=float(m.dropout))
    return _spec(seq, "cosmoflow_mlperf", int(m.size))


register_model("cosmoflow", build_cosmoflow,
               "CosmoFlow as the strong-scaling paper trains it: seven 3D convolutions, pools, a dense head; 4 "
               "cosmological parameters a sample (MSE)", "4 x N^3, N a power of two >= 32",
               {"size": 32, "width": 0.125, "dropout": 0.3}, benchmark="cosmoflow", options=CosmoFlowConf)
register_model("cosmoflow_mlperf", build_cosmoflow_mlperf,
               "CosmoFlow as MLPerf HPC's reference trains it: five conv + max-pool blocks, tanh x 1.2",
               "4 x N^3, N a power of two >= 32 (MLPerf: 128)", {"size": 32, "width": 0.0625, "dropout": 0.3},
               benchmark="cosmoflow", options=MLPerfConf)
