"""The power limits of the GPU models ``cluster.gpu`` names: the energy a plan bounds a run's by.

The board's power limit as its vendor's data sheet gives it (the default limit a site may lower, never raise):

===========  =====  =========================================================================================
name         W      source
===========  =====  =========================================================================================
v100-16gb    300    NVIDIA Tesla V100 data sheet (SXM2)
v100-32gb    300    same
a100-40gb    400    NVIDIA A100 data sheet (SXM4)
a100-64gb    400    assumed an SXM4 A100's (CINECA's Leonardo gives no figure for its custom 64 GB part)
a100-80gb    400    NVIDIA A100 data sheet (SXM4)
h100         700    NVIDIA H100 data sheet (SXM5)
h200         700    NVIDIA H200 data sheet (SXM)
gh200        1000   NVIDIA GH200 data sheet: the module (CPU, GPU and memory) is set between 450 and 1000 W; the
                    most it may draw
mi250x-gcd   280    AMD Instinct MI250X data sheet: 560 W the module, two GCDs
===========  =====  =========================================================================================
"""
from __future__ import annotations

POWER_LIMIT_W: dict[str, float] = {
    "v100-16gb": 300.0, "v100-32gb": 300.0, "a100-40gb": 400.0, "a100-64gb": 400.0, "a100-80gb": 400.0,
    "h100": 700.0, "h200": 700.0, "gh200": 1000.0, "mi250x-gcd": 280.0,
}


def power_limit_w(gpu: str | None) -> float | None:
    """The power limit of GPU model ``gpu`` (``cluster.gpu``), None where it is not in the table."""
    return POWER_LIMIT_W.get(str(gpu)) if gpu else None


__all__ = ["POWER_LIMIT_W", "power_limit_w"]
