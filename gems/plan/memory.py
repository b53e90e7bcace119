"""``gems plan``: memory per rank of an R x D x S job, without starting the world.

Why: a job that does not fit finds out after it queued, started every rank and
ran a first step. The planner answers before: for every distinct mesh position
(pipeline position ``d``, spatial part ``s``; replicas are identical) how many
bytes the rank needs and where they go, against the device's memory, the
largest global batch that fits, and the smallest change that would make an
oversized job fit. It runs in one process at any world size (1024, 2048
ranks...) in seconds, allocating nothing of the model's activations.

How the estimate is made:

* **Activations are measured, not modelled.** The real model is built
  (``gems.models.build_model``), converted by the real ``apply_spatial`` with a
  stand-in :class:`~gems.spatial.SpatialContext` for this rank's part (the halo
  exchange, the all-reduces and the gather are replaced by shape-only
  stand-ins), and run layer by layer in training mode under
  ``FakeTensorMode`` at the rank's *local* shapes: its spatial part, the halo
  windows the spatial layers assemble, the micro-batch of the schedule.
  Every tensor autograd saves for backward is caught by
  ``torch.autograd.graph.saved_tensors_hooks``, de-duplicated by storage and
  attributed to the layer that saved it, so the count is autograd's real saved
  set (input windows of convolutions, outputs of activations, pooling
  indices, casted weights under autocast ...), minus the parameters. The
  forward runs at micro-batches 1 and 2; each layer's memory is affine in the
  micro-batch, which gives any batch size without another trace. The
  backward's worst layer is found at the batch planned, among the layers'
  lines (which layer is worst changes with the batch: CosmoFlow's dense head
  at one sample, its first convolution at 64).
* **Precision.** ``bf16``/``fp16`` run the trace under ``torch.autocast`` on
  CPU targets, and under a function mode that applies CUDA autocast's casting
  rules (convolutions and matmuls in low precision, reductions, norms and
  losses in fp32, weight casts cached) on GPU targets, since CPU and CUDA
  autocast differ (e.g. ``avg_pool3d`` is fp32 on CPU only).
* **Schedules.** A partition keeps its saved set, its input and its output
  per micro-batch from forward to backward. Which micro-batches are alive at
  once comes from walking this rank's action list of the real schedule
  (:func:`gems.pipeline.make_schedule`): ``gpipe`` keeps all ``m``, ``1f1b``
  ``min(m, D-d)``, ``mast``/``master`` one per direction for ``m = 1`` on the
  two mirrored partitions (2x parameters). ``checkpoint=true`` keeps only
  partition inputs (and a partition's sent output until its gradient comes
  back: the send's buffer) and recomputes one partition at a time in its
  backward; on the plain path the segments (the run's own,
  :func:`gems.parallel.recompute_pieces`) are recomputed last to first, each
  beside the inputs of the segments before it. A recomputation keeps torch's
  random state too (:meth:`gems.layers.Recompute.device_bytes`, on CPU ranks).
  The peak adds the backward working set (the output and input gradients
  of one layer, and on CPU ranks the workspace its convolutions' backward
  allocates for itself) at the layer where saved tensors plus that working
  set are largest: storages saved only by later layers are freed by then.
  A partition that sends its output holds the gradient it receives for it
  (one buffer, with the skips' gradients where they travel with it) through
  its whole backward.
* **CPU workspace.** oneDNN's backward of a convolution allocates a
  scratchpad and weight-gradient buffers of its own (about 4x the weights of
  a 256-channel 3^3 convolution, whatever its extent: a quarter of a
  CosmoFlow 32^3 rank's tensors); torch's reference kernel, which it picks
  for one small sample, unfolds the input (27x it for a 3^3 kernel). CPU
  ranks measure it per convolution on the spot
  (:func:`gems.plan.cpu.conv_workspace`); on GPU ranks cuDNN's
  workspace takes what the caching allocator has free (the reserve's
  fragmentation part, :data:`gems.plan.reserve.CUDNN_WORKSPACE_BYTES`).
* **Other terms**: parameters (fp32), gradients (fp32), optimizer state
  (Adam 2x parameters, SGD with momentum 1x); halo buffers (the largest layer's
  received and packed slabs, from the real exchange plan of the cut); comm
  buffers (gradient buckets: the reducer sums gradients of 1 MiB or more in
  place and keeps a flattened copy of the smaller ones until the step's
  ``finish()``, so the held copies are the small gradients; pipeline
  messages received in an exchange round before the action that needs them
  (the most the rank holds at once, from the step's exchange plan:
  :meth:`gems.pipeline.exchange.ExchangePlan.held`) plus a gradient in flight; the
  spatial gather's all-gather buffers); the input (and target) batch of the
  replica line on ranks that run the first (last) stage.
* **Device**: GPU ranks where the run's ranks will have a GPU
  (:func:`gems.bootstrap.plan_device`: ``train.device=cuda``, or ``auto`` with
  ``cluster.gpu`` or ``cluster.gpu_memory_gb`` given, Slurm with
  ``cluster.gpus_per_node`` > 0, the local launcher on a machine with a GPU),
  else CPU ranks. A GPU's memory is the total CUDA reports for it
  (``torch.cuda.get_device_properties().total_memory``): ``cluster.gpu_memory_gb``
  is the data sheet's figure ("40 GB"), which for HBM is a binary size (an
  A100 40 GB has 40 GiB, of which CUDA reports 40339 MiB), so the planner
  takes ``cluster.gpu``'s measured total when it names a GPU of that size, else
  that many GiB less what a driver keeps
  (:func:`gems.plan.devices.gpu_memory_bytes`); with ``cluster.gpu`` alone that
  GPU's measured total; else the local GPU's total. CPU ranks: this machine's
  RAM shared by the ranks of a node.
* **Reserve**: what a GPU rank holds beside the tensors counted above, from
  its parts (:func:`gems.plan.reserve.gpu_reserve`, sources there): the CUDA
  context, cuBLAS's workspaces, NCCL's buffers for each communicator the rank
  uses (the world, spatial, pipeline and gradient groups, each where it has
  more than one rank and the rank runs something on it; the replica group is
  created but idle) and the caching allocator's fragmentation, a
  fraction of the tensor peak; ``plan.reserve_gb`` (GiB), when set, replaces
  them all. CPU ranks set aside ``plan.reserve_gb`` GiB, at most 0.5, for the
  interpreter.

What is approximate: the reserve's parts (the CUDA context and NCCL's channel
count are assumed, the fragmentation fraction is not measured), forward-time
temporaries of a single op, the CPU workspace of a bf16 convolution (measured
in fp32), the CUDA autocast rules beyond the ops CNNs use, ``balance_by=time``
(planned with the memory balance), and spatial position classes (parts whose
slabs have the same sizes at every layer and the same neighbours are traced
once).

The plan's output types and JSON keys are in :mod:`gems.plan.schema`; the suggestion and the step-time
prediction are added by :func:`gems.plan.make.make_plan`.
"""
from __future__ import annotations

import math
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from gems.bootstrap import KEEP_GROWTH, backend_for, keeps_host_memory_within, node_memory_bytes, plan_device
from gems.config import job_tasks, reads_files, section
from gems.errors import ConfigError
from gems.layers import Recompute
from gems.memory import rank_cap_bytes
from gems.parallel import recompute_pieces, resolve, spatial_model, stage_balance
from gems.pipeline.deferred import deferrable
from gems.pipeline.exchange import plan_exchanges, receive_lead
from gems.pipeline.partition import trace_shapes
from gems.pipeline.schedules import GRAD, registered
from gems.plan.calibration import load_calibration
from gems.plan.devices import GPUS, gpu_memory_bytes
from gems.plan.disk import state_copies
from gems.plan.reserve import blas_workspace_bytes, gpu_reserve, rank_communicators
from gems.plan.schema import SCHEMA, Breakdown, GiB, MemoryPlan, Position, gib
from gems.plan.store import cached
from gems.rank.graphs import decide as graphs_decide
from gems.replication import summed_in_place
from gems.shapes import split_bounds
from gems.trace.model import Trace, precision_context, spatial_stand_in, trace_layers

