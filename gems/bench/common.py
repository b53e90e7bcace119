"""What every benchmark table carries: the environment and the command that reproduces it."""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Sequence


def cpu_name() -> str:
    from gems.plan.store import cpu_identity

    return cpu_identity()[0]


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
