"""The planner asked before a run launches (``train.check_fit``): a point that cannot fit is bad input.

``gems run`` and every point of ``gems sweep`` plan their memory on the planner's quick path (one trace at
the configured batch, no batch search, no step-time prediction) before anything starts. A point that does
not fit stops with exit 2 and the planner's verdict, with its suggestion (the search for one runs only then).
The out-of-memory killer would otherwise end the run minutes in, and on a shared node it may take other
users' processes with it. CPU ranks of the local launcher are checked against the memory this machine has
free now; GPU ranks against their preset's GPU. ``train.check_fit=false`` launches anyway.
"""
from __future__ import annotations

import time
from typing import Any

from gems.errors import ConfigError

__all__ = ["check_fit"]


def check_fit(cfg: Any) -> float:
    """Seconds the check took; a ConfigError naming ``train.check_fit`` with the verdict when ``cfg`` does not fit."""
    from gems.plan.memory import make_plan

    t0 = time.perf_counter()
    plan = make_plan(cfg, suggest=False, quick=True, available=True)
    if plan.fits:
        return time.perf_counter() - t0
    plan = make_plan(cfg, suggest=True, quick=True, available=True)
    if plan.fits:  # (memory freed meanwhile)
        return time.perf_counter() - t0
    raise ConfigError("train.check_fit", "true", f"a configuration that fits: gems plan says it {plan.verdict}; "
                      "train.check_fit=false launches it anyway")