__all__ = ["Breakdown", "Position", "MemoryPlan", "plan_memory", "Planner", "Setup", "setup", "SCHEMA", "GiB"]

_CACHE: dict[tuple, Any] = {}  # built models, spatial layer lists and traces of this process, by what they depend on


# ============================================================================ per-stage memory (affine in the micro-batch)
@dataclass
class _Affine:
    c: float
    k: float

    def at(self, b: int) -> int:
        return int(round(self.c + self.k * b))


def _line(v1: float, v2: float, b1: int = 1, b2: int = 2) -> _Affine:
    """The line through (b1, v1) and (b2, v2); one point (b1 == b2): proportional to the micro-batch."""
    if b1 == b2:
        return _Affine(0.0, v1 / b1)
    k = (v2 - v1) / (b2 - b1)
    return _Affine(v1 - k * b1, k)


@dataclass
class _Stage:
    """Memory terms of one partition on one spatial position, as functions of the micro-batch."""

    saved: _Affine  # per micro-batch: saved set incl. the partition's input and output
    const: _Affine  # the part of ``saved`` that does not grow with the micro-batch (casted weights, stats)
    inp: _Affine  # the partition's input (what checkpointing keeps)
    out: _Affine  # the partition's output (what crosses the next cut)
    halo: _Affine
    gather: _Affine
    params: int
    copied: int = 0  # gradient bytes the reducer sums through a flattened copy (parameters under 1 MiB)
    ckpt_layers: list[tuple[int, int]] = field(default_factory=list)  # checkpointed pieces (plain path)
    layer_work: list[_Affine] = field(default_factory=list)  # per layer: its backward's excess over ``saved``
    layer_convs: list[tuple[bool, list[tuple]]] = field(default_factory=list)  # per layer: (input grad, convs)
    #: a forward without gradients (an evaluation's): the largest input and output of one layer together
    forward: _Affine = field(default_factory=lambda: _Affine(0.0, 0.0))
    #: per micro-batch and layer, what a split backward's W holds from its I (gems.pipeline.deferred): each
    #: deferrable layer's input and its output's gradient (none for a layer without deferrable modules)
    kept_for_w: list[_Affine] = field(default_factory=list)

    @property
    def held_for_w(self) -> _Affine:
        """Per micro-batch, all a split backward's W holds from its I (:attr:`kept_for_w` summed); the rest of the
        micro-batch's activations are freed by the I."""
        return _Affine(sum(k.c for k in self.kept_for_w), sum(k.k for k in self.kept_for_w))

    def working(self, chunk: int, workspace: Any = None, at_peak: bool = False,
                span: tuple[int, int] | None = None, lines: Sequence[_Affine] | None = None,
                keeping: bool = False) -> tuple[int, int]:
        """(the backward's working set at micro-batch ``chunk``, the part of it that is its ops' own workspace).

        ``workspace(signature, batch, input_grad)``: the bytes a convolution allocates for itself. CPU ranks
        (:func:`gems.plan.cpu.conv_workspace`, measured): it is added at each layer, so the worst layer is
        the one where the saved set, the gradients and the workspace together are largest. ``at_peak`` (GPU
        ranks: cuDNN's, :func:`gems.plan.reserve.cudnn_workspace`): the largest convolution's is added at the
        worst layer, as an allowance (measured on an H200, CUDA allocated a few percent more than the saved
        set and the worst layer's gradients, more than a workspace at its own layer explains).

        ``span``, ``lines``: the layers [a, e) of a checkpointed segment and their working sets over the segment's
        own saved set (the plain path recomputes one segment at a time, so the stage's set is not what they top)."""
        layer_work = self.layer_work if lines is None else list(lines)
        if keeping and self.kept_for_w:  # a split backward's I: what it keeps for its W of the layers after each
            kept = [k.at(chunk) for k in self.kept_for_w]
            layer_work = [_Affine(w.c + sum(kept[j:]), w.k) for j, w in enumerate(layer_work)]
        layer_convs = self.layer_convs if span is None else self.layer_convs[span[0]:span[1]]
        # the worst layer at ``chunk``, not the line through the worst at the traced batches: which layer is worst
        # changes with the batch (CosmoFlow 64^3: the dense head's at 1 and 2 samples, the first convolution's at
        # 64, twice the bytes; an H200 allocated 2.9% over the plan that took the line)
        work = max([0, *(w.at(chunk) for w in layer_work)])
        if workspace is None or not any(convs for _, convs in self.layer_convs):
            return work, 0
        if at_peak:  # the stage's largest convolution's, whatever the span (an allowance, as above)
            ws = max(workspace(sig, chunk, grad) for grad, convs in self.layer_convs for sig in convs)
            return work + ws, ws
        best, ws_at = 0, 0
        for w, (grad, convs) in zip(layer_work, layer_convs):
            ws = max((workspace(sig, chunk, grad) for sig in convs), default=0)
            if w.at(chunk) + ws > best:
                best, ws_at = w.at(chunk) + ws, ws
        return best, ws_at


def _stages(t1: Trace, t2: Trace, bal: Sequence[int], layers: Sequence[nn.Module]) -> list[_Stage]:
    out = []
    b1, b2 = t1.batch, t2.batch

    def _affine(v1: float, v2: float) -> _Affine:
        return _line(v1, v2, b1, b2)

    start = 0
    D = len(bal)
    for i, n in enumerate(bal):
        a, e = start, start + n
        s1, i1, lw1, o1 = t1.stage_by_layer(a, e, i == D - 1)
        s2, i2, lw2, o2 = t2.stage_by_layer(a, e, i == D - 1)
        sv = _affine(s1, s2)
        const = _Affine(max(0.0, sv.c), 0.0)
        per = _Affine(min(sv.c, 0.0), sv.k)
        h1 = max((v for j, v in t1.halo.items() if a <= j < e), default=0)
        h2 = max((v for j, v in t2.halo.items() if a <= j < e), default=0)
        g1 = sum(v for j, v in t1.gather.items() if a <= j < e)
        g2 = sum(v for j, v in t2.gather.items() if a <= j < e)
        sizes = [p.numel() * p.element_size() for layer in layers[a:e] for p in layer.parameters()]
        convs = [(t1.in_grad[j], list(dict.fromkeys(sig for (cls, sig) in [*t1.ops.get(j, {}), *t2.ops.get(j, {})]
                                                    if cls == "conv"))) for j in range(a, e)]
        # (the last layer's output gradient is the received buffer, the skips' packed with it: a view keeps it all)
        counts = [len(deferrable(layers[j])) for j in range(a, e)]
        kept = [_affine(_held_for_w(t1, j, o1 if j == e - 1 else None, n), _held_for_w(t2, j, o2 if j == e - 1 else None, n))
                if n else _Affine(0.0, 0.0) for j, n in zip(range(a, e), counts)]
        out.append(_Stage(per, const, _affine(i1, i2), _affine(o1, o2), _affine(h1, h2),
                          _affine(g1, g2), sum(sizes), sum(b for b in sizes if not summed_in_place(b)),
                          layer_work=[_affine(x1, x2) for x1, x2 in zip(lw1, lw2)], layer_convs=convs,
                          forward=_affine(_forward_set(t1, a, e), _forward_set(t2, a, e)), kept_for_w=kept))
        start = e
    return out


