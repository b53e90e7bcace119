"""Rank processes forked from a server that has imported torch once.

A Python rank that starts from nothing imports torch, then torch._dynamo (torch's
optimizers import it the first time they are built) and gems: about 3 s of CPU
on the 2-core test machine, more than the steps of a short run, for every rank
of every run. multiprocessing's fork server is an interpreter that imports
:data:`PRELOAD` once and then only forks. It has run no torch operation, so no
thread pool, no CUDA context and no lock that another thread held is copied
into a rank; torch's documentation names it, with spawn, as a start method that
CUDA allows. One server serves every rank this process starts
(:func:`context`): the ranks of ``gems run``'s local launcher (:func:`start_worker`)
and those of :func:`gems.launch.world.run_world`.

A rank forked here is set up as ``python -m gems.worker --config FILE`` would
be: its own session (the launcher ends it with its process group), the
environment the launcher gave it (``os.environ``, the thread count of
``OMP_NUM_THREADS`` applied, since the server's OpenMP read its own), the
launcher's working folder first on ``sys.path``, its log as stdout and stderr,
written through, and ``gems.worker --config FILE (rank R)`` as its process
title (``ps``, ``pgrep -f``), where setproctitle is installed.
/proc/PID/environ shows the environment the server started with, not the
rank's (``os.environ`` inside the rank is its own); the title names the rank.
As with multiprocessing's spawn, each process imports the starting program's
main module again (as ``__mp_main__``): a script of its own that calls gems's
launcher keeps its work under ``if __name__ == "__main__":`` (the ``gems``
command does).
"""
from __future__ import annotations

import importlib
import io
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

#: what the fork server imports before it forks any process: torch, what a rank imports on its first step, and
#: the entries of both kinds of process
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "gems.worker", "gems.launch.world"]


def context() -> Any:
    """multiprocessing's forkserver context, the server to import :data:`PRELOAD` when this process starts it."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first process asked for
    return ctx


class Forked:
    """A process started by :func:`start`, with what the launcher asks of a ``subprocess.Popen``:
    ``pid``, ``poll()``, ``wait(timeout)`` and ``kill()`` (exit status as Popen gives it: -N for signal N)."""

    def __init__(self, proc: Any, args: list[str]) -> None:
        self._proc, self.args = proc, args
        self.pid: int = proc.pid

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        code = self._proc.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return int(code)

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()


def start_worker(config: Path, env: dict[str, str], log: Path, rank: int) -> Forked:
    """Start ``gems.worker --config CONFIG`` as a forked rank (see the module's docstring) with ``env``, writing
    ``log``; the working folder is this process's."""
    return start("gems.worker:main", ["--config", str(config)], env, log, f"gems.worker --config {config} (rank {rank})")


def start(entry: str, argv: list[str], env: dict[str, str], log: Path, title: str) -> Forked:
    """Fork ``entry(argv)`` (``module:function``) from the server, set up as ``python -m MODULE ARGV`` would be, with
    ``env``, this process's working folder, ``log`` as its stdout and stderr and ``title`` as its process title."""
    proc = context().Process(target=_forked_main, args=(entry, argv, env, str(log), os.getcwd(), title),
                             name=title, daemon=False)
    proc.start()
    return Forked(proc, [title])


def _forked_main(entry: str, argv: list[str], env: dict[str, str], log: str, cwd: str, title: str) -> None:
    """The forked process: set up as an interpreter started for it would be, run ``entry``, exit with its status."""
    try:  # first: setproctitle finds the title's room by the environment the process started with
        from setproctitle import setproctitle

        setproctitle(title)
    except ImportError:  # pragma: no cover - a dependency; the title is for people reading ps
        pass
    os.setsid()  # its own session and process group, as start_new_session gave it
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace")
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path.insert(0, cwd)  # python -m puts the working folder first (a custom model's module is found there)
    import torch

    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # the server's OpenMP read the server's environment, not this one
    module_name, function = entry.split(":")
    module = importlib.import_module(module_name)  # the server imported gems.worker already
    sys.argv = [str(getattr(module, "__file__", module_name)), *argv]
    os._exit(_exit_status(lambda: getattr(module, function)(argv)))


def _exit_status(run: Any) -> int:
    """``run()``'s exit status as the interpreter would give it: its return value, a SystemExit's code, 1 with the
    traceback for any other error; an uncaught KeyboardInterrupt ends the process by SIGINT, as Python does."""
    import signal
    import traceback

    try:
        code = run()
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code
        else:  # sys.exit("message"): the message on stderr, status 1
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        code = 130  # pragma: no cover - the signal ends the process first
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return int(code or 0)
