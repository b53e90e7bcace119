"""The devices seen from outside the training: a node's GPUs checked before the world starts (:mod:`.health`), and each
rank's power, energy, clocks, throttling, temperature and memory sampled while it trains (:mod:`.rank`), gathered into
the record (:mod:`.figures`). NVML is called in one module (:mod:`.nvml`); a query it does not answer is left out
with its reason, never read as zero.
"""
from __future__ import annotations

import os
import socket


def node_name() -> str:
    """The node this process runs on, as Slurm names it (``SLURMD_NODENAME``), else the host's name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
