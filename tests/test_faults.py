"""Reliability at scale: stalls end the job with the stalled rank named, non-finite losses stop the
run at their step, failures are told by their cause, signals end every rank, time limits requeue.

Real ranks throughout (gloo, mpiexec, the Slurm test cluster). Where the launcher's own process is what is
tested (a signal to it, its death, a frozen rank seen from outside, a Slurm run ended by a signal) it is a
``gems`` process of its own; elsewhere ``gems`` runs through ``gems.cli.main`` in the test's process
(tests/_cli.py's ``gems_here``: the launcher's own code, its ranks forked by multiprocessing's fork server). The
watchdog's diagnosis and the failure explanation are also tested as pure functions on heartbeats and reports that a
real cluster cannot be put into on demand (a frozen process, a rank that never started)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _cli import gems_here, merged, records

from gems.config import compose, section
from gems.fault.reports import Exit, explain, write_report
from gems.fault.watchdog import Beat, collective_timeout_s, diagnose
from gems.progress import WAITS

SMALL = ["model.size=32", "model.width=0.25", "train.batch_size=4", "train.warmup_steps=1"]
STALL = ["fault.stall_timeout_s=4", "fault.warmup_timeout_s=60"]


def _alive_workers(job: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"gems.worker --config .*{job}"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


# ---------------------------------------------------------------------------- stalls, real processes
@pytest.mark.parametrize("mesh,stall_rank,cause_phase,waits", [
    (["parallel.replicas=2"], 1, "forward", {"0": "gradient sum"}),
    (["parallel.replicas=2"], 0, "forward", {"1": "gradient sum"}),
    (["parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=2"], 0, "forward",
     {"1": "pipeline transfer"}),
    (["parallel.spatial=2"], 1, "forward", {"0": "halo"}),
])
def test_a_stalled_rank_ends_the_job_with_its_rank_step_and_phase(tmp_path, mesh, stall_rank, cause_phase, waits):
    out = gems_here("run", f"results.dir={tmp_path}", *SMALL, *mesh, *STALL, "train.steps=8",
                    f"fault.stall_rank={stall_rank}", "fault.at_step=3")
    assert out.returncode == 1, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    f = r["failure"]
    assert r["status"] == "failed" and f["kind"] == "stall", r["error"]
    assert f["ranks"] == [stall_rank] and f["step"] == 3 and f["phase"] == cause_phase, f
    assert f["waiting"] == waits and all(p in WAITS for p in f["waiting"].values())
    assert f"rank {stall_rank} made no progress" in r["error"] and f"rank {stall_rank} made no" in out.stderr
    assert f["seconds"] >= 4
    assert len(r["loss"]) == 0 or len(r["loss"]) <= 3
    # the watchdog ended it, at the stall timeout, before the collectives' own timeout (the backstop) would have:
    # both measured from the rank's last progress, whatever the machine's load
    backstop = collective_timeout_s(section(compose(STALL), "comm"), section(compose(STALL), "fault"))
    assert 4 <= f["seconds"] < backstop, (f["seconds"], backstop)
    assert not _alive_workers(r["run_id"])


def _rank_pid(job: str, rank: int) -> int:
    """The process of ``rank``, by its title (a rank forked by gems/launch/forkserver.py names its rank there)."""
    for pid in _alive_workers(job):
        if Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").endswith(f"(rank {rank})".encode()):
            return pid
    raise AssertionError(f"no rank {rank} of {job}")


def test_a_frozen_rank_0_is_named_by_the_others_and_the_launcher(tmp_path):
    """Rank 0 hosts the store and the monitor: frozen (SIGSTOP), it can tell nothing. The others find
    the store silent for their allowance, blame rank 0 and end; the launcher writes the record."""
    p = _start(tmp_path, *STALL)
    _wait_for(lambda: any("gems: step 3/" in log.read_text(errors="replace")
                          for log in tmp_path.glob(".jobs/*/rank0.log")))
    (job,) = [d.name for d in tmp_path.glob(".jobs/*")]
    os.kill(_rank_pid(job, 0), signal.SIGSTOP)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 1, err
    (r,) = records(str(tmp_path))
    assert r["failure"]["ranks"] == [0] and "rank 0 stopped answering" in r["error"], r["error"]
    _wait_for(lambda: not _alive_workers(job), timeout=120)


def test_a_stall_under_mpiexec_is_found_too(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", *SMALL, *STALL, "comm=mpi", "parallel.replicas=2", "train.steps=8",
                    "fault.stall_rank=1", "fault.at_step=2")
    assert out.returncode == 1, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    assert r["failure"]["kind"] == "stall" and r["failure"]["ranks"] == [1] and r["failure"]["step"] == 2
    assert r["failure"]["waiting"] == {"0": "gradient sum"}


def test_without_stall_detection_the_collective_timeout_still_ends_a_stall(tmp_path):
    """fault.stall_timeout_s=null: the collectives' own timeout (comm.timeout_s) raises; the rank that
    raised is named with its error (an echo of the stall), never a hang."""
    out = gems_here("run", f"results.dir={tmp_path}", *SMALL, "parallel.replicas=2", "train.steps=8",
                    "fault.stall_timeout_s=null", "comm.timeout_s=8", "fault.stall_rank=1", "fault.at_step=2")
    assert out.returncode == 1, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    assert r["status"] == "failed" and "rank 0" in r["error"], r["error"]


# ---------------------------------------------------------------------------- non-finite losses
def test_a_nan_loss_stops_the_run_at_its_step_and_keeps_the_last_good_checkpoint(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", *SMALL, "parallel.replicas=2", "train.steps=6",
                    "train.checkpoint_every=1", "fault.nan_rank=1", "fault.at_step=3")
    assert out.returncode == 1, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    f = r["failure"]
    assert r["status"] == "failed" and f["kind"] == "nonfinite" and f["step"] == 3, r["error"]
    assert f["where"] == "input" and f["rank"] == 1 and f["samples"] == [14, 15]  # replica 1's half of step 3
    assert "step 3" in r["error"] and "input of rank 1" in r["error"] and "step 3" in out.stderr
    assert len(r["loss"]) == 4 and all(torch.isfinite(torch.tensor(r["loss"][:3]))) and r["loss"][3] != r["loss"][3]
    assert r["throughput_samples_per_s"] is None
    (ck,) = tmp_path.glob(".jobs/*/ckpt")
    assert (ck / "latest").read_text() == "3"  # saved after step 2, before the NaN; nothing saved after


def test_a_nan_in_a_pipeline_is_placed_in_the_partition_that_made_it(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", *SMALL, "parallel.pipeline=2", "parallel.schedule=1f1b",
                    "parallel.micro_batches=2", "train.steps=4", "fault.nan_rank=0", "fault.at_step=2")
    assert out.returncode == 1, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    assert r["failure"]["where"] == "input" and r["failure"]["rank"] == 0 and r["failure"]["step"] == 2


def test_on_nonfinite_warn_keeps_going_and_results_show_no_throughput(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", *SMALL, "train.steps=4", "train.on_nonfinite=warn",
                    "fault.nan_rank=0", "fault.at_step=1", "results.sweep=w")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "train.on_nonfinite=warn" in out.stderr
    (r,) = records(str(tmp_path))
    assert r["status"] == "ok" and r["diverged"] is True and r["nonfinite_steps"][0] == 1
    res = gems_here("results", str(tmp_path))
    assert res.returncode == 0, res.stderr
    # the table of study w, beside its record, where `gems results` says it wrote it
    table = Path(next(ln for ln in res.stdout.splitlines() if ln.startswith("table: "))[len("table: "):])
    assert table.parent == tmp_path, res.stdout
    row = next(ln for ln in table.read_text().splitlines() if ln.startswith("| cosmoflow"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "diverged"
    header = [c.strip() for c in table.read_text().splitlines()[2].strip("|").split("|")]
    for col in ("samples/s", "samples/s/gpu", "speedup", "efficiency"):
        assert cells[header.index(col)] == "", (col, row)


# ---------------------------------------------------------------------------- causes, not echoes
def test_the_rank_that_failed_is_named_with_its_own_error_not_the_echo(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", "model=custom", "model._target_=_custom_models.failing",
                    "model.input_shape=[1,8,8]", "model.num_outputs=3", "parallel.replicas=2", "train.batch_size=4",
                    "train.steps=5", "train.warmup_steps=1")
    assert out.returncode == 1, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    assert r["error"].startswith("rank 1 failed: ValueError: the user's layer refuses this batch"), r["error"]
    assert r["failure"]["rank"] == 1 and r["failure"]["kind"] == "rank_error"
    assert "Connection closed" not in r["error"]


def test_a_rank_killed_by_a_signal_says_which_and_its_memory(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", *SMALL, "parallel.replicas=2", "train.steps=5",
                    "fault.kill_rank=1", "fault.at_step=2")
    assert out.returncode == 1, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    assert "rank 1 was killed by signal 9 (SIGKILL" in r["error"] and "out-of-memory killer" in r["error"], r["error"]
    assert "resident memory was" in r["error"] and r["failure"]["rss_bytes"] > 50 * 2**20


def test_a_partition_without_parameters_trains_like_serial(tmp_path):
    """1F1B at D = 3 with partition 1 = LeakyReLU + AvgPool3d: no parameters on rank 1 (the time balance
    can give a rank such a partition)."""
    common = [*SMALL, "train.steps=3", "train.optimizer=sgd", "train.lr=0.01"]
    ser = gems_here("run", f"results.dir={tmp_path}/s", *common)
    par = gems_here("run", f"results.dir={tmp_path}/p", *common, "parallel.pipeline=3", "parallel.schedule=1f1b",
                    "parallel.micro_batches=2", "parallel.balance=[1,2,19]")
    assert ser.returncode == 0 and par.returncode == 0, par.stderr[-2000:]
    (s,), (p,) = records(str(tmp_path / "s")), records(str(tmp_path / "p"))
    assert p["mesh"]["balance"] == [1, 2, 19]
    torch.testing.assert_close(torch.tensor(p["loss"]), torch.tensor(s["loss"]), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------- signals and orphans
def _start(tmp_path: Path, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "gems.cli", "run", f"results.dir={tmp_path}", *SMALL,
                             "parallel.replicas=2", "train.steps=200", "fault.step_delay_s=0.2", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for(cond, timeout: float = 300.0) -> None:
    """Wait until ``cond()``: ``timeout`` is a guard against a hang only, never a figure the test holds."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_whatever_signal_ends_the_launcher_ends_its_ranks_and_the_record_says_cancelled(tmp_path, sig):
    p = _start(tmp_path)
    _wait_for(lambda: any("gems: step 2/" in log.read_text(errors="replace")
                          for log in tmp_path.glob(".jobs/*/rank0.log")))
    (job,) = [d.name for d in tmp_path.glob(".jobs/*")]
    assert len(_alive_workers(job)) == 2
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + sig, err
    assert f"cancelled by {signal.Signals(sig).name}" in err and "2 rank(s) were ended" in err
    _wait_for(lambda: not _alive_workers(job), timeout=120)
    (r,) = records(str(tmp_path))
    assert r["status"] == "failed" and r["failure"]["kind"] == "cancelled" and "cancelled" in r["error"]


