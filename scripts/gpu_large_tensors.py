"""Which of CosmoFlow's first layers slow down once a tensor holds 2^31 elements or more, on the GPU at hand.

    python scripts/gpu_large_tensors.py [--out FILE.json]     # a GPU machine; about 20 s on an H100

CosmoFlow's first convolution at 512^3 (4 -> 16 channels, batch 1) makes an output of 16 x 512^3 = 2^31 elements,
one more than a 32-bit signed index reaches. One H100 lease measured gems's 512^3 bf16 step at 2.42 s where the
plan, from the same model's rates at 64^3-256^3, said 0.11 s (results/gpu/h100-2026-11-27.md). This times the
forward and backward of the first block's layers (the convolution, its LeakyReLU, the average pool after it) at a
depth of 512 (2^31 elements out of the convolution) and of 511 (just under), in fp32 and bf16, so the time a
voxel of each tells which layer crosses to a slower path, if any. Not a benchmark: a diagnosis, printed and
written as JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def _time(fn, repeats: int = 2) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def measure(depth: int, dtype: torch.dtype) -> dict[str, float]:
    dev = torch.device("cuda")
    x = torch.randn(1, 4, depth, 512, 512, device=dev, dtype=dtype, requires_grad=True)
    w = torch.randn(16, 4, 3, 3, 3, device=dev, dtype=dtype, requires_grad=True)
    y = F.conv3d(x, w, padding=1)
    gy = torch.randn_like(y)
    out: dict[str, float] = {"elements_out": float(y.numel())}
    out["conv_forward_s"] = _time(lambda: F.conv3d(x, w, padding=1))
    out["conv_backward_s"] = _time(lambda: torch.autograd.grad(F.conv3d(x, w, padding=1), (x, w), gy))
    a = y.detach().requires_grad_(True)
    out["leaky_relu_forward_backward_s"] = _time(lambda: torch.autograd.grad(F.leaky_relu(a, 0.3), a, gy))
    pooled = F.avg_pool3d(a, 3, 2, 1)
    gp = torch.randn_like(pooled)
    out["avg_pool_forward_backward_s"] = _time(lambda: torch.autograd.grad(F.avg_pool3d(a, 3, 2, 1), a, gp))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_large_tensors: no GPU here", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = False
    rows: list[dict[str, Any]] = []
    for dtype in (torch.bfloat16, torch.float32):
        for depth in (511, 512):
            r = {"dtype": str(dtype).removeprefix("torch."), "depth": depth, **measure(depth, dtype)}
            torch.cuda.empty_cache()
            rows.append(r)
            print(json.dumps(r), flush=True)
    for name in ("bfloat16", "float32"):
        under, over = (next(r for r in rows if r["dtype"] == name and r["depth"] == d) for d in (511, 512))
        for k in ("conv_forward_s", "conv_backward_s", "leaky_relu_forward_backward_s", "avg_pool_forward_backward_s"):
            print(f"{name} {k}: {under[k] * 1e3:.2f} ms at 511, {over[k] * 1e3:.2f} ms at 512 "
                  f"({over[k] / under[k] * 511 / 512:.2f}x a voxel)", flush=True)
    if a.out:
        a.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                     "cudnn": torch.backends.cudnn.version(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
