"""Rank functions and the serial reference for the pipeline transparency tests.

A *case* is a dict: model ("cosmoflow" | "resnet_bn" | "resnet_gn"), schedule,
D (pipeline), R (replicas), m (micro-batches), eta (gems_replicas or None),
checkpoint, B (global batch), steps. Every rank builds the same model from the
same seed, runs ``steps`` SGD steps through ``apply_pipeline``, sums gradients
over the mesh's ``grad`` group and returns the global loss of every step, the
step-0 gradients and final parameters of each partition it holds.
``serial_case`` computes the same from one process by gradient accumulation
over the same chunks.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gems.mesh import Mesh
from gems.models.layers import batch_context
from gems.pipeline import apply_pipeline, is_mirrored, split

SEED = 7
LR = 0.05


def build(model: str) -> tuple[nn.Sequential, tuple[int, ...], str]:
    torch.manual_seed(0)
    if model == "cosmoflow":
        from gems.models.cosmoflow import cosmoflow

        return cosmoflow(32, width=0.125, dropout=0.3), (4, 32, 32, 32), "mse"
    from gems.models.resnet import resnet_v2

    norm = "batch" if model == "resnet_bn" else "group"
    return resnet_v2(20, in_channels=3, num_classes=5, width=0.25, norm=norm), (3, 16, 16), "ce"


def batch(step: int, B: int, shape: tuple[int, ...], loss: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, *shape, generator=g)
    y = torch.randn(B, 4, generator=g) if loss == "mse" else torch.randint(0, 5, (B,), generator=g)
    return x, y, list(range(step * B, (step + 1) * B))


def make_loss(kind: str, B: int):  # type: ignore[no-untyped-def]
    def loss_fn(out: torch.Tensor, tgt: torch.Tensor, n: int) -> torch.Tensor:
        if kind == "mse":
            return ((out - tgt) ** 2).mean(dim=1).sum() / B
        return F.cross_entropy(out, tgt, reduction="sum") / B
    return loss_fn


def pipeline_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_run_case(rank, world, c) for c in cases]


def _run_case(rank: int, world: int, c: dict[str, Any]) -> dict[str, Any]:
    seq, shape, kind = build(c["model"])
    R, D, B = c["R"], c["D"], c["B"]
    mesh = Mesh(R, D, world_size=world)
    mesh.build_groups(rank, mirrored=is_mirrored(c["schedule"]))
    runner = apply_pipeline(seq, mesh, rank, loss_fn=make_loss(kind, B), batch_size=B // R, schedule=c["schedule"],
                            micro_batches=c["m"], gems_replicas=c.get("eta"), checkpoint=c.get("checkpoint", False),
                            sample_shape=shape if c.get("trace", True) else None, balance=c.get("balance"),
                            balance_by=c.get("balance_by", "memory"))
    params = runner.parameters()  # may be empty: a memory-balanced cut can leave a rank only pooling layers
    opt = torch.optim.SGD(params, lr=LR) if params else None
    r = mesh.coord(rank).replica
    share = slice(r * B // R, (r + 1) * B // R)
    losses, grads0 = [], {}
    for t in range(c["steps"]):
        x, y, ids = batch(t, B, shape, kind)
        for p in params:
            p.grad = torch.zeros_like(p)
        local = runner.step(x[share] if runner.needs_inputs else None, y[share] if runner.needs_targets else None,
                            ids[share], SEED, t)
        for p in runner.parameters():
            if mesh.group("grad") is not None:
                dist.all_reduce(p.grad, group=mesh.group("grad"))
        total = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(total.item())
        if t == 0:
            grads0 = {i: [p.grad.clone() for p in part.parameters()] for i, part in runner.partitions.items()}
        if opt is not None:
            opt.step()
    return {"rank": rank, "losses": losses, "grads0": grads0, "balance": runner.balance,
            "params": {i: [p.detach().clone() for p in part.parameters()] for i, part in runner.partitions.items()},
            "samples_per_step": runner.samples_per_step}


def serial_case(c: dict[str, Any], balance: list[int]) -> dict[str, Any]:
    """One process, the same chunks: replica r's share cut into eta x m chunks, gradients accumulated."""
    seq, shape, kind = build(c["model"])
    R, B = c["R"], c["B"]
    eta = 2 if c["schedule"] == "mast" else (c.get("eta") or 1)
    chunks = R * eta * c["m"]
    k = B // chunks
    loss_fn = make_loss(kind, B)
    opt = torch.optim.SGD(seq.parameters(), lr=LR)
    parts = split(seq, balance)
    losses, grads0 = [], {}
    for t in range(c["steps"]):
        x, y, ids = batch(t, B, shape, kind)
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for j in range(chunks):
            sl = slice(j * k, (j + 1) * k)
            with batch_context(SEED, t, ids[sl]):
                loss = loss_fn(seq(x[sl]), y[sl], k)
                loss.backward()
            total += loss.item()
        losses.append(total)
        if t == 0:
            grads0 = {i: [p.grad.clone() for p in part.parameters()] for i, part in enumerate(parts)}
        opt.step()
    return {"losses": losses, "grads0": grads0,
            "params": {i: [p.detach().clone() for p in part.parameters()] for i, part in enumerate(parts)}}
