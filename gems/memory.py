"""Memory of a rank, as the record reports it and the benchmarks compare it: the process's peak (:class:`MemoryMeter`),
and the tensor memory a GPU would count, measured on CPU (:func:`step_peak_bytes` with :func:`persistent_bytes`;
the record's ``peak_memory_bytes.tensor_per_rank``); the cap a rank's tensors are held to.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any, Callable

import torch


def _rss_status(field_name: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM, since its start or the last :meth:`MemoryMeter.reset`).
    Not getrusage's ru_maxrss: Linux carries a parent's peak over through fork and exec, so a rank started by a
    large launcher (or a test started by pytest) would report its parent's."""
    return _rss_status("VmHWM")


class MemoryMeter:
    """Peak memory of this rank: torch.cuda's peak allocation on GPU, peak RSS growth on CPU (which also counts what
    the C library keeps, all of it with ``train.host_memory=keep``, and its fragmentation)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.base = 0

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = 0
        else:
            try:  # reset the kernel's high-water mark (Linux >= 4.0)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
            self.base = _rss_status("VmRSS")

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return max(0, peak_rss_bytes() - self.base)

    def requested_peak(self) -> int | None:
        """On GPU, the most bytes the tensors asked for at once (the caching allocator's ``requested_bytes``
        peak), None on CPU or where torch does not count it. :meth:`peak` counts the blocks handed out: each
        request rounded up to 512 bytes, and a cached block up to 1 MiB larger than a request of the large pool
        taken whole, since the allocator splits off only a larger rest (c10/cuda/CUDACachingAllocator.cpp,
        ``should_split``). The two peaks side by side tell the planner's count of tensors from what the allocator
        adds to it."""
        if self.device.type != "cuda":
            return None
        value = torch.cuda.memory_stats(self.device).get("requested_bytes.all.peak")
        return None if value is None else int(value)

    def reserved_peak(self) -> int | None:
        """On GPU, the most the caching allocator held from the device (``max_memory_reserved``: its pools, a CUDA
        graph's private pool among them, with what they cache), None on CPU: what a graph's pool takes beside
        the tensors the plan counts (docs/gpu.md, "Graphs and NCCL")."""
        return int(torch.cuda.max_memory_reserved(self.device)) if self.device.type == "cuda" else None


def rank_cap_bytes(cfg: Any) -> int | None:
    """``cluster.rank_memory_gb`` in bytes (None where unset): the most one rank's tensors may take. One rule for the
    plan, which counts it as the rank's device (gems.plan.memory), and for the run, which holds every rank to it
    (:func:`limit_gpu`, :func:`over_cap`)."""
    value = getattr(getattr(cfg, "cluster", None), "rank_memory_gb", None)  # (a configuration without the section)
    return None if value is None else int(float(value) * 2**30)


def limit_gpu(cap: int | None, device: torch.device) -> float | None:
    """A GPU rank's caching allocator held to ``cap`` bytes (``torch.cuda.set_per_process_memory_fraction`` of the
    device's total; a cap past the device leaves it whole): an allocation past it raises CUDA's out-of-memory error,
    as a smaller GPU would; no cap sets the whole device (a process that set up a capped rank before keeps no limit).
    The fraction set, or None (a CPU rank). The CUDA context and NCCL's buffers lie outside the allocator, so the
    plan, which counts them against the cap too, errs on the safe side."""
    if device.type != "cuda":
        return None
    fraction = 1.0 if cap is None else min(1.0, cap / torch.cuda.get_device_properties(device).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def over_cap(cap: int | None, peaks: list[int]) -> tuple[int, int] | None:
    """(rank, its tensor peak) of the rank whose measured tensor peak went furthest past ``cap`` bytes, None where
    every rank kept within it (or no cap is set): a CPU rank's counterpart of a GPU's out-of-memory error, judged on
    what the plan counts (the tensors' peak, :func:`step_peak_bytes` over the profiled steps)."""
    if cap is None or not peaks:
        return None
    rank = max(range(len(peaks)), key=lambda r: peaks[r])
    return (rank, peaks[rank]) if peaks[rank] > cap else None


def tensor_bytes(tensors: Any) -> int:
    """Bytes held by distinct tensor storages among ``tensors`` (an iterable of tensors; views count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def persistent_bytes(params: Any, optimizer: Any = None, extra: Any = ()) -> int:
    """Tensor bytes that live across steps: parameters, their gradients, optimizer state, ``extra`` tensors."""
    params = list(params)
    ts = [p for p in params] + [p.grad for p in params if p.grad is not None] + list(extra)
    if optimizer is not None:
        ts += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensor_bytes(ts)


def step_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak tensor bytes allocated on the CPU while ``fn()`` runs, above what was live when it started.

    The CPU counterpart of ``torch.cuda.max_memory_allocated()`` minus its value at
    the start: read from the profiler's allocator events (every allocation and free
    of the default CPU allocator, workspaces of kernels included), so unlike peak RSS
    it does not count glibc's heap that was kept from earlier steps, library buffers or
    the Python interpreter. Blocks allocated before ``fn`` and freed inside it are not
    subtracted (the profiler does not know their size), so it errs high, never low.
    """
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    mem = sorted((e["ts"], e["args"].get("Ev Idx", 0), int(e["args"]["Bytes"])) for e in events
                 if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type", 0) == 0)
    live = peak = 0
    for _, _, nbytes in mem:
        live += nbytes
        peak = max(peak, live)
    return peak
