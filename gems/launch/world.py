"""Run a function on every rank of a real gloo world on this machine (the tests and the benchmarks use it):
``run_world(fn, n)`` returns ``fn(rank, world_size, *args)`` of each rank in rank order, raises with a failed rank's
traceback, and ends a hang at ``timeout`` seconds. The ranks are forked from a server that has imported torch once
(gems.launch.forkserver), each with the caller's environment at the call: a fork instead of torch's import (about
1.6 s of CPU here), which the tests pay for hundreds of ranks.
"""
from __future__ import annotations

import os
import pickle
import traceback
from typing import Any, Callable

from gems import capture
from gems.bootstrap import free_port as bootstrap_free_port


def free_port() -> int:
    """A loopback port free now (:func:`gems.bootstrap.free_port`)."""
    return bootstrap_free_port("127.0.0.1")


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue: Any,
           env: dict[str, str]) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    os.environ.clear()  # the caller's environment now, not the fork server's when it started
    os.environ.update(env)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        out = fn(rank, world, *args)
        # plain pickle copies tensor data: torch's queue would share memory that dies with this process
        queue.put((rank, True, pickle.dumps(out)))
    except BaseException:  # report every failure to the parent, then exit non-zero
        queue.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)
    finally:
        capture.release(None)  # a stand-in's graphs, as a rank's end releases them (gems.worker.end_rank)
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable (a module-level function) and its results picklable.
    """
    from gems.launch.forkserver import context

    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, env), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    import queue as _q
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"run_world: {world_size - len(results) - len(errors)} rank(s) still running after {timeout}s")
            try:
                rank, ok, payload = queue.get(timeout=min(left, 1.0))
            except _q.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
                if dead and not errors:
                    # a rank died without reporting (killed, segfault): give the others a moment, then fail
                    time.sleep(2.0)
                    if queue.empty():
                        codes = [procs[i].exitcode for i in dead]
                        raise RuntimeError(f"run_world: rank(s) {dead} exited with {codes} without a result")
                continue
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                errors.append(f"--- rank {rank} ---\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("run_world failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
