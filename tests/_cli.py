"""Run the real `gems` command in a subprocess and read what it wrote."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys


def gems(*args: str, cwd: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "gems.cli", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout, env=env)


def records(folder: str) -> list[dict]:
    out = []
    for p in sorted(glob.glob(os.path.join(folder, "**", "*.json"), recursive=True)):
        if "/.jobs/" in p:
            continue
        with open(p) as f:
            r = json.load(f)
        if str(r.get("schema", "")).startswith("gems.record/"):  # not the sweep manifests beside them
            r["_path"] = p
            out.append(r)
    return out


def merged(*overrides: str) -> list[str]:
    """``overrides`` with one value per key, the last one given (a key twice on gems's command line is bad input):
    for a test's base settings followed by what the test changes."""
    last = {o.split("=", 1)[0]: i for i, o in enumerate(overrides)}
    return [o for i, o in enumerate(overrides) if last[o.split("=", 1)[0]] == i]
