"""Rank functions and the serial reference for the pipeline transparency tests.

A *case* is a dict: model ("cosmoflow" | "resnet_bn" | "resnet_gn" | "unet"), schedule,
D (pipeline), R (replicas), S (spatial parts), m (micro-batches), eta
(gems_replicas or None), checkpoint, B (global batch), steps, and ``via``:

* ``"pipeline"``: the rank calls ``apply_pipeline`` itself and sums the
  gradients over the mesh's ``grad`` group with one ``all_reduce`` each;
* ``"worker"``: the rank composes the strategies exactly as ``gems run`` does,
  through :func:`gems.rank.compose.parallelize` (spatial parts inside the pipeline
  partitions, then the pipeline, then the real
  :class:`gems.replication.GradientReducer` summing over the ``grad`` group,
  hooks and buckets included). Spatial cases (S > 1) need this route.

Every rank builds the same model from the same seed, runs ``steps`` SGD steps
and returns the global loss of every step and, for each partition it holds,
the step-0 gradients and final parameters, each with its index in the serial
model's ``parameters()`` (partitions of a spatial model carry an extra gather
layer, so partitions are compared parameter by parameter, not by position),
the floating buffers with their index in ``buffers()`` and the
``num_batches_tracked`` of its BatchNorm layers. ``serial_case`` computes the
same from one process by gradient accumulation over the same chunks.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gems.commlog import Recorder
from gems.mesh import Mesh
from gems.models import ModelSpec, build_model
from gems.models.layers import batch_context
from gems.pipeline import apply_pipeline, is_mirrored, make_schedule
from gems.pipeline.runtime import PipelineRunner

SEED = 7
LR = 0.05


def build(model: str) -> ModelSpec:
    """The model through the registry, as ``gems run`` builds it; the same weights on every rank. ``registered:NAME``
    is a registered model at its registration's example size (gems.models.registry.ModelKind.example)."""
    torch.manual_seed(0)
    if model.startswith("registered:"):
        from gems.models import registered

        return build_model(registered()[model.split(":", 1)[1]].example)
    if model == "cosmoflow":
        node: dict[str, Any] = dict(name="cosmoflow", size=32, width=0.125, dropout=0.3)
    elif model == "unet":  # skip connections across every cut (gems.models.skips carries them)
        node = dict(name="unet3d", size=16, width=0.0625, in_channels=1, num_classes=3, norm="batch")
    else:
        node = dict(name="resnet", depth=20, size=16, in_channels=3, num_classes=5, width=0.25,
                    norm="batch" if model == "resnet_bn" else "group")
    return build_model(node)


def _kind(spec: ModelSpec) -> str:
    return "mse" if spec.loss == "mse" else ("dense" if spec.target == "dense" else "ce")


