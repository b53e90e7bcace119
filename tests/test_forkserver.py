"""Processes forked from gems's fork servers (gems/launch/forkserver.py) are set up like an interpreter started
for them: their environment, working folder, thread count, session, log, title and exit status. Every test runs
on both servers: the launcher's own fork (``prestart``) and multiprocessing's."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gems.launch import forkserver
from gems.launch.forkserver import start

PROBE = '''
import json, os, sys, time
import torch


def main(argv):
    what = argv[0]
    if what == "report":
        print(json.dumps({"cwd": os.getcwd(), "path0": sys.path[0], "env": dict(os.environ),
                          "threads": torch.get_num_threads(), "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0),
                          "sid": os.getsid(0), "argv": sys.argv[1:],
                          "cmdline": open("/proc/self/cmdline", "rb").read().decode().split(chr(0))[0]}))
        return 0
    if what == "status":
        return int(argv[1])
    if what == "exit-message":
        sys.exit("the message")
    if what == "error":
        raise ValueError("a bug")
    if what == "interrupt":
        raise KeyboardInterrupt
    if what == "sleep":
        print("sleeping", flush=True)
        time.sleep(60)
    return 0
'''


@pytest.fixture(params=["own", "multiprocessing"])
def server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which server forks: this process's own fork, as ``gems run`` makes it before its checks, or
    multiprocessing's."""
    own = forkserver._Server() if request.param == "own" else None
    monkeypatch.setattr(forkserver, "_SERVER", own)
    if own is not None:
        request.addfinalizer(own.close)
    return str(request.param)