def _held_for_w(t: Trace, j: int, out: int | None = None, modules: int = 1) -> int:
    """What a split backward's W holds of one micro-batch (gems.pipeline.deferred) for layer ``j``, one with
    deferrable modules: its input and its output's gradient, the size of its output (``out``: the stage's output as
    it crosses the cut, where the gradient is that buffer); the model's input, a view of the batch, counted as the
    batch. A layer of several such ``modules`` (a residual block's convolutions) also holds the inputs of those
    inside it and their output gradients: counted as twice what the layer saves beside its own input."""
    own = (t.out_bytes[j - 1] if j > 0 else 0) + (t.out_bytes[j] if out is None else out)
    if modules < 2:
        return own
    entry = t.out_keys[j - 1] if j > 0 else t.in_key
    inside = sum(nb for key, (nb, users) in t.saved.items() if j in users and key != entry)
    return own + 2 * inside


def _forward_set(t: Trace, a: int, e: int) -> int:
    """A forward without gradients over layers [a, e): each layer holds its input and its output, nothing saved."""
    ins = [t.in_bytes, *t.out_bytes]
    return max((ins[j] + t.out_bytes[j] for j in range(a, min(e, len(t.out_bytes)))), default=0)


# ============================================================================ schedules
#: (F, B or I, the partition, micro-batches alive per partition, those between their I and their W per partition,
#: messages held, the receiving stages of input gradients sent and held)
Flight = tuple[str, int, dict[int, int], dict[int, int], int, tuple[int, ...]]


#: each pipeline rank's states (_in_flight) by its exchange plan's identity (held with it), rank, lead and backend
_FLIGHTS: dict[tuple[int, int, int, str], tuple[Any, list[Flight]]] = {}


def _in_flight(schedule: Any, d: int, held: Sequence[int] = (),
               unsent: Sequence[tuple[tuple[int, int], ...]] = ()) -> list[Flight]:
    """The distinct states of rank ``d``'s action list that can set its peak: (F for a forward, B for the
    backward's working set, I for a split backward's input half, the partition, micro-batches alive per partition
    then, those between their I and their W per partition, messages held beside them, the receiving stage of each
    input gradient sent and held beside them), walked with what each kind of action does
    (:class:`gems.pipeline.schedules.Kind`): whatever the schedule, no name is asked. ``held``: per action, the
    messages received or posted ahead that it runs beside (:meth:`gems.pipeline.exchange.ExchangePlan.held_during`;
    none where not given). ``unsent``: per action, the sends whose buffers it still holds
    (:meth:`~gems.pipeline.exchange.ExchangePlan.unconfirmed`; an activation's is the micro-batch's output, counted
    with it). A long schedule's steady state repeats itself, so the distinct states stay few."""
    Key = tuple[str, int, tuple[tuple[int, int], ...], tuple[tuple[int, int], ...], int, tuple[int, ...]]
    steps: dict[Key, None] = {}
    live: dict[int, int] = {}
    after_i: dict[int, int] = {}  # a split backward's micro-batches between their I and their W

    def state() -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
        return tuple(sorted(live.items())), tuple(sorted((q, n) for q, n in after_i.items() if n))

    for k, a in enumerate(schedule.actions[d]):
        h = held[k] if k < len(held) else 0
        grads = tuple(stage for kind, stage in (unsent[k] if k < len(unsent) else ()) if kind == GRAD)
        if a.kind.forward:
            live[a.stage] = live.get(a.stage, 0) + 1
            steps[("F", a.stage, *state(), h, grads)] = None
        else:
            if a.kind.input_gradient:  # the backward's working set is live while it runs (an I's: "I")
                steps[("B" if a.kind.frees else "I", a.stage, *state(), h, grads)] = None
                live[a.stage] -= 1
                if not a.kind.frees:  # an I: what its W needs stays
                    after_i[a.stage] = after_i.get(a.stage, 0) + 1
            elif a.kind.frees:  # a W
                after_i[a.stage] -= 1
    return [(k, p, dict(alive), dict(waiting_w), h, g) for k, p, alive, waiting_w, h, g in steps]


# ============================================================================ the plan
@dataclass
class Setup:
    spec: Any
    model_key: str
    mesh: Any
    schedule: str
    m: int
    eta: int
    checkpoint: bool
    precision: str
    gpu: bool
    batch: int  # train.batch_size
    replicas: int
    optimizer_factor: int
    bucket_mb: float
    overlap: bool | None
    bn_stats: str
    balance: list[int] | None
    balance_by: str
    settings: Any  # gems.parallel.ParallelSettings: the schedule, pipelined, holder groups, stages
    threads: int = 1  # a rank's CPU threads (gems.plan.memory.rank_threads)
    notes: list[str] = field(default_factory=list)  # e.g. where the spatial trunk really ends
    #: batches a GPU rank's reader holds on the device beside the one the step uses (device_batches_ahead)
    batches_ahead: int = 0
    #: cuDNN workspaces measured on this kind of GPU (gems bench calibrate), else modelled
    calibration: Any = None
    #: bytes the reader ahead holds beside the batch it is making (reader_draw), on a rank that reads inputs
    reader_draw: int = 0
    #: whether a GPU rank replays its step from a CUDA graph (gems.rank.graphs.decide): the graph's static input
    #: and target hold one more batch, and its pool the step's tensors for the whole run
    graphed: bool = False
    #: whether the run evaluates (a validation set): a graphed rank's evaluation runs eager beside the graph's pool
    evaluates: bool = False

    @property
    def kind(self) -> Any:
        """The schedule's registration (gems.pipeline.schedules.ScheduleKind): what it takes, asked by capability."""
        return registered()[self.schedule]


def _device(cfg: Any, world: int, available: bool = False) -> dict[str, Any]:
    """The device a rank runs on: its memory in bytes (``memory_bytes``) and, on CPU ranks, the reserve; a GPU
    rank's reserve is modelled once the mesh is known (:func:`_gpu_reserve`). ``cluster.rank_memory_gb``
    (:func:`gems.memory.rank_cap_bytes`) caps it: a CPU rank's whole memory, with no reserve beside it (the run
    measures its tensors against the cap, as a GPU's allocator counts them); a GPU's memory where the cap is less
    (the run limits its allocator to the cap; the plan still counts the context and NCCL's buffers against it)."""
    dev = _device_itself(cfg, world, available)
    cap = rank_cap_bytes(cfg)
    if cap is None:
        return dev
    given = f"cluster.rank_memory_gb={float(cfg.cluster.rank_memory_gb):g} GiB"
    if dev["kind"] == "gpu":
        if cap < dev["memory_bytes"]:
            dev.update(name=f"{dev['name']}, capped", memory_bytes=cap, memory_source=given, capped=True)
        return dev
    if cap > dev["memory_bytes"]:  # a CPU rank's share of its node's memory is all it has, whatever the cap
        given += f", past the rank's share of its node ({dev['memory_source']})"
        cap = int(dev["memory_bytes"])
    return {"kind": "cpu", "name": "a rank capped", "memory_bytes": cap, "memory_source": given, "capped": True,
            "reserve_bytes": 0, "reserve": {"source": "cluster.rank_memory_gb (the cap counts tensors)", "bytes": 0,
                                            "parts": {}}}


