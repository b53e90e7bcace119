"""model=resnet: ResNet-v2 of depth 9n+2 as a flat sequence that partitions well."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from gems.errors import ConfigError
from gems.models import build_model
from gems.models.resnet import PreActBottleneck, resnet_v2


def weighted_depth(seq: nn.Sequential) -> int:
    """Layers on the longest path: convolutions outside the shortcuts plus the linear layer."""
    convs = sum(1 for m in seq.modules() if isinstance(m, nn.Conv2d))
    shortcuts = sum(1 for m in seq.modules() if isinstance(m, PreActBottleneck) and m.shortcut is not None)
    return convs - shortcuts + sum(1 for m in seq if isinstance(m, nn.Linear))


@pytest.mark.parametrize("depth", [11, 20, 110, 164])
def test_depth_is_9n_plus_2_and_the_sequence_is_flat(depth):
    seq = resnet_v2(depth, width=0.25)
    n = (depth - 2) // 9
    assert weighted_depth(seq) == depth
    assert sum(isinstance(m, PreActBottleneck) for m in seq) == 3 * n
    assert len(seq) == 3 * n + 6  # stem, blocks, norm, relu, pool, flatten, linear: every block is one cut point


def test_parameter_counts_match_the_paper():
    # He et al. 2016, Table 2 (CIFAR): ResNet-164 1.7M, ResNet-1001 10.2M
    assert sum(p.numel() for p in resnet_v2(164).parameters()) / 1e6 == pytest.approx(1.7, abs=0.05)
    assert sum(p.numel() for p in resnet_v2(1001).parameters()) / 1e6 == pytest.approx(10.2, abs=0.15)


def test_build_resnet_spec_and_forward():
    cfg = dict(name="resnet", depth=20, size=32, in_channels=1, num_classes=7, width=0.25, norm="group")
    spec = build_model(cfg)
    assert spec.input_shape == (1, 32, 32) and spec.num_outputs == 7 and spec.loss == "cross_entropy"
    assert spec.target == "vector"
    assert isinstance(spec.module[spec.spatial_end], nn.AdaptiveAvgPool2d)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in spec.module.modules())
    out = spec.module(torch.randn(2, 1, 32, 32))
    assert out.shape == (2, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in spec.module.parameters())


def test_pre_activation_keeps_the_identity_path_clean():
    block = PreActBottleneck(16, 4, norm="none")  # c_in == 4 x planes: identity shortcut
    assert block.shortcut is None
    for conv in (block.conv1, block.conv2, block.conv3):
        nn.init.zeros_(conv.weight)
        nn.init.zeros_(conv.bias)
    x = torch.randn(2, 16, 5, 5)
    assert torch.equal(block(x), x)  # the input passes unactivated (He et al. 2016: no ReLU after the addition)


@pytest.mark.parametrize("bad,key", [(dict(depth=100), "model.depth"), (dict(depth=2), "model.depth"),
                                     (dict(norm="layer"), "model.norm"), (dict(size=2), "model.size")])
def test_bad_config_names_the_key(bad, key):
    cfg = {**dict(name="resnet", depth=20, size=32), **bad}
    with pytest.raises(ConfigError) as e:
        build_model(cfg)
    assert e.value.key == key
    if key == "model.depth":
        assert "9n+2" in str(e.value)
