"""``gems plan plan.dry_run=true``: one rank of the full-size world runs the real code for one step, alone, over torch's
fake process group and on fake tensors, so that mesh, group, partition and schedule errors that appear only at full
size surface in seconds, before a job queues (docs/planner.md). Values are not computed: the loss is 0.
"""
from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["dry_run"]


def dry_run(cfg: Any) -> dict[str, Any]:
    """One step of rank ``plan.dry_run_rank`` of the configured world over the fake process group; what it
    built and ran. Raises what the real code raises (mesh, groups, partitions, schedule)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gems.bootstrap import World
    from gems.config import section, typed
    from gems.data.synthetic import SyntheticData
    from gems.errors import ConfigError
    from gems.mesh import mesh_from_config
    from gems.models import build_model
    from gems.parallel import resolve
    from gems.rank.compose import set_up_rank
    from gems.rank.data import step_batch

    t0 = time.perf_counter()
    cfg = typed(cfg)
    mesh = mesh_from_config(cfg)
    size = mesh.size
    rank = int(cfg.plan.dry_run_rank)
    if not 0 <= rank < size:
        raise ConfigError("plan.dry_run_rank", rank, f"a rank of the {size}-rank world: 0..{size - 1}")
    if dist.is_initialized():
        raise RuntimeError("gems plan plan.dry_run=true runs in a process without a process group")
    settings = resolve(cfg)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        mesh.build_groups(rank, groups=settings.holder_groups)
        tpn = int(cfg.cluster.tasks_per_node or cfg.cluster.gpus_per_node or 1)
        world = World(rank=rank, size=size, local_rank=rank % max(1, tpn), master_addr="fake", master_port=0,
                      source="single", device=torch.device("cpu"), backend="fake", grad_comm="torch")
        B = int(cfg.train.batch_size)
        with FakeTensorMode(allow_non_fake_inputs=True):
            coord, spec, par, opt = set_up_rank(cfg, world, mesh, settings)
            # synthetic samples of the configured shapes: the dry run reads no files
            data = SyntheticData(spec, int(cfg.train.seed), max(B, int(cfg.data.num_samples)))
            ids, x, y = step_batch(data, par, 0, B, mesh.replicas, coord.replica)
            par.forward_backward(x, y, ids, 0)
            par.quiesce()
            opt.step()
            opt.zero_grad(set_to_none=True)
        groups = {axis: mesh.ranks(axis) for axis in ("spatial", "pipeline", "replica", "grad")}
        from gems.checkpoint import Holding, at_scale

        with torch.device("meta"):  # the serial model's tensors (the model file's), without memory
            whole = build_model(section(cfg, "model")).module.state_dict()
        return {
            "world_size": size, "rank": rank,
            "coord": {"replica": coord.replica, "pipeline": coord.pipeline, "spatial": coord.spatial,
                      "spatial_grid": list(coord.spatial_grid)},
            "groups": {axis: {"size": len(r), "first_ranks": r[:4]} for axis, r in groups.items()},
            # the calls that made them, one a mesh axis whose groups have several ranks: on GPUs each is one split
            # of the world's communicator that every rank takes part in (gems.mesh.Mesh.build_groups)
            "setup": {"group_calls": len(mesh.groups.setup_calls),
                      "axes": [axis for _, axis in mesh.groups.setup_calls]},
            "partitions": list(par.balance) if par.balance else None,
            "parameters": int(sum(p.numel() for p in par.params)),
            "input_part": None if x is None else list(x.shape),
            # what this rank's checkpoints and model file would write and hold (gems.checkpoint.at_scale)
            "checkpoint": at_scale(mesh, rank, Holding(par.names, par.params, opt).state(),
                                   int(cfg.train.checkpoint_writers), whole),
            "notes": list(par.notes),
            "seconds": time.perf_counter() - t0,
        }
    finally:
        dist.destroy_process_group()
