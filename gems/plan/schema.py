"""What ``gems plan`` returns: the plan of one configuration, per distinct mesh position, and its JSON keys.

``plan.format=json`` prints one object; its keys (schema ``gems.plan/1``):
``schema, model, input_shape, world_size, mesh {replicas, pipeline, spatial,
parts, spatial_dims}, schedule, micro_batches, gems_replicas, checkpoint,
precision, optimizer, global_batch, micro_batch`` (samples per chunk),
``balance`` (layers per partition), ``device {kind, name, memory_bytes,
memory_source, reserve_bytes, usable_bytes, reserve}`` (GPU: and ``nominal_gb``,
the data sheet's figure; ``reserve {source, bytes, parts}``: ``source``
"modelled" with ``parts {cuda_context, cublas_workspace, cudnn_workspace,
nccl, fragmentation}`` summing to ``bytes`` and ``fragmentation_fraction,
pipeline_position, communicators [{name, size, used, why, connections,
bytes}], assumed``, or "plan.reserve_gb"; CPU: "cpu default" or
"plan.reserve_gb"; with ``train.device=cuda`` also ``sm90, rocm``, which
set cuBLAS's workspace), ``positions`` (one per distinct position:
``pipeline, spatial`` (the indices s that share it), ``grid, partitions,
local_input_shape, in_flight`` (micro-batches alive at the peak per
partition), ``bytes {parameters, gradients, optimizer, activations, halo,
communication, total}``, ``activations_detail {saved, working, batch,
constant, workspace}`` (``workspace``: the part of ``working`` that is the
CPU convolution workspace)), ``peak {bytes, pipeline, spatial}``, ``fits``,
``max_global_batch``, ``max_micro_batch``, ``min_gems_replicas`` (master:
the fewest passes that fit ``train.batch_size``), ``suggestion``, ``verdict``,
``seconds``, ``notes``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["SCHEMA", "GiB", "Breakdown", "Position", "MemoryPlan"]

SCHEMA = "gems.plan/1"
GiB = float(2**30)


def gib(b: float) -> str:
    """Bytes as GiB for a verdict: a tenth of a GiB from 10 GiB up, else three significant figures (a cap of 0.29 GiB
    and a peak of 0.295 told apart)."""
    v = b / GiB
    return f"{v:.1f} GiB" if v >= 10 else f"{v:.3g} GiB"

@dataclass
class Breakdown:
    """Bytes of one rank by what holds them."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    halo: int = 0
    communication: int = 0

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.halo + self.communication

    def as_dict(self) -> dict[str, int]:
        d = asdict(self)
        d["total"] = self.total
        return d


@dataclass
class Position:
    """One distinct mesh position: pipeline position ``pipeline`` and the spatial indices that share its memory."""

    pipeline: int
    spatial: list[int]
    grid: list[int]
    partitions: list[int]
    local_input_shape: list[int]
    in_flight: dict[int, int]
    bytes: Breakdown
    activations_detail: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        s = self.spatial
        if len(s) == 1:
            ss = str(s[0])
        elif s == list(range(s[0], s[-1] + 1)):
            ss = f"{s[0]}-{s[-1]}"
        else:
            ss = ",".join(map(str, s[:4])) + (",..." if len(s) > 4 else "")
        return f"d={self.pipeline},s={ss}"


@dataclass
class MemoryPlan:
    """What ``gems plan`` prints (:func:`to_json` is its JSON form)."""

    model: str
    input_shape: list[int]
    world_size: int
    mesh: dict[str, Any]
    schedule: str
    micro_batches: int
    gems_replicas: int
    checkpoint: bool
    precision: str
    optimizer: str
    global_batch: int
    micro_batch: int
    balance: list[int]
    device: dict[str, Any]
    positions: list[Position]
    fits: bool
    max_global_batch: int
    max_micro_batch: int
    min_gems_replicas: int | None
    suggestion: str | None
    verdict: str
    seconds: float
    notes: list[str]
    prediction: Any = None  # gems.plan.timing.Prediction, or None when not predicted
    hardware: Any = None  # the predicted step's distance to the device (gems.plan.roofline.fractions), or None

    @property
    def worst(self) -> Position:
        return max(self.positions, key=lambda p: p.bytes.total)


