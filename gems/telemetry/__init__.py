"""The devices seen from outside the training: a node's GPUs checked before the world starts, and each rank's
power, energy, clocks, throttling, temperature and memory sampled while it trains.

- :mod:`gems.telemetry.nvml`: the one place that calls NVML (``pynvml``, imported only where GPUs are checked or
  sampled); a query NVML does not answer is left out with its reason, never read as zero;
- :mod:`gems.telemetry.health`: the node's checks (``gems nodes check``, and once a node before the rendezvous);
- :mod:`gems.telemetry.rank`: :class:`~gems.telemetry.rank.RankTelemetry`, one sampler thread a rank (NVML on GPU
  ranks, RAPL on CPU ranks: :mod:`gems.telemetry.rapl`);
- :mod:`gems.telemetry.figures`: the record's ``telemetry`` section from every rank's summary, and the straggler
  scores;
- :mod:`gems.telemetry.limits`: the power limits of the GPU models ``cluster.gpu`` names (the plan's energy bound).
"""
from __future__ import annotations

import os
import socket


def node_name() -> str:
    """The node this process runs on, as Slurm names it (``SLURMD_NODENAME``), else the host's name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