def test_a_killed_launcher_leaves_no_rank_and_the_run_resumes_from_its_checkpoint(tmp_path):
    """SIGKILL cannot be caught: the ranks' watchdogs see the launcher gone and end. The run id resumes
    from the last checkpoint (with the configuration it started with: another is refused, exit 2) and
    trains exactly as an uninterrupted run."""
    p = _start(tmp_path, "train.checkpoint_every=2", "fault.stall_timeout_s=6")
    _wait_for(lambda: any(tmp_path.glob(".jobs/*/ckpt/latest")) and
              int(next(tmp_path.glob(".jobs/*/ckpt/latest")).read_text()) >= 4)
    (job,) = [d.name for d in tmp_path.glob(".jobs/*")]
    p.kill()
    p.wait()
    _wait_for(lambda: not _alive_workers(job), timeout=120)
    assert not records(str(tmp_path))
    args = ["run", f"results.dir={tmp_path}", f"run_id={job}", *SMALL, "parallel.replicas=2", "train.steps=12"]
    bad = gems_here(*merged(*args, "train.batch_size=8"))
    assert bad.returncode == 2 and "train.batch_size=8" in bad.stderr and "expected 4" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
    again = gems_here(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    (r,) = records(str(tmp_path))
    ref = gems_here("run", f"results.dir={tmp_path}/ref", *SMALL, "parallel.replicas=2", "train.steps=12")
    assert ref.returncode == 0, ref.stderr[-2000:]
    (f,) = records(str(tmp_path / "ref"))
    assert r["restarts"] == 1 and r["loss"] == f["loss"]
    dup = gems_here(*args)
    assert dup.returncode == 2 and f"run_id={job}" in dup.stderr and "records are never replaced" in dup.stderr


# ---------------------------------------------------------------------------- nothing leaks
def test_job_folders_checkpoints_and_logs_are_the_owners_alone_records_stay_readable(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", *SMALL, "parallel.replicas=2", "train.steps=3",
                    "train.checkpoint_every=1")
    assert out.returncode == 0, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    jobs = tmp_path / ".jobs"
    (jd,) = list(jobs.iterdir())
    assert mode(jobs) == 0o700 and mode(jd) == 0o700 and mode(jd / "ckpt") == 0o700
    assert all(mode(d) == 0o700 for d in (jd / "ckpt").glob("step*"))
    assert mode(tmp_path / f"{r['run_id']}.json") & 0o044 == 0o044  # readable by group and others


# ---------------------------------------------------------------------------- pure functions
def _beat(rank: int, phase: str, age: float, seen: float = 100.0, limit: float = 60.0, step: int = 7) -> Beat:
    return Beat(rank, 1, step, phase, age, limit, seen)


def test_diagnose_names_the_computing_rank_not_the_ones_waiting_for_it():
    beats = {0: _beat(0, "gradient sum", 61), 1: _beat(1, "forward", 62), 2: _beat(2, "halo", 61.5)}
    s = diagnose(beats, 3, now=100.0, started=0.0, startup_limit=600, tick=5)
    assert s.ranks == [1] and s.phase == "forward" and s.step == 7 and s.waiting == {0: "gradient sum", 2: "halo"}
    assert "rank 1 made no progress for 62 s at step 7, in phase forward (fault.stall_timeout_s=60)" in s.message(60, 600)


def test_diagnose_the_cause_may_cross_its_limit_a_tick_after_a_waiting_rank():
    # rank 1 stalled first, but its last heartbeat is nearly a tick old: rank 0 crosses first
    beats = {0: _beat(0, "gradient sum", 60.2), 1: _beat(1, "forward", 59.5)}
    s = diagnose(beats, 2, now=100.0, started=0.0, startup_limit=600, tick=1)
    assert s.ranks == [1] and s.age >= 60


def test_diagnose_nothing_before_the_limit_and_the_warm_up_allowance():
    beats = {0: _beat(0, "setup", 300, limit=600), 1: _beat(1, "forward", 30)}
    assert diagnose(beats, 2, now=100.0, started=0.0, startup_limit=600, tick=5) is None


def test_diagnose_a_frozen_process_whose_heartbeat_stopped():
    # rank 2's last heartbeat arrived 70 s ago with age 1: frozen (SIGSTOP, a process that holds the GIL)
    beats = {0: _beat(0, "pipeline transfer", 3, seen=100), 1: _beat(1, "gradient sum", 3, seen=100),
             2: _beat(2, "backward", 1, seen=30)}
    s = diagnose(beats, 3, now=100.0, started=0.0, startup_limit=600, tick=5)
    assert s.ranks == [2] and s.frozen == [2] and "heartbeat of rank 2 stopped" in s.message(60, 600)


def test_diagnose_a_rank_that_never_reported_and_ranks_that_all_wait():
    s = diagnose({0: _beat(0, "step sync", 5)}, 2, now=700.0, started=0.0, startup_limit=600, tick=5)
    assert s.ranks == [1] and s.missing == [1] and "never reported progress" in s.message(60, 600)
    beats = {0: _beat(0, "gradient sum", 70), 1: _beat(1, "gradient sum", 65)}
    s = diagnose(beats, 2, now=100.0, started=0.0, startup_limit=600, tick=5)
    assert s.ranks == [0] and "every stalled rank was waiting for a peer" in s.message(60, 600)


def test_explain_prefers_the_rank_that_failed_on_its_own(tmp_path):
    write_report(tmp_path, 0, "RuntimeError: Connection closed by peer [127.0.0.1]:1234", echo=True)
    time.sleep(0.01)
    write_report(tmp_path, 2, "ValueError: optimizer got an empty parameter list", echo=False)
    head, f = explain(tmp_path, [Exit(0, 1), Exit(2, 1)])
    assert head.startswith("rank 2 failed: ValueError: optimizer got an empty parameter list") and f["rank"] == 2
    assert "rank 0 failed after it" in head
    head, f = explain(tmp_path / "none", [Exit(1, 1), Exit(3, -9, rss_bytes=3 * 2**30)])
    assert head.startswith("rank 3 was killed by signal 9") and "3.00 GiB" in head and f["signal"] == 9



def test_a_slurm_task_that_died_first_without_python_is_named_not_a_peer_that_raised_after_it(tmp_path):
    """srun ends the step when task 1 exits 3 (--kill-on-bad-exit); task 2, whose rendezvous lost its peers, may
    raise before it is killed (the race CI met). The job folder is laid out by submitit's own helpers, as a real
    job leaves it; the order srun saw decides, not which task left a Python error."""
    from types import SimpleNamespace

    from submitit.core import utils

    from gems.launch.diagnose import error_of
    from gems.launch.jobs import SlurmRun

    cfg = compose(["cluster=local_slurm", "parallel.replicas=4", f"results.dir={tmp_path}", "run_id=r"])
    run = SlurmRun(cfg, SimpleNamespace(job_id="7"), tmp_path / "job", 0.0, 60.0)

    def paths(t: int):
        p = utils.JobPaths(run.job_dir, job_id="7", task_id=t)
        p.stderr.parent.mkdir(parents=True, exist_ok=True)
        return p

    srun = ["srun: error: node2: task 1: Exited with exit code 3", "srun: error: node2: task 2: Exited with exit code 1",
            "srun: error: node1: task 0: Killed"]
    paths(0).stderr.write_text("\n".join(srun) + "\n")
    paths(1).stderr.write_text("rank 1: dying on purpose with status 3\n")
    trace = "Traceback (most recent call last):\nDistNetworkError: Failed to recv, got 0 bytes."
    utils.cloudpickle_dump(("error", trace), paths(2).result_pickle)
    err = error_of(run, "FAILED") or ""
    assert err.startswith("the job ended FAILED: task 1 exited with status 3") and "dying on purpose" in err, err
    # a task that raised first is named with its own exception
    paths(0).stderr.write_text("\n".join([srun[1], srun[0], srun[2]]) + "\n")
    assert (error_of(run, "FAILED") or "").startswith("task 2 raised DistNetworkError"), error_of(run, "FAILED")

def test_collective_timeouts_leave_room_for_the_watchdog():
    """The collective timeout is comm.timeout_s, else the warm-up allowance plus the stall timeout; with stall
    detection off (null) the schema's default stall allowance still bounds it. The sections arrive typed
    (gems.config.section), whatever the configuration leaves out taking the schema's default."""
    from omegaconf import OmegaConf

    from gems.config import FaultConf, section

    def timeout(cfg: dict) -> float:
        c = OmegaConf.create(cfg)
        return collective_timeout_s(section(c, "comm"), section(c, "fault"))

    assert isinstance(section(OmegaConf.create({}), "fault"), FaultConf)
    assert timeout({"comm": {"timeout_s": None}, "fault": {"stall_timeout_s": 60, "warmup_timeout_s": 600}}) == 660
    assert timeout({"comm": {"timeout_s": 30}}) == 30
    assert timeout({"fault": {"stall_timeout_s": None, "warmup_timeout_s": 100}}) == 160
    assert timeout({"fault": {"warmup_timeout_s": 100, "stall_timeout_s": 5}}) == 105


# ---------------------------------------------------------------------------- Slurm
slurm = pytest.mark.skipif(shutil.which("sinfo") is None, reason="Slurm is not installed (scripts/slurm_cluster.sh start)")


@pytest.mark.slurm
@slurm
def test_a_stall_on_slurm_cancels_the_job_and_names_the_rank(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", "cluster=local_slurm", "cluster.nodes=2", "parallel.replicas=2",
                    *SMALL, *STALL, "train.steps=8", "fault.stall_rank=1", "fault.at_step=3")
    assert out.returncode == 1, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    assert r["failure"]["kind"] == "stall" and r["failure"]["ranks"] == [1] and r["failure"]["step"] == 3, r["error"]
    job = r["env"].get("slurm_job_id") or next(tmp_path.glob(".jobs/*/*_submission.sh")).name.split("_")[0]
    q = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True)
    assert q.stdout.strip() in ("", "CANCELLED", "COMPLETED", "FAILED"), q.stdout


