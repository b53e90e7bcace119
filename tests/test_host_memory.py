"""``train.host_memory``: freed host memory is kept for reuse, so a step does not fault its tensors in again."""
from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = r"""
import resource, sys, torch
from gems.bootstrap import keep_host_memory
applied = keep_host_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
n = 96 * 2**20 // 4  # 96 MiB: above glibc's largest mmap threshold, like a CosmoFlow activation
for _ in range(10):  # warm up: glibc needs a few rounds before its freed blocks coalesce into reusable ones
    t = torch.ones(n); del t
before = faults()
for _ in range(5):
    t = torch.ones(n); del t
print(applied, faults() - before)
"""


def _faults(mode: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True, timeout=120)
    applied, n = out.stdout.split()
    return applied, int(n)


def test_keep_stops_refaulting_large_blocks() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt")
    applied, kept = _faults("keep")
    _, released = _faults("release")
    assert applied == "True"
    pages = 5 * 96 * 2**20 // 4096
    assert released > pages // 2, f"glibc's defaults should fault every round in again ({released} faults)"
    assert kept < pages // 20, f"kept memory should be reused without faults ({kept} faults, {released} released)"


def test_host_memory_choice_is_checked(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "gems.cli", "run", "train.host_memory=forever", f"results.dir={tmp_path}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "train.host_memory" in out.stderr and "forever" in out.stderr and "keep" in out.stderr


def test_a_ranks_peak_is_its_own_not_its_launchers() -> None:
    """train.host_memory=auto decides on the rank's peak after its first step; a launcher (here this test) holding
    1 GiB when it starts the rank must not lend it its peak (getrusage's ru_maxrss would: Linux carries it over
    through fork and exec)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc/self/status")
    held = bytearray(2**30)
    held[::4096] = b"\1" * len(held[::4096])  # resident, not just reserved
    code = ("import resource; from gems.memory import peak_rss_bytes\n"
            "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    own, inherited = (int(v) for v in subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                      check=True, timeout=120).stdout.split())
    assert inherited >= 2**30  # the trap, shown: the parent's peak
    assert own < 2**29, own  # gems.memory imports torch: some 100-200 MiB of its own (more for a CUDA build)
    del held
