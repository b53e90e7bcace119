"""``gems bench spatial``: does cutting one CosmoFlow sample in two pay off?

CosmoFlow (paper variant) on one 4 x 128^3 sample, batch 1: a training step
(forward, backward, gradient sum over the parts, SGD) serially (S=1, one
process) and spatially partitioned along depth (S=2, two gloo processes),
one thread per process. Reports the median step time and speedup (goal
>= 1.8x), each rank's peak resident memory growth over the step loop's
start (goal <= 0.6x of S=1), and the share of the step spent exchanging
halos, per layer. Rerun with ``python -m gems.bench.spatial [OUT_DIR]``.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

COMMAND = "python -m gems.bench.spatial [OUT_DIR]   (or: gems bench spatial)"


class _Node(dict):
    """A config node (attribute access) for build_model."""

    __getattr__ = dict.__getitem__


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    try:  # Linux: writing 5 resets VmHWM (the peak RSS) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def bench_rank(rank: int, world: int, size: int, steps: int, warmup: int, overlap: bool) -> dict[str, Any]:
    """One rank of the benchmark (``world`` = S): step times, peak RSS growth, halo seconds."""
    import torch
    import torch.distributed as dist

    from gems.data.synthetic import sample_input
    from gems.models import build_model
    from gems.models.layers import batch_context
    from gems.spatial import SpatialContext, apply_spatial

    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = build_model(_Node(name="cosmoflow", size=size, width=1.0, dropout=0.2))
    shape = spec.input_shape
    sctx = None
    model = spec.module
    if world > 1:
        sctx = SpatialContext(None, list(range(world)), (world,), (0,), (rank,), overlap=overlap)
        model = apply_spatial(model, sctx, spec.spatial_end)
    slices = sctx.local_slices(shape[1:]) if sctx else None
    x = sample_input(0, 0, shape, slices).unsqueeze(0)
    if sctx:
        sctx.mark(x, shape[1:])
    target = torch.zeros(1, spec.num_outputs)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    times: list[float] = []
    if world > 1:
        dist.barrier()
    _reset_peak()
    base = _status_kib("VmRSS")
    for step in range(warmup + steps):
        if step == warmup and sctx:
            sctx.halo_seconds.clear()
        t0 = time.perf_counter()
        with batch_context(0, step, [0]):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, target) / (world if sctx else 1)
        loss.backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    peak = _status_kib("VmHWM") - base
    return {"times": times, "peak_kib": peak, "halo": dict(sctx.halo_seconds) if sctx else {}}


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def bench_spatial(out_dir: str | os.PathLike = "results/bench", size: int = 128, steps: int = 3, warmup: int = 1) -> str:
    """Run S=1 and S=2 (with and without overlap), write ``spatial.md`` and ``spatial.json``; return the table."""
    import torch

    from gems.testing import run_world

    load_before = os.getloadavg()
    runs = {
        "S=1 (serial)": run_world(bench_rank, 1, size, steps, warmup, True, timeout=1800),
        "S=2 (depth, overlap)": run_world(bench_rank, 2, size, steps, warmup, True, timeout=1800),
        "S=2 (depth, no overlap)": run_world(bench_rank, 2, size, steps, warmup, False, timeout=1800),
    }
    load_after = os.getloadavg()
    base_t = statistics.median(runs["S=1 (serial)"][0]["times"])
    base_m = runs["S=1 (serial)"][0]["peak_kib"]
    lines = [
        f"# Spatial parallelism: CosmoFlow 4x{size}^3, batch 1, one thread per rank",
        "",
        "| run | median step (s) | speedup | peak RSS growth per rank (MiB) | memory vs S=1 | halo share of step (max over ranks) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, ranks in runs.items():
        # a step ends when the slowest rank ends
        step = statistics.median(max(ts) for ts in zip(*[r["times"] for r in ranks]))
        peak = max(r["peak_kib"] for r in ranks)
        halo = max(sum(r["halo"].values()) for r in ranks) / (step * steps) if ranks[0]["halo"] else 0.0
        lines.append(f"| {name} | {step:.3f} | {base_t / step:.2f}x | {peak / 1024:.0f} | {peak / base_m:.2f}x | "
                     f"{100 * halo:.1f}% |")
    lines += ["", "Goals: speedup >= 1.8x (ideal 2x), memory <= 0.6x of S=1.", "",
              "## Halo time per layer (S=2, no overlap; rank 0; packing + waiting + backward exchange)", "",
              "| layer | halo s per step | share of step |", "| --- | ---: | ---: |"]
    r0 = runs["S=2 (depth, no overlap)"][0]
    step0 = statistics.median(r0["times"])
    for label, sec in r0["halo"].items():
        lines.append(f"| {label} | {sec / steps:.4f} | {100 * sec / steps / step0:.2f}% |")
    lines += ["", "## Environment", "",
              f"- torch {torch.__version__}, Python {platform.python_version()}, gloo backend on one machine",
              f"- CPU: {_cpu()}, {os.cpu_count()} logical cores; 1 thread per rank",
              f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
              f"- load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f} "
              "(other processes on the machine skew the 2-rank timings)",
              f"- steps: {warmup} warm-up + {steps} measured; peak RSS = VmHWM growth over the step loop",
              "", "## To reproduce", "", f"    {COMMAND}", ""]
    text = "\n".join(lines)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spatial.md").write_text(text)
    (out / "spatial.json").write_text(json.dumps(runs, indent=1))
    return text


if __name__ == "__main__":
    print(bench_spatial(sys.argv[1] if len(sys.argv) > 1 else "results/bench"))
