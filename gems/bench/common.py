"""What every benchmark table carries: the environment and the command that reproduces it."""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Sequence


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    import torch

    from gems.results.record import git_commit

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "git_commit": git_commit(),
    }


def env_block(command: str) -> str:
    env = environment()
    lines = ["Environment:", ""]
    lines += [f"- {k}: {v}" for k, v in env.items() if v is not None]
    lines += ["", f"To reproduce: `{command}`", ""]
    return "\n".join(lines)


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def write(out_dir: Path, name: str, text: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.md"
    path.write_text(text)
    return path


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
    import torch

    params = list(params)
    ts = [p for p in params] + [p.grad for p in params if p.grad is not None] + list(extra)
    if optimizer is not None:
        ts += [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensor_bytes(ts)


def step_peak_bytes(fn: Any) -> int:
    """Peak tensor bytes allocated on the CPU while ``fn()`` runs, above what was live when it started.

    The CPU counterpart of ``torch.cuda.max_memory_allocated()`` minus its value at
    the start: read from the profiler's allocator events (every allocation and free
    of the default CPU allocator, workspaces of kernels included), so unlike peak RSS
    it does not count glibc's heap that was kept from earlier steps, library buffers or
    the Python interpreter. Blocks allocated before ``fn`` and freed inside it are not
    subtracted (the profiler does not know their size), so it errs high, never low.
    """
    import json
    import tempfile

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


def out_dir_from_argv(argv: Sequence[str], command: str) -> str:
    """The OUT_DIR argument of ``python -m gems.bench.NAME [OUT_DIR]``; -h/--help prints the usage and exits."""
    import sys

    if len(argv) > 1 and argv[1].startswith("-"):
        if argv[1] in ("-h", "--help"):
            print(f"usage: {command}\nwrites NAME.md (the table and its environment) under OUT_DIR (default results/bench)")
            raise SystemExit(0)
        print(f"error: argument {argv[1]!r}: expected an output folder (OUT_DIR) or --help", file=sys.stderr)
        raise SystemExit(2)
    return argv[1] if len(argv) > 1 else "results/bench"
