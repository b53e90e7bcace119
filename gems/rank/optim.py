"""The optimizer of a rank's parameter copies (and of a rank that holds none).
"""
from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig
from torch import nn


class _NoParameters:
    """The optimizer of a rank whose partitions hold no parameters (only pooling, say): nothing to step,
    a state that saves and loads like any other (torch's optimizers refuse an empty parameter list)."""

    def __init__(self) -> None:
        self.state: dict[Any, Any] = {}
        self.param_groups: list[dict[str, Any]] = []

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def make_optimizer(cfg: DictConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    t = cfg.train
    if not params:  # a partition without parameters is legitimate (time balance may give a rank pooling only)
        return _NoParameters()  # type: ignore[return-value]
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=float(t.lr), momentum=float(t.momentum))
    return torch.optim.Adam(params, lr=float(t.lr))


