"""Rank processes forked from a server that has imported torch once (about 3 s of CPU a rank on the 2-core test
machine, more than the steps of a short run) and run no torch operation, so no thread pool, CUDA context or held lock
reaches a rank: the launcher's own fork (:func:`prestart`), else multiprocessing's fork server (:func:`context`).
:func:`start` takes the first there is and sets the rank up as ``python -m gems.worker --config FILE`` would be
(docs/commands.md).
"""
from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.multiprocessing as mp

#: what the fork server imports before it forks any process: torch, what a rank imports on its first step, and
#: the entries of both kinds of process
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "gems.worker", "gems.launch.world"]


def context() -> Any:
    """multiprocessing's forkserver context, the server to import :data:`PRELOAD` when this process starts it: where
    no server was prestarted (the gloo worlds of gems.launch.world, a launcher called from a user's script) or the
    command's own has ended (killed, or ended on finding CUDA initialised in itself: :func:`cuda_initialised`).
    torch's documentation names forkserver, with spawn, as a start method CUDA allows. As under spawn, each process
    imports the starting program's main module again (as ``__mp_main__``): such a script keeps its work under
    ``if __name__ == "__main__":``."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: the first process asked for
    return ctx


class Forked:
    """A process started by :func:`start`, with what the launcher asks of a ``subprocess.Popen``:
    ``pid``, ``poll()``, ``wait(timeout)`` and ``kill()`` (exit status as Popen gives it: -N for signal N)."""

    def __init__(self, pid: int, args: list[str], exitcode: Callable[[float], int | None]) -> None:
        self.pid, self.args = pid, args
        self._exitcode = exitcode  # waits up to the seconds given for the exit status, None while it runs

    def poll(self) -> int | None:
        return self._exitcode(0.0)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            code = self._exitcode(min(left, 1.0))
            if code is not None:
                return int(code)
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------------------- the launcher's own server
def _send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message)
    sock.sendall(struct.pack("!I", len(data)) + data)


def _receive(sock: socket.socket) -> Any:
    """One message; None at the end of the stream."""
    head = _read_exactly(sock, 4)
    if head is None:
        return None
    body = _read_exactly(sock, struct.unpack("!I", head)[0])
    return None if body is None else pickle.loads(body)


def _read_exactly(sock: socket.socket, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            return None
        out += chunk
    return out


class _Server:
    """The launcher's fork, which forks its ranks (:func:`prestart`): the launcher asks with ``("start", ...)``,
    the server answers ``("started", pid)`` at once and ``("exit", pid, status)`` when that rank ends."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the server
            ours.close()
            status = 0
            try:
                _serve(theirs)
            except BaseException:  # pragma: no cover - nothing reads its output: the launcher sees the socket end
                status = 1
            os._exit(status)
        theirs.close()
        self.pid, self.sock, self.owner = pid, ours, os.getpid()
        self.exits: dict[int, int] = {}
        self.alive = True
        self.lock = threading.Lock()
        atexit.register(self.close)

    def start(self, request: tuple[Any, ...]) -> int | None:
        """The pid of the rank the server forked, or None where the server has ended (nothing was started)."""
        with self.lock, _signals_held():
            try:
                _send(self.sock, ("start", *request))
            except OSError:
                self.alive = False
                return None
            while True:
                message = self._next()
                if message is None:
                    return None
                if message[0] == "started":
                    pid = int(message[1])
                    self.exits.pop(pid, None)  # a reused pid: an earlier rank's status is not this one's
                    return pid
                self._take(message)

    def exitcode(self, pid: int, timeout: float) -> int | None:
        """``pid``'s exit status once the server reported it, waiting up to ``timeout`` seconds for reports."""
        deadline = time.monotonic() + timeout
        with self.lock, _signals_held():
            while pid not in self.exits and self.alive:
                ready, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    break
                message = self._next()
                if message is None:
                    break
                self._take(message)
            if pid not in self.exits and not self.alive and not _exists(pid):
                self.exits[pid] = -signal.SIGKILL  # its server was killed: no status came, and the rank is gone
            return self.exits.get(pid)

    def _next(self) -> Any:
        """The server's next message; None once it has ended."""
        try:
            message = _receive(self.sock)
        except OSError:
            message = None
        if message is None:
            self.alive = False
        return message

    def _take(self, message: Any) -> None:
        if message[0] == "exit":
            self.exits[int(message[1])] = int(message[2])

    def close(self) -> None:
        """At the launcher's exit: the server goes (its ranks are of their own sessions and watch the launcher)."""
        if self.owner != os.getpid():  # a fork of the launcher exiting: not its server to end
            return
        if self.alive:
            self.alive = False
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        self.sock.close()


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """The launcher's cancelling signals held off while it talks to its server (a handler raising mid-message would
    break the stream's framing or lose a status); they are delivered, and cancel, as the exchange ends."""
    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - another user's process took the pid
        return False
    return True


