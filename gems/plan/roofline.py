"""How far a step is from the hardware: the model's FLOPs and bytes a training step, the rate a rank reached, and
its fraction of the device's peak (the model FLOPs utilisation torchtitan prints, and its bandwidth twin).

The work is the *model's*, counted once on the serial model's trace (:mod:`gems.trace.ops`: torch's FLOP
formulas, every op's bytes read and written), whatever the mesh: a forward, and a backward of twice its FLOPs and
bytes (input and weight gradients; the first layer's convolution or matmul only its weight gradient), as the
planner times them. Recomputation (``parallel.checkpoint``), halo exchanges and the spatial gather are the
mesh's overheads, not the model's: they lower the fraction, as they should. R replicas each train B/R samples of a
step, so a step is R times the work of B/R samples; a rank's share is that over the world (``per_rank``).

The peak is the device's data sheet (:data:`gems.plan.devices.GPUS`): the tensor cores' dense rate at the run's
precision (TF32 for fp32 where the GPU has it and ``train.tf32`` does not turn it off) and the memory bandwidth.
A CPU has no such figure here: its record gives the rates reached and no fraction.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Work", "model_work", "peak", "gpu_named", "fractions", "hardware", "of_run"]


@dataclass(frozen=True)
class Work:
    """A training step of the whole model at the global batch: its FLOPs and the bytes its ops move."""

    flops: float
    bytes: float

    def per_rank(self, world: int) -> "Work":
        return Work(self.flops / max(1, world), self.bytes / max(1, world))


def _counted(ops: dict[int, Any], first: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one forward and its backward over a trace's layers (``first``: the model's first layer)."""
    flops = nbytes = 0.0
    for i, layer in ops.items():
        for (cls, _sig), (f, b, n) in layer.items():
            if n <= 0:
                continue
            back = 1.0 if (i == first and cls in ("conv", "matmul")) else 2.0
            flops += f * (1.0 + back)
            nbytes += b * 3.0
    return flops, nbytes


def model_work(cfg: Any) -> Work:
    """The work of one training step of ``cfg``'s model at its global batch, from the planner's trace of the serial
    model at micro-batches 1 and 2 (cached as the planner's are), linear in the batch."""
    from omegaconf import open_dict

    from gems.config import serial
    from gems.plan.memory import Planner, setup

    one = serial(cfg)  # every parallel key at its one-rank value: whatever options the schedule took
    with open_dict(one):
        one.train.batch_size = 2
    pl = Planner(setup(one), quick=True)
    t1, t2 = pl.traced(0, 1), pl.traced(0, 2)
    first = min(t1.ops) if t1.ops else 0
    (f1, b1), (f2, b2) = _counted(t1.ops, first), _counted(t2.ops, first)
    R, B = int(cfg.parallel.replicas), int(cfg.train.batch_size)
    line = B / R  # the samples a replica trains a step

    def at(v1: float, v2: float) -> float:
        return v1 + (line - 1) * (v2 - v1)

    return Work(R * at(f1, f2), R * at(b1, b2))


def gpu_named(name: str | None) -> str | None:
    """The key of :data:`gems.plan.devices.GPUS` a CUDA device name (``torch.cuda.get_device_name``) or a
    ``cluster.gpu`` value names; None for another device."""
    from gems.plan.devices import GPUS

    if not name:
        return None
    low = str(name).lower()
    if low in GPUS:
        return low
    if "gh200" in low:
        return "gh200"
    for key in ("h200", "h100"):
        if key in low:
            return key
    if "mi250x" in low:
        return "mi250x-gcd"
    for key in ("a100", "v100"):
        if key in low:
            gb = re.search(r"(\d+)\s*gb", low)
            size = gb.group(1) if gb else ("40" if key == "a100" else "16")
            cand = f"{key}-{size}gb"
            return cand if cand in GPUS else None
    return None


def peak(gpu: str | None, precision: str, tf32: bool | None = None) -> tuple[float, float] | None:
    """(FLOP/s, bytes/s) of ``gpu``'s data sheet at ``precision``: the tensor cores' dense rate (fp32: TF32 where
    the GPU has it, unless ``tf32`` is False: torch's default runs fp32 convolutions in TF32), and its memory
    bandwidth; None off the table (a CPU)."""
    from gems.plan.devices import GPUS

    key = gpu_named(gpu)
    if key is None:
        return None
    g = GPUS[key]
    if precision == "fp32":
        rate = g.fp32 if (tf32 is False or g.tf32 is None) else g.tf32
    else:
        rate = (g.bf16 if precision == "bf16" else g.fp16) or g.fp32
    return rate * 1e12, g.bandwidth * 1e9


def fractions(work: Work, step_s: float, world: int, device_peak: tuple[float, float] | None) -> dict[str, Any]:
    """What a rank reached at a step of ``step_s`` seconds: the model's FLOP/s and bytes/s a rank, and their
    fractions of ``device_peak`` where there is one."""
    mine = work.per_rank(world)
    out: dict[str, Any] = {"model_flops_per_step": work.flops, "model_bytes_per_step": work.bytes,
                           "flops_per_s_per_rank": mine.flops / step_s if step_s > 0 else None,
                           "bytes_per_s_per_rank": mine.bytes / step_s if step_s > 0 else None,
                           "peak_flops_per_s": None, "peak_bytes_per_s": None, "flops_fraction": None,
                           "bytes_fraction": None}
    if device_peak is not None and step_s > 0:
        out.update(peak_flops_per_s=device_peak[0], peak_bytes_per_s=device_peak[1],
                   flops_fraction=mine.flops / step_s / device_peak[0],
                   bytes_fraction=mine.bytes / step_s / device_peak[1])
    return out


def hardware(cfg: Any, step_s: float, world: int, device: str | None) -> dict[str, Any]:
    """:func:`fractions` of a step of ``step_s`` seconds of ``cfg``'s model on ``world`` ranks of ``device`` (a CUDA
    device's name or a key of the table; anything else, a CPU: no fraction), with the device it was held against."""
    key = gpu_named(device)
    tf32 = None if cfg.train.tf32 is None else bool(cfg.train.tf32)
    out = fractions(model_work(cfg), step_s, world, peak(key, str(cfg.train.precision), tf32))
    out["device"] = key or device
    if key is None:
        out["note"] = "no data-sheet peak for this device (gems.plan.devices.GPUS): the rates reached, no fraction"
    return out


def of_run(cfg: Any, world: int, device_name: str, step_s: float) -> dict[str, Any]:
    """The record's ``hardware`` section (:func:`hardware`) of a run's median step on ``device_name`` (a CUDA
    device's name; ``cluster.gpu`` where that names none of the table's). A model the planner cannot trace says
    why instead (the run's figures stand)."""
    device = device_name if gpu_named(device_name) or device_name == "cpu" else (cfg.cluster.gpu or device_name)
    try:
        return hardware(cfg, step_s, world, device)
    except Exception as e:  # noqa: BLE001 - the record says why it has no figures
        return {"device": gpu_named(device) or device, "error": f"the model's work was not counted: "
                f"{type(e).__name__}: {e}"}
