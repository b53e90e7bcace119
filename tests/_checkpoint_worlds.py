"""Ranks of a gloo world that write the trained model (tests/test_checkpoints.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def export_rank(rank: int, world_size: int, folder: str, cap: int) -> dict[str, Any]:
    """Every rank holds the same small model (a replica each); the model file is written under a recorder of every
    torch.distributed call this rank makes. Returns the calls, the writers and the model's bytes."""
    from gems import checkpoint as ckpt
    from gems.commlog import Recorder

    cfg, world, saver = _saver(rank, world_size, folder, cap)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(2, 8, 3), nn.BatchNorm3d(8), nn.Flatten(), nn.Linear(8 * 6 ** 3, 64))
    names = {f"{m_name}.{attr}" if m_name else attr: (m, attr) for m_name, m in model.named_modules()
             for attr in [*m._parameters, *(b for b in m._buffers if b not in m._non_persistent_buffers_set)]}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hold = ckpt.Holding(names, list(model.parameters()), opt)
    path = Path(folder) / "export.model.pt"
    with Recorder() as rec:
        ckpt.export(cfg, world, hold, saver, 1, path, list(model.state_dict()))
    calls = [e for e in rec.events if e.get("e") == "post"]
    return {"calls": calls, "writers": saver.writers, "writes": saver.share.writes,
            "model_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
            "state": {k: v.clone() for k, v in model.state_dict().items()}}


def _saver(rank: int, world_size: int, folder: str, cap: int) -> tuple[Any, Any, Any]:
    """(configuration, world, Saver) of rank ``rank`` of ``world_size`` replicas with ``cap`` writers."""
    from omegaconf import open_dict

    from gems import checkpoint as ckpt
    from gems.bootstrap import World
    from gems.config import compose
    from gems.mesh import Mesh

    cfg = compose([f"parallel.replicas={world_size}", f"train.batch_size={world_size}",
                   f"train.checkpoint_writers={cap}", f"results.dir={folder}"])
    with open_dict(cfg):
        cfg.run_id = "checkpoints"
    world = World(rank, world_size, rank, "127.0.0.1", 0, "single", torch.device("cpu"), "gloo", "torch", None,
                  "localhost")
    return cfg, world, ckpt.Saver(cfg, world, Mesh(replicas=world_size))


def group_rank(rank: int, world_size: int, folder: str, cap: int) -> dict[str, Any]:
    """The writers' group as each rank of a world of ``world_size`` replicas sees it (``cap`` writers)."""
    import torch.distributed as dist

    _, _, saver = _saver(rank, world_size, folder, cap)
    g = saver.group()
    return {"member": g is not None, "size": dist.get_world_size(g) if g is not None else 0,
            "same": saver.group() is g}
