"""Spatial + data parallelism in your own training loop, with the gems Python API.

    torchrun --standalone --nproc-per-node=4 examples/spatial_own_loop.py --replicas 2

Each sample of CosmoFlow (32^3 here) is cut in depth over S = world / replicas
ranks; replicas split the global batch. Rank 0 also trains the plain serial
model on the same global batch and checks that the losses agree.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gems
from gems.data.synthetic import SyntheticData
from gems.models import build_model
from omegaconf import OmegaConf


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)

    world = gems.init()
    R = args.replicas
    mesh = gems.Mesh(replicas=R, parts=(world.size // R,), spatial_dims=(0,), world_size=world.size)
    mesh.build_groups(world.rank, timeout=world.timeout)
    me = mesh.coord(world.rank)

    torch.manual_seed(0)  # every rank starts from the same weights
    spec = build_model(OmegaConf.create({"name": "cosmoflow", "size": 32, "width": 0.5, "dropout": 0.2}))
    serial = sopt = None
    if world.rank == 0:  # the reference: the same model trained by one process on the whole batch
        import copy

        serial = copy.deepcopy(spec.module)
        sopt = torch.optim.Adam(serial.parameters(), lr=1e-3)
    ctx = gems.SpatialContext.from_mesh(mesh, world.rank)
    model = gems.apply_spatial(spec.module, ctx, spatial_end=spec.spatial_end)
    reducer = gems.GradientReducer(model.parameters(), mesh.group("grad"))  # sum over the R x S copies
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = SyntheticData(spec, seed=0, num_samples=64)
    share = args.batch // R

    for step in range(args.steps):
        ids = list(range(step * args.batch + me.replica * share, step * args.batch + (me.replica + 1) * share))
        x, y = data.batch(ids, ctx.local_slices(spec.input_shape[1:]))  # only this rank's slab is generated
        reducer.start_step()
        with gems.batch_context(0, step, ids):
            out = model(x)  # gathered before the dense head: every part holds the full output
        # weighted so that the sum over all ranks is the serial mean loss (docs/design.md)
        loss = F.mse_loss(out, y, reduction="sum") / out.shape[1] / args.batch / mesh.spatial
        loss.backward()
        reducer.finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        if serial is not None and sopt is not None:
            ids_all = list(range(step * args.batch, (step + 1) * args.batch))
            xa, ya = data.batch(ids_all)
            with gems.batch_context(0, step, ids_all):
                ref = F.mse_loss(serial(xa), ya)
            ref.backward()
            sopt.step()
            sopt.zero_grad(set_to_none=True)
            print(f"step {step}: loss {total.item():.7f}  serial {ref.item():.7f}")
            torch.testing.assert_close(total, ref.detach(), rtol=1e-5, atol=1e-7)
    if world.rank == 0:
        print("losses equal the serial run")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
