"""Run the real `gems` command and read what it wrote: as a process of its own (:func:`gems`), or in this process
through the same function the console script calls (:func:`gems_here`): no interpreter, torch's import or fork
server to start for each command. A command run here that launches ranks gets them as real processes from
multiprocessing's fork server (as any program calling ``gems.cli.main`` does), and the launcher's own code runs
here: its watch, records, restarts and signals. What only the console script's own process shows (its signals,
a SIGKILL, forking its ranks from itself: gems/launch/forkserver.py) is tested with :func:`gems`."""
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


def gems_here(*args: str, cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """``gems ARGS`` run by ``gems.cli.main`` in this process, its exit status and what it printed as a
    finished process's (ranks it launches are processes of their own, from multiprocessing's fork server)."""
    import contextlib
    import io

    from gems.cli import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # a command that exits (argparse's --help, say)
                code = e.code if isinstance(e.code, int) else 1
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["gems", *args], code, out.getvalue(), err.getvalue())


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