@pytest.mark.slurm
@slurm
def test_the_time_limit_checkpoints_requeues_and_resumes_to_identical_losses(tmp_path):
    """A 2-minute limit with the signal 30 s before it (Slurm sends it up to 30 s earlier still, so between
    30 s and 90 s into the job): the first run gets SIGUSR2, every rank saves, the job is requeued and
    resumes. 100 steps of at least a second each cannot finish before the latest the signal comes, on
    any machine (70 did once, on a slower one whose signal came late); the resumed job runs the rest at its
    own pace (fault.step_delay_once: the test took two minutes when every step of both jobs slept)."""
    common = merged(*SMALL, "parallel.replicas=2", "train.steps=100", "train.batch_size=2")
    out = gems_here("run", f"results.dir={tmp_path}/slurm", "cluster=local_slurm", "cluster.nodes=2", *common,
                    "cluster.time_min=2", "cluster.signal_margin_s=30", "fault.step_delay_s=1", "fault.step_delay_once=true")
    assert out.returncode == 0, out.stderr[-3000:]
    (r,) = records(str(tmp_path / "slurm"))
    assert r["status"] == "ok" and r["restarts"] >= 1 and len(r["loss"]) == 100, r.get("error")
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "slurm").glob(".jobs/*/*_0_log.err"))
    assert "the time limit is near: checkpointing and requeueing" in logs
    ref = gems_here("run", f"results.dir={tmp_path}/ref", *common)
    assert ref.returncode == 0, ref.stderr[-2000:]
    (f,) = records(str(tmp_path / "ref"))
    assert r["loss"] == f["loss"]


