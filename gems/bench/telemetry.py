"""``gems bench telemetry``: what a rank's sampler costs a step (issue 80's goal: at most 0.5%), and what it reads
(:func:`bench_telemetry`).
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from gems.bench.common import env_block, md_table, median, write

#: the contenders: (label, the sampler's interval in seconds; None: no telemetry)
CONTENDERS: tuple[tuple[str, float | None], ...] = (("plain loop", None), ("sampler, default interval", 0.25),
                                                    ("sampler at 0.01 s", 0.01))
GOAL = 0.005


def _job(device: torch.device) -> tuple[Any, Any, Any, int]:
    """(model, optimizer, batch, samples) of the benchmark's step on ``device``."""
    from gems.config import compose, section
    from gems.data.synthetic import SyntheticData
    from gems.models import build_model

    gpu = device.type == "cuda"
    cfg = compose(["model=cosmoflow", f"model.size={128 if gpu else 32}", f"model.width={1.0 if gpu else 0.25}"])
    batch = 8 if gpu else 2
    torch.manual_seed(0)
    spec = build_model(section(cfg, "model"))
    model = spec.module.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = SyntheticData(spec, 0, 64).batch(list(range(batch)))
    return model, opt, (x.to(device), y.to(device)), batch


def _steps(job: Any, device: torch.device, steps: int, interval: float | None, index: int | None) -> dict[str, Any]:
    """``steps`` timed steps (one warm-up first), with a sampler at ``interval`` (None: none): their median and,
    with a sampler, its summary."""
    from gems.layers import batch_context
    from gems.telemetry.rank import RankTelemetry

    model, opt, (x, y), batch = job
    tel = RankTelemetry(index, 0, interval) if interval is not None else None
    if tel is not None:
        tel.start()
    times = []
    try:
        for step in range(steps + 1):
            if tel is not None:
                tel.step_began(step, step > 0)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with batch_context(0, step, list(range(batch))):  # the model's dropout masks, a sample each
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            if tel is not None:
                tel.step_ended(step, dt, batch)
            if step > 0:
                times.append(dt)
    finally:
        if tel is not None:
            tel.stop()
    return {"median_s": statistics.median(times), "summary": tel.summary() if tel is not None else None}


def sample_cost(index: int | None, reps: int = 50) -> float | None:
    """Seconds one sample of every query takes on this device (None where nothing is metered)."""
    from gems.telemetry.rank import RankTelemetry

    tel = RankTelemetry(index, 0, None)
    tel.start()
    if not tel.metered():
        return None
    t0 = time.perf_counter()
    for _ in range(reps):
        tel.read()
    return (time.perf_counter() - t0) / reps


def bench_telemetry(out_dir: Path, rounds: int = 3, steps: int = 30) -> str:
    """One process trains CosmoFlow (128³, batch 8 on a GPU; 32³ at a quarter of the width, batch 2, on a CPU) with a
    plain loop synchronised once a step, three contenders alternated in ``rounds`` rounds: no telemetry, the
    sampler at its default interval, and at 0.01 s (forty times as often: the cost a sample has). A row: the median
    step, its ratio to the plain loop's and the samples read; below, one sample's own time and what the sampler read
    (:func:`read_line`); ``telemetry.json`` holds every figure. Without NVML the sampler meters RAPL, or nothing
    (said). Returns the table."""
    from gems.telemetry import nvml

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    # the GPU the step runs on; on a CPU, NVML's first GPU where NVML is here (the sampler's cost is its own)
    index = 0 if device.type == "cuda" or nvml.library() is not None else None
    job = _job(device)
    got: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in CONTENDERS}
    for _ in range(rounds):
        for label, interval in CONTENDERS:
            got[label].append(_steps(job, device, steps, interval, index))
    plain = median([g["median_s"] for g in got[CONTENDERS[0][0]]])
    rows, found = [], {}
    for label, interval in CONTENDERS:
        step = median([g["median_s"] for g in got[label]])
        last = got[label][-1]["summary"]
        read = last.get("samples_taken", 0) if last else 0
        rows.append([label, "-" if interval is None else f"{interval:g}", f"{step * 1e3:.2f}", f"{step / plain:.4f}",
                     f"{100 * (step / plain - 1):+.2f}%", read])
        found[label] = {"interval_s": interval, "step_s": step, "ratio": step / plain, "summary": last}
    one = sample_cost(index)
    default = found[CONTENDERS[1][0]]
    text = "## gems bench telemetry\n\n"
    text += (f"CosmoFlow on {device.type} ({'a GPU' if device.type == 'cuda' else 'this CPU'}), {steps} steps a "
             f"contender a round, {rounds} rounds alternated; the median step of each (goal: the sampler at its "
             f"default interval costs at most {100 * GOAL:g}% of a step).\n\n")
    text += md_table(["contender", "interval s", "step ms", "x plain", "cost", "samples taken"], rows)
    lib = nvml.library()
    text += ("\nNVML: " + (f"pynvml from {getattr(lib, '__file__', '?')}" if lib is not None else
                             f"not here ({nvml.absent()})") + ".\n")
    verdict = "meets" if default["ratio"] - 1 <= GOAL else "misses"
    text += (f"\nThe sampler at its default interval: {100 * (default['ratio'] - 1):+.2f}% of a step ({verdict} the "
             f"goal). One sample of every query: "
             + (f"{one * 1e6:.0f} us" if one is not None else "nothing metered here") + ".\n\n")
    text += read_line(default["summary"]) + "\n\n"
    text += env_block("gems bench telemetry")
    write(out_dir, "telemetry", text)
    (out_dir / "telemetry.json").write_text(json.dumps({"device": device.type, "rounds": rounds, "steps": steps,
                                                        "sample_s": one, "contenders": found}, indent=1))
    return text


def read_line(s: dict[str, Any] | None) -> str:
    """What the sampler read in words: energy, mean power against the limit, NVML's peak memory beside torch's."""
    if not s or s.get("source") is None:
        return "What it read: nothing (" + "; ".join((s or {}).get("left_out", {}).values() or ["no meter"]) + ")."
    parts = [f"source {s['source']}"]
    if s.get("energy_j") is not None:
        parts.append(f"energy {s['energy_j']:.3g} J over {s['steps']} measured steps ({s['j_per_sample']:.3g} J a "
                     "sample)")
    power = s.get("power_w") or {}
    if power.get("mean") is not None:
        limit = s.get("power_limit_w")
        within = f" of a {limit:g} W limit ({'within' if power['mean'] <= limit else 'ABOVE'} it)" if limit else ""
        parts.append(f"mean power {power['mean']:.1f} W{within}")
    mem = s.get("memory_bytes") or {}
    if mem.get("nvml_used_peak") is not None:
        parts.append(f"NVML's peak memory {mem['nvml_used_peak'] / 2**30:.2f} GiB"
                     + (f" beside torch's peak reserved {mem['torch_reserved_peak'] / 2**30:.2f} GiB"
                        if mem.get("torch_reserved_peak") is not None else ""))
    left = s.get("left_out") or {}
    if left:
        parts.append("left out: " + "; ".join(f"{k} ({v})" for k, v in left.items()))
    return "What it read: " + ", ".join(parts) + "."


if __name__ == "__main__":
    import sys

    from gems.bench.common import out_dir_from_argv

    print(bench_telemetry(Path(out_dir_from_argv(sys.argv, "python -m gems.bench.telemetry [OUT_DIR]"))))
