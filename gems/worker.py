"""The gems worker: the entry every rank runs on every launcher (:func:`run_rank`, ``python -m gems.worker --config``),
from configuration to results record: the world bootstrapped, the rank's watchdog and message log started, the
training (or ``gems eval``) run, the record written by rank 0; a rank that fails writes its failure report first.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import sys
import threading
import time
import traceback
from typing import Any

from omegaconf import OmegaConf

from gems import capture as rules
from gems import checkpoint as ckpt
from gems import commlog, progress
from gems.bootstrap import (
    init_world,
    job_device,
    ranks_on_this_node,
)
from gems.config import FaultConf, section, typed
from gems.errors import ConfigError
from gems.fault import reports
from gems.fault.watchdog import Watchdog
from gems.rank.evaluate import evaluate_model
from gems.rank.graphs import stand_in
from gems.rank.loop import Stopped, train, write_once
from gems.results import record as rec
from gems.storage import StorageFailed, named, os_error
from gems.telemetry.health import check_node


def run_rank(cfg_yaml: str) -> dict[str, Any] | None:
    """Entry point on every rank; rank 0 writes the record and returns it.

    A rank that fails writes its failure report (:mod:`gems.fault.reports`) before
    the error leaves it, so the launcher can tell the cause from the echoes.
    """
    ckpt.install_time_limit_handler()  # first: Slurm's signal may come while the rank starts
    cfg = typed(OmegaConf.create(cfg_yaml))  # the typed settings every module below reads (gems.config.typed)
    rank = _env_rank()
    wd: Watchdog | None = None
    world: Any = None
    failed: list[str] = []  # this rank's own error, where it failed (what a teardown that hangs adds to)
    # the message log spans the rank's end: its graphs' release and its process groups' destruction are logged
    with contextlib.ExitStack() as logged:
        try:
            # the node's GPUs, before the rendezvous (once a node: gems/telemetry/health.py)
            check_node(cfg, job_device(cfg), ranks_on_this_node(), rec.job_dir(cfg))
            world = init_world(cfg)
            rank = world.rank

            def on_stall(message: str, failure: dict[str, Any]) -> None:
                write_once(rec.record_path(cfg), rec.failed_record(cfg, message, failure=failure,
                                                                    restarts=ckpt.restart_count()))

            wd = start_watchdog(cfg, world, on_stall)
            logged.enter_context(commlog.install_from_env(world.rank, world.device))  # GEMS_COMM_LOG=DIR
            # gems eval: a trained model evaluated on the ranks a training run would have (gems.rank.evaluate)
            record = evaluate_model(cfg, world, wd) if cfg.eval.path else train(cfg, world, wd)
            release_graphs(world)  # while the watchdog still watches: the device's queue may wait for peers
            if wd is not None:
                wd.stop()
            if world.rank == 0:
                progress.mark("record")
                hardware(cfg, world, record)
                keep_record(cfg, record)
                return record
            return None
        except Stopped:
            raise  # the record says it all
        except BaseException as e:
            if not isinstance(e, (KeyboardInterrupt, SystemExit)) and rank is not None:
                reports.report_exception(rec.job_dir(cfg), rank, e)
            failed.append(reports.one_line(e))
            raise
        finally:
            end_rank(world, wd, cfg, failed[0] if failed else None)


def keep_record(cfg: Any, record: dict[str, Any]) -> None:
    """Rank 0 writes a finished run's per-step CSV, then its record (where the CSV cannot be written for the storage's
    reason, the record says so as a failure, and the rank stops with that line: exit 1)."""
    path = rec.record_path(cfg)
    try:
        if record.get("kind") != "eval":  # (gems eval's record has no steps)
            rec.write_steps(path, record)
    except StorageFailed as e:
        record.update(status="failed", error=f"{e.line()}; the training finished: its model file and checkpoints are "
                      "kept", failure={**e.as_dict(), "finished": True})
        write_once(path, record)
        raise Stopped(record["error"]) from e
    except Exception as e:  # the CSV is a copy of the record's figures: the record is written whatever it met
        print(f"gems: warning: the per-step CSV was not written: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    rec.write_record(path, record)


def start_watchdog(cfg: Any, world: Any, on_stall: Any) -> Watchdog | None:
    """This rank's heartbeat thread (``fault.stall_timeout_s``; null switches stall detection off)."""
    f = section(cfg, "fault")
    if f.stall_timeout_s is None:
        return None
    jd = rec.job_dir(cfg)

    def report(message: str, failure: dict[str, Any]) -> None:
        reports.write_report(jd, world.rank, message, echo=world.rank not in failure.get("ranks", []),
                             kind=failure.get("kind", "stall"), blame=failure.get("blame"))

    launcher = os.environ.get("GEMS_LAUNCHER_PID")
    return Watchdog(world.rank, world.size, stall_s=f.stall_timeout_s, warmup_s=f.warmup_timeout_s,
                    addr=os.environ.get("MASTER_ADDR", world.master_addr),
                    port=int(os.environ.get("MASTER_PORT", world.master_port)),
                    on_stall=on_stall if world.rank == 0 else None, on_report=report,
                    launcher_pid=int(launcher) if launcher else None).start()


