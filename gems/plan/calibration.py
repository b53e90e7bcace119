"""What ``gems bench calibrate`` measured on a GPU, read by ``gems plan`` (``cluster.gpu_calibration=PATH``).

A data sheet gives a GPU's peak; what a model's own convolutions reach of it, and the workspace cuDNN takes for
them, depends on their shapes, the cuDNN version and the precision. ``gems bench calibrate`` (gems.bench.calibrate)
times every convolution of the configured model at the micro-batch it runs at, on the GPU at hand (forward, the
input gradient and the weight gradient, each with CUDA events), measures the workspace each allocates, and the
bandwidth memory-bound ops reach; it writes one JSON file:

    {"schema": "gems.calibration/1", "gpu": "NVIDIA H200", "torch": ..., "cudnn": ..., "date": ...,
     "precisions": {"fp32": {"memory_GBps": ..., "op_overhead_s": ...,
                             "convs": [{"signature": [...], "batch": 8, "flops": ..., "forward_s": ...,
                                        "input_grad_s": ..., "weight_grad_s": ..., "workspace_bytes": ...}]}}}

The plan then times a calibrated convolution at its measured rate (FLOP/s, forward and backward), takes its
measured workspace (per sample), and uses the measured bandwidth for memory-bound ops; what the file does not
hold it takes from the data sheet and the GPU table's efficiencies (:data:`gems.plan.devices.GPU_EFFICIENCY`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gems.errors import ConfigError

__all__ = ["Calibration", "load_calibration", "SCHEMA"]

SCHEMA = "gems.calibration/1"


def _key(sig: Any) -> str:
    """A convolution signature (gems.trace.ops) as a file stores it and as the plan looks it up."""
    return json.dumps(sig, separators=(",", ":"))


def jsonable(sig: tuple) -> list[Any]:
    """A signature with its tuples as lists (what JSON keeps)."""
    return [jsonable(v) if isinstance(v, tuple) else v for v in sig]


@dataclass
class Calibration:
    """One calibration file: per precision, each convolution's measured times and workspace, and the
    memory-bound ops' bandwidth."""

    path: str
    gpu: str
    precisions: dict[str, dict[str, Any]] = field(default_factory=dict)

    def _convs(self, precision: str) -> dict[str, dict[str, Any]]:
        got = self.precisions.get(precision) or {}
        return {_key(c["signature"]): c for c in got.get("convs", [])}

    def conv(self, sig: tuple, precision: str) -> dict[str, Any] | None:
        """The measured entry of a convolution (its signature without the batch), or None."""
        return self._convs(precision).get(_key(jsonable(sig)))

    def conv_rates(self, precision: str) -> dict[tuple, tuple[float, float]]:
        """Signature -> (forward, backward) FLOP/s measured: the backward's rate is the forward's work over the
        input and weight gradients' time together (as gems.plan.devices.Rates takes it)."""
        out = {}
        for c in self._convs(precision).values():
            sig = _tuple(c["signature"])
            bwd = float(c["input_grad_s"]) + float(c["weight_grad_s"])
            out[sig] = (float(c["flops"]) / float(c["forward_s"]), float(c["flops"]) / bwd)
        return out

    def workspace_per_sample(self, sig: tuple, precision: str | None = None) -> float | None:
        """cuDNN's workspace of a convolution per sample of its micro-batch, where it was measured."""
        for p in ([precision] if precision else list(self.precisions)):
            c = self.conv(sig, p) if p else None
            if c is not None:
                return float(c["workspace_bytes"]) / max(1, int(c["batch"]))
        return None

    def memory_bandwidth(self, precision: str) -> float | None:
        got = (self.precisions.get(precision) or {}).get("memory_GBps")
        return None if got is None else float(got) * 1e9


def _tuple(v: Any) -> Any:
    return tuple(_tuple(x) for x in v) if isinstance(v, list) else v


def load_calibration(cfg: Any) -> Calibration | None:
    """The calibration ``cluster.gpu_calibration`` names, or None; a missing or malformed file is exit 2."""
    path = cfg.cluster.get("gpu_calibration") if hasattr(cfg.cluster, "get") else getattr(cfg.cluster, "gpu_calibration", None)
    if not path:
        return None
    p = Path(str(path)).expanduser()
    what = "a file gems bench calibrate wrote (gems bench calibrate cluster.gpu_calibration=PATH on the GPU)"
    try:
        data = json.loads(p.read_text())
    except OSError:
        raise ConfigError("cluster.gpu_calibration", str(path), f"an existing file: {what}") from None
    except ValueError:
        raise ConfigError("cluster.gpu_calibration", str(path), f"JSON: {what}") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("precisions"), dict):
        raise ConfigError("cluster.gpu_calibration", str(path), f"a {SCHEMA} file: {what}")
    return Calibration(str(p), str(data.get("gpu", "")), dict(data["precisions"]))
