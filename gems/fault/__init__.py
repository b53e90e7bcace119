"""Faults at scale: where each rank is (:mod:`~gems.fault.progress`), stalls found and ended
(:mod:`~gems.fault.watchdog`), failures told by their cause (:mod:`~gems.fault.reports`), and
deliberate failures for tests (:mod:`~gems.fault.inject`)."""
from __future__ import annotations

import torch


def all_finite(t: torch.Tensor | None) -> torch.Tensor | bool:
    """Whether every value of ``t`` is finite, as a device flag (no synchronisation until it is read)."""
    if t is None or not t.is_floating_point():
        return True
    with torch.no_grad():
        return torch.isfinite(t).all()
