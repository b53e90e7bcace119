"""``gems bench pipeline``: GEMS schedules against layer parallelism and torch's own pipelining, on two ranks of this
machine (one thread each, D = 2, the same ResNet-v2 cut at the same layer for every contender, the same global batch):
what the mirrored replica buys (``mast`` over ``lp``), ``master`` against torch's ``Schedule1F1B`` and
``ScheduleGPipe``, and gems's runtime against torch's on torch's own schedules (docs/benchmarks.md).
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import torch

MODEL = dict(depth=29, width=0.5, size=64, in_channels=3, num_classes=10, norm="group")
MICRO = 4  # samples per micro-batch (per replica pass for master) in the schedule comparison
LARGE = 256  # image size of the second mast-over-lp comparison (16x the pixels: fixed per-step costs weigh less)
BOUND = "bound: whole model on half the batch x2, no communication"


def _contenders() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        dict(label="gems lp", kind="gems", schedule="lp", m=1, B=16),
        dict(label="gems mast", kind="gems", schedule="mast", m=1, B=16),
        # Chimera: 2 micro-batches per direction, so transfers overlap the other micro-batch's compute
        dict(label="gems mast (m=2 per direction)", kind="gems", schedule="mast", m=2, B=16),
        dict(label="gems master (eta=2, m=2 per pass)", kind="gems", schedule="master", m=2, eta=2, B=16),
        # the cut parallel.balance_by=comm picks at D = 2: the smallest activation crossing it
        dict(label="gems lp, comm cut", kind="gems", schedule="lp", m=1, B=16, cut="comm"),
        dict(label="gems mast, comm cut", kind="gems", schedule="mast", m=1, B=16, cut="comm"),
        # the most two ranks can do on this machine: what a mast rank computes (the whole model on half of the
        # batch), in two concurrent processes, without a single message
        dict(label=BOUND, kind="bound", B=16),
    ]
    for B in (16, 8):  # 4 and 2 micro-batches of MICRO samples
        m = B // MICRO
        out += [
            dict(label=f"gems master (eta={m})", kind="gems", schedule="master", m=1, eta=m, B=B),
            dict(label=f"gems 1f1b (m={m})", kind="gems", schedule="1f1b", m=m, B=B),
            dict(label=f"torch Schedule1F1B (m={m})", kind="torch", schedule="1f1b", m=m, B=B),
            dict(label=f"gems gpipe (m={m})", kind="gems", schedule="gpipe", m=m, B=B),
            dict(label=f"torch ScheduleGPipe (m={m})", kind="torch", schedule="gpipe", m=m, B=B),
        ]
    # the rounds placed by the actions' measured times (parallel.rounds_by=time, from the second warm-up cycle)
    # against the unit clock, at the balanced cut and at the uneven one the smallest crossing picks
    out += [
        dict(label="gems 1f1b (m=4), rounds by time", kind="gems", schedule="1f1b", m=4, B=16, rounds="time"),
        dict(label="gems 1f1b (m=4), comm cut", kind="gems", schedule="1f1b", m=4, B=16, cut="comm"),
        dict(label="gems 1f1b (m=4), comm cut, rounds by time", kind="gems", schedule="1f1b", m=4, B=16, cut="comm",
             rounds="time"),
        dict(label="gems interleaved1f1b (v=2, m=4), rounds by time", kind="gems", schedule="interleaved1f1b", m=4,
             v=2, B=16, rounds="time"),
    ]
    # interleaved stages and the split backward (zero bubble), gems against torch on 4 micro-batches of MICRO
    out += [
        dict(label="gems interleaved1f1b (v=2, m=4)", kind="gems", schedule="interleaved1f1b", m=4, v=2, B=16),
        dict(label="torch ScheduleInterleaved1F1B (v=2, m=4)", kind="torch", schedule="interleaved", m=4, v=2, B=16),
        dict(label="gems zbh1 (m=4)", kind="gems", schedule="zbh1", m=4, B=16),
        dict(label="gems master (eta=4), split backward", kind="gems", schedule="master", m=1, eta=4, split=True, B=16),
        dict(label="torch ScheduleInterleavedZeroBubble (v=2, m=4)", kind="torch", schedule="izb", m=4, v=2, B=16),
    ]
    big = f" ({LARGE}^2)"
    out += [
        dict(label="gems lp" + big, kind="gems", schedule="lp", m=1, B=16, size=LARGE),
        dict(label="gems mast" + big, kind="gems", schedule="mast", m=1, B=16, size=LARGE),
        dict(label="gems lp, comm cut" + big, kind="gems", schedule="lp", m=1, B=16, cut="comm", size=LARGE),
        dict(label="gems mast, comm cut" + big, kind="gems", schedule="mast", m=1, B=16, cut="comm", size=LARGE),
        dict(label=BOUND + big, kind="bound", B=16, size=LARGE),
    ]
    return out


CONTENDERS = _contenders()


def _model() -> torch.nn.Sequential:
    from gems.models.resnet import resnet_v2

    torch.manual_seed(0)
    return resnet_v2(MODEL["depth"], MODEL["in_channels"], MODEL["num_classes"], MODEL["width"], MODEL["norm"])


def _data(step: int, B: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(B, MODEL["in_channels"], size, size, generator=g)
    return x, torch.randint(0, MODEL["num_classes"], (B,), generator=g)


def _contender(rank: int, world: int, c: dict[str, Any],
               balances: dict[Any, list[int]]) -> tuple[Callable[[int], None], Any, Any]:
    """Build one contender on this rank: (training step of step index t, its parameters, its optimizer)."""
    import torch.nn.functional as F

    from gems.config import CommConf
    from gems.mesh import Mesh
    from gems.pipeline import apply_pipeline, is_mirrored, split
    from gems.replication import GradientReducer, attach

    seq = _model()
    batch = c["B"]
    size = c.get("size", MODEL["size"])
    stages = 2 * int(c.get("v") or 1)
    balance = balances[size] if stages == 2 else balances[(size, stages)]
    if c.get("cut") == "comm":
        from gems.pipeline.partition import balance_by_comm

        balance = balance_by_comm(seq, (MICRO, MODEL["in_channels"], size, size))
    if c["kind"] == "bound":
        params = list(seq.parameters())

        def step(t: int, x: torch.Tensor, y: torch.Tensor) -> None:
            half = slice(rank * batch // 2, (rank + 1) * batch // 2)
            F.cross_entropy(seq(x[half]), y[half], reduction="sum").div(batch).backward()
    elif c["kind"] == "gems":
        mesh = Mesh(1, 2, world_size=world)
        mesh.build_groups(rank, mirrored=is_mirrored(c["schedule"]))
        runner = apply_pipeline(seq, mesh, rank, loss_fn=lambda o, t, n: F.cross_entropy(o, t, reduction="sum") / batch,
                                batch_size=batch, schedule=c["schedule"], micro_batches=c["m"],
                                gems_replicas=c.get("eta"), balance=balance, virtual_stages=c.get("v"),
                                split_backward=c.get("split", False), sample_shape=(MODEL["in_channels"], size, size))
        params = runner.parameters()
        # the mirrored copies' gradients are summed as `gems run` sums them: bucketed, each bucket between two
        # exchange rounds every holder shares, inside its action where nothing comes between (gems.replication.attach)
        reducer = GradientReducer(runner.partitions, mesh.group("grad") if is_mirrored(c["schedule"]) else None,
                                  CommConf().bucket_mb)
        attach(reducer, runner)
        backwards = Counter(a.stage for a in runner.actions if a.kind.finishes_gradients)
        count = {id(q): backwards[s] for s, part in runner.partitions.items() for q in part.parameters()}
        if c.get("rounds") == "time":
            runner.time_actions()

        def step(t: int, x: torch.Tensor, y: torch.Tensor) -> None:
            reducer.start_step(expected=lambda q: count[id(q)])
            runner.step(x, y, list(range(t * batch, (t + 1) * batch)), 0, t)
            reducer.finish()
            if t == 1 and runner.clock is not None:  # both ranks run this contender's cycle 1 together
                runner.place_rounds_by_time()
    elif c["schedule"] in ("interleaved", "izb"):  # torch's looped schedules: stages rank and rank + 2
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble

        parts = split(seq, balance)
        mine = [s for s in range(stages) if s % 2 == rank]
        pstages = [PipelineStage(parts[s], s, stages, torch.device("cpu")) for s in mine]
        icls: Any = ScheduleInterleaved1F1B if c["schedule"] == "interleaved" else ScheduleInterleavedZeroBubble
        isched = icls(pstages, n_microbatches=c["m"], loss_fn=lambda o, t: F.cross_entropy(o, t))
        params = [p for s in mine for p in parts[s].parameters()]

        def step(t: int, x: torch.Tensor, y: torch.Tensor) -> None:
            if rank == 0:  # stage 0 reads the input; the last stage (3) is rank 1's
                isched.step(x)
            else:
                isched.step(target=y, losses=[])
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        part = split(seq, balance)[rank]
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

    def train_step(t: int) -> None:
        x, y = _data(t, batch, size)
        opt.zero_grad(set_to_none=False)
        step(t, x, y)
        opt.step()

    return train_step, params, opt


def _bench_rank(rank: int, world: int, contenders: list[dict[str, Any]], balances: dict[Any, list[int]], cycles: int,
                warmup: int) -> dict[str, Any]:
    """Every contender in these two processes, one training step each per cycle, in a rotating order."""
    import torch.distributed as dist

    from gems.bootstrap import keep_host_memory
    from gems.memory import persistent_bytes, step_peak_bytes

    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= world:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    keep_host_memory()  # as `gems run` does on CPU ranks, for every contender
    built = [_contender(rank, world, c, balances) for c in contenders]
    times: list[list[float]] = [[] for _ in contenders]
    n = len(contenders)
    for cycle in range(warmup + cycles):
        for k in range(n):
            i = (cycle + k) % n
            dist.barrier()
            t0 = time.perf_counter()
            built[i][0](cycle)
            dist.barrier()
            if cycle >= warmup:
                times[i].append(time.perf_counter() - t0)
    peaks = []
    for train_step, params, opt in built:  # one profiled step each: the tensor memory a step needs
        held = persistent_bytes(params, opt)
        dist.barrier()
        peaks.append(held + step_peak_bytes(lambda: train_step(warmup + cycles)))
    return {"times": times, "tensor_peak": peaks,
            "param_bytes": [sum(p.numel() * p.element_size() for p in params) for _, params, _ in built]}


def _layer_times(size: int) -> list[float]:
    from gems.bootstrap import keep_host_memory
    from gems.pipeline.partition import layer_times

    keep_host_memory()
    torch.set_num_threads(1)
    seq = _model()
    return [min(a, b) for a, b in zip(*(layer_times(seq, (MICRO, MODEL["in_channels"], size, size)) for _ in range(2)))]


def _balance(size: int, parts: int = 2) -> list[int]:
    from gems.pipeline.partition import balance_by_cost

    return balance_by_cost(_layer_times(size), parts)


def bench_pipeline(out_dir: str | os.PathLike[str] = "results/bench", cycles: int = 30, warmup: int = 3) -> str:
    """Run every contender on 2 local gloo ranks; write ``pipeline.md`` under ``out_dir``; return the table.

    All contenders live in the same two processes and take turns: each cycle
    runs one training step of every contender, in an order that rotates from
    cycle to cycle. On a shared machine the noise then falls on all of them
    alike; a contender's step time is its median over the cycles, and each
    goal ratio is also given as the median of the ratios within a cycle.

    A contender runs whole training steps: zero_grad, forward and backward of the global batch, the gradient sum
    over the mirrored copies where the schedule has them, an SGD step. The *bound* runs what one ``mast`` rank
    computes a step (the whole model on half the batch) in both processes at once with no communication: the most
    two ranks get out of this machine; ``lp`` and ``mast`` run again on 256² images, where fixed per-step costs weigh
    less, as at the image sizes GEMS is for. Memory is each rank's peak tensor memory (from the CPU allocator's
    events: what a GPU would count) beside the parameter bytes it holds; peak RSS is not reported, since the
    contenders share a process.
    """
    from gems.launch.world import run_world

    load_before = os.getloadavg()[0]
    balances: dict[Any, list[int]] = {size: _balance(size) for size in (MODEL["size"], LARGE)}
    balances[(MODEL["size"], 4)] = _balance(MODEL["size"], 4)  # the interleaved rows: v = 2 stages per rank
    balance = balances[MODEL["size"]]
    res = run_world(_bench_rank, 2, CONTENDERS, balances, cycles, warmup, timeout=1800)
    load_after = os.getloadavg()[0]
    # a step ends when the slower rank ends
    steps = {c["label"]: [max(a, b) for a, b in zip(res[0]["times"][i], res[1]["times"][i])]
             for i, c in enumerate(CONTENDERS)}
    med = {k: statistics.median(v) for k, v in steps.items()}
    by = {c["label"]: c["B"] / med[c["label"]] for c in CONTENDERS}
    batch = {c["label"]: c["B"] for c in CONTENDERS}

    def paired(a: str, b: str) -> str:
        """Median and quartiles over cycles of a's throughput over b's within the same cycle."""
        r = [(batch[a] / x) / (batch[b] / y) for x, y in zip(steps[a], steps[b])]
        q = statistics.quantiles(r, n=4)
        return f"per cycle {statistics.median(r):.2f}x, quartiles {q[0]:.2f}-{q[2]:.2f}"

    mib = 1 << 20
    lines = ["| schedule | global batch | samples/s | median step (s) | quartiles (s) | x lp | peak tensor memory per "
             "rank (MiB) | parameters per rank (MiB) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    big = f" ({LARGE}^2)"
    for i, c in enumerate(CONTENDERS):
        q = statistics.quantiles(steps[c["label"]], n=4)
        tensor = [r["tensor_peak"][i] for r in res]
        pbytes = [r["param_bytes"][i] for r in res]
        lp = "gems lp" + (big if c.get("size") == LARGE else "")  # against lp on the same images
        lines.append(f"| {c['label']} | {c['B']} | {by[c['label']]:.2f} | {med[c['label']]:.3f} | {q[0]:.3f}-{q[2]:.3f} | "
                     f"{by[c['label']] / by[lp]:.2f} | {' / '.join(f'{p / mib:.1f}' for p in tensor)} | "
                     f"{' / '.join(f'{p / mib:.2f}' for p in pbytes)} |")
    from gems.pipeline.partition import balance_by_comm

    summary = []
    for size, tail in ((MODEL["size"], ""), (LARGE, big)):
        comm_cut = balance_by_comm(_model(), (MICRO, MODEL["in_channels"], size, size))
        mast, lp, bound = by["gems mast" + tail], by["gems lp" + tail], by[BOUND + tail]
        summary += [f"- {size}^2 images: mast over lp **{mast / lp:.2f}x** ({paired('gems mast' + tail, 'gems lp' + tail)}; "
                    f"goal >= 1.7x, ideal 2x); the no-communication bound over lp {bound / lp:.2f}x "
                    f"({paired(BOUND + tail, 'gems lp' + tail)}), so mast reaches {mast / bound:.0%} of what two ranks "
                    "can do here",
                    f"- {size}^2 images, at the cut `parallel.balance_by=comm` picks ({comm_cut}: the smallest activation "
                    "crosses it; mast's default cut at D = 2, `balance_by=auto`; at D = 2 mast and lp are balanced "
                    "whatever the cut, and it is lp's fastest cut too): mast over lp "
                    f"{by['gems mast, comm cut' + tail] / by['gems lp, comm cut' + tail]:.2f}x "
                    f"({paired('gems mast, comm cut' + tail, 'gems lp, comm cut' + tail)})"]
    for B in (16, 8):
        m = B // MICRO
        master = by[f"gems master (eta={m})"]
        ideal = (m + 1) / m  # 1F1B at D = 2 idles 1 / (m + 1) of the time; master at D = 2 does not
        summary.append(f"- global batch {B} ({m} micro-batches of {MICRO}): master over torch Schedule1F1B "
                       f"**{master / by[f'torch Schedule1F1B (m={m})']:.2f}x** "
                       f"({paired(f'gems master (eta={m})', f'torch Schedule1F1B (m={m})')}), over torch ScheduleGPipe "
                       f"**{master / by[f'torch ScheduleGPipe (m={m})']:.2f}x** "
                       f"({paired(f'gems master (eta={m})', f'torch ScheduleGPipe (m={m})')}) (goal >= 1.2x; the bubble bound is "
                       f"{ideal:.2f}x); gems 1f1b over torch Schedule1F1B "
                       f"{by[f'gems 1f1b (m={m})'] / by[f'torch Schedule1F1B (m={m})']:.2f}x, gems gpipe over torch "
                       f"ScheduleGPipe {by[f'gems gpipe (m={m})'] / by[f'torch ScheduleGPipe (m={m})']:.2f}x (same "
                       "schedules: runtime overhead)")
    def vs(a: str, b: str) -> str:
        return f"**{by[a] / by[b]:.2f}x** ({paired(a, b)})"

    summary += [
        f"- interleaved stages, v = 2 per rank, 4 micro-batches of {MICRO}: gems interleaved1f1b over torch "
        f"ScheduleInterleaved1F1B {vs('gems interleaved1f1b (v=2, m=4)', 'torch ScheduleInterleaved1F1B (v=2, m=4)')}; "
        f"over gems 1f1b on 2 stages {vs('gems interleaved1f1b (v=2, m=4)', 'gems 1f1b (m=4)')} (the bubble it saves "
        "against the messages it adds)",
        f"- zero bubble, 4 micro-batches of {MICRO}: gems zbh1 over gems 1f1b {vs('gems zbh1 (m=4)', 'gems 1f1b (m=4)')}; "
        f"over torch ScheduleInterleavedZeroBubble (v = 2, on 4 stages) "
        f"{vs('gems zbh1 (m=4)', 'torch ScheduleInterleavedZeroBubble (v=2, m=4)')}; master (eta=4) with the split "
        f"backward over master (eta=4) {vs('gems master (eta=4), split backward', 'gems master (eta=4)')}",
        "- rounds placed by the actions' measured times (`parallel.rounds_by=time`) over the unit clock's: 1f1b "
        f"(m=4) {vs('gems 1f1b (m=4), rounds by time', 'gems 1f1b (m=4)')}; at the comm cut (uneven stages) "
        f"{vs('gems 1f1b (m=4), comm cut, rounds by time', 'gems 1f1b (m=4), comm cut')}; interleaved1f1b "
        f"{vs('gems interleaved1f1b (v=2, m=4), rounds by time', 'gems interleaved1f1b (v=2, m=4)')}",
    ]
    env = (f"{platform.machine()}, {os.cpu_count()} cores, load average {load_before:.1f} before and {load_after:.1f} "
           f"after (other work on the machine slows the concurrent schedules most); Python {platform.python_version()}, "
           f"torch {torch.__version__}, gloo, 2 ranks x 1 thread, each rank pinned to its own core when there are two")
    text = "\n".join([
        "# gems bench pipeline", "",
        f"ResNet-v2 depth {MODEL['depth']} (width {MODEL['width']}, {MODEL['norm']} norm) on {MODEL['size']}^2 images "
        f"(rows marked {LARGE}^2: on {LARGE}^2 images), "
        f"D = 2 cut at balance {balance} ({balances[LARGE]} on {LARGE}^2; measured layer times), micro-batch {MICRO} "
        "for master (one per replica "
        f"pass) and the 1F1B/GPipe schedules. All contenders share two processes and take turns, one training step "
        f"each per cycle in a rotating order: {cycles} cycles after {warmup} warm-up cycles, medians over cycles. "
        "Every step includes the gradient sum over mirrored copies (mast, master: gems' bucketed reducer, "
        "each bucket between two exchange rounds every holder shares, as `gems run` does) and the SGD update. Every "
        "rank keeps freed host memory "
        "for reuse, as `gems run` does on CPU ranks (`train.host_memory=auto`). Peak tensor memory: parameters, "
        "gradients and the peak a step allocates on top (the CPU allocator's events; what a GPU would count). "
        "The per-cycle ratios pair the two contenders' steps of the same cycle. The *bound* rows run what one mast "
        "rank computes in a step (the whole model, forward and backward, on half of the global batch) in both "
        "processes at once with no communication at all: the best two ranks can do on this machine, where two "
        "busy cores slow each other down (shared memory bandwidth, a shared host).", "",
        *lines, "", *summary, "", "## Environment", "", env, "", "## To reproduce", "",
        "```", "gems bench pipeline    # or: python -m gems.bench.pipeline results/bench", "```", ""])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.md").write_text(text)
    return text


if __name__ == "__main__":
    from gems.bench.common import out_dir_from_argv

    print(bench_pipeline(out_dir_from_argv(sys.argv, "python -m gems.bench.pipeline [OUT_DIR]")))
