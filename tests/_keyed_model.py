"""A model registered outside gems/models with a key of its own, ``model.hidden`` (tests/test_registries.py): the
module registers it when imported, as a user's module would, and a rank imports it through ``model.module``."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gems.config import ModelConf, key
from gems.models import ModelSpec, first_flatten, register_model

NAME = "keyed"


@dataclass
class KeyedConf(ModelConf):
    """``model=keyed``'s own key."""

    hidden: int = key(2, "channels of its convolution", ge=1)


def build_keyed(m: KeyedConf) -> ModelSpec:
    """One 3D convolution of ``model.hidden`` channels, a pooling and a dense head of 3 outputs on 1 x N^3."""
    torch.manual_seed(0)
    n, c = int(m.size), int(m.hidden)
    seq = nn.Sequential(nn.Conv3d(1, c, 3, padding=1), nn.ReLU(), nn.AvgPool3d(2), nn.Flatten(),
                        nn.Linear(c * (n // 2) ** 3, 3))
    return ModelSpec(seq, NAME, (1, n, n, n), 3, "mse", "vector", first_flatten(seq))


def register() -> None:
    register_model(NAME, build_keyed, "a test's model with a key of its own", "1 x N^3, N even", {"size": 8},
                   config={"size": 8, "in_channels": 1}, options=KeyedConf)


register()