def batch(step: int, B: int, shape: tuple[int, ...], loss: str, outputs: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(B, *shape, generator=g)
    if loss == "dense":  # a class per voxel
        return x, torch.randint(0, outputs, (B, *shape[1:]), generator=g), list(range(step * B, (step + 1) * B))
    y = torch.randn(B, outputs, generator=g) if loss == "mse" else torch.randint(0, outputs, (B,), generator=g)
    return x, y, list(range(step * B, (step + 1) * B))


def make_loss(kind: str, B: int):  # type: ignore[no-untyped-def]
    def loss_fn(out: torch.Tensor, tgt: torch.Tensor, n: int) -> torch.Tensor:
        if kind == "mse":
            return ((out - tgt) ** 2).mean(dim=1).sum() / B
        if kind == "dense":  # each sample's mean over its voxels (a sum over them would train chaotically)
            return F.cross_entropy(out, tgt, reduction="none").flatten(1).mean(dim=1).sum() / B
        return F.cross_entropy(out, tgt, reduction="sum") / B
    return loss_fn


def pipeline_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [_run_case(rank, world, c) for c in cases]


def fake_times(rank: int, actions: Any) -> dict[Any, float]:
    """A made-up measurement of ``actions`` (kind, stage) on ``rank`` (the ``timed="fake"`` cases): odd stages three
    times the even ones' (uneven stages move rounds), a backward 2.5 forwards, and every rank's a little
    different, so only the agreement over the ranks gives them one plan."""
    from gems.pipeline.schedules import Kind

    per = {Kind.F: 1.0, Kind.B: 2.5, Kind.I: 1.25, Kind.W: 1.25}
    return {(a.kind, a.stage): (1 + 2 * (a.stage % 2)) * per[a.kind] * 1e-3 * (1 + 0.1 * rank) for a in actions}


class _Rank:
    """What one rank trains, however it was composed."""

    mesh: Mesh
    held: dict[int, nn.Module]  # partition index -> this rank's module of it
    params: list[nn.Parameter]
    needs_inputs: bool
    needs_targets: bool
    slices: tuple[slice, ...] | None  # this rank's spatial part of a sample
    samples_per_step: int
    balance: list[int] | None

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int], t: int) -> Any:
        """One step's forwards and backwards (the rank's weighted loss); afterwards ``.grad`` holds the sum over
        the grad group."""
        raise NotImplementedError

    def place_rounds(self, how: str, rank: int) -> tuple[str | None, Any]:
        """The rounds placed by the actions' times from the next step on (``how``: "real", the clock's; "fake",
        :func:`fake_times`): the record's note and the step plan's layout (None where the rank cannot see it)."""
        raise NotImplementedError


class _Direct(_Rank):
    def __init__(self, rank: int, world: int, c: dict[str, Any], spec: ModelSpec) -> None:
        R, D, B = c["R"], c["D"], c["B"]
        self.mesh = Mesh(R, D, world_size=world)
        self.mesh.build_groups(rank, mirrored=is_mirrored(c["schedule"]))
        if c.get("one_batch"):  # every round one batch on the line's one group, as under NCCL
            self.mesh.groups.pipeline_up = None
        self.runner = apply_pipeline(
            spec.module, self.mesh, rank, loss_fn=make_loss(_kind(spec), B), batch_size=B // R,
            schedule=c["schedule"], micro_batches=c["m"], gems_replicas=c.get("eta"), virtual_stages=c.get("v"),
            split_backward=c.get("split", False),
            checkpoint=c.get("checkpoint", False), sample_shape=spec.input_shape if c.get("trace", True) else None,
            balance=c.get("balance"), balance_by=c.get("balance_by", "memory"))
        if c.get("timed"):
            self.runner.time_actions()
        self.held = dict(self.runner.partitions)
        self.params = self.runner.parameters()  # may be empty: a memory-balanced cut can leave only pooling layers
        self.needs_inputs, self.needs_targets = self.runner.needs_inputs, self.runner.needs_targets
        self.slices, self.samples_per_step, self.balance = None, self.runner.samples_per_step, self.runner.balance

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int], t: int) -> float:
        for p in self.params:
            p.grad = torch.zeros_like(p)
        local = self.runner.step(x, y, ids, SEED, t)
        if self.mesh.group("grad") is not None:
            for p in self.params:
                dist.all_reduce(p.grad, group=self.mesh.group("grad"))
        return local

    def place_rounds(self, how: str, rank: int) -> tuple[str | None, Any]:
        runner = self.runner
        assert runner.clock is not None and runner.clock.spans, "the clock timed the first step's actions"
        if how == "fake":
            runner.clock.least = lambda: fake_times(rank, runner.actions)  # type: ignore[method-assign]
        return runner.place_rounds_by_time(), runner.plan().layout()


