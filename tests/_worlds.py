import torch
import torch.distributed as dist


def allreduce_rank(rank, world):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()
    return rank


def loss_scaling(rank, world, scaling, overflow_at):
    """Two replicas of a small convolutional model, gradients summed by gems' reducer, stepped through
    gems.precision.LossScaler; rank 1's input is huge at step ``overflow_at`` (its scaled gradients overflow).
    Returns the per-step global losses, whether each step was taken, the scales and the final parameters."""
    from torch import nn

    from gems.precision import LossScaler
    from gems.replication import GradientReducer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    reducer = GradientReducer(model, dist.group.WORLD, bucket_mb=0.001)
    scaler = LossScaler(torch.device("cpu"), scaling, init_scale=2.0**10, growth_interval=2)
    out = {"losses": [], "stepped": [], "scales": []}
    for step in range(5):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(2, 2, 6, 6, generator=g), torch.randn(2, 3, generator=g)
        if step == overflow_at and rank == 1:
            x = x * 3e35
        reducer.start_step()
        loss = ((model(x) - y) ** 2).mean() / world
        scaler.scale(loss).backward()
        reducer.finish()
        total = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(total)
        out["losses"].append(total.item())
        out["stepped"].append(scaler.step(opt, step))
        opt.zero_grad(set_to_none=True)
        out["scales"].append(scaler.value)
    out["params"] = [p.detach().clone() for p in model.parameters()]
    out["skipped"] = scaler.summary()["skipped_steps"]
    return out


def many_skips(skips):
    """A model whose middle cut ``skips`` skip connections cross, through a layer fake tensors cannot run (so a
    pipeline learns the cut's layout from the first step's header), its batch, and its loss (a sum over the batch
    of 2)."""
    from torch import nn

    from gems.models.skips import PopAdd, SkipStore, Stash

    class Untraceable(nn.Module):
        def forward(self, x):
            return x * (1.0 + 0.0 * float(x.detach().sum()))

    torch.manual_seed(0)
    store = SkipStore()
    names = [f"s{i}" for i in range(skips)]
    seq = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), *[Stash(store, n) for n in names], Untraceable(),
                        *[PopAdd(store, n) for n in reversed(names)], nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 1, 4, 4, generator=g), torch.randn(2, 3, generator=g)
    return seq, x, y, lambda out, t, n: ((out - t) ** 2).sum() / 2


def many_skips_pipeline(rank, world, skips):
    """:func:`many_skips` on D = 2 (GPipe, one micro-batch) cut in the middle: this rank's loss and gradients."""
    from gems.mesh import Mesh
    from gems.pipeline import apply_pipeline

    seq, x, y, loss = many_skips(skips)
    mesh = Mesh(replicas=1, pipeline=2, world_size=world)
    mesh.build_groups(rank)
    runner = apply_pipeline(seq, mesh, rank, loss_fn=loss, batch_size=2, schedule="gpipe",
                            balance=[skips + 2, skips + 2])
    total = runner.step(x, y, [0, 1], seed=0, step=0)
    return float(total), [p.grad.clone() for p in runner.parameters()]


def sends_held(rank, world, checkpoint):
    """D = 2 under 1F1B with 4 micro-batches: how many sends each stage still holds at the start of each of its
    backwards (the first stage's activations, the second's input gradients), over two steps."""
    from torch import nn

    from gems.mesh import Mesh
    from gems.pipeline import apply_pipeline

    torch.manual_seed(0)
    seq = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.Flatten(),
                        nn.Linear(4 * 6 * 6, 3))
    mesh = Mesh(replicas=1, pipeline=2, world_size=world)
    mesh.build_groups(rank)
    runner = apply_pipeline(seq, mesh, rank, loss_fn=lambda y, t, n: ((y - t) ** 2).sum() / 8, batch_size=8,
                            schedule="1f1b", micro_batches=4, balance=[2, 3], checkpoint=checkpoint,
                            sample_shape=(1, 6, 6))
    held = []
    backward = runner._backward

    def counting(a, grad, target):
        held.append(len(runner._sends))
        return backward(a, grad, target)

    runner._backward = counting
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 1, 6, 6, generator=g), torch.randn(8, 3, generator=g)
    for step in range(2):
        runner.step(x, y, list(range(8)), seed=0, step=step)
    return held
