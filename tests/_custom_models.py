"""Tiny models for `gems run model=custom model._target_=_custom_models.NAME` (tests/ is on PYTHONPATH)."""
import torch
from torch import nn


def global_pool() -> nn.Sequential:
    """A 3D net with a global pooling before its gather point (the Flatten, layer 3): not partitionable."""
    return nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                         nn.Linear(2, 3))


class Normalize(nn.Module):
    """A layer of the user's own that reduces over the whole sample: gems does not know it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.abs().amax(dim=(2, 3, 4), keepdim=True).clamp_min(1e-6)


def own_layer(n: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), Normalize(), nn.Flatten(), nn.Linear(2 * n ** 3, 3))


def plain(n: int = 8) -> nn.Sequential:
    """A partitionable 3D net: no model.spatial_end needed, the gather goes before its Flatten."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.ReLU(), nn.AvgPool3d(2), nn.Flatten(),
                         nn.Linear(2 * (n // 2) ** 3, 3))


class FailOnRank(nn.Module):
    """Raises a user error on one rank (``RANK``) from its ``at``-th forward on: its peers see only echoes."""

    def __init__(self, rank: int, at: int) -> None:
        super().__init__()
        self.rank, self.at, self.calls = rank, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os

        if os.environ.get("RANK") == str(self.rank):
            self.calls += 1
            if self.calls > self.at:
                raise ValueError("the user's layer refuses this batch")
        return x


def failing(rank: int = 1, at: int = 2, n: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), FailOnRank(rank, at), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * n * n, 3))


def resnet_head_2d(n: int = 8) -> nn.Sequential:
    """A ResNet-style 2D net: convolutions, then AdaptiveAvgPool2d(1) before its Flatten and classifier."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def max_head_3d(n: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 3, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool3d(1), nn.Flatten(),
                         nn.Linear(3, 3))


def adaptive_3(n: int = 8) -> nn.Sequential:
    """An adaptive pooling to 2 x 2 x 2 (not a global one): gems gathers before it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(2), nn.Flatten(),
                         nn.Linear(16, 3))


class Square(nn.Module):
    """A layer of the user's own that acts on each cell: registered below, so gems cuts it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def registered_own(n: int = 8) -> nn.Sequential:
    from gems.spatial import register_pointwise

    register_pointwise(Square)
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), Square(), nn.AvgPool3d(2), nn.Flatten(),
                         nn.Linear(2 * (n // 2) ** 3, 3))


def dense_own() -> nn.Sequential:
    """A dense (per-cell classes) net with a layer gems does not know: it cannot be gathered mid-way."""
    return nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), Normalize(), nn.Conv3d(2, 2, 1))


def tiny_cnn(n: int = 16) -> nn.Sequential:
    """One 2D convolution and a linear head on [3, n, n] inputs (gems plan's FLOP count is checked on it)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * n * n, 4))


class RefusesPartOf(nn.Module):
    """A registered cell-wise layer that refuses a part of ``size`` rows: only the rank holding such a part
    fails, so the serial check before launch passes and the dry run of that rank finds it."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[2] == self.size:
            raise ValueError(f"the user's layer refuses a part of {self.size} rows")
        return x


def refuses_part(size: int = 4, n: int = 9) -> nn.Sequential:
    from gems.spatial import register_pointwise

    register_pointwise(RefusesPartOf)
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), RefusesPartOf(size), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(2, 3))


def lifecycle(n: int = 16) -> nn.Sequential:
    """A 3D regression net the transparency suites do not run (the trained model's file, resumes on other meshes,
    gems eval): GroupNorm (per sample: every mesh computes the serial batch, where BatchNorm's statistics would
    follow the micro-batches), a one-sided halo (k3 s2 p1), a 1x1 convolution, per-sample dropout, two dense
    layers."""
    from gems.models.layers import SampleDropout

    torch.manual_seed(3)
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.LeakyReLU(0.1),
                         nn.Conv3d(4, 6, 3, stride=2, padding=1), nn.GroupNorm(3, 6), nn.ReLU(), nn.AvgPool3d(2),
                         nn.Conv3d(6, 4, 1), nn.Flatten(), SampleDropout(0.2), nn.Linear(4 * (n // 4) ** 3, 8),
                         nn.ReLU(), nn.Linear(8, 3))


def cosmo_tiny(n: int = 8) -> nn.Sequential:
    """A CosmoFlow-like regressor of 4 targets on 4-channel n^3 crops (the tests' MLPerf TFRecords are 8^3):
    partitionable, the gather before its Flatten."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.LeakyReLU(0.3), nn.AvgPool3d(2), nn.Flatten(),
                         nn.Linear(4 * (n // 2) ** 3, 4))


class _Alerting(nn.Module):
    """An op as torch reports one without a deterministic kernel under use_deterministic_algorithms(warn_only=True)
    (its warning, word for word: no CPU kernel of torch's raises one to test with)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import warnings

        warnings.warn("scatter_add_cuda_kernel does not have a deterministic implementation, but you set "
                      "'torch.use_deterministic_algorithms(True, warn_only=True)'. You can file an issue at "
                      "https://github.com/pytorch/pytorch/issues", UserWarning)
        return x


def alerting_tiny(n: int = 8) -> nn.Sequential:
    """cosmo_tiny with an op torch would run without a deterministic kernel (:class:`_Alerting`)."""
    tiny = cosmo_tiny(n)
    return nn.Sequential(tiny[0], _Alerting(), *tiny[1:])