class _Worker(_Rank):
    """Composed by ``gems.rank.compose.parallelize`` from a configuration, as on every rank of ``gems run``."""

    def __init__(self, rank: int, world: int, c: dict[str, Any], spec: ModelSpec) -> None:
        from gems.bootstrap import World
        from gems.config import typed
        from gems.mesh import mesh_from_config
        from gems.rank.compose import parallelize

        cfg = typed({
            "parallel": dict(replicas=c["R"], pipeline=c["D"], spatial=c["S"], spatial_dims=list(c["spatial_dims"]),
                             schedule=c["schedule"], micro_batches=c["m"], gems_replicas=c.get("eta"),
                             virtual_stages=c.get("v"), split_backward=c.get("split", False),
                             balance=c.get("balance"),
                             balance_by=c.get("balance_by", "memory"), checkpoint=c.get("checkpoint", False),
                             bn_stats="global", overlap=c.get("overlap"),
                             rounds_by="time" if c.get("timed") else "unit"),
            "train": dict(batch_size=c["B"], seed=SEED, precision="fp32",
                          loss_scaling="dynamic" if c.get("loss_scaling") else "off"),
            "comm": dict(bucket_mb=c.get("bucket_mb", 4.0)),
        })
        w = World(rank=rank, size=world, local_rank=rank, master_addr="127.0.0.1", master_port=0, source="single",
                  device=torch.device("cpu"), backend="gloo", grad_comm="torch")
        self.mesh = mesh_from_config(cfg, world)
        self.mesh.build_groups(rank, mirrored=is_mirrored(c["schedule"]))
        self.par = parallelize(spec, self.mesh, w, cfg)
        sched = make_schedule(c["schedule"], c["D"], c["m"], c.get("eta"), c.get("v"), c.get("split", False))
        held = sched.partitions_of(self.mesh.coord(rank).pipeline)
        assert len(held) == len(self.par.modules), (held, len(self.par.modules))
        self.held = dict(zip(held, self.par.modules))
        self.params = self.par.params
        self.needs_inputs, self.needs_targets = self.par.needs_input, self.par.needs_target
        self.slices, self.samples_per_step = self.par.input_slices, self.par.samples_per_step
        self.balance = getattr(self.par, "balance", None)

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int], t: int) -> float:
        for p in self.params:
            p.grad = None  # as the worker leaves them (zero_grad(set_to_none=True))
        return self.par.forward_backward(x, y, ids, t)

    def place_rounds(self, how: str, rank: int) -> tuple[str | None, Any]:
        assert how == "real", "the worker's runner measures its own actions"
        before = len(self.par.notes)
        self.par.place_rounds()
        return (self.par.notes[before] if len(self.par.notes) > before else None), None


