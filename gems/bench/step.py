"""``gems bench step``: is a gems step on one GPU as fast as MLPerf's best (MLPerf HPC v3.0: CosmoFlow at 200 samples/s
an H100, 224 in its 32-GPU instances, the whole step one CUDA graph), and as the best plain loop? gems graphed, eager
and with the whole step in the graph, against a plain loop and that loop captured whole, on MLPerf's CosmoFlow at
batch 1 and 8 and the science configuration (:func:`bench_step`; docs/benchmarks.md). On a CPU the same code runs
at 32³: the plumbing, not the figures.
"""
from __future__ import annotations

import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gems.bench.common import env_block, md_table, median, write
from gems.config import section

JOB = ["model=cosmoflow_mlperf", "model.dropout=0", "train.precision=bf16", "train.check_fit=false"]
SCIENCE = ["model=cosmoflow", "model.size=128", "train.batch_size=4", "train.precision=fp32", "data=files",
           "data.augment=cube", "train.check_fit=false"]
GOAL_RATE, GOAL_RATIO, GOAL_DATA, GOAL_SCIENCE_S = 224.0, 0.95, 0.05, 0.020


def _gems(overrides: list[str], device: torch.device, steps: int, warmup: int, folder: str) -> dict[str, Any]:
    """gems's loop on ``device`` in this process, its files under ``folder``; its record."""
    from omegaconf import open_dict

    from gems.bootstrap import World
    from gems.config import compose
    from gems.rank.loop import train

    cfg = compose([*overrides, f"train.steps={steps}", f"train.warmup_steps={warmup}", f"train.device={device.type}",
                   f"results.dir={folder}"])
    with open_dict(cfg):
        cfg.run_id = f"bench-step-{time.time_ns()}"
    world = World(0, 1, 0, "127.0.0.1", 0, "single", device, "nccl" if device.type == "cuda" else "gloo",
                  "torch", None, "localhost")
    with contextlib.redirect_stdout(io.StringIO()):
        return dict(train(cfg, world))


def _plain(overrides: list[str], device: torch.device, steps: int, warmup: int, graphed: bool) -> float:
    """Median step seconds of the plain loop a user would write (the module channels-last, one batch made once on
    the device, autocast, one synchronisation a step), its whole step one CUDA graph with ``graphed``: the physical
    control, what the device does with no host in the way."""
    from gems.config import compose
    from gems.models import build_model
    from gems.rank.optim import make_optimizer

    cfg = compose(overrides)
    torch.manual_seed(0)
    spec = build_model(section(cfg, "model"))
    model = spec.module.to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last_3d if len(spec.input_shape) == 4 else torch.channels_last)
    # the configured optimizer; captured whole, a capturable one (Adam keeps its step count on the device)
    opt = make_optimizer(cfg, list(model.parameters()), capturable=graphed)
    B = int(cfg.train.batch_size)
    x = torch.randn(B, *spec.input_shape, device=device)
    y = torch.randn(B, spec.num_outputs, device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(cfg.train.precision))

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None,
                            cache_enabled=not graphed):
            loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        return loss

    run = step
    if graphed:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture's stream, as torch's graphs documentation does
            for _ in range(3):
                opt.zero_grad(set_to_none=True)
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        opt.zero_grad(set_to_none=True)
        with torch.cuda.graph(graph):
            step()

        def run() -> torch.Tensor:
            graph.replay()
            return x
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run()
        if not graphed:
            opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return median(times[warmup:])


def _files(root: Path, size: int, n: int) -> str:
    from gems.data.synth import write_synthetic

    path = root / f"mlperf{size}"
    if not path.exists():
        write_synthetic(path, n, (4, size, size, size))
    return str(path)


def _figures(r: dict[str, Any], batch: int) -> dict[str, Any]:
    step = float(r["step_time_s"]["median"])
    hw = r.get("hardware") or {}
    return {"rate": batch / step, "step": step, "data": float(r["time_breakdown_s"]["data"]) / step,
            "flops_frac": hw.get("flops_fraction"), "graphed": bool(r.get("cuda_graphs"))}


