"""The weighted local loss of a rank: summed over every rank it is the serial mean loss (docs/design.md).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from gems.mesh import Mesh
from gems.models import ModelSpec


# ---------------------------------------------------------------------------- loss
def make_loss_fn(spec: ModelSpec, mesh: Mesh, global_batch: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The weighted local loss: summed over all ranks it equals the serial mean loss (docs/design.md)."""
    gathered = mesh.spatial_enabled and spec.spatial_end is not None
    part_weight = 1.0 / mesh.spatial if gathered else 1.0

    if spec.target == "dense":
        cells = math.prod(spec.input_shape[1:])

        def dense(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if spec.loss == "cross_entropy":
                s = F.cross_entropy(out.float(), y, reduction="sum")
            else:
                s = F.mse_loss(out.float(), y.float(), reduction="sum") / out.shape[1]
            return s / (cells * global_batch)

        return dense

    def vector(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if spec.loss == "cross_entropy":
            s = F.cross_entropy(out.float(), y, reduction="sum")
        else:
            s = F.mse_loss(out.float(), y.float(), reduction="sum") / out.shape[1]
        return s * (part_weight / global_batch)

    return vector


