"""What gems' code does on fake tensors (the planner's trace, ``gems plan plan.dry_run=true``): shapes, no values."""
from __future__ import annotations

import torch

__all__ = ["scalar", "is_fake"]


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a FakeTensor (a shape without memory or values)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def scalar(t: torch.Tensor) -> float:
    """``float(t)``; 0.0 for a fake tensor (the dry run computes shapes, not values)."""
    return 0.0 if is_fake(t) else float(t)
