"""Faults at scale: where each rank is (:mod:`gems.progress`, kept below
every strategy, which all mark it), stalls found and ended
(:mod:`~gems.fault.watchdog`), failures told by their cause (:mod:`~gems.fault.reports`), and
deliberate failures for tests (:mod:`~gems.fault.inject`)."""
from __future__ import annotations

import torch


def all_finite(t: torch.Tensor | None) -> torch.Tensor | bool:
    """Whether every value of ``t`` is finite, as a device flag (no synchronisation until it is read).

    A NaN or an Inf makes the sum non-finite, and the sum allocates nothing the size of ``t`` (``isfinite``
    would allocate a mask a quarter of its size at the step's memory peak); it is summed in fp32 (fp64 for
    fp64), where finite activations do not overflow.
    """
    if t is None or not t.is_floating_point():
        return True
    with torch.no_grad():
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        return torch.isfinite(t.detach().sum(dtype=acc))
