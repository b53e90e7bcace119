"""The planner asked before a run launches (``train.check_fit``): a point that cannot fit is bad input.

``gems run`` and every point of ``gems sweep`` plan their memory on the planner's quick path (one trace at
the configured batch, no batch search, no step-time prediction) before anything starts. A point that does
not fit stops with exit 2 and the planner's verdict, with its suggestion (the search for one runs only then).
The out-of-memory killer would otherwise end the run minutes in, and on a shared node it may take other
users' processes with it. CPU ranks of the local launcher are checked against the memory this machine has
free now; GPU ranks against their preset's GPU. ``train.check_fit=false`` launches anyway.

On CPU ranks the full plan also measures each convolution's backward workspace (oneDNN's scratchpad: seconds
for a model's first plan). The check plans without it first, a lower bound: a point that does not fit even
so is refused at once, one that fits with :data:`MARGIN` to spare (a workspace is a few times one layer's
weights, far below that) is let through, and only the points in between are planned with the workspaces.
"""
from __future__ import annotations

import time
from typing import Any

from gems.errors import ConfigError

__all__ = ["check_fit", "MARGIN"]

#: a point whose planned memory without the CPU workspaces fits this many times over fits with them
MARGIN = 1.5


def check_fit(cfg: Any) -> float:
    """Seconds the check took; a ConfigError naming ``train.check_fit`` with the verdict when ``cfg`` does not fit."""
    from gems.plan.make import make_plan

    t0 = time.perf_counter()
    plan = make_plan(cfg, suggest=False, quick=True, available=True, workspace=False)
    if plan.fits:
        dev = plan.device
        resident = plan.worst.bytes.total * float((dev.get("host_memory") or {}).get("resident_factor", 1.0))
        if dev["kind"] == "gpu" or MARGIN * resident <= dev["usable_bytes"]:
            return time.perf_counter() - t0
        plan = make_plan(cfg, suggest=False, quick=True, available=True)
        if plan.fits:
            return time.perf_counter() - t0
    plan = make_plan(cfg, suggest=True, quick=True, available=True, workspace=plan.device["kind"] == "gpu")
    raise ConfigError("train.check_fit", "true", f"a configuration that fits: gems plan says it {plan.verdict}; "
                      "train.check_fit=false launches it anyway")