def release_graphs(world: Any) -> bool:
    """The rank's CUDA graphs released (gems.capture.release: its device's queue finished, every graph reset even
    where the device failed, the garbage collected), before anything ends its process groups. False where the device
    reported an error, now or at an earlier release: then the process groups end by abort, which waits for no queue."""
    try:
        rules.release(world.device if world is not None else None, waiting=lambda: progress.waiting("gpu queue"))
    except Exception as e:  # a device that failed cannot finish its queue: say so; its graphs were reset all the same
        print(f"gems: rank {getattr(world, 'rank', '?')}: its device failed while its CUDA graphs were released "
              f"({type(e).__name__}: {str(e)[:200]}); its process groups end by abort", file=sys.stderr, flush=True)
    return not rules.DEVICE_ERRORS


#: the exit status of a rank whose process groups did not end within the time limit (a teardown, not a step:
#: gems.gpucheck reports it as a teardown hang)
TEARDOWN_EXIT = 70
#: past the time limit, how long the rank's own report may take before faulthandler ends the process (a teardown
#: that holds the interpreter's lock leaves no Python thread to run: its stacks are printed, exit status 1)
LAST_RESORT_S = 30.0


def teardown_s(fault: FaultConf) -> float:
    """How long ending a rank's process groups may take: the watchdog's stall allowance (``fault.stall_timeout_s``;
    its default where stall detection is off: the teardown is bounded all the same)."""
    stall = fault.stall_timeout_s if fault.stall_timeout_s is not None else FaultConf().stall_timeout_s
    return float(stall or 0.0)