@pytest.fixture
def probe_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: str) -> Path:
    """A module only the working folder holds, as a user's custom model's module would be (forked by ``server``)."""
    (tmp_path / "gems_probe_module.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _run(folder: Path, *argv: str, env: dict[str, str] | None = None, name: str = "p") -> tuple[int, str]:
    log = folder / f"{name}.log"
    proc = start("gems_probe_module:main", list(argv), dict(os.environ) if env is None else env, log,
                 f"gems-probe {name}")
    code = proc.wait(timeout=120)
    return code, log.read_text()


def test_a_forked_process_has_the_environment_folder_threads_session_and_title_it_was_given(probe_dir: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="2", GEMS_PROBE_VALUE="forty-two")
    env.pop("HOME", None)
    code, out = _run(probe_dir, "report", env=env)
    assert code == 0, out
    seen = json.loads(out.splitlines()[-1])
    assert seen["cwd"] == str(probe_dir) and seen["path0"] == str(probe_dir)
    assert seen["env"]["GEMS_PROBE_VALUE"] == "forty-two" and "HOME" not in seen["env"]
    assert seen["threads"] == 2  # OMP_NUM_THREADS of its own, not the server's
    assert seen["pid"] == seen["pgid"] == seen["sid"]  # its own session: the launcher ends its group
    assert seen["argv"] == ["report"] and seen["cmdline"] == "gems-probe p"
    code, out = _run(probe_dir, "report", env=dict(env, OMP_NUM_THREADS="1"), name="q")
    assert json.loads(out.splitlines()[-1])["threads"] == 1


@pytest.mark.parametrize("argv,status,says", [
    (["status", "0"], 0, None),
    (["status", "3"], 3, None),
    (["exit-message"], 1, "the message"),
    (["error"], 1, "ValueError: a bug"),
    (["interrupt"], -signal.SIGINT, "KeyboardInterrupt"),
])
def test_a_forked_process_exits_with_the_status_an_interpreter_would_give(probe_dir, argv, status, says) -> None:
    code, out = _run(probe_dir, *argv)
    assert code == status, out
    if says:
        assert says in out
    if argv[0] == "error":
        assert "Traceback (most recent call last)" in out


def test_a_forked_process_is_waited_for_killed_by_its_group_and_reports_the_signal(probe_dir: Path) -> None:
    log = probe_dir / "s.log"
    proc = start("gems_probe_module:main", ["sleep"], dict(os.environ), log, "gems-probe sleeper")
    deadline = time.monotonic() + 60
    while "sleeping" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    pgrep = subprocess.run(["pgrep", "-f", "gems-probe sleeper"], capture_output=True, text=True)
    assert [int(p) for p in pgrep.stdout.split()] == [proc.pid]  # the title names it, as the tests of faults read
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def _title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[0]


def _parent(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid:")))


def test_gems_runs_ranks_come_from_the_commands_own_fork(tmp_path: Path) -> None:
    """`gems run` forks its server before its checks run torch (gems.launch.base.prestart): each rank's parent is
    that server, titled as such, and the server's parent is the command. Once the run ends, the server is gone."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "gems.cli", "run", f"results.dir={tmp_path}", "model.size=32", "model.width=0.25",
           "parallel.spatial=2", "train.steps=6", "fault.step_delay_s=1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        ranks: list[int] = []
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
            found = subprocess.run(["pgrep", "-f", f"gems.worker --config {tmp_path}"], capture_output=True, text=True)
            ranks = [int(p) for p in found.stdout.split()]
            time.sleep(0.2)
        assert len(ranks) == 2, proc.communicate(timeout=120)
        servers = {_parent(r) for r in ranks}
        assert len(servers) == 1
        (srv,) = servers
        assert _parent(srv) == proc.pid and _title(srv) == f"gems fork server (of {proc.pid})"
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert not Path(f"/proc/{srv}").exists() or "zombie" in Path(f"/proc/{srv}/status").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_rank_asked_for_after_the_commands_fork_was_killed_comes_from_multiprocessings(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    """The command's own server killed from outside: a rank still running reads as killed once it is gone, and the
    next rank asked for is started by multiprocessing's server instead of failing the run."""
    (tmp_path / "gems_probe_module.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    own = forkserver._Server()
    monkeypatch.setattr(forkserver, "_SERVER", own)
    try:
        log = tmp_path / "s.log"
        sleeper = start("gems_probe_module:main", ["sleep"], dict(os.environ), log, "gems-probe orphan")
        deadline = time.monotonic() + 60
        while "sleeping" not in (log.read_text() if log.exists() else "") and time.monotonic() < deadline:
            time.sleep(0.1)
        os.kill(own.pid, signal.SIGKILL)
        os.waitpid(own.pid, 0)
        assert sleeper.poll() is None  # still running, an orphan now
        os.killpg(sleeper.pid, signal.SIGKILL)
        assert sleeper.wait(timeout=30) == -signal.SIGKILL and not own.alive
        code, out = _run(tmp_path, "status", "3", name="after")
        assert code == 3, out
    finally:
        own.close()


def test_a_program_calling_gems_main_is_not_forked_as_a_server(tmp_path: Path, monkeypatch) -> None:
    """Only the `gems` command's own process forks itself (a caller of gems.cli.main has run torch already): bad
    input found after the point where the command would fork leaves no server behind."""
    from gems.cli import main

    monkeypatch.setattr(forkserver, "_SERVER", None)
    assert main(["run", f"results.dir={tmp_path}", "parallel.spatial=64", "model.size=32"]) == 2
    assert forkserver._SERVER is None and not any(tmp_path.iterdir())


def test_the_commands_fork_hands_over_to_multiprocessings_once_cuda_is_initialised_in_it(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    """CUDA initialised in the command's own server before a fork (a state this CPU machine cannot reach: its
    check is replaced by one that says so): the server forks nothing more and ends, and the rank asked for, and the
    next, come from multiprocessing's server, which is a fresh interpreter."""
    (tmp_path / "gems_probe_module.py").write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(forkserver, "cuda_initialised", lambda: True)  # inherited by the fork made next
    own = forkserver._Server()
    monkeypatch.setattr(forkserver, "_SERVER", own)
    try:
        code, out = _run(tmp_path, "report", name="first")
        assert code == 0, out
        seen = json.loads(out.splitlines()[-1])
        assert seen["ppid"] != own.pid and not own.alive  # not forked by the command's server, which has ended
        os.waitpid(own.pid, 0)  # it ended on its own
        code, out = _run(tmp_path, "status", "4", name="second")
        assert code == 4, out
    finally:
        own.close()


def test_cuda_initialised_reads_torchs_own_state() -> None:
    """On this CPU machine nothing initialised CUDA: the guard lets the server fork."""
    assert forkserver.cuda_initialised() is False
