"""The power limits of the GPU models ``cluster.gpu`` names: the energy a plan bounds a run's by. Each is the board's
limit as its vendor's data sheet gives it (the default a site may lower, never raise).
"""
from __future__ import annotations

POWER_LIMIT_W: dict[str, float] = {
    "v100-16gb": 300.0,  # NVIDIA Tesla V100 data sheet (SXM2)
    "v100-32gb": 300.0,  # same
    "a100-40gb": 400.0,  # NVIDIA A100 data sheet (SXM4)
    "a100-64gb": 400.0,  # assumed an SXM4 A100's (CINECA's Leonardo gives no figure for its custom 64 GB part)
    "a100-80gb": 400.0,  # NVIDIA A100 data sheet (SXM4)
    "h100": 700.0,  # NVIDIA H100 data sheet (SXM5)
    "h200": 700.0,  # NVIDIA H200 data sheet (SXM)
    "gh200": 1000.0,  # NVIDIA GH200 data sheet: the module (CPU, GPU, memory) is set between 450 and 1000 W: the most
    "mi250x-gcd": 280.0,  # AMD Instinct MI250X data sheet: 560 W the module, two GCDs
}


def power_limit_w(gpu: str | None) -> float | None:
    """The power limit of GPU model ``gpu`` (``cluster.gpu``), None where it is not in the table."""
    return POWER_LIMIT_W.get(str(gpu)) if gpu else None


__all__ = ["POWER_LIMIT_W", "power_limit_w"]