def end_rank(world: Any, wd: Watchdog | None, cfg: Any = None, error: str | None = None) -> None:
    """How every rank ends, whatever ended it (done, failed, preempted, a failed capture): its graphs released, with
    the watchdog still watching (a device whose queue waits for a hung peer ends the process there, by the watchdog's
    path, never by waiting on NCCL), then the watchdog stopped, then its process groups ended (destroyed; aborted where
    the device failed): NCCL's teardown waits for every graph holding its work (gems.capture), so it comes after
    them, within :func:`teardown_s`; past it the rank names what it waits for and exits (:func:`teardown_hung`).
    ``error``: this rank's own failure, where it failed."""
    import torch.distributed as dist

    healthy = release_graphs(world)
    if wd is not None:
        wd.stop()
    if not dist.is_initialized():
        return
    limit = teardown_s(section(cfg, "fault")) if cfg is not None else teardown_s(FaultConf())
    timer = threading.Timer(limit, teardown_hung, args=(cfg, world.rank, limit, healthy, error))
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(limit + LAST_RESORT_S, exit=True)
    try:
        end_groups(abort=not healthy)
    except Exception:  # the peer may already be gone; the record says why
        pass
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def end_groups(abort: bool) -> None:
    """The process groups ended: destroyed, or NCCL's aborted where the device failed (no wait for its queue). On a
    CPU rank's graph stand-in the end first waits while a graph holding NCCL work is alive, as NCCL's (2.26 on) does."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    while stand_in() and rules.holding():
        time.sleep(0.05)
    if abort and dist.get_backend() == "nccl":
        c10d._abort_process_group()
    else:
        dist.destroy_process_group()


def teardown_hung(cfg: Any, rank: int, limit: float, healthy: bool, error: str | None) -> None:
    """Past the teardown's limit (a thread of its own, the rank blocked in NCCL's teardown): the rank names what its
    teardown waits for (the graphs still alive and their communicators) in its failure report (added to the one it
    wrote where it failed), rank 0 writes the run's record where none exists yet, and the rank exits
    :data:`TEARDOWN_EXIT`."""
    graphs = rules.alive()
    how = "destroyed" if healthy else "aborted (its device failed)"
    waits = ("CUDA graphs still alive: " + "; ".join(graphs)) if graphs else \
        "no graph gems made is alive (NCCL's own teardown did not return)"
    message = (f"rank {rank}: its process groups were not {how} within {limit:g} s (fault.stall_timeout_s): {waits}; "
               f"it exits with status {TEARDOWN_EXIT} (a teardown, not a step)")
    try:
        print(f"gems: error: {message}", file=sys.stderr, flush=True)
        if cfg is not None:
            jd = rec.job_dir(cfg)
            if not reports.amend_report(jd, rank, teardown=message, graphs_alive=graphs):
                reports.write_report(jd, rank, message, echo=False, kind="teardown", graphs_alive=graphs)
            path = rec.record_path(cfg)
            if rank == 0 and rec.find_record(path) is None:
                write_once(path, rec.failed_record(cfg, f"{error}; then {message}" if error else message,
                                                   failure={"kind": "teardown", "graphs_alive": graphs}))
    finally:  # whatever the writing met (a full disk), the rank ends
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(TEARDOWN_EXIT)


def hardware(cfg: Any, world: Any, record: dict[str, Any]) -> None:
    """Add the record's ``hardware`` section to a training run's record: how far its median step (the slowest
    rank's) is from the device's peak (:func:`gems.plan.roofline.of_run`; the planner's model of the work, which
    lies above the rank's loop, is asked here, where the record is finished)."""
    import torch

    from gems.plan.roofline import of_run

    median = (record.get("step_time_s") or {}).get("median")
    if not isinstance(median, (int, float)) or not median > 0:  # gems eval, or a run that measured no step
        return
    name = torch.cuda.get_device_name(world.device) if world.device.type == "cuda" else "cpu"
    record["hardware"] = of_run(cfg, world.size, name, float(median))


def _output_file() -> str:
    """Where this process's output goes (its rank log, where a launcher sends it there)."""
    try:
        return os.readlink("/proc/self/fd/1")
    except OSError:
        return "stdout"


def _env_rank() -> int | None:
    for key in ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gems.worker", description="Run one gems rank (launchers call this).")
    ap.add_argument("--config", required=True, help="resolved configuration YAML written by the launcher")
    args = ap.parse_args(argv)
    try:
        with open(args.config) as f:
            text = f.read()
        run_rank(text)
    except ConfigError as e:
        print(f"gems: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Stopped as e:  # every rank stopped at one step, the record written: one line
        print(f"gems: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:
        rank = _env_rank()
        err = os_error(e)  # a write to the rank's own output (its log: no file named) that the storage refused
        failed = named(e, "this rank's output", _output_file()) if err is not None and err.filename is None else None
        with contextlib.suppress(OSError):
            if failed is not None:
                print(f"gems: error: rank {'?' if rank is None else rank}: {failed}", file=sys.stderr, flush=True)
            else:
                print(f"gems: rank {'?' if rank is None else rank} failed:\n{traceback.format_exc()}", file=sys.stderr,
                      flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