@pytest.mark.slurm
@slurm
def test_ending_an_attached_run_on_slurm_cancels_its_job_and_says_which(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "gems.cli", "run", f"results.dir={tmp_path}", "cluster=local_slurm",
                          *SMALL, "parallel.replicas=2", "train.steps=100", "fault.step_delay_s=0.5"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    _wait_for(lambda: any(tmp_path.glob(".jobs/*/*_0_log.out")), timeout=120)
    job = next(tmp_path.glob(".jobs/*/*_submission.sh")).name.split("_")[0]
    time.sleep(2)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 128 + signal.SIGTERM and f"cancelled Slurm job(s) {job}" in err, err
    (r,) = records(str(tmp_path))
    assert r["failure"]["kind"] == "cancelled" and r["env"]["slurm_job_id"] == job
    _wait_for(lambda: subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                                     text=True).stdout.strip() in ("", "CANCELLED", "COMPLETED"), timeout=120)


def test_a_local_run_that_would_outlast_the_launchers_wait_is_told_so_early(tmp_path):
    """The local launcher ends a run at cluster.timeout_min (default: cluster.time_min and 5 minutes). Five
    steps in, the run's pace says it will not finish: a warning names the key and a value that gives it room,
    and the record of the ended run names the key that ended it."""
    # five steps of 0.3 s are done a second and a half after the first: the rest of the launcher's 18 s is the
    # start's, which a loaded machine slows (a step of a second left it 13 s)
    r = gems_here("run", f"results.dir={tmp_path}", *SMALL, "train.steps=1000", "fault.step_delay_s=0.3",
                  "cluster.timeout_min=0.3")
    assert r.returncode != 0
    warn = [ln for ln in r.stderr.splitlines() if ln.startswith("gems: warning: at this pace")]
    assert len(warn) == 1 and "longer than the 18 s the launcher waits (cluster.timeout_min=0.3)" in warn[0], r.stderr
    room = re.search(r"; cluster.timeout_min=(\d+) gives it room$", warn[0])
    need = re.search(r"the run takes about ([\d.]+) (s|min|h),", warn[0])
    assert room and need, warn
    # 1000 steps of 0.3 s and more need five minutes at least; the room covers the time the pace it measured
    # says the run needs (whatever this machine's load made that pace), and a fifth more
    need_s = float(need.group(1)) * {"s": 1, "min": 60, "h": 3600}[need.group(2)]
    assert int(room.group(1)) >= 2 and int(room.group(1)) * 60 >= need_s, warn
    (rec,) = records(str(tmp_path))
    assert rec["failure"] == {"kind": "timeout"} and rec["error"].startswith(
        "timed out after 0.3 min (cluster.timeout_min=0.3): the ranks were ended unfinished"), rec["error"]