def _serve(sock: socket.socket) -> None:
    """The server's loop: imports what a rank needs, then forks each rank asked for and reports how it ended."""
    try:
        from setproctitle import setproctitle

        setproctitle(f"gems fork server (of {os.getppid()})")  # not a second `gems run ...` in ps
    except ImportError:  # pragma: no cover - a dependency; the title is for people reading ps
        pass
    os.setsid()  # the terminal's Ctrl-C is the launcher's to handle; the server goes when the launcher does
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # never holds the launcher's output open (a caller reading it to its end waits for that)
        os.dup2(null, fd)
    os.close(null)
    for name in PRELOAD:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    while True:
        try:
            ready, _, _ = select.select([sock.fileno(), wake_r], [], [])
        except InterruptedError:  # pragma: no cover - select is retried by Python on EINTR
            continue
        if wake_r in ready:
            os.read(wake_r, 4096)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                _send(sock, ("exit", pid, os.waitstatus_to_exitcode(status)))
        if sock.fileno() in ready:
            message = _receive(sock)
            if message is None:  # the launcher is gone
                return
            if cuda_initialised():  # a rank forked now would inherit a CUDA context it cannot use: the launcher
                return  # sees the server end and starts this rank and the next from multiprocessing's (start)
            pid = os.fork()
            if pid == 0:  # the rank
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w):
                    os.close(fd)
                sock.close()
                _forked_main(*message[1:])  # ends the process
            children.add(pid)
            _send(sock, ("started", pid))


def cuda_initialised() -> bool:
    """Whether CUDA was initialised in this process or in the one it was forked from (torch's bad fork): a process
    forked from it cannot use CUDA (CUDA's contexts do not survive a fork), so this server must not fork ranks."""
    import torch

    return bool(torch.cuda.is_initialized() or torch.cuda._is_in_bad_fork())


_SERVER: _Server | None = None


def prestart() -> None:
    """Fork this process as the server of the ranks it will start (``gems run``, ``eval``, ``sweep`` with the local
    launcher). Call it once torch is imported and before any torch operation or thread; a second call does nothing.
    The fork imports the rest of :data:`PRELOAD` while the launcher checks the run, forks each rank asked for and
    reports its pid and exit status back over a socket."""
    global _SERVER
    if _SERVER is None:
        import torch  # noqa: F401  the one import of torch the launcher and its ranks share

        _SERVER = _Server()


def start_worker(config: Path, env: dict[str, str], log: Path, rank: int) -> Forked:
    """Start ``gems.worker --config CONFIG`` as a forked rank (:func:`start`) with ``env``, writing ``log``; the
    working folder is this process's."""
    return start("gems.worker:main", ["--config", str(config)], env, log, f"gems.worker --config {config} (rank {rank})")


def start(entry: str, argv: list[str], env: dict[str, str], log: Path, title: str) -> Forked:
    """Fork ``entry(argv)`` (``module:function``) from the server (this process's own where :func:`prestart` made
    one, else multiprocessing's), set up as ``python -m MODULE ARGV`` would be, with ``env``, this process's working
    folder, ``log`` as its stdout and stderr and ``title`` as its process title. The process gets its own session
    (the launcher ends it with its process group), ``os.environ`` as given (the thread count of ``OMP_NUM_THREADS``
    applied, since the server's OpenMP read its own) and the launcher's working folder first on ``sys.path``.
    /proc/PID/environ shows the environment the server started with, not the rank's: the title names the rank."""
    request = (entry, argv, env, str(log), os.getcwd(), title)
    server = _SERVER
    if server is not None and server.alive and server.owner == os.getpid():  # (not a fork of the launcher's)
        pid = server.start(request)
        if pid is not None:
            return Forked(pid, [title], lambda timeout: server.exitcode(pid, timeout))
        # the server has ended (killed from outside): multiprocessing's serves this rank and the next ones
    proc = context().Process(target=_forked_main, args=request, name=title, daemon=False)
    proc.start()

    def exitcode(timeout: float) -> int | None:
        if timeout > 0:
            proc.join(timeout)
        return proc.exitcode

    return Forked(int(proc.pid), [title], exitcode)


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
