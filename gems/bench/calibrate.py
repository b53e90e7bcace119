"""``gems bench calibrate [OVERRIDES] [out=DIR]``: what the configured model's own convolutions reach on the GPU at hand,
written for ``gems plan`` (``DIR/calibration-<gpu>.json``, read by ``cluster.gpu_calibration=PATH``; its format:
gems.plan.calibration) with its table (``DIR/calibration-<gpu>.md``). Without a GPU it measures the CPU the same way:
the file's plumbing, not a GPU's figures.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from gems.plan.calibration import SCHEMA, jsonable

__all__ = ["bench_calibrate", "measure"]

REPS = 7


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn: Callable[[], Any], device: torch.device, reps: int = REPS) -> float:
    """The median seconds of ``fn()`` after one warm-up call (cuDNN picks its algorithm there), each call timed
    alone: CUDA events on a GPU, the host's clock on a CPU."""
    fn()
    _sync(device)
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _workspace(fn: Callable[[], Any], result_bytes: int, device: torch.device) -> int:
    """Bytes a call allocates beyond what it returns (the caching allocator's peak; 0 on a CPU)."""
    if device.type != "cuda":
        return 0
    _sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return max(0, torch.cuda.max_memory_allocated(device) - base - result_bytes)


def _conv(sig: tuple, batch: int, input_grad: bool, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The forward, input-gradient and weight-gradient seconds and the workspace of one convolution."""
    from gems.plan.cpu import conv_case

    f, inputs, flops = conv_case((*sig, batch), input_grad)
    nd = sig[1]
    fmt = {3: torch.channels_last_3d, 2: torch.channels_last}.get(nd, torch.contiguous_format)
    x, w = (t.detach().to(device=device, dtype=dtype) for t in inputs)
    if device.type == "cuda":
        x, w = x.contiguous(memory_format=fmt), w.contiguous(memory_format=fmt)
    x.requires_grad_(input_grad)
    w.requires_grad_(True)
    out = f(x, w)
    g = torch.ones_like(out)
    entry: dict[str, Any] = {"signature": jsonable(sig), "batch": batch, "input_grad": input_grad, "flops": flops,
                             "dtype": str(dtype).replace("torch.", "")}
    entry["forward_s"] = _median_s(lambda: f(x, w), device)
    entry["input_grad_s"] = _median_s(lambda: torch.autograd.grad(out, [x], g, retain_graph=True), device) \
        if input_grad else 0.0
    entry["weight_grad_s"] = _median_s(lambda: torch.autograd.grad(out, [w], g, retain_graph=True), device)
    elem = out.element_size()
    entry["workspace_bytes"] = max(
        _workspace(lambda: f(x, w), out.numel() * elem, device),
        _workspace(lambda: torch.autograd.grad(out, [x, w] if input_grad else [w], g, retain_graph=True),
                   (x.numel() * elem if input_grad else 0) + w.numel() * elem, device))
    return entry


def _bandwidth(device: torch.device, dtype: torch.dtype) -> float:
    """GB/s an elementwise op (read once, written once) reaches on 64 Mi elements."""
    n = 1 << 26 if device.type == "cuda" else 1 << 22
    x = torch.randn(n, device=device).to(dtype)
    s = _median_s(lambda: torch.nn.functional.leaky_relu(x, 0.3), device)
    return 2 * n * x.element_size() / s / 1e9


def _signatures(cfg: Any) -> tuple[list[tuple[tuple, bool]], int]:
    """Every distinct (convolution signature, input gradient?) of the configured model as the planner traces it,
    and the micro-batch the run uses."""
    from gems.plan.memory import Planner, setup

    st = setup(cfg)
    pl = Planner(st, quick=True)
    chunk = max(1, pl.chunk_of(st.batch))
    _, classes = pl.profile(chunk)
    seen: dict[tuple, bool] = {}
    for _, _, stages, _ in classes:
        for stage in stages:
            for grad, convs in stage.layer_convs:
                for sig in convs:
                    seen[sig] = seen.get(sig, False) or bool(grad)
    return list(seen.items()), chunk


def measure(cfg: Any) -> dict[str, Any]:
    """The calibration of the configured model on this machine's GPU (its CPU where it has none): for every distinct
    convolution of the model (as the planner traces it, at the run's micro-batch) and each precision a GPU trains in
    (fp32 with torch's default TF32 convolutions, bf16), the forward, the input gradient and the weight gradient
    timed with CUDA events (the median of several calls after a warm-up, channels-last), and the workspace each call
    allocates beyond its result from the caching allocator's peak; one elementwise op over a large tensor gives the
    bandwidth memory-bound ops reach. About a minute on a GPU for CosmoFlow."""
    from gems.results.record import git_commit

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    sigs, chunk = _signatures(cfg)
    precisions = {"fp32": torch.float32, "bf16": torch.bfloat16} if device.type == "cuda" else {"fp32": torch.float32}
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    for name, dtype in precisions.items():
        out[name] = {"memory_GBps": _bandwidth(device, dtype),
                     "convs": [_conv(sig, chunk, grad, device, dtype) for sig, grad in sigs]}
    return {"schema": SCHEMA, "device": device.type,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (no GPU: plumbing only)",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
            "tf32_convolutions": bool(torch.backends.cudnn.allow_tf32), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "gems_commit": git_commit(), "model": str(cfg.model.name), "micro_batch": chunk,
            "seconds": round(time.perf_counter() - t0, 1), "precisions": out}


def bench_calibrate(out_dir: Path, overrides: list[str] | None = None) -> str:
    """Measure, write the calibration file and its table; return the table."""
    from gems.bench.common import md_table, write
    from gems.config import compose, typed

    cfg = typed(compose(list(overrides or [])))
    data = measure(cfg)
    gpu = "".join(ch if ch.isalnum() else "-" for ch in data["gpu"].split(" (")[0].lower()).strip("-")
    path = Path(str(cfg.cluster.gpu_calibration)) if cfg.cluster.gpu_calibration else \
        Path(out_dir) / f"calibration-{gpu}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    rows = []
    for prec, got in data["precisions"].items():
        for c in got["convs"]:
            sig = c["signature"]
            total = c["forward_s"] + c["input_grad_s"] + c["weight_grad_s"]
            rows.append([prec, f"{sig[2]}->{sig[3]} k{'x'.join(map(str, sig[4]))} at {'x'.join(map(str, sig[-1]))}",
                         c["batch"], f"{c['forward_s'] * 1e3:.3f}", f"{c['input_grad_s'] * 1e3:.3f}",
                         f"{c['weight_grad_s'] * 1e3:.3f}", f"{c['flops'] * 3 / total / 1e12:.1f}",
                         f"{c['workspace_bytes'] / 2**20:.0f}"])
        rows.append([prec, "memory-bound (leaky_relu)", "", "", "", "", f"{got['memory_GBps']:.0f} GB/s", ""])
    text = "\n".join([
        f"# gems bench calibrate: {data['model']} on {data['gpu']}", "",
        md_table(["precision", "convolution", "micro-batch", "forward ms", "input grad ms", "weight grad ms",
                  "TFLOP/s (3x forward work)", "workspace MiB"], rows), "",
        f"torch {data['torch']}, CUDA {data['cuda']}, cuDNN {data['cudnn']}, TF32 convolutions "
        f"{data['tf32_convolutions']}, {data['date']}, {data['seconds']} s, gems {data['gems_commit']}.", "",
        f"The file `gems plan ... cluster.gpu_calibration={path}` reads.", "",
        "```", "gems bench calibrate " + " ".join(overrides or []), "```", ""])
    write(Path(out_dir), path.stem, text)
    return text
