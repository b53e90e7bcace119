"""Stand-in rank functions for the Slurm tests: small, importable on the compute nodes.

They take the resolved configuration YAML like ``gems.worker.run_rank`` does, so the
launcher's path (submitit pickle, srun, per-task results) is the real one.
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Any


def _torch_env() -> Any:
    """submitit's torch variables, with gems's rendezvous port of the job (gems.bootstrap.port_from_job): submitit's
    own draw (20000-60000) falls in Linux's ephemeral range, where another job's connection on the node may hold it
    (EADDRINUSE failed a suite run that way)."""
    import submitit

    from gems.bootstrap import port_from_job

    env = submitit.helpers.TorchDistributedEnvironment()
    env.master_port = port_from_job(submitit.JobEnvironment().job_id)
    return env.export(set_cuda_visible_devices=False)


def allreduce_rank(cfg_yaml: str) -> dict[str, Any]:
    """Join a gloo world from submitit's variables and all-reduce rank+1."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    env = _torch_env()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    t = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"rank": env.rank, "world": env.world_size, "node": os.environ.get("SLURMD_NODENAME"),
            "sum": float(t.item())}


def die_on_rank1(cfg_yaml: str) -> int:
    """Rank 1 dies at once without a result; the others would wait for it in the rendezvous."""
    import torch.distributed as dist

    env = _torch_env()
    if env.rank == 1:
        print("rank 1: dying on purpose", flush=True)
        import sys

        sys.stderr.write("rank 1: dying on purpose with status 3\n")
        sys.stderr.flush()
        os._exit(3)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    dist.barrier()
    return env.rank


def sleep_forever(cfg_yaml: str) -> None:
    """Never returns: only the launcher's timeout can end it."""
    while True:
        time.sleep(1)
