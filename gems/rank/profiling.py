"""The profilers a step may run under: torch's (``train.profile``, a chrome trace a rank) and gems's count of a CPU
rank's tensor memory (what a GPU of that memory would hold)."""
from __future__ import annotations

from typing import Any, Callable

import torch

from gems import progress
from gems.memory import persistent_bytes, step_peak_bytes
from gems.results import record as rec


def traced(cfg: Any, world: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` under torch.profiler, this rank's chrome trace written under the job's folder."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if world.device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        out = fn()
        device_sync(world.device)
    d = rec.job_dir(cfg) / "profile"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    prof.export_chrome_trace(str(d / f"rank{world.rank}.json"))
    return out


def tensor_peak(state: Any, batch: list[Any], fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` (a step) and the most bytes of tensors it held at once, counted as a GPU's allocator would
    (gems.memory): what outlives the step (parameters, the optimizer's state, buffers, train.ema's copy, the batch)
    and the step's own peak."""
    s = state
    held = persistent_bytes(s.stepper.params, s.opt, [b for m in s.stepper.modules for b in m.buffers()] +
                            (s.ema.average if s.ema is not None else []) + [t for t in batch if t is not None])
    box: list[Any] = []
    peak = step_peak_bytes(lambda: box.append(fn()))
    return box[0], held + peak


def device_sync(device: torch.device) -> None:
    """Wait for the GPU's queue (the step's kernels and NCCL's communication): a hang on the GPU shows as this
    wait in a stall report, not as whatever the host last marked."""
    if device.type == "cuda":
        with progress.waiting("gpu queue"):
            torch.cuda.synchronize(device)
