"""``gems bench pipeline``: GEMS schedules against layer parallelism and torch's own pipelining.

Two questions, on two ranks of this machine (one thread each, D = 2, the same
ResNet-v2 cut at the same layer for every contender, the same global batch):

1. What does the mirrored replica buy? ``mast`` against ``lp`` (goal >= 1.7x,
   ideal 2x: B's work fills the half of the time A leaves idle).
2. Is ``master`` worth it against what a PyTorch user would pick instead?
   ``master`` against ``torch.distributed.pipelining``'s ``Schedule1F1B`` and
   ``ScheduleGPipe`` at the same micro-batch size (goal >= 1.2x).

Every contender runs whole training steps: zero_grad, forward and backward of
the global batch, the gradient sum over the mirrored copies where the
schedule has them, an SGD step. Throughput is global batch / median step
time; memory is each rank's peak tensor memory (parameters, gradients and
what a step allocates on top, from the CPU allocator's events) and its peak
RSS growth, beside the parameter bytes it holds.
"""
from __future__ import annotations

import os
import platform
import resource
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

MODEL = dict(depth=29, width=0.5, size=64, in_channels=3, num_classes=10, norm="group")
MICRO = 4  # samples per micro-batch (per replica pass for master) in the schedule comparison


def _contenders() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        dict(label="gems lp", kind="gems", schedule="lp", m=1, B=16),
        dict(label="gems mast", kind="gems", schedule="mast", m=1, B=16),
    ]
    for B in (16, 8):  # 4 and 2 micro-batches of MICRO samples
        m = B // MICRO
        out += [
            dict(label=f"gems master (eta={m})", kind="gems", schedule="master", m=1, eta=m, B=B),
            dict(label=f"gems 1f1b (m={m})", kind="gems", schedule="1f1b", m=m, B=B),
            dict(label=f"torch Schedule1F1B (m={m})", kind="torch", schedule="1f1b", m=m, B=B),
            dict(label=f"torch ScheduleGPipe (m={m})", kind="torch", schedule="gpipe", m=m, B=B),
        ]
    return out


CONTENDERS = _contenders()


