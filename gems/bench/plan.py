"""``gems bench plan``: gems plan's predictions against what the same configurations measure here (step time, its
breakdown, peak tensor memory per rank; :func:`bench_plan`), and against published figures (:func:`published`).
Rerun with ``python -m gems.bench.plan [OUT_DIR]``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gems.bench.common import env_block, md_table
from gems.plan.cpu import forget_cpu_rates

COMMAND = "gems bench plan   (or: python -m gems.bench.plan [OUT_DIR])"

STEPS = ["train.steps=10", "train.warmup_steps=2"]
RESNET = ["model=resnet", "model.depth=29", "model.width=0.5", "model.size=64", "model.norm=group"]
CONFIGS: list[tuple[str, list[str]]] = [
    ("CosmoFlow 64^3, S=1", ["model=cosmoflow", "model.size=64", "train.batch_size=2"]),
    ("CosmoFlow 64^3, S=2", ["model=cosmoflow", "model.size=64", "train.batch_size=2", "parallel.spatial=2"]),
    ("CosmoFlow 128^3, S=1", ["model=cosmoflow", "model.size=128", "train.batch_size=1"]),
    ("CosmoFlow 128^3, S=2", ["model=cosmoflow", "model.size=128", "train.batch_size=1", "parallel.spatial=2"]),
    ("CosmoFlow 64^3, R=2", ["model=cosmoflow", "model.size=64", "train.batch_size=4", "parallel.replicas=2"]),
    ("ResNet-v2-29 64^2, lp D=2", RESNET + ["train.batch_size=16", "parallel.pipeline=2", "parallel.schedule=lp"]),
    ("ResNet-v2-29 64^2, 1f1b D=2 m=4", RESNET + ["train.batch_size=16", "parallel.pipeline=2",
                                                 "parallel.schedule=1f1b", "parallel.micro_batches=4"]),
    ("ResNet-v2-29 64^2, mast D=2", RESNET + ["train.batch_size=16", "parallel.pipeline=2", "parallel.schedule=mast"]),
]


# Published figures beside the model's predictions (planner only: nothing runs). The clusters as the
# planner's keys: Lassen-like V100 nodes for the GEMS and CosmoFlow papers (4 V100 16 GB a node, NVLink2
# 75 GB/s a GPU pair, two EDR InfiniBand rails, 25 GB/s a node), NVIDIA Eos for MLPerf HPC v3.0 (8 H100 a
# node, NVLink4 450 GB/s a direction, one NDR400 NIC of 50 GB/s a GPU), Perlmutter's preset for v2.0.
LASSEN = ["cluster=slurm", "cluster.account=x", "cluster.gpu=v100-16gb", "cluster.gpus_per_node=4",
          "cluster.gpu_memory_gb=16", "cluster.intra_node_GBps=75", "cluster.intra_node_latency_us=3",
          "cluster.inter_node_GBps=25", "cluster.inter_node_latency_us=5"]
EOS = ["cluster=slurm", "cluster.account=x", "cluster.gpu=h100", "cluster.gpus_per_node=8", "cluster.gpu_memory_gb=80",
       "cluster.intra_node_GBps=450", "cluster.intra_node_latency_us=3", "cluster.inter_node_GBps=50",
       "cluster.inter_node_latency_us=5"]
PERLMUTTER = ["cluster=perlmutter", "cluster.account=x"]
# the published runs read their samples from files staged on the nodes (gems's synthetic generator, on the
# host, would cost more than these steps: gems plan says so for data=synthetic); the path is never read
STAGED = ["data=files", "data.path=/staged"]
GEMS_RESNET = ["+experiment=gems_resnet1001", "model.size=256", *STAGED]
COSMO512 = ["+experiment=cosmoflow512_weak", "train.precision=fp32", *STAGED]
MLPERF = ["model=cosmoflow_mlperf", *STAGED, "parallel.replicas=512", "train.batch_size=512", "train.precision=bf16"]
GEMS_EFFICIENCY = 0.9732  # GEMS (SC20): ResNet-1k weak scaling to 1024 V100s
JITTER_PROBE = 0.01  # cluster.jitter of the plan that finds the jitter a published efficiency implies
MLPERF_TRAIN_SAMPLES = 524288  # the MLPerf HPC CosmoFlow training set (an epoch), as assumed here


def published() -> str:
    """The GEMS, CosmoFlow-512^3 and MLPerf HPC CosmoFlow figures beside what the planner predicts for them."""
    from gems.config import compose
    from gems.plan import make_plan

    def pred(overrides: list[str]) -> Any:
        plan = make_plan(compose(overrides), suggest=False)
        return plan, plan.prediction

    rows = []
    # GEMS (SC20): ResNet-1k, GEMS-Hybrid weak scaling to 1024 V100s at 97.32% efficiency
    _, one = pred([*GEMS_RESNET, *LASSEN, "parallel.replicas=1"])
    plan, big = pred([*GEMS_RESNET, *LASSEN, "parallel.replicas=256"])
    eff = big.throughput / 256 / one.throughput
    # the rank-to-rank jitter that would make the model lose what the published run lost: the replicas' waits
    # are linear in cluster.jitter (gems.plan.timing.rendezvous_wait), so one probe gives it
    _, probe = pred([*GEMS_RESNET, *LASSEN, "parallel.replicas=256", f"cluster.jitter={JITTER_PROBE}"])
    implied = JITTER_PROBE * (one.step_s / GEMS_EFFICIENCY - big.step_s) / max(probe.step_s - big.step_s, 1e-12)
    rows.append(["GEMS ResNet-1001, MASTER D=4, eta=4, R=1 -> 256 (1024 V100)",
                 f"{100 * GEMS_EFFICIENCY:.2f}% weak-scaling efficiency",
                 f"{100 * eff:.2f}% without jitter ({one.step_s:.3g} s -> {big.step_s:.3g} s a step; peak "
                 f"{plan.worst.bytes.total / 2**30:.1f} GiB a GPU); the published figure is what the model gives "
                 f"with cluster.jitter={implied:.2g} ({implied * 1e3:.2g} ms of rank-to-rank spread over a second of "
                 "compute)",
                 "256^2 images (at 1024^2 the planner finds 75 GiB a GPU at D=4: more than a V100 holds); losses "
                 "modelled: the exposed gradient all-reduce and, with cluster.jitter, the wait for the slowest of "
                 "the 256 replicas (no published figure for Lassen's jitter: unset)"])
    # Oyama et al. (TPDS 2021): CosmoFlow 512^3 on up to 2K V100s, S = 4 depth slabs, data parallel on top
    _, one = pred([*COSMO512, *LASSEN, "parallel.replicas=1"])
    plan, big = pred([*COSMO512, *LASSEN, "parallel.replicas=512"])
    _, jit = pred([*COSMO512, *LASSEN, "parallel.replicas=512", f"cluster.jitter={implied:.3g}"])
    _, jit1 = pred([*COSMO512, *LASSEN, "parallel.replicas=1", f"cluster.jitter={implied:.3g}"])
    eff = big.throughput / 512 / one.throughput
    rows.append(["CosmoFlow 512^3, S=4, R=1 -> 512 (2048 V100)", "trained on up to 2K V100s (no throughput in the "
                 "abstract)", f"{100 * eff:.1f}% weak-scaling efficiency, {big.throughput:.4g} samples/s "
                 f"({one.step_s:.3g} s -> {big.step_s:.3g} s a step; {plan.worst.bytes.total / 2**30:.1f} GiB a GPU); "
                 f"with the jitter the GEMS figure implies, {100 * jit.throughput / 512 / jit1.throughput:.1f}% "
                 f"({jit.throughput:.4g} samples/s)",
                 "fp32, one sample a replica"])
    # MLPerf HPC CosmoFlow: about 2.1 min on 512 H100 (v3.0), 3.8 min on 512 A100 (v2.0), global batch 512
    for name, cluster, minutes in (("512 H100 (Eos, v3.0)", EOS, 2.1), ("512 A100 (Perlmutter, v2.0)", PERLMUTTER, 3.8)):
        _, pr = pred([*MLPERF, *cluster])
        epoch = MLPERF_TRAIN_SAMPLES / pr.throughput
        rows.append([f"MLPerf HPC CosmoFlow 128^3, R=512, batch 512, {name}", f"about {minutes} min to train",
                     f"{pr.step_s * 1e3:.3g} ms a step, {epoch:.3g} s an epoch of {MLPERF_TRAIN_SAMPLES} samples: "
                     f"{minutes * 60 / epoch:.0f} epochs in {minutes} min",
                     "bf16; the model predicts steps, not the epochs to converge, start-up, staging or evaluation"])
    return "\n".join(["## Published figures beside the model's predictions", "",
                      "Planner only (nothing runs); the cluster figures are in `gems/bench/plan.py`.", "",
                      md_table(["study", "published", "predicted by gems plan", "assumed"], rows)])


def _links(rank: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    peer = 1 - rank
    for name, n, reps in (("small", 2, 400), ("large", 4 * 2**20 // 4, 20)):
        t, got = torch.zeros(n), torch.empty(n)

        def exchange() -> None:  # both ways at once, as a halo exchange and each step of a ring all-reduce
            for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, peer), dist.P2POp(dist.isend, t, peer)]):
                w.wait()

        for _ in range(3):  # warm up the connection
            exchange()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            exchange()
        res[name] = ((time.perf_counter() - t0) / reps, n * 4)
    res["late"] = [_delivery(rank, late) for late in (False, True)]
    res["jitter"] = _jitter(rank)
    if rank == 1:  # the receiver knows the delivery times
        Path(out + ".late").write_text(json.dumps(res["late"]))
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


#: the segments of compute _jitter times between two ranks' meetings (convolutions of 16^3: about 1 ms each here)
JITTER_SEGMENTS = (16, 64)


def _jitter(rank: int, reps: int = 40) -> float:
    """How much the same compute varies between two ranks computing at once: both run the same number of
    convolutions, meet (a small all-reduce) and again, ``reps`` times for each segment length; from the
    differences of their times, the standard deviation of one rank's time over one second of compute
    (``cluster.jitter``: it grows as the square root of the time; the mean over the segment lengths)."""
    import statistics

    import torch
    import torch.distributed as dist

    conv = torch.nn.Conv3d(8, 8, 3, padding=1)
    x = torch.randn(1, 8, 16, 16, 16)
    z = torch.zeros(1)
    est = []
    for n in JITTER_SEGMENTS:
        mine = []
        with torch.no_grad():
            for _ in range(reps + 2):
                dist.all_reduce(z)
                t0 = time.perf_counter()
                for _ in range(n):
                    conv(x)
                mine.append(time.perf_counter() - t0)
        times = torch.tensor(mine[2:], dtype=torch.float64)  # the first two warm up
        both = [torch.empty_like(times) for _ in range(2)]
        dist.all_gather(both, times)
        diff = (both[0] - both[1]).tolist()
        mean = float(torch.cat(both).mean())
        est.append(statistics.stdev(diff) / 2 ** 0.5 / mean ** 0.5)
    return sum(est) / len(est)


SENDER_COMPUTES_S = 0.1  # how long the sender of _delivery's message computes on after posting it


def _delivery(rank: int, late: bool, reps: int = 7) -> float:
    """Seconds from rank 0 posting a small message to rank 1 having it, while rank 0 computes on for
    SENDER_COMPUTES_S (as a rank does after posting its halo sends); rank 1 posts its receive at once, or
    ``late`` (after computing a third of that). The median over ``reps``; clocks are this machine's."""
    import torch
    import torch.distributed as dist

    conv = torch.nn.Conv3d(8, 8, 3, padding=1)
    x = torch.randn(1, 8, 16, 16, 16)

    def compute(seconds: float) -> None:
        end = time.perf_counter() + seconds
        with torch.no_grad():
            while time.perf_counter() < end:
                conv(x)

    t, stamp, got = torch.zeros(256), torch.zeros(1, dtype=torch.float64), []
    for _ in range(reps):
        dist.barrier()
        if rank == 0:
            stamp[0] = time.perf_counter()
            work = dist.isend(t, 1)
            compute(SENDER_COMPUTES_S)
            work.wait()
            dist.send(stamp, 1)
        else:
            if late:
                compute(SENDER_COMPUTES_S / 3)
            dist.recv(t, 0)
            arrived = time.perf_counter()
            dist.recv(stamp, 0)
            got.append(arrived - float(stamp[0]))
    return sorted(got)[reps // 2] if got else 0.0


def measure_link() -> tuple[float, float, tuple[float, float], float]:
    """(bandwidth per direction in GB/s, latency in us) of the link between two gloo processes on this machine,
    measured as the runtime uses it: messages exchanged both ways at once (a halo exchange, a step of a ring
    all-reduce; a one-way ping-pong reads a faster link than those get on this project's VM); and the
    seconds a small message takes to arrive while its sender computes on (:func:`_delivery`): with its
    receive posted first, and posted late; and how much two ranks' compute varies (:func:`_jitter`)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "link.json")
        mp.start_processes(_links, args=(port, out), nprocs=2, start_method="spawn")
        res = json.loads(Path(out).read_text())
        first, late = json.loads(Path(out + ".late").read_text())
    lat = res["small"][0]
    t_big, n_big = res["large"]
    return n_big / max(t_big - lat, 1e-9) / 1e9, lat * 1e6, (first, late), res["jitter"]


def _predict(overrides: list[str]) -> dict[str, Any]:
    from gems.config import compose
    from gems.plan import make_plan

    plan = make_plan(compose(overrides), suggest=False)
    pr = plan.prediction
    return {"step": pr.step_s, "breakdown": pr.breakdown, "tensor": plan.worst.bytes.total}


def _mean(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two predictions of one configuration averaged (the tensor memory does not depend on the rates)."""
    return {"step": (a["step"] + b["step"]) / 2, "tensor": a["tensor"],
            "breakdown": {k: (a["breakdown"][k] + b["breakdown"][k]) / 2 for k in a["breakdown"]}}


def _measure(overrides: list[str], results: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = subprocess.run([sys.executable, "-m", "gems.cli", "run", f"results.dir={results}", *overrides],
                         capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"gems run {' '.join(overrides)} failed: {out.stderr[-1500:]}")
    rec = json.loads(max(results.glob("*.json"), key=lambda p: p.stat().st_mtime).read_text())
    mem = rec["peak_memory_bytes"]
    return {"step": rec["step_time_s"]["median"], "breakdown": rec["time_breakdown_s"],
            "tensor": mem.get("tensor_max") or mem["max"]}


def bench_plan(out_dir: Path | str = "results/bench") -> str:
    """Each configuration that fits this machine (CosmoFlow 64³ and 128³ at S = 1, 2; ResNet-v2 under lp, 1f1b and
    mast at D = 2; a replicated run) planned, then trained by ``gems run`` (gloo, one thread a rank), its record's
    step time, breakdown and tensor memory set beside the prediction. The links are measured first
    (:func:`measure_link`) and handed to the planner as the preset's figures, as a user calibrating a cluster would.
    On this shared machine each configuration's CPU rates are timed just before its run and just after, and the
    prediction is the mean of the two (the VM drifts 20-30% over minutes: one side alone moved a prediction by up
    to 40%); a rerun still moves the ratios by 10-20%. Goals: step time within 25%, peak tensor memory within 10%.
    Returns the table."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bw, lat, delivery, jitter = measure_link()
    link = [f"cluster.intra_node_GBps={bw:.3g}", f"cluster.intra_node_latency_us={lat:.3g}",
            f"cluster.jitter={jitter:.3g}"]
    rows, detail = [], []
    step_ok = mem_ok = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, ov) in enumerate(CONFIGS):
            overrides = [*ov, *STEPS, *link]
            # this machine's rates timed anew just before and just after the run they predict (side by side:
            # the VM's speed drifts by 20-30% over minutes), the prediction the mean of the two plans
            forget_cpu_rates()
            before = _predict(overrides)
            meas = _measure(overrides, Path(tmp) / f"c{i}")
            forget_cpu_rates()
            pred = _mean(before, _predict(overrides))
            r_step = pred["step"] / meas["step"]
            r_mem = pred["tensor"] / meas["tensor"]
            step_ok += abs(r_step - 1) <= 0.25
            mem_ok += abs(r_mem - 1) <= 0.10
            rows.append([label, pred["step"], meas["step"], r_step, "yes" if abs(r_step - 1) <= 0.25 else "no",
                         pred["tensor"] / 2**20, meas["tensor"] / 2**20, r_mem,
                         "yes" if abs(r_mem - 1) <= 0.10 else "no"])
            terms = ("compute", "halo", "pipeline_comm", "allreduce", "bubble_or_wait", "data")
            detail.append([label] + [f"{pred['breakdown'][k]:.3g} / {meas['breakdown'].get(k, 0.0):.3g}" for k in terms])
            print(f"{label}: predicted {pred['step']:.3g} s, measured {meas['step']:.3g} s; tensor memory "
                  f"{pred['tensor'] / 2**20:.0f} / {meas['tensor'] / 2**20:.0f} MiB", flush=True)
    n = len(CONFIGS)
    text = ["# gems bench plan", "",
            f"gems plan's predictions against `gems run` on this machine ({n} configurations, {STEPS[0]}, "
            f"{STEPS[1]}, one thread a rank; each prediction the mean of two plans, with this machine's rates "
            "timed just before and just after the run). Links measured first by two gloo processes exchanging messages both "
            f"ways at once: {bw:.3g} GB/s a direction, {lat:.3g} us a message (given to the planner as "
            "`cluster.intra_node_GBps`, "
            "`cluster.intra_node_latency_us`); two processes computing the same convolutions between meetings "
            f"differ by {jitter * 1e3:.3g} ms (standard deviation of one's time over a second of compute, given as "
            "`cluster.jitter`: the planner's waits where ranks meet). While the sender computes on for "
            f"{SENDER_COMPUTES_S * 1e3:.0f} ms after posting a small message, it arrives after "
            f"{delivery[0] * 1e3:.2f} ms when the receive was posted first, and after {delivery[1] * 1e3:.0f} ms "
            f"when the receive is posted {SENDER_COMPUTES_S / 3 * 1e3:.0f} ms late (the model counts latency + "
            "bytes / bandwidth: not the wait for a neighbour that is late, nor the sender's delay).", "",
            md_table(["configuration", "predicted step (s)", "measured step (s)", "predicted / measured",
                      "within 25%", "predicted peak tensor MiB", "measured peak tensor MiB", "predicted / measured",
                      "within 10%"], rows),
            f"Step time within 25%: {step_ok} of {n}; peak tensor memory within 10%: {mem_ok} of {n}.", "",
            "Breakdown, predicted / measured (seconds per step; a measured record counts pipeline waits as "
            "bubble_or_wait and the rest of the step as compute):", "",
            md_table(["configuration", "compute", "halo", "pipeline_comm", "allreduce", "bubble_or_wait", "data"],
                     detail),
            published(), env_block(COMMAND)]
    table = "\n".join(text)
    (out_dir / "plan.md").write_text(table)
    return table


if __name__ == "__main__":
    print(bench_plan(sys.argv[1] if len(sys.argv) > 1 else "results/bench"))