def _device_itself(cfg: Any, world: int, available: bool) -> dict[str, Any]:
    """The device as it is, before ``cluster.rank_memory_gb``."""
    c = cfg.cluster
    override = cfg.plan.reserve_gb
    nominal = float(c.gpu_memory_gb or 0.0)
    if plan_device(cfg) == "cuda":
        if nominal > 0:
            gpu = c.gpu
            total, source = gpu_memory_bytes(nominal, gpu)
            label = f"{gpu} " if gpu else ""
            return {"kind": "gpu", "name": f"{c.name} GPU {label}(data sheet: {nominal:g} GB)", "nominal_gb": nominal,
                    "memory_bytes": int(total), "memory_source": source}
        if c.gpu:
            g = GPUS.get(str(c.gpu))
            if g is None:
                raise ConfigError("cluster.gpu", c.gpu, f"one of {', '.join(GPUS)} (the figures gems plan has), or "
                                  "cluster.gpu_memory_gb")
            return {"kind": "gpu", "name": f"{c.name} GPU {c.gpu} (data sheet: {g.nominal_gb:g} GB)",
                    "nominal_gb": g.nominal_gb, "memory_bytes": int(g.memory_bytes),
                    "memory_source": f"the total CUDA reports for a {c.gpu} (gems.plan.devices.GPUS)"}
        if not torch.cuda.is_available():
            raise ConfigError("cluster.gpu_memory_gb", nominal, "the GPU memory its data sheet gives, in GB (e.g. 80), "
                              "or cluster.gpu, when planning GPU ranks on a machine without a GPU")
        props = torch.cuda.get_device_properties(0)
        return {"kind": "gpu", "name": props.name, "memory_bytes": int(props.total_memory),
                "memory_source": "this machine's GPU 0 as CUDA reports it",
                "sm90": (props.major, props.minor) == (9, 0), "rocm": torch.version.hip is not None}
    per_node = world if c.name == "local" and c.launcher == "local" else int(c.tasks_per_node or 1)
    free = node_memory_bytes() if available and c.launcher == "local" else None
    if c.mem_gb:
        ram, source = float(c.mem_gb) * GiB, f"cluster.mem_gb={float(c.mem_gb):g} GiB a node"
    elif free is not None:
        ram, source = float(free), "this machine's available memory now"
    else:
        ram, source = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this machine's RAM"
    # CPU ranks: the interpreter's and allocator's share, plan.reserve_gb GiB (1 unless set) but at most 0.5
    reserve = int(min(float(override if override is not None else 1.0) * GiB, 0.5 * GiB))
    return {"kind": "cpu", "name": f"RAM / {per_node} rank(s) per node", "memory_bytes": int(ram / max(1, per_node)),
            "memory_source": f"{source} / {per_node} rank(s) per node", "reserve_bytes": reserve,
            "reserve": {"source": "plan.reserve_gb" if override is not None else "cpu default", "bytes": reserve,
                        "parts": {"interpreter_and_allocator": reserve}}}


def _gpu_reserve(cfg: Any, pl: Planner, dev: dict[str, Any]) -> Any:
    """A GPU rank's reserve (:func:`gems.plan.reserve.gpu_reserve`): ``plan.reserve_gb`` when set, else its parts,
    with NCCL's communicators counted for every pipeline position from the mesh and the schedule."""
    st, mesh = pl.st, pl.st.mesh
    override = cfg.plan.reserve_gb
    sched = pl.sched() if pl.pipelined else None
    links = sched.links() if sched is not None else []
    by_position = {}
    for d in range(mesh.pipeline):
        holders = next((len(g) for g in st.settings.holder_groups if d in g), 1)
        by_position[d] = rank_communicators(mesh.replicas, mesh.pipeline, mesh.spatial,
                                            st.replicas * mesh.spatial * holders, [ln for ln in links if d in ln])
    return gpu_reserve(by_position, cfg.cluster.gpu, None if override is None else float(override),
                       dev.get("sm90"), dev.get("rocm"))


def _world(cfg: Any) -> int | None:
    c = cfg.cluster
    if c.launcher == "slurm" or c.name != "local":
        if c.tasks_per_node is None:
            return None
        return job_tasks(c)
    return None