def test_the_wait_and_the_room_name_the_key_that_sets_them():
    from gems.config import ClusterConf

    assert ClusterConf(time_min=30).wait_s() == 35 * 60
    assert ClusterConf(time_min=30).wait_key() == "cluster.time_min=30, and 5 minutes"
    assert ClusterConf(time_min=30).room_for(38 * 60) == "cluster.time_min=41"  # 45.6 min of waiting, less 5
    assert ClusterConf(time_min=30).room_for(30) == "cluster.time_min=1"
    assert ClusterConf(timeout_min=2.5).room_for(300) == "cluster.timeout_min=6"


def test_a_typed_section_resolves_interpolations_and_names_a_bad_key():
    """gems.config.section resolves an interpolation that names another section, and a key its schema does not
    have is a ConfigError naming it (the launcher reads the fault section before anything resolves it)."""
    from omegaconf import OmegaConf

    from gems.config import section
    from gems.errors import ConfigError

    cfg = OmegaConf.create({"train": {"warmup_steps": 3}, "fault": {"at_step": "${train.warmup_steps}"}})
    assert section(cfg, "fault").at_step == 3
    with pytest.raises(ConfigError, match="fault.max_restart"):
        section(OmegaConf.create({"fault": {"max_restart": 2}}), "fault")