def _run_case(rank: int, world: int, c: dict[str, Any]) -> dict[str, Any]:
    spec = build(c["model"])
    shape, kind = tuple(spec.input_shape), _kind(spec)
    param_index = {id(p): k for k, p in enumerate(spec.module.parameters())}
    buffer_index = {id(b): k for k, b in enumerate(spec.module.buffers())}
    recorder = Recorder(device=torch.device("cpu"))  # what this rank issues, in order (replayed under NCCL's rules)
    with recorder:
        me: _Rank = (_Worker if c["via"] == "worker" else _Direct)(rank, world, c, spec)
    # gloo's own order (``gloo_order``): the steps unrecorded, so the runtime posts receives ahead of their rounds
    # (gems.pipeline.exchange.receive_lead), counted here; a recorded run posts as NCCL does, in the rounds
    steps_recorded: Any = contextlib.nullcontext() if c.get("gloo_order") else recorder
    ahead = [0]
    real_exchange = PipelineRunner._exchange

    def counted(runner: PipelineRunner, rnd: Any, receives_only: bool = False) -> None:
        ahead[0] += receives_only
        real_exchange(runner, rnd, receives_only)

    PipelineRunner._exchange = counted  # type: ignore[method-assign]
    R, B = c["R"], c["B"]
    opt = torch.optim.SGD(me.params, lr=LR) if me.params else None
    r = me.mesh.coord(rank).replica
    share = slice(r * B // R, (r + 1) * B // R)
    index = {i: [param_index[id(p)] for p in part.parameters()] for i, part in me.held.items()}
    losses: list[float] = []
    grads0: dict[int, list[torch.Tensor]] = {}
    timed: tuple[str | None, Any] | None = None
    with steps_recorded, _restored(PipelineRunner, "_exchange", real_exchange):
        for t in range(c["steps"]):
            x, y, ids = batch(t, B, shape, kind, spec.num_outputs)
            x, y = x[share], y[share]
            if me.slices is not None:  # this rank's part of every sample, as the data reader hands it over
                x = x[(slice(None), slice(None), *me.slices)].contiguous()
                if kind == "dense":  # and of every voxel's class
                    y = y[(slice(None), *me.slices)].contiguous()
            local = me.step(x if me.needs_inputs else None, y if me.needs_targets else None, ids[share], t)
            total = torch.tensor([float(local)], dtype=torch.float64)
            dist.all_reduce(total)
            losses.append(total.item())
            scaled = c.get("loss_scaling") and isinstance(me, _Worker)
            if scaled and opt is not None:  # fp16's route: unscale after the sum, agree on overflow, step
                assert me.par.scaler.enabled and me.par.scaler.step(opt, t)
            if t == 0:
                grads0 = {i: [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in part.parameters()]
                          for i, part in me.held.items()}
            if opt is not None and not scaled:
                opt.step()
            if t == 0 and c.get("timed"):  # the next steps' rounds placed by the actions' times
                timed = me.place_rounds(c["timed"], rank)
    sched = make_schedule(c["schedule"], c["D"], c["m"], c.get("eta"), c.get("v"), c.get("split", False))
    forwards = {i: sum(a.kind == "F" and a.stage == i for a in sched.actions[me.mesh.coord(rank).pipeline])
                for i in me.held}
    return {"rank": rank, "losses": losses, "grads0": grads0, "balance": me.balance, "index": index,
            "params": {i: [p.detach().clone() for p in part.parameters()] for i, part in me.held.items()},
            "buffers": {i: [(buffer_index[id(b)], b.detach().clone()) for _, b in part.named_buffers() if b.is_floating_point()]
                        for i, part in me.held.items()},
            "tracked": {i: [int(b) for n, b in part.named_buffers() if n.endswith("num_batches_tracked")]
                        for i, part in me.held.items()},
            "forwards": forwards, "samples_per_step": me.samples_per_step, "comm": recorder.events, "timed": timed,
            "posted_ahead": ahead[0]}


@contextlib.contextmanager
def _restored(owner: Any, name: str, value: Any) -> Any:
    try:
        yield
    finally:
        setattr(owner, name, value)


def serial_case(c: dict[str, Any]) -> dict[str, Any]:
    """One process, the same chunks: replica r's share cut into eta x m chunks, gradients accumulated.

    Returns the losses and, indexed like ``parameters()`` / ``buffers()`` of the model, the step-0
    gradients, the initial and final parameters and the final buffers. Cases that cut the batch alike
    share one reference (the caller must not modify it).
    """
    eta = make_schedule(c["schedule"], c["D"], c["m"], c.get("eta"), c.get("v"), c.get("split", False)).replicas
    return _serial(c["model"], c["B"], c["R"] * eta * c["m"], c["steps"])


@functools.lru_cache(maxsize=None)
def _serial(model: str, B: int, chunks: int, steps: int) -> dict[str, Any]:
    spec = build(model)
    seq, shape, kind = spec.module, tuple(spec.input_shape), _kind(spec)
    k = B // chunks
    loss_fn = make_loss(kind, B)
    params = list(seq.parameters())
    init = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=LR)
    losses, grads0 = [], []
    for t in range(steps):
        x, y, ids = batch(t, B, shape, kind, spec.num_outputs)
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for j in range(chunks):
            sl = slice(j * k, (j + 1) * k)
            with batch_context(SEED, t, ids[sl]):
                loss = loss_fn(seq(x[sl]), y[sl], k)
                loss.backward()
            total += loss.item()
        losses.append(total)
        if t == 0:
            grads0 = [p.grad.clone() for p in params]
        opt.step()
    return {"losses": losses, "grads0": grads0, "init": init, "params": [p.detach().clone() for p in params],
            "buffers": [b.detach().clone() for b in seq.buffers()]}