def bench_step(out_dir: Path, overrides: list[str] | None = None, rounds: int = 3) -> str:
    """The contenders alternated in ``rounds`` rounds in one process, on ``model=cosmoflow_mlperf`` in bf16 with SGD
    and momentum, no dropout (as NVIDIA's run): gems (its loop, its reader on HDF5 files of 128³ x 4 int16 counts,
    its model replayed from CUDA graphs), gems eager, gems with the optimizer's update in the graph too (GPU, batch
    1), the plain loop and the plain loop graphed (:func:`_plain`); then the science configuration (CosmoFlow 128³,
    batch 4, ``data.augment=cube``, gems only). A row: samples/s, the ratio to the graphed plain loop of its round,
    the share of gems's step spent waiting for data, the model's fraction of the device's peak; every gems record is
    written beside the table (``step-records.json``). Goals (issue 59): gems at batch 1 >= 224 samples/s and >= 0.95
    of the graphed plain loop, its data wait <= 5% of its step, the science step <= 20 ms. Returns the table."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # a CPU runs the plumbing alone (one batch, the fewest steps that leave measured ones): its times are no figure
    size, batches, steps, warmup, files = (128, (1, 8), 40, 10, 64) if cuda else (32, (1,), 3, 1, 4)
    if not cuda:
        rounds = min(rounds, 1)
    given = list(overrides or [])
    rows, records = [], []
    with tempfile.TemporaryDirectory(prefix="gems-bench-step-") as tmp:
        data = ["data=files", f"data.path={_files(Path(tmp), size, files)}"]
        for B in batches:
            base = [*JOB, f"model.size={size}", f"train.batch_size={B}", *given]
            got: dict[str, list[Any]] = {k: [] for k in ("gems", "gems eager", "gems whole step", "plain",
                                                         "plain graphed")}
            mine = [("gems", []), ("gems eager", ["train.cuda_graphs=false"])]
            if cuda and B == 1:  # (gems.rank.graphs: the whole step in the graph, measured against the update outside)
                mine.append(("gems whole step", ["train.graph_optimizer=true"]))
            for _ in range(rounds):  # alternated: every contender sees the same machine
                for name, extra in mine:
                    r = _gems([*base, *data, *extra], device, steps, warmup, tmp)
                    records.append({"contender": name, "batch": B, "record": r})
                    got[name].append(_figures(r, B))
                got["plain"].append(B / _plain(base, device, steps, warmup, graphed=False))
                if cuda:
                    got["plain graphed"].append(B / _plain(base, device, steps, warmup, graphed=True))
            control = median(got["plain graphed"]) if got["plain graphed"] else None
            for name in [n for n, _ in mine]:
                f = {k: median([g[k] for g in got[name]]) if got[name][0][k] is not None else None
                     for k in ("rate", "step", "data", "flops_frac")}
                ratio = f["rate"] / control if control else None
                met = (f"{'yes' if f['rate'] >= GOAL_RATE and (ratio or 0) >= GOAL_RATIO and f['data'] <= GOAL_DATA else 'no'}"
                       if name == "gems" and B == 1 and cuda else "")
                eager = name == "gems" and not all(g["graphed"] for g in got[name])
                why = " (eager: its record's notes say why)" if cuda else " (eager: a CPU has no CUDA graphs)"
                rows.append([f"{name}, batch {B}" + (why if eager else ""),
                             f"{f['rate']:.1f}", f"{f['step'] * 1e3:.2f}", "" if ratio is None else f"{ratio:.3f}",
                             f"{100 * f['data']:.1f}%", "" if f["flops_frac"] is None else f"{100 * f['flops_frac']:.2f}%",
                             met])
            for name in ("plain", "plain graphed"):
                if got[name]:
                    rate = median(got[name])
                    rows.append([f"{name}, batch {B}", f"{rate:.1f}", f"{B / rate * 1e3:.2f}",
                                 "" if control is None else f"{rate / control:.3f}", "", "", ""])
        if cuda:  # the science configuration: gems only, graphed and eager
            path = _files(Path(tmp), 128, 16)
            for name, extra in (("gems", []), ("gems eager", ["train.cuda_graphs=false"])):
                r = _gems([*SCIENCE, f"data.path={path}", *given, *extra], device, steps, warmup, tmp)
                records.append({"contender": f"science {name}", "batch": 4, "record": r})
                f = _figures(r, 4)
                rows.append([f"science {name}: CosmoFlow 128³, batch 4, HDF5, cube", f"{f['rate']:.1f}",
                             f"{f['step'] * 1e3:.2f}", "", f"{100 * f['data']:.1f}%",
                             "" if f["flops_frac"] is None else f"{100 * f['flops_frac']:.2f}%",
                             ("yes" if f["step"] <= GOAL_SCIENCE_S else "no") if name == "gems" else ""])
    name = torch.cuda.get_device_name(device) if cuda else "cpu (plumbing only)"
    text = f"## gems bench step on {name}\n\n"
    text += (f"MLPerf's CosmoFlow ({size}³ x 4, bf16, SGD with momentum, no dropout), one rank; {rounds} alternated "
             f"round(s) of {steps} steps, medians of the steps after {warmup}. *gems*: its loop reading HDF5 files "
             "(int16 counts, finished on the device) through its reader, the model replayed from CUDA graphs; *gems "
             "eager*: train.cuda_graphs=false; *gems whole step*: the optimizer's update inside the graph too "
             "(train.graph_optimizer, batch 1); *plain*: a plain loop on one batch resident on the device; *plain "
             "graphed*: that loop's whole step one CUDA graph (the control). */ graphed*: samples/s over the graphed "
             "plain loop's in the same rounds. *data*: the share of gems's step it waited for its batch. *of peak*: "
             "the model's FLOP/s over the data sheet's (gems.plan.roofline). Goals: gems at batch 1 >= "
             f"{GOAL_RATE:g} samples/s and >= {GOAL_RATIO} of the graphed plain loop with <= {100 * GOAL_DATA:g}% data "
             f"wait; the science step <= {GOAL_SCIENCE_S * 1e3:g} ms.\n\n")
    text += md_table(["contender", "samples/s", "step ms", "/ graphed", "data", "of peak", "goal met"], rows)
    text += "\n" + env_block(" ".join(["gems bench step", *given]))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "step-records.json").write_text(json.dumps(records, indent=1, default=str))
    write(out_dir, "step" if cuda else "step-cpu", text)
    return text


def check_overrides(overrides: list[str]) -> None:
    """Overrides change the job of the GPU mode; on a CPU only the plumbing runs: bad input there."""
    if overrides and not torch.cuda.is_available():
        from gems.errors import ConfigError

        raise ConfigError("bench option", " ".join(overrides), "out=DIR (overrides set the job on a machine with a GPU)")


if __name__ == "__main__":
    from gems.bench.common import out_dir_from_argv

    print(bench_step(Path(out_dir_from_argv(sys.argv, "python -m gems.bench.step [OUT_DIR]"))))