def test_the_watchdog_gives_every_warm_up_and_profiled_step_the_warm_up_allowance(tmp_path):
    """The steps before a run measures (its warm-up and, on CPU ranks, the steps profiled for tensor memory) may take
    far longer than later ones: the rank's set-up tells its watchdog so (warm_until), whether or not it resumes."""
    from types import SimpleNamespace

    from omegaconf import open_dict

    from gems.bootstrap import World
    from gems.config import compose
    from gems.rank.setup import set_up

    cfg = compose(["model.size=32", "model.width=0.25", "train.steps=5", "train.warmup_steps=1",
                   "train.check_fit=false"])
    with open_dict(cfg):
        cfg.run_id = "warm-until"
        cfg.results.dir = str(tmp_path)
    wd = SimpleNamespace(warm_until=1)
    world = World(0, 1, 0, "127.0.0.1", 0, "single", torch.device("cpu"), "gloo", "torch", None, "localhost")
    state = set_up(cfg, world, wd)  # type: ignore[arg-type]
    assert state.plan.measure_from == 2 and wd.warm_until == 2


def test_the_stall_allowance_grows_with_the_runs_slowest_step():
    """fault.stall_timeout_s is a floor: after warm-up a rank is allowed STALL_STEPS times the slowest step it timed
    since its first (which compiles and plans), so a run whose steps take minutes is not ended for one of them; the
    warm-up allowance and the slow phases keep theirs, and a stall's message names the raised allowance."""
    from gems.fault.watchdog import STALL_STEPS, Stall, Watchdog

    wd = Watchdog(0, 1, stall_s=60, warmup_s=600)
    wd.warm_until = 3
    assert wd.limit(5, "forward") == 60 and wd.limit(2, "forward") == 600 and wd.limit(5, "checkpoint") == 600
    wd.saw_step(2.0)
    assert wd.limit(5, "forward") == 60  # 10 x 2 s is under the floor
    wd.saw_step(9.5)
    wd.saw_step(4.0)  # the slowest counts
    assert wd.limit(5, "forward") == STALL_STEPS * 9.5 == 95 and wd.limit(1, "forward") == 600
    s = Stall([1], 7, "forward", 96.0, 95.0, waiting={0: "gradient sum"})
    assert "(fault.stall_timeout_s=60, raised to 95 s: 10x the run's slowest step)" in s.message(60, 600)
    assert "(fault.stall_timeout_s=60)" in Stall([1], 7, "forward", 61.0, 60.0).message(60, 600)
    assert "fault.warmup_timeout_s=600" in Stall([1], 1, "forward", 601.0, 600.0).message(60, 600)


def test_a_run_of_steps_longer_than_the_stall_timeout_finishes(tmp_path):
    """Every step 2.5 s (fault.step_delay_s, in its data phase) against fault.stall_timeout_s=2: a fixed allowance
    ended this run at its first step after warm-up; 10x its slowest step lets it finish, with its losses."""
    out = gems_here("run", f"results.dir={tmp_path}", *SMALL, "train.steps=5", "fault.stall_timeout_s=2",
                    "fault.warmup_timeout_s=60", "fault.step_delay_s=2.5")
    assert out.returncode == 0, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    assert r["status"] == "ok" and len(r["loss"]) == 5