class Planner:
    """Traces (cached per spatial class and micro-batch) and the memory arithmetic on top."""

    def __init__(self, st: Setup, quick: bool = False, parts: str = "every") -> None:
        self.st = st
        self.quick = quick
        #: ``every`` spatial class traced, or its ``largest`` only (gems.plan.search: :meth:`classes`)
        self.parts = parts
        self._ckpt_batches = (1, 2)
        self.amp = precision_context(st.precision, st.gpu)
        self.notes: list[str] = list(st.notes)
        self._ckpt: dict[int, list[tuple[tuple[int, int, list[int], int], tuple[int, int, list[int], int]]]] = {}
        self._ckpt_skips: dict[int, tuple[int, int]] = {}  # the skips crossing the pieces, at the two traced batches
        # a convolution's backward allocates a workspace of its own: CPU ranks measure it here; GPU ranks take
        # cuDNN's, measured on the GPU (gems bench calibrate) or modelled (gems.plan.reserve.cudnn_workspace)
        self.workspace: Any = None
        if not st.gpu:
            from gems.plan.cpu import conv_workspace

            self.workspace = lambda sig, batch, grad: conv_workspace(sig, batch, grad, st.threads)
        else:
            from gems.plan.reserve import cudnn_workspace

            elem = 4 if st.precision == "fp32" else 2
            self.workspace = lambda sig, batch, grad: cudnn_workspace(sig, batch, grad, elem, st.calibration,
                                                                      st.precision)
        #: GPU ranks whose model runs matmuls: cuBLAS's workspaces, allocated by the caching allocator and so in
        #: what CUDA counts as allocated (set by plan_memory: gems.plan.reserve.blas_workspace_bytes)
        self.blas = 0

    # ---- structure ------------------------------------------------------------------
    def sched(self) -> Any:
        return self.st.settings.schedule

    @property
    def pipelined(self) -> bool:
        return self.st.settings.pipelined

    @property
    def chunks(self) -> int:
        sched = self.st.settings.schedule
        return sched.chunks if sched is not None else 1

    def chunk_of(self, batch: int) -> int:
        return batch // (self.st.replicas * self.chunks)

    def check_batch(self, batch: int) -> None:
        self.st.settings.with_batch(batch)  # ConfigError naming the key that does not divide

    def classes(self) -> list[list[int]]:
        """Spatial indices grouped by identical slab sizes at every layer and identical neighbours."""
        mesh, spec = self.st.mesh, self.st.spec
        if mesh.spatial == 1:
            return [[0]]
        end = spec.spatial_end if spec.spatial_end is not None else len(spec.module)

        def trunk() -> list[tuple[int, ...]]:
            return [s[2:] for s, _ in trace_shapes(list(spec.module)[:end], (1, *spec.input_shape), torch.float32)]

        kept = ("trunk shapes", self.st.model_key, end)
        shapes = [tuple(spec.input_shape[1:])]
        try:
            shapes += cached(kept, trunk) if spec.source_known else trunk()
        except Exception:  # a trunk that cannot run serially on fake tensors: key by the input only (not kept)
            pass
        memo = ("classes", self.st.model_key, mesh.parts, mesh.spatial_dims, self.parts)
        if memo in _CACHE:
            return [list(c) for c in _CACHE[memo]]
        # per cut dim, each grid index's key (first, last, its part's extent at every layer): computed once a dim
        per_dim = []
        for d, p in zip(mesh.spatial_dims, mesh.parts):
            bounds = [split_bounds(int(sh[d]), p) for sh in shapes if d < len(sh)]
            per_dim.append([(g == 0, g == p - 1, tuple(b[g][1] - b[g][0] for b in bounds)) for g in range(p)])
        keys: dict[tuple, list[int]] = {}
        for s in range(mesh.spatial):
            g = mesh.grid_of(s)
            keys.setdefault(tuple(per_dim[k][g[k]] for k in range(len(per_dim))), []).append(s)
        if self.parts == "largest":  # one class, the largest part's, standing for every part (module docstring)
            def size(key: tuple) -> tuple[int, int]:
                return (sum(sum(sizes) for _, _, sizes in key), -sum(first or last for first, last, _ in key))

            rep = max(keys, key=size)
            _CACHE[memo] = [keys[rep] + [s for k, members in keys.items() if k != rep for s in members]]
        else:
            _CACHE[memo] = list(keys.values())
        return [list(c) for c in _CACHE[memo]]

    def layers_for(self, s: int) -> tuple[list[nn.Module], Any, list[int]]:
        """The (spatial) layer list of spatial index ``s``, its stand-in context and local input shape."""
        mesh, spec = self.st.mesh, self.st.spec
        if mesh.spatial == 1:
            return list(spec.module), None, list(spec.input_shape)
        from gems.spatial import apply_spatial

        sctx = spatial_stand_in(mesh.parts, mesh.spatial_dims, mesh.grid_of(s),
                                 self.st.overlap if self.st.overlap is not None else self.st.gpu)
        sl = sctx.local_slices(spec.input_shape[1:])
        local = [spec.input_shape[0], *[len(range(*x.indices(n))) for x, n in zip(sl, spec.input_shape[1:])]]
        seq = apply_spatial(spec.module, sctx, spec.spatial_end, bn_stats=self.st.bn_stats)
        seq.train()
        return list(seq), sctx, local

    def balance(self, n_layers: int, chunk: int) -> list[int]:
        """The balance the run would take (:func:`gems.parallel.stage_balance`, as the worker calls it), with
        ``time`` planned as ``memory`` (it is measured when the run starts)."""
        st = self.st
        if not self.pipelined:
            return [n_layers]
        st.settings.check_layers(n_layers)  # a given balance is checked against the layers there
        by = st.balance_by
        if by == "time" and st.balance is None:
            self.notes.append("parallel.balance_by=time is measured at run time; planned with the memory balance")
            by = "memory"
        s = st.settings
        if not st.spec.source_known or s.balance is not None:
            return stage_balance(s, st.spec, chunk, by)
        # a decided balance traces the model on fake tensors: kept on disk by what stage_balance reads
        key = ("balance", st.model_key, s.stages, by, s.chunk if chunk is None else int(chunk), s.mesh.parts,
               s.mesh.spatial_dims, st.spec.spatial_end)
        return cached(key, lambda: stage_balance(s, st.spec, chunk, by))

    # ---- memory ---------------------------------------------------------------------
    def _layers(self, s: int) -> tuple[list[nn.Module], Any, list[int]]:
        key = ("layers", self.st.model_key, self.st.mesh.parts, self.st.mesh.spatial_dims, s, self.st.overlap,
               self.st.gpu, self.st.bn_stats)
        if key not in _CACHE:
            _CACHE[key] = self.layers_for(s)
        return _CACHE[key]

    def deferred(self, s: int) -> list[int]:
        """Per layer of spatial part ``s``, its modules a split backward defers (gems.pipeline.deferred.deferrable:
        their weight gradients wait for the W), as the memory plan counts what the W holds."""
        key = ("deferred", self.st.model_key, self.st.mesh.parts, self.st.mesh.spatial_dims, s, self.st.overlap,
               self.st.gpu, self.st.bn_stats)
        if key not in _CACHE:
            _CACHE[key] = [len(deferrable(layer)) for layer in self._layers(s)[0]]
        return list(_CACHE[key])

    def recomputed(self, n_layers: int) -> frozenset[int]:
        """The layers whose forward runs again in the backward (``parallel.checkpoint``): on a pipeline every layer
        and the loss (index ``n_layers``: each partition is replayed whole, gems.pipeline.runtime), on the plain path
        the layers of every piece but the last (gems.models.skips.checkpointed); none without recomputation. The
        step's time counts their forward, and its exchanges, a second time (gems.plan.timing)."""
        if not self.st.checkpoint:
            return frozenset()
        if self.pipelined:
            return frozenset(range(n_layers + 1))
        return frozenset(j for a, e in self._pieces()[:-1] for j in range(a, e))

    def _pieces(self) -> list[tuple[int, int]]:
        """The plain path's recomputed pieces, as the run cuts them (one trace of the serial model: kept)."""
        key = ("pieces", self.st.model_key, self.st.mesh.parts, self.st.mesh.spatial_dims, self.st.spec.spatial_end)
        if key not in _CACHE:
            def make() -> list[tuple[int, int]]:
                return recompute_pieces(self.st.spec, self.st.mesh)

            _CACHE[key] = cached(key, make) if self.st.spec.source_known else make()
        return _CACHE[key]

    def traced(self, s: int, batch: int) -> Trace:
        """The trace of spatial part ``s`` at micro-batch ``batch`` (kept in this process, and on disk where the
        model's source is known: gems.plan.store)."""
        key = ("trace", self.st.model_key, self.st.mesh.parts, self.st.mesh.spatial_dims, s, self.st.overlap,
               self.st.gpu, self.st.bn_stats, self.st.precision, batch)
        if key not in _CACHE:
            def make() -> Trace:
                layers, sctx, local = self._layers(s)
                return trace_layers(self.st.spec, layers, batch, local, self.st.spec.input_shape[1:], sctx, self.amp,
                                    memo=(self.st.precision, self.st.gpu))

            # kept on disk between processes (gems/plan/store.py), where gems's source digest covers the model's
            _CACHE[key] = cached(key, make) if self.st.spec.source_known else make()
        return _CACHE[key]

    def profile(self, chunk: int) -> tuple[list[int], list[tuple[list[int], list[int], list[_Stage], int]]]:
        """Balance, and per spatial class: (indices, local input shape, stages, target bytes per sample).

        ``quick`` (used to test candidate changes): one trace at ``chunk`` of the middle part only.
        """
        classes = self.classes()
        if self.quick:
            mid = self.st.mesh.spatial // 2
            classes = [[mid]]
        out = []
        bal: list[int] = []
        for members in classes:
            layers, sctx, local = self._layers(members[0])
            if not bal:
                bal = self.balance(len(layers), chunk)
            if self.quick:
                t1 = t2 = self.traced(members[0], max(1, chunk))
            else:
                t1, t2 = self.traced(members[0], 1), self.traced(members[0], 2)
            stages = _stages(t1, t2, bal, layers)
            if not self.pipelined and self.st.checkpoint:  # the plain path's recomputed pieces, as the run cuts them
                n = len(layers)
                stages[0].ckpt_layers = self._pieces()
                self._ckpt_batches = (t1.batch, t2.batch)
                self._ckpt[id(stages[0])] = [(t1.stage_by_layer(a, e, e == n, packed=False),
                                              t2.stage_by_layer(a, e, e == n, packed=False))
                                             for a, e in stages[0].ckpt_layers]
                cuts = [a for a, _ in stages[0].ckpt_layers[1:]]
                self._ckpt_skips[id(stages[0])] = (t1.kept_skips(cuts), t2.kept_skips(cuts))
            out.append((members, local, stages, t1.target_bytes))
        return bal, out

    def _graphed_slots(self, stages: list[_Stage], slots: dict[int, int],
                       chunk: int) -> tuple[int, int, dict[int, int], int]:
        """A pipeline's graphed pieces (gems.rank.pieces): every slot (a stage's forward of one micro-batch and
        replica pass on this rank, ``slots``: how many a stage) holds its own pool for the whole run, which keeps
        what its two graphs allocated: the forward's saved set (its static input and output in it), the output's
        gradient, the backward's working set and its parameters' gradients (copied out to ``.grad`` after each
        replay). Every slot's together, not the schedule's in-flight peak: no pool hands memory to another.
        (peak, its working part, micro-batches alive per stage, the workspace in it)."""
        peak = extra = ws = 0
        for q, n in sorted(slots.items()):
            work, w = stages[q].working(chunk, self.workspace, self.st.gpu)
            peak += n * (stages[q].saved.at(chunk) + stages[q].out.at(chunk) + work + stages[q].params)
            extra, ws = extra + n * work, max(ws, w)
        return int(peak), int(extra), dict(slots), int(ws)

    def position(self, d: int, members: list[int], local: list[int], stages: list[_Stage], target_b: int,
                 chunk: int, flights: list[Flight], held: list[int], slots: dict[int, int] | None = None) -> Position:
        """The memory of pipeline position ``d`` for spatial ``members``; each of ``flights`` (:func:`_in_flight`)
        with the messages the position holds beside that state, received or posted before the action that needs
        them (:meth:`gems.pipeline.exchange.ExchangePlan.held_during`); ``slots``: a graphed pipeline's pieces a
        stage on this rank (:meth:`_graphed_slots`)."""
        st = self.st
        mesh = st.mesh
        D = mesh.pipeline
        params = sum(stages[p].params for p in held)
        grads = params
        optim = st.optimizer_factor * params
        # activations: walk the schedule
        peak, extra_at, at, ws, early = 0, 0, flights[0][2] if flights else {}, 0, 0
        # a message buffer: the largest a held partition receives or sends
        bound = max(max(stages[p].inp.at(chunk), stages[p].out.at(chunk)) for p in held) \
            if self.pipelined and D > 1 else 0
        if not self.pipelined:
            s0 = stages[0]
            if st.checkpoint:
                segs = self._ckpt[id(s0)]
                b1, b2 = self._ckpt_batches
                # the inputs each recomputed segment keeps from its forward to its backward
                inputs = [_line(a[1], b[1], b1, b2).at(chunk) for a, b in segs[:-1]]
                skips = _line(*self._ckpt_skips[id(s0)], b1, b2).at(chunk)  # the skips crossing them, once
                # the random state each recomputed segment keeps (in its graph's node), and one more while one replays
                replays = (len(inputs) + 1) * Recompute.device_bytes(st.gpu)
                # the backward runs the segments last to first, one at a time: the last one's saved set is kept
                # from the forward, while every segment's input is; segment j < last is recomputed once the ones
                # after it are done and their inputs freed, beside the inputs of those before it (its own is in its
                # saved set). Each with the worst of its layers' backward over that set; the largest sum is the peak
                peak = -1
                for j, ((a, b), span) in enumerate(zip(segs, s0.ckpt_layers)):
                    lines = [_line(x1, x2, b1, b2) for x1, x2 in zip(a[2], b[2])]
                    w, w_ws = s0.working(chunk, self.workspace, st.gpu, span, lines)
                    total = sum(inputs[:j]) + skips + _line(a[0], b[0], b1, b2).at(chunk) + w + replays
                    if total > peak:
                        peak, extra_at, ws = total, w, w_ws
            else:
                work, ws = s0.working(chunk, self.workspace, st.gpu)
                peak, extra_at = s0.saved.at(chunk) + work, work
            at = {0: 1}
            const = s0.const.at(chunk)
        else:
            const = sum(stages[p].const.at(chunk) for p in held)
            for kind, p, live, after_i, waiting, unsent in flights:
                # the input gradients sent and not yet known delivered (into stage s: stage s + 1's input's size)
                keep = sum(stages[s + 1].inp.at(chunk) for s in unsent)
                # a split backward's micro-batches between their I and their W: what the W needs, whether or not
                # the stage recomputes (the I's recomputed activations are those the W takes)
                keep += sum(n * stages[q].held_for_w.at(chunk) for q, n in after_i.items())
                for q, n in live.items():
                    if not st.checkpoint:
                        keep += n * stages[q].saved.at(chunk)
                        continue
                    # recomputed: a micro-batch keeps its input and its random state, and (but on the last stage)
                    # its output, the send's buffer, until its gradient comes back at the latest
                    # (ExchangePlan.delivered); the action's own output is counted below (F) or freed already (B)
                    keep += n * (stages[q].inp.at(chunk) + Recompute.device_bytes(st.gpu))
                    if q != st.settings.stages - 1:
                        keep += (n - (q == p)) * stages[q].out.at(chunk)
                w = 0
                if kind != "F" or not st.checkpoint:
                    # an I keeps what its W will need of each layer it has passed (the output gradient, and the
                    # input the layer's saved set would have let go) beside the working set of the layer it is at
                    work, w = stages[p].working(chunk, self.workspace, st.gpu, keeping=kind == "I")
                    # recomputed: its saved set again, and the random state's copy while it replays; the saved set
                    # holds the micro-batch's input, the storage kept above (counted twice before: CosmoFlow's second
                    # stage of 1F1B at D=2 and m=2 planned at 1.41 of its measured memory, 1.20 without recomputation)
                    extra = work + (stages[p].saved.at(chunk) - stages[p].inp.at(chunk)
                                    + Recompute.device_bytes(st.gpu) if st.checkpoint else 0)
                else:
                    extra = stages[p].out.at(chunk)
                if keep + extra + waiting * bound > peak + early * bound:
                    peak, extra_at, at, ws, early = keep + extra, extra, dict(live), w, waiting
        first = 0 in held
        last_stage = (st.settings.stages - 1) in held if self.pipelined else True
        line = chunk * self.chunks  # the samples of the line this rank reads per step
        in_per_sample = 4 * math.prod(local)
        batch_bytes = ((line * in_per_sample if first else 0) + (line * target_b if last_stage else 0)) \
            * (1 + st.batches_ahead) + (st.reader_draw if first else 0) \
            + ((line * in_per_sample if first else 0) + (line * target_b if last_stage else 0) if st.graphed
               else 0)  # the graph's static input and target
        if st.graphed and self.pipelined and slots:  # a pipeline's graphed pieces (gems.rank.pieces)
            peak, extra_at, at, ws = self._graphed_slots(stages, slots, chunk)
        # a graphed rank's pool keeps the step's tensors (the peak above) for the whole run, so an evaluation's
        # forward, eager, allocates beside it rather than in what the step freed (gems.rank.graphs)
        beside = max((stages[p].forward.at(chunk) for p in held), default=0) if st.graphed and st.evaluates else 0
        acts = peak + const + batch_bytes + self.blas + beside
        halo = max((stages[p].halo.at(chunk) for p in held), default=0)
        # communication buffers
        grad_group = st.replicas * mesh.spatial * next(len(g) for g in st.settings.holder_groups if d in g)
        # (a graphed rank's small gradients are the views of its buckets' flattened buffers: nothing copied)
        comm = sum(stages[p].copied for p in held) if grad_group > 1 and not st.graphed else 0
        if self.pipelined and D > 1:
            # messages received in a round (or posted ahead) before the action that needs them, beside the peak's
            # state (the one in use is the partition's input, counted as saved), plus a gradient in flight
            comm += early * bound + max(stages[p].inp.at(chunk) for p in held)
        comm += max((stages[p].gather.at(chunk) for p in held), default=0)
        bd = Breakdown(params, grads, optim, int(acts), int(halo), int(comm))
        return Position(d, members, list(mesh.grid_of(members[0])), held, local, {int(k): int(v) for k, v in at.items()}, bd,
                        {"saved": int(peak - extra_at), "working": int(extra_at),
                         "batch": int(batch_bytes), "constant": int(const), "workspace": int(ws),
                         "blas_workspace": int(self.blas), "evaluation_beside_graph": int(beside)})

    def positions(self, batch: int, profile: Any = None) -> tuple[list[int], list[Position]]:
        st = self.st
        chunk = self.chunk_of(batch)
        bal, classes = profile if profile is not None else self.profile(chunk)
        D = st.mesh.pipeline
        out = []
        sched = self.sched() if self.pipelined else None
        exchanges = plan_exchanges(sched) if sched is not None else None
        backend = backend_for(torch.device("cuda" if st.gpu else "cpu"))
        lead = receive_lead(backend)
        for d in range(D):
            if sched is not None and exchanges is not None:
                held = sched.partitions_of(d)
                # each state with the messages held beside it, the receives gloo posts ahead included
                # and the sends it holds not known delivered: over gloo, whose send is done only once waited for;
                # NCCL's completes with its round (a meeting) and is freed after the next action
                # (the unit-clock plans are values, kept: each rank's states walked once a plan)
                memo = (id(exchanges), d, lead, backend)
                got = _FLIGHTS.get(memo)
                if got is None or got[0] is not exchanges:
                    unsent = exchanges.unconfirmed(d) if backend == "gloo" else []
                    got = (exchanges, _in_flight(sched, d, exchanges.held_during(d, lead), unsent))
                    if len(_FLIGHTS) < 1 << 14:
                        _FLIGHTS[memo] = got
                flights = got[1]
                slots = dict(Counter(a.stage for a in sched.actions[d] if a.kind.forward))
            else:
                held, flights, slots = [0], [], {}
            for members, local, stages, target_b in classes:
                out.append(self.position(d, members, local, stages, target_b, chunk, flights, held, slots))
        return bal, out


