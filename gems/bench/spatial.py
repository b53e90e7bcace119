"""``gems bench spatial``: does cutting one CosmoFlow sample in two pay off? CosmoFlow on one 4 x 128³ sample, a
training step serially (S = 1) and cut along depth (S = 2, two gloo processes, one thread each): the step's speedup,
each rank's peak tensor memory and resident growth, and the share of the step spent on halos, layer by layer
(docs/benchmarks.md). Rerun with ``python -m gems.bench.spatial [OUT_DIR]``.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

COMMAND = "python -m gems.bench.spatial [OUT_DIR]   (or: gems bench spatial out=DIR)"

#: name -> (processes, mode, host memory); modes: serial, overlap / sync (S=2 with / without overlap), and the
#: bounds: bound (plain torch), bound_fix (the spatial layers' kernel choice), bound_sum (bound_fix + gradient sum).
#: Host memory "keep" is what `gems run` does on CPU ranks (train.host_memory=auto); "release" is glibc's default.
RUNS: dict[str, tuple[int, str, str]] = {
    "S=1 (serial)": (1, "serial", "keep"),
    "S=2 (depth, overlap)": (2, "overlap", "keep"),
    "S=2 (depth, no overlap)": (2, "sync", "keep"),
    "S=2 (depth, overlap), gradient sum over MPI": (2, "overlap+mpi", "keep"),
    "S=1 (serial), host_memory=release": (1, "serial", "release"),
    "S=2 (depth, overlap), host_memory=release": (2, "overlap", "release"),
    "bound: serial model on a half slab x2, plain torch": (2, "bound", "keep"),
    "bound: serial model on a half slab x2, conv fix": (2, "bound_fix", "keep"),
    "bound: ... conv fix + gradient sum": (2, "bound_sum", "keep"),
}
#: the serial run each row's speedup and memory ratio is taken against
BASELINE = {"release": "S=1 (serial), host_memory=release", "keep": "S=1 (serial)"}


def _fixed_convs(model: Any) -> Any:
    """The serial model with every Conv3d computed through ``conv_nd`` (same parameters)."""
    import torch
    from torch import nn

    from gems.spatial.conv_backend import conv_nd

    class FixedConv(nn.Module):
        def __init__(self, conv: nn.Conv3d) -> None:
            super().__init__()
            self.conv = conv

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            c = self.conv
            return conv_nd(x, c.weight, c.bias, c.stride, c.padding, c.dilation, c.groups)

    return nn.Sequential(*[FixedConv(m) if isinstance(m, nn.Conv3d) else m for m in model])


def bench_rank(rank: int, world: int, size: int, steps: int, warmup: int, mode: str,
               host_memory: str = "keep", bucket_mb: float | None = None, grad_comm: str = "gloo") -> dict[str, Any]:
    """One rank of one configuration: step times, peak RSS growth, peak tensor bytes, halo and gradient-sum seconds."""
    import torch
    import torch.distributed as dist

    from gems.bootstrap import keep_host_memory
    from gems.data.synthetic import sample_input
    from gems.layers import batch_context
    from gems.memory import MemoryMeter, persistent_bytes, step_peak_bytes
    from gems.models import build_model
    from gems.replication import GradientReducer
    from gems.spatial import SpatialContext, apply_spatial

    if host_memory == "keep":
        keep_host_memory()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec = build_model(dict(name="cosmoflow", size=size, width=1.0, dropout=0.2))
    shape = spec.input_shape
    sctx = None
    model = spec.module
    slices = None
    spatial = mode in ("overlap", "sync")
    if spatial:
        sctx = SpatialContext(None, list(range(world)), (world,), (0,), (rank,), overlap=mode == "overlap")
        model = apply_spatial(model, sctx, spec.spatial_end)
        slices = sctx.local_slices(shape[1:])
    elif mode.startswith("bound"):  # this rank's half plus one halo plane, no communication
        half = shape[1] // 2 + 1
        lo = 0 if rank == 0 else shape[1] - half
        slices = (slice(lo, lo + half), slice(None), slice(None))
        if mode in ("bound_fix", "bound_sum"):
            model = _fixed_convs(model)
    x = sample_input(0, 0, shape, slices).unsqueeze(0)
    if sctx:
        sctx.mark(x, shape[1:])
    target = torch.zeros(1, spec.num_outputs)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-4)
    if bucket_mb is None:  # what `gems run` uses: comm.bucket_mb's default
        from gems.config import CommConf

        bucket_mb = CommConf().bucket_mb
    group: Any = dist.group.WORLD if spatial or mode == "bound_sum" else None
    if group is not None and grad_comm == "mpi":  # comm.backend=mpi: the gradient sum through mpi4py
        from mpi4py import MPI

        from gems.replication import MPIGroup

        group = MPIGroup(MPI.COMM_WORLD, list(range(world)))
    reducer = GradientReducer(model, group, bucket_mb)
    times: list[float] = []
    grad_sum: list[float] = []

    def one_step(step: int) -> float:
        reducer.start_step()
        with batch_context(0, step, [0]):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out, target) / (world if sctx else 1)
        loss.backward()
        waited = reducer.finish()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return waited

    if world > 1:
        dist.barrier()
    meter = MemoryMeter(torch.device("cpu"))
    meter.reset()
    for step in range(warmup + steps):
        if step == warmup and sctx:
            sctx.halo_seconds.clear()
        t0 = time.perf_counter()
        waited = one_step(step)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            grad_sum.append(waited)
    peak = meter.peak() // 1024  # KiB
    halo = dict(sctx.halo_seconds) if sctx else {}
    # tensor memory, as a GPU would count it: what lives across steps plus the peak a step allocates on top
    held = persistent_bytes(params, opt, [x, target, *model.buffers()])
    if world > 1:
        dist.barrier()
    in_step = step_peak_bytes(lambda: one_step(warmup + steps))
    return {"times": times, "peak_kib": peak, "grad_sum": grad_sum, "halo": halo,
            "tensor_peak": held + in_step, "tensor_held": held}


def mpi_rank_main(out: str, size: int, steps: int, warmup: int, mode: str, host: str) -> None:
    """One rank under ``mpiexec`` (``comm.backend=mpi``: gloo for the halos, MPI for the gradient sum);
    rank 0 writes every rank's result to ``out`` as JSON."""
    import datetime as dt

    import torch.distributed as dist

    from gems.bootstrap import discover

    rank, world, _, addr, port, _, comm = discover("mpi")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=dt.timedelta(seconds=600))
    res = bench_rank(rank, world, size, steps, warmup, mode, host, grad_comm="mpi")
    every = comm.gather(res, root=0)
    if rank == 0:
        Path(out).write_text(json.dumps(every))
    dist.destroy_process_group()