def _model() -> torch.nn.Sequential:
    from gems.models.resnet import resnet_v2

    torch.manual_seed(0)
    return resnet_v2(MODEL["depth"], MODEL["in_channels"], MODEL["num_classes"], MODEL["width"], MODEL["norm"])


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _data(step: int, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(B, MODEL["in_channels"], MODEL["size"], MODEL["size"], generator=g)
    return x, torch.randint(0, MODEL["num_classes"], (B,), generator=g)


def _bench_rank(rank: int, world: int, c: dict[str, Any], balance: list[int], steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.nn.functional as F

    from gems.mesh import Mesh
    from gems.pipeline import apply_pipeline, is_mirrored, split

    from gems.bench.common import persistent_bytes, step_peak_bytes
    from gems.bootstrap import keep_host_memory
    from gems.config import CommConf
    from gems.replication import GradientReducer

    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= world:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    keep_host_memory()  # as `gems run` does on CPU ranks, for every contender
    seq = _model()
    batch = c["B"]
    mesh = Mesh(1, 2, world_size=world)
    if c["kind"] == "gems":
        mesh.build_groups(rank, mirrored=is_mirrored(c["schedule"]))
        runner = apply_pipeline(seq, mesh, rank, loss_fn=lambda o, t, n: F.cross_entropy(o, t, reduction="sum") / batch,
                                batch_size=batch, schedule=c["schedule"], micro_batches=c["m"],
                                gems_replicas=c.get("eta"), balance=balance,
                                sample_shape=(MODEL["in_channels"], MODEL["size"], MODEL["size"]))
        params = runner.parameters()
        # the mirrored copies' gradients are summed as `gems run` sums them: bucketed, overlapped with the backward
        reducer = GradientReducer(params, mesh.group("grad") if is_mirrored(c["schedule"]) else None,
                                  CommConf().bucket_mb)
        backwards = Counter(a.stage for a in runner.actions if a.kind == "B")
        count = {id(q): backwards[s] for s, part in runner.partitions.items() for q in part.parameters()}
        del seq

        def step(t: int, x: torch.Tensor, y: torch.Tensor) -> None:
            reducer.start_step(expected=lambda q: count[id(q)])
            runner.step(x, y, list(range(t * batch, (t + 1) * batch)), 0, t)
            reducer.finish()
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        part = split(seq, balance)[rank]
        del seq
        stage = PipelineStage(part, rank, 2, torch.device("cpu"))
        cls = Schedule1F1B if c["schedule"] == "1f1b" else ScheduleGPipe
        sched = cls(stage, n_microbatches=c["m"], loss_fn=lambda o, t: F.cross_entropy(o, t))
        params = list(part.parameters())

        def step(t: int, x: torch.Tensor, y: torch.Tensor) -> None:
            if rank == 0:
                sched.step(x)
            else:
                sched.step(target=y, losses=[])

    opt = torch.optim.SGD(params, lr=0.01)
    times: list[float] = []
    base = _rss_bytes()

    def train_step(t: int) -> None:
        x, y = _data(t, batch)
        opt.zero_grad(set_to_none=False)
        step(t, x, y)
        opt.step()

    for t in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        train_step(t)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    rss = max(0, _peak_bytes() - base)
    held = persistent_bytes(params, opt)
    dist.barrier()
    in_step = step_peak_bytes(lambda: train_step(warmup + steps))
    return {"times": times[warmup:], "peak_growth": rss, "tensor_peak": held + in_step,
            "param_bytes": sum(p.numel() * p.element_size() for p in params)}


def _balance() -> list[int]:
    from gems.pipeline.partition import balance_by_cost, layer_times

    from gems.bootstrap import keep_host_memory

    keep_host_memory()
    torch.set_num_threads(1)
    seq = _model()
    times = [min(a, b) for a, b in zip(*(layer_times(seq, (MICRO, MODEL["in_channels"], MODEL["size"], MODEL["size"]))
                                         for _ in range(2)))]
    return balance_by_cost(times, 2)


def bench_pipeline(out_dir: str | os.PathLike[str] = "results/bench", steps: int = 8, warmup: int = 2,
                   rounds: int = 3) -> str:
    """Run every contender on 2 local gloo ranks; write ``pipeline.md`` under ``out_dir``; return the table.

    Contenders run one after the other in fresh processes, ``rounds`` times in
    alternating order; a contender's step time is the median over rounds of
    its median step (the machine may be shared: every contender sees the same
    noise, and one lucky or unlucky round moves nobody).
    """
    from gems.testing import run_world

    load_before = os.getloadavg()[0]
    balance = _balance()
    runs: dict[str, list[tuple[float, list[int], list[int], list[int]]]] = {}
    for rnd in range(rounds):
        for c in (CONTENDERS if rnd % 2 == 0 else CONTENDERS[::-1]):
            res = run_world(_bench_rank, 2, c, balance, steps, warmup, timeout=600)
            step_s = statistics.median(max(a, b) for a, b in zip(res[0]["times"], res[1]["times"]))
            runs.setdefault(c["label"], []).append((step_s, [r["peak_growth"] for r in res],
                                                    [r["tensor_peak"] for r in res], [r["param_bytes"] for r in res]))
    load_after = os.getloadavg()[0]
    rows = []
    for c in CONTENDERS:
        rs = sorted(runs[c["label"]])
        step_s, rss, tensor, pbytes = rs[len(rs) // 2]  # the median round (rounds is odd by default)
        rows.append((c, c["B"] / step_s, step_s, min(r[0] for r in rs), max(r[0] for r in rs), rss, tensor, pbytes))
    by = {c["label"]: tput for c, tput, *_ in rows}
    mib = 1 << 20
    lines = ["| schedule | global batch | samples/s | step (s) | range over rounds (s) | x lp | peak tensor memory per "
             "rank (MiB) | peak RSS growth per rank (MiB) | parameters per rank (MiB) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    for c, tput, step_s, lo, hi, rss, tensor, pbytes in rows:
        lines.append(f"| {c['label']} | {c['B']} | {tput:.2f} | {step_s:.3f} | {lo:.3f}-{hi:.3f} | "
                     f"{tput / by['gems lp']:.2f} | {' / '.join(f'{p / mib:.1f}' for p in tensor)} | "
                     f"{' / '.join(f'{p / mib:.0f}' for p in rss)} | {' / '.join(f'{p / mib:.2f}' for p in pbytes)} |")
    summary = [f"- mast over lp: **{by['gems mast'] / by['gems lp']:.2f}x** (goal >= 1.7x, ideal 2x)"]
    for B in (16, 8):
        m = B // MICRO
        master = by[f"gems master (eta={m})"]
        ideal = (m + 1) / m  # 1F1B at D = 2 idles 1 / (m + 1) of the time; master at D = 2 does not
        summary.append(f"- global batch {B} ({m} micro-batches of {MICRO}): master over torch Schedule1F1B "
                       f"**{master / by[f'torch Schedule1F1B (m={m})']:.2f}x**, over torch ScheduleGPipe "
                       f"**{master / by[f'torch ScheduleGPipe (m={m})']:.2f}x** (goal >= 1.2x; the bubble bound is "
                       f"{ideal:.2f}x); gems 1f1b over torch Schedule1F1B "
                       f"{by[f'gems 1f1b (m={m})'] / by[f'torch Schedule1F1B (m={m})']:.2f}x (same schedule: runtime overhead)")
    env = (f"{platform.machine()}, {os.cpu_count()} cores, load average {load_before:.1f} before and {load_after:.1f} "
           f"after (other work on the machine slows the concurrent schedules most); Python {platform.python_version()}, "
           f"torch {torch.__version__}, gloo, 2 ranks x 1 thread, each rank pinned to its own core when there are two")
    text = "\n".join([
        "# gems bench pipeline", "",
        f"ResNet-v2 depth {MODEL['depth']} (width {MODEL['width']}, {MODEL['norm']} norm) on {MODEL['size']}^2 images, "
        f"D = 2 cut at balance {balance} (measured layer times), micro-batch {MICRO} for master (one per replica "
        f"pass) and the 1F1B/GPipe schedules; median of {steps} steps after {warmup} warm-up steps, median of {rounds} "
        "rounds; every step includes the gradient sum over mirrored copies (mast, master: gems' bucketed reducer, "
        "overlapped with the backward, as `gems run` does) and the SGD update. Every rank keeps freed host memory "
        "for reuse, as `gems run` does on CPU ranks (`train.host_memory=auto`). Peak tensor memory: parameters, "
        "gradients and the peak a step allocates on top (the CPU allocator's events; what a GPU would count); "
        "peak RSS growth also counts what the C library keeps.", "",
        *lines, "", *summary, "", "## Environment", "", env, "", "## To reproduce", "",
        "```", "gems bench pipeline    # or: python -m gems.bench.pipeline results/bench", "```", ""])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.md").write_text(text)
    return text


if __name__ == "__main__":
    print(bench_pipeline(sys.argv[1] if len(sys.argv) > 1 else "results/bench"))