def setup(cfg: Any) -> Setup:
    from omegaconf import OmegaConf

    from gems.mesh import mesh_from_config
    from gems.models import build_model

    p = cfg.parallel
    mesh = mesh_from_config(cfg, _world(cfg))
    settings = resolve(cfg)
    model_key = OmegaConf.to_yaml(cfg.model, resolve=True)
    if ("model", model_key) not in _CACHE:
        spec = build_model(section(cfg, "model"))
        spec.module.train()
        _CACHE[("model", model_key)] = spec
    spec = _CACHE[("model", model_key)]
    cut = ("spatial model", model_key, mesh.parts, mesh.spatial_dims, str(p.bn_stats), bool(p.gather_uncut))
    if cut not in _CACHE:  # (where the trunk ends under this cut: the same for every candidate of the cut)
        _CACHE[cut] = spatial_model(spec, mesh, str(p.bn_stats), bool(p.gather_uncut))
    spec, gather_note = _CACHE[cut]
    sched = str(p.schedule)
    eta = settings.schedule.replicas if settings.schedule is not None else 1
    factor = state_copies(cfg.train)  # the optimizer's state and train.ema's average, in copies of the parameters
    gpu = plan_device(cfg) == "cuda"
    # whether a GPU rank replays its model from CUDA graphs, and where not, why (the plan's notes say so)
    graphed, eager_why = graphs_decide(cfg, settings, mesh, torch.device("cuda")) if gpu else (False, None)
    pool_note = GRAPHED_SPATIAL_POOL if graphed and mesh.spatial > 1 else None
    if mesh.spatial > 1:
        from gems.spatial.context import SpatialContext  # noqa: F401 - fails early when spatial is unavailable
    return Setup(spec, model_key, mesh, sched, int(p.micro_batches), eta, bool(p.checkpoint), str(cfg.train.precision), gpu,
                  int(cfg.train.batch_size), mesh.replicas, factor, float(cfg.comm.bucket_mb), p.overlap,
                  str(p.bn_stats), list(p.balance) if p.balance else None,
                  settings.balance_by, settings, rank_threads(cfg),
                  _setup_notes(cfg, settings, [n for n in (gather_note, eager_why, pool_note) if n]),
                  device_batches_ahead(int(cfg.data.prefetch), reads_files(cfg.data)) if gpu else 0,
                  load_calibration(cfg) if gpu else None, reader_draw(cfg, spec) if gpu else 0, graphed,
                  bool(cfg.data.val_path) or int(cfg.data.val_samples) > 0)