def _under_mpiexec(world: int, size: int, steps: int, warmup: int, mode: str, host: str) -> list[dict[str, Any]] | None:
    """Run one configuration under mpiexec; None when there is no MPI launcher."""
    import subprocess
    import tempfile

    from gems.errors import ConfigError
    from gems.launch.local import mpiexec_path

    try:
        mpiexec = mpiexec_path()
    except ConfigError:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ranks.json")
        code = (f"from gems.bench.spatial import mpi_rank_main; "
                f"mpi_rank_main({out!r}, {size}, {steps}, {warmup}, {mode!r}, {host!r})")
        run = subprocess.run([mpiexec, "-n", str(world), sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=1800)
        if run.returncode != 0:
            raise RuntimeError(f"mpiexec run failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
        return json.loads(Path(out).read_text())


def _summary(rounds: list[list[dict[str, Any]]], steps: int) -> dict[str, float]:
    """Median over rounds of: step time (a step ends when the slowest rank ends), peak RSS growth and peak
    tensor bytes (max over ranks), halo share and gradient-sum wait share (max over ranks)."""
    step_r, peak_r, tensor_r, halo_r, grad_r = [], [], [], [], []
    for ranks in rounds:
        step = statistics.median(max(ts) for ts in zip(*[r["times"] for r in ranks]))
        step_r.append(step)
        peak_r.append(max(r["peak_kib"] for r in ranks))
        tensor_r.append(max(r["tensor_peak"] for r in ranks))
        halo_r.append(max(sum(r["halo"].values()) for r in ranks) / (step * steps) if ranks[0]["halo"] else 0.0)
        grad_r.append(max(statistics.median(r["grad_sum"]) for r in ranks) / step)
    return {"step": statistics.median(step_r), "lo": min(step_r), "hi": max(step_r), "peak": statistics.median(peak_r),
            "tensor": statistics.median(tensor_r), "halo": statistics.median(halo_r), "grad": statistics.median(grad_r)}


def bench_spatial(out_dir: str | os.PathLike = "results/bench", size: int = 128, steps: int = 3, warmup: int = 1,
                  rounds: int = 5) -> str:
    """Run every configuration of :data:`RUNS` in ``rounds`` rounds; write ``spatial.md`` and ``spatial.json``.

    Each round runs every configuration once (S = 1, S = 2 with and without overlap, the bounds), so every one sees
    the same background noise, and the table gives the median over rounds with the spread. Runs keep freed host
    memory as ``gems run`` does on CPU ranks (two rows repeat S = 1 and 2 with glibc's defaults), and sum gradients
    with the run's own GradientReducer. The bounds: the serial model on a half-depth slab (65 of 128 planes: the part
    and its halo plane) in two concurrent processes with no halo exchange, what two ranks could at best do;
    ``plain`` with torch's convolutions as they are, ``conv fix`` through
    :func:`gems.spatial.conv_backend.conv_nd`, and ``+ gradient sum`` with the weight gradients summed over the two,
    which any spatial scheme needs."""
    import torch

    from gems.bench.common import cpu_name
    from gems.launch.world import run_world

    load_before = os.getloadavg()
    results: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in RUNS}
    for _ in range(rounds):
        for name, (world, mode, host) in RUNS.items():
            if mode.endswith("+mpi"):
                res = _under_mpiexec(world, size, steps, warmup, mode[:-4], host)
                if res is None:  # no MPI here: leave the row out
                    continue
                results[name].append(res)
            else:
                results[name].append(run_world(bench_rank, world, size, steps, warmup, mode, host, timeout=1800))
    results = {name: rs for name, rs in results.items() if rs}
    load_after = os.getloadavg()
    summ = {name: _summary(rs, steps) for name, rs in results.items()}
    mib = 1 << 20
    lines = [
        f"# Spatial parallelism: CosmoFlow 4x{size}^3, batch 1, one thread per rank",
        "",
        "| run | median step (s) | range over rounds (s) | speedup | peak tensor memory per rank (MiB) | "
        "tensor memory vs S=1 | peak RSS growth per rank (MiB) | RSS vs S=1 | halo share of step | "
        "gradient-sum wait share |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in summ.items():
        base = summ[BASELINE[RUNS[name][2]]]
        lines.append(f"| {name} | {s['step']:.3f} | {s['lo']:.3f}-{s['hi']:.3f} | {base['step'] / s['step']:.2f}x | "
                     f"{s['tensor'] / mib:.0f} | {s['tensor'] / base['tensor']:.2f}x | "
                     f"{s['peak'] / 1024:.0f} | {s['peak'] / base['peak']:.2f}x | {100 * s['halo']:.1f}% | "
                     f"{100 * s['grad']:.1f}% |")
    lines += ["", "Goals: speedup >= 1.8x (ideal 2x), memory <= 0.6x of S=1. Each row is compared with the S=1 run "
              "of the same host-memory setting.",
              "",
              "- *Peak tensor memory* is what a GPU would count (`torch.cuda.max_memory_allocated`): the tensors that "
              "live across steps (parameters, optimizer state, the input part) plus the peak a training step "
              "allocates on top, read from the CPU allocator's events (gems.memory.step_peak_bytes). "
              "*Peak RSS growth* is the process's resident-memory high-water mark over the step loop: it also counts "
              "what glibc keeps (all of it with host_memory=keep) and its fragmentation.",
              "- *host_memory*: `gems run` keeps freed host memory in the process on CPU ranks "
              "(`train.host_memory=auto`, see gems.bootstrap.keep_host_memory); `release` is glibc's default, "
              "where every step page-faults its large activations in again. Keeping makes both S=1 and S=2 faster "
              "and lowers the S=2 speedup: S=1 had more to lose to page faults.",
              "- *gradient sum over MPI*: `comm.backend=mpi` as `gems run` does it: the ranks start under "
              "mpiexec, halos still go over gloo, the weight-gradient sum goes through mpi4py (MPICH sums through "
              "shared memory, without transport threads competing with the compute).",
              "- The bounds run the serial model on 65 of the 128 depth planes (a part and its halo plane) in two "
              "concurrent processes with no communication: the best two ranks could do on this machine. "
              "`plain` uses torch's kernels as they are (torch picks its slow reference kernel for the third "
              "convolution's slab shape), `conv fix` the kernel choice the spatial layers make, `+ gradient sum` "
              "adds the one communication no spatial scheme avoids: summing the weight gradients (19 MB) over "
              "the two processes with the runtime's reducer (gloo over TCP loopback, whose transport threads take CPU "
              "from the compute of both ranks). S=2 pays that "
              "and a halo exchange at every layer (a two-way sync point; per layer below). A two-rank step ends "
              "when the slower core ends, which caps every two-rank row alike on a shared machine.",
              "",
              "## Halo time per layer (S=2, no overlap; rank 0; packing + waiting + backward exchange)", "",
              "| layer | halo s per step | share of step |", "| --- | ---: | ---: |"]
    r0 = [rs[0] for rs in results["S=2 (depth, no overlap)"]]
    step0 = statistics.median(t for r in r0 for t in r["times"])
    for label in r0[0]["halo"]:
        sec = statistics.median(r["halo"].get(label, 0.0) for r in r0) / steps
        lines.append(f"| {label} | {sec:.4f} | {100 * sec / step0:.2f}% |")
    lines += ["", "## Environment", "",
              f"- torch {torch.__version__}, Python {platform.python_version()}, gloo backend on one machine",
              f"- CPU: {cpu_name()}, {os.cpu_count()} logical cores; 1 thread per rank",
              f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
              f"- load average (1 min) before / after: {load_before[0]:.2f} / {load_after[0]:.2f} "
              "(other processes on the machine skew the 2-rank timings)",
              f"- {rounds} rounds, each running every configuration once (in the table's order); per run "
              f"{warmup} warm-up + {steps} measured steps, then one profiled step for the tensor memory; "
              "medians over rounds",
              "- peak RSS = VmHWM growth over the step loop (warm-up included)",
              "", "## To reproduce", "", f"    {COMMAND}", ""]
    text = "\n".join(lines)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spatial.md").write_text(text)
    (out / "spatial.json").write_text(json.dumps(results, indent=1))
    return text


if __name__ == "__main__":
    from gems.bench.common import out_dir_from_argv

    print(bench_spatial(out_dir_from_argv(sys.argv, "python -m gems.bench.spatial [OUT_DIR]")))