#: what the plan of a graphed spatial step assumes of the graph's pool (issue 74, item 2)
GRAPHED_SPATIAL_POOL = ("train.graph_spatial: the graph's pool is planned as the eager step's peak with the halo term "
                        "beside it: no stream is recorded inside a capture, a halo's buffers are held until their "
                        "streams join and then reused by the pool (gems.capture.keep, join), the received ones of one "
                        "layer at most past their eager lifetime; planned, not measured (the lease's graphed phase "
                        "sets each graphed point's max_memory_reserved beside it)")


def _setup_notes(cfg: Any, settings: Any, notes: list[str]) -> list[str]:
    if settings.pipelined and str(cfg.parallel.get("rounds_by", "unit")) == "time":
        notes.append("parallel.rounds_by=time places the pipeline's rounds by times measured at run time; the memory "
                     "is planned for the unit clock's rounds (timed ones may hold a received buffer at another point "
                     "of the step)")
    return notes


def device_batches_ahead(prefetch: int, read: bool = False) -> int:
    """Batches a GPU rank's reader keeps on the device beside the step's (gems.rank.data.Prefetcher): its queue
    holds ``data.prefetch`` of them and it holds one more made while the queue is full; synthetic samples are
    drawn on the GPU and read ones copied there, both on its side stream. Measured on an H200: gems's 128^3
    CosmoFlow at batch 8 allocated 728 MiB more than a plain loop over the same module, three 256 MiB batches
    (results/gpu/h200-2026-11-26.json). ``read`` (HDF5 files): the batch being made is copied as the files'
    counts and transformed there, so it holds its counts and its input at once for a moment: one more, counted
    as float32 (the layout's int16 counts are half of that; a file may hold floats)."""
    return (prefetch + 1 + int(read)) if prefetch > 0 else 0


def reader_draw(cfg: Any, spec: Any) -> int:
    """Bytes a GPU rank's reader ahead holds on the device beside the batch it is making: one block of synthetic
    samples drawn there (gems.data.synthetic.draw_bytes: 2^20 values, or one plane where a plane holds more; 1 MiB
    for the U-Net at 64^3, 4 MiB for CosmoFlow),
    while the step runs. Read files (``hdf5``) hold their counts instead (:func:`device_batches_ahead`); with no
    reader ahead (``data.prefetch=0``) the step draws its batch before its own tensors exist."""
    if reads_files(cfg.data) or int(cfg.data.prefetch) <= 0:
        return 0
    from gems.data.synthetic import draw_bytes

    return draw_bytes(spec.input_shape)


def rank_threads(cfg: Any) -> int:
    """A CPU rank's threads: ``train.threads``, else the preset's ``cpus_per_task``, else 1."""
    return int(cfg.train.threads or cfg.cluster.cpus_per_task or 1)


def _largest(pl: Planner, quick: bool, largest: bool, usable: float, chunk: int) -> tuple[int, Any]:
    """(the largest micro-batch that fits, the profile the plan reuses): none and no profile for a quick plan, the
    profile alone without ``largest``; on GPU ranks ``usable`` is what the fixed parts leave over (1 + the
    fragmentation) x the peak."""
    if quick:
        return -1, None
    if not largest:
        return -1, pl.profile(max(1, chunk))
    return _max_chunk(pl, int(usable), chunk)


def _max_chunk(pl: Planner, usable: int, chunk0: int) -> tuple[int, Any]:
    """The largest micro-batch (samples per chunk) whose plan fits ``usable`` bytes, with the profile reused."""
    prof = pl.profile(max(1, chunk0))

    def peak(c: int) -> int:
        batch = c * pl.st.replicas * pl.chunks
        return max(p.bytes.total for p in pl.positions(batch, prof)[1])

    if peak(1) > usable:
        return 0, prof
    lo, hi = 1, 2
    while peak(hi) <= usable:
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if peak(mid) <= usable:
            lo = mid
        else:
            hi = mid
    return lo, prof


def _blas_workspaces(cfg: Any, pl: Planner, dev: dict[str, Any]) -> int:
    """cuBLAS's workspaces on a GPU rank whose model's trace holds a matmul (it creates the handles that hold them;
    gems.plan.reserve.blas_workspace_bytes), else 0."""
    if dev["kind"] != "gpu":
        return 0
    t = pl.traced(pl.classes()[0][0], 1)  # (a part the plan traces anyway: every part runs the same ops)
    if not any(cls == "matmul" for ops in t.ops.values() for (cls, _sig) in ops):
        return 0
    return blas_workspace_bytes(cfg.cluster.gpu, dev.get("sm90"), dev.get("rocm"))


def _checkpoint_host(cfg: Any, st: Any, positions: list[Any], dev: dict[str, Any], notes: list[str]) -> None:
    """Host memory for the files a run writes (gems.checkpoint): the model file, which rank 0 reads back whole from
    the writers' shares (the serial model's parameters and buffers, once: ``export_host_bytes``); and with
    ``train.checkpoint_async``, the copy DCP's async_save stages of a writer's share of its position (its
    parameters, buffers and optimizer state over the position's writers: ``checkpoint_host_bytes``)."""
    from gems.checkpoint import writer_count

    model = sum(t.numel() * t.element_size() for t in st.spec.module.state_dict().values())
    dev["export_host_bytes"] = int(model)
    notes.append(f"the model file: rank 0 reads the whole model into host memory to write it ({model / 2**20:.1f} "
                 "MiB; no device holds more than its own tensors)")
    if not cfg.train.checkpoint_async:
        return
    w = writer_count(st.mesh, int(cfg.train.checkpoint_writers))
    staged = -(-max(p.bytes.parameters + p.bytes.optimizer for p in positions) // w)
    dev["checkpoint_host_bytes"] = int(staged)
    notes.append(f"train.checkpoint_async: a writing rank holds a copy of its share of its position's parameters, "
                 f"buffers and optimizer state (1/{w}) in host memory while a checkpoint is written: "
                 f"{staged / 2**20:.1f} MiB")


def plan_memory(cfg: Any, quick: bool = False, available: bool = False,
                workspace: bool = True, largest: bool = True, parts: str = "every") -> tuple[MemoryPlan, Planner, Any]:
    """The memory plan of the composed configuration ``cfg`` (no process group, no allocation), with the planner
    and the profile it measured (what the step-time prediction reuses, :mod:`gems.plan.predict`). No
    suggestion and no prediction: :func:`gems.plan.make.make_plan` adds them.

    ``quick``: only whether the configured batch fits (one trace of the middle spatial part; no batch search).
    ``available``: CPU ranks of the local launcher get the memory this machine has free now, not all its RAM
    (the check before a run: other processes hold the rest).
    ``workspace``: CPU ranks count their convolutions' backward workspaces (measured: seconds per new shape;
    without them the plan is a lower bound, what the check before a run tries first: gems.plan.fit).
    ``largest``: search the largest batch that fits (``max_global_batch``; -1 without: a mesh search plans
    thousands of candidates at the user's batch, gems.plan.search). ``parts``: ``every`` spatial class traced, or
    the ``largest`` part's alone standing for all (the mesh search: the part with the most cells and neighbours,
    an interior one where the cut is even, is the one that sets the peak and the step in every plan gems makes).
    """
    t0 = time.perf_counter()
    st = setup(cfg)
    mesh = st.mesh
    pl = Planner(st, quick, parts)
    if not workspace:
        pl.workspace = None
    if st.spec.spatial_ndim > 0:
        for d in mesh.spatial_dims:
            if d >= st.spec.spatial_ndim:
                raise ConfigError("parallel.spatial_dims", list(mesh.spatial_dims),
                                  f"dims of this {st.spec.spatial_ndim}-D model, each in 0..{st.spec.spatial_ndim - 1}")
    pl.check_batch(st.batch)
    world = mesh.size
    dev = _device(cfg, world, available)
    reserve = _gpu_reserve(cfg, pl, dev) if dev["kind"] == "gpu" else None
    pl.blas = _blas_workspaces(cfg, pl, dev)
    if reserve is not None:  # the fixed parts now; fragmentation, a fraction of the peak, once it is known
        usable = dev["memory_bytes"] - reserve.fixed
        frag = reserve.fragmentation_fraction
    else:
        usable, frag = dev["memory_bytes"] - dev["reserve_bytes"], 0.0
    chunk = pl.chunk_of(st.batch)
    # CPU ranks: what train.host_memory costs in resident memory over the tensor peak (kept freed memory)
    # (a capped CPU rank: the cap counts the tensors themselves, as the run measures them)
    policy = str(cfg.train.host_memory) if dev["kind"] == "cpu" and not dev.get("capped") else None
    growth = KEEP_GROWTH if policy == "keep" else 1.0
    max_chunk, prof = _largest(pl, quick, largest, usable / growth / (1.0 + frag), chunk)
    bal, positions = pl.positions(st.batch, prof)
    worst = max(positions, key=lambda p: p.bytes.total)
    if reserve is not None:
        reserve.with_peak(worst.bytes.total)
        dev["reserve_bytes"] = int(reserve.total)
        dev["reserve"] = reserve.as_dict()
        usable = dev["memory_bytes"] - reserve.total
    dev["usable_bytes"] = int(usable)
    if policy == "auto":  # the runtime's rule on the planned peak: keep only where the node has room for it
        growth = KEEP_GROWTH if keeps_host_memory_within(worst.bytes.total, dev["memory_bytes"], 1) else 1.0
    if policy is not None:
        dev["host_memory"] = {"policy": policy, "keeps_freed_memory": growth > 1.0, "resident_factor": growth}
    resident = growth * worst.bytes.total
    fits = resident <= usable
    max_batch = max_chunk * st.replicas * pl.chunks
    min_eta = None
    if st.kind.passes == "eta":  # master: the fewest passes that fit the batch
        line = st.batch // st.replicas
        for eta in range(1, line + 1):
            if line % (eta * st.m) == 0 and max_chunk >= line // (eta * st.m):
                min_eta = eta
                break
    where = f"rank position {worst.label}"
    if growth > 1.0:  # kept freed memory: the resident size is what the node must hold
        where += (f" (resident {gib(resident)}: train.host_memory={policy} keeps freed memory, "
                  f"{KEEP_GROWTH} x the tensor peak; train.host_memory=release needs {gib(worst.bytes.total)})")
    elif policy == "auto":
        where += " (train.host_memory=auto will release freed memory: keeping it would not fit)"
    verdict = (f"{'fits' if fits else 'does not fit'}: peak {gib(worst.bytes.total)} of {gib(dev['memory_bytes'])} "
               f"on {where}")
    _checkpoint_host(cfg, st, positions, dev, pl.notes)
    plan = MemoryPlan(
        model=st.spec.name,
        input_shape=list(st.spec.input_shape), world_size=world,
        mesh={"replicas": mesh.replicas, "pipeline": mesh.pipeline, "spatial": mesh.spatial, "parts": list(mesh.parts),
              "spatial_dims": list(mesh.spatial_dims)},
        schedule=st.schedule, micro_batches=st.m, gems_replicas=st.eta, checkpoint=st.checkpoint,
        precision=st.precision, optimizer=str(cfg.train.optimizer), global_batch=st.batch, micro_batch=chunk,
        balance=list(bal), device=dev, positions=positions, fits=fits, max_global_batch=max_batch,
        max_micro_batch=max_chunk, min_gems_replicas=min_eta, suggestion=None, verdict=verdict,
        seconds=round(time.perf_counter() - t0, 3), notes=pl.notes, prediction=None)
    return plan, pl, prof
