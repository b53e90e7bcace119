"""The gems worker: what every rank runs, from configuration to results record.

``run_rank(cfg_yaml)`` is the entry on every launcher (local processes,
submitit tasks, ``srun``/``mpiexec`` via ``python -m gems.worker --config``).
It bootstraps the world (gems/bootstrap.py), builds the R x D x S mesh,
builds the model and composes the strategies in :func:`parallelize`, runs the
step loop with warm-up, and rank 0 writes the results record.

The strategies are composed in one place, in this order (docs/design.md):
spatial parts inside each layer, then pipeline partitions over the layers,
then the gradient sum over every copy of each parameter.
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn

from gems import checkpoint as ckpt
from gems import commlog, timers
from gems.bootstrap import (
    KEEP_GROWTH,
    World,
    check_launch,
    init_world,
    keep_host_memory,
    keeps_host_memory_within,
    node_memory_bytes,
    ranks_on_this_node,
)
from gems.dryrun import scalar
from gems.errors import ConfigError, RunError
from gems.fault import all_finite, inject, progress, reports
from gems.fault.watchdog import Watchdog
from gems.layers import batch_context, guard_bf16_conv3d
from gems.memory import MemoryMeter, persistent_bytes, step_peak_bytes
from gems.mesh import Coord, Mesh, mesh_from_config
from gems.models import ModelSpec, build_model, check_shapes
from gems.parallel import ParallelSettings, resolve, spatial_model, spatial_stage_balance
from gems.pipeline.runtime import split_waits
from gems.precision import LossScaler, autocast, scaling_enabled
from gems.replication import GradientReducer, mpi_group
from gems.results import record as rec


# ---------------------------------------------------------------------------- loss
def make_loss_fn(spec: ModelSpec, mesh: Mesh, global_batch: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The weighted local loss: summed over all ranks it equals the serial mean loss (docs/design.md)."""
    gathered = mesh.spatial_enabled and spec.spatial_end is not None
    part_weight = 1.0 / mesh.spatial if gathered else 1.0

    if spec.target == "dense":
        cells = math.prod(spec.input_shape[1:])

        def dense(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            if spec.loss == "cross_entropy":
                s = F.cross_entropy(out.float(), y, reduction="sum")
            else:
                s = F.mse_loss(out.float(), y.float(), reduction="sum") / out.shape[1]
            return s / (cells * global_batch)

        return dense

    def vector(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if spec.loss == "cross_entropy":
            s = F.cross_entropy(out.float(), y, reduction="sum")
        else:
            s = F.mse_loss(out.float(), y.float(), reduction="sum") / out.shape[1]
        return s * (part_weight / global_batch)

    return vector


# ---------------------------------------------------------------------------- composition
@dataclass
class Parallel:
    """What one rank trains: a forward/backward step function and its parameters."""

    step: Callable[[torch.Tensor | None, torch.Tensor | None, list[int], int], float]
    params: list[nn.Parameter]
    modules: list[nn.Module]
    reducer: GradientReducer
    input_slices: tuple[slice, ...] | None  # this rank's spatial part of a sample
    needs_input: bool
    needs_target: bool
    samples_per_step: int  # samples this rank's replica line trains per step
    stats: Callable[[], dict[str, float]] = field(default=lambda: {})
    balance: list[int] | None = None  # layers per pipeline partition (None without a pipeline)
    notes: list[str] = field(default_factory=list)  # what the composition decided on its own (the record says)
    #: where this rank first saw a non-finite value in the last step: 0 its input, 1 + s the output of
    #: partition s; None when all was finite (read only after a non-finite loss: it may synchronise a GPU)
    first_nonfinite: Callable[[], int | None] = field(default=lambda: None)
    #: wait for this rank's messages still in flight (a profiled step ends with none: see drain_sends)
    quiesce: Callable[[], None] = field(default=lambda: None)
    #: fp16's loss scaling (gems.precision): the loss the backward starts from, the optimizer step after the sum
    scaler: LossScaler = field(default_factory=lambda: LossScaler(torch.device("cpu"), False))
    #: when the pipeline sent and waited for each message (gems.pipeline.runtime.Transfers); None without one
    transfers: Any = None


def parallelize(spec: ModelSpec, mesh: Mesh, world: World, cfg: DictConfig,
                settings: ParallelSettings | None = None) -> Parallel:
    """Compose the strategies for this rank, in this order:

    1. spatial: each layer works on this rank's part of the sample (S > 1);
    2. pipeline: the layers are split into the schedule's partitions and it
       runs them (D > 1, or a schedule other than lp);
    3. replication: gradients are summed over every rank that holds a copy.

    ``settings`` (:func:`gems.parallel.resolve`) says how; resolved from ``cfg`` when not given.
    """
    settings = settings or resolve(cfg)
    rank, device = world.rank, world.device
    p = cfg.parallel
    spec, gather_note = spatial_model(spec, mesh, p.bn_stats)
    B, R = int(cfg.train.batch_size), mesh.replicas
    local_batch = B // R
    seed = int(cfg.train.seed)
    loss_fn = make_loss_fn(spec, mesh, B)
    seq: nn.Sequential = spec.module
    slices: tuple[slice, ...] | None = None
    if device.type == "cpu" and cfg.train.precision == "bf16":
        guard_bf16_conv3d(seq)  # torch's bf16 Conv3d weight gradient on CPU is wrong for inputs 2 cells deep

    ctx: Any = None

    pipelined = settings.pipelined
    balance = list(settings.balance) if settings.balance else None

    # 1. spatial
    if mesh.spatial_enabled:
        from gems.spatial import SpatialContext, apply_spatial

        ctx = SpatialContext.from_mesh(mesh, rank, p.get("overlap"))
        slices = tuple(ctx.local_slices(spec.input_shape[1:]))
        if pipelined and balance is None and settings.stages > 1:  # balanced on the serial layers, as ranks run them
            balance = spatial_stage_balance(settings, spec, device)
        seq = apply_spatial(seq, ctx, spec.spatial_end, bn_stats=p.bn_stats)

    def halo_stats() -> dict[str, float]:
        if ctx is None:
            return {}
        out = {"halo": float(sum(ctx.halo_seconds.values()))}
        ctx.halo_seconds.clear()
        return out

    def quiesce() -> None:
        if ctx is not None:
            ctx.drain_sends()

    if any(t.device != device for t in [*seq.parameters(), *seq.buffers()]):  # (fake parameters cannot be moved)
        seq = seq.to(device)
    if device.type == "cuda" and spec.spatial_ndim in (2, 3):
        seq = seq.to(memory_format=torch.channels_last if spec.spatial_ndim == 2  # type: ignore[call-overload]
                     else torch.channels_last_3d)
    amp = autocast(cfg.train.precision, device)
    t = cfg.train
    scaler = LossScaler(device, scaling_enabled(str(t.precision), str(t.get("loss_scaling", "auto"))),
                        float(t.get("loss_scale_init", 2.0**16)), int(t.get("loss_scale_growth_interval", 2000)))

    # 2. pipeline
    if pipelined:
        from collections import Counter

        from gems.pipeline import apply_pipeline

        runner = apply_pipeline(
            seq, mesh, rank, loss_fn=lambda out, y, n: loss_fn(out, y), batch_size=local_batch,
            schedule=p.schedule, micro_batches=int(p.micro_batches),
            gems_replicas=settings.gems_replicas, virtual_stages=settings.virtual_stages,
            split_backward=settings.split_backward,
            balance=balance, balance_by=settings.balance_by_given,
            checkpoint=settings.checkpoint, sample_shape=_pipeline_sample(spec, ctx, slices), device=device,
            amp=lambda: autocast(cfg.train.precision, device),
        )
        runner.scale_loss = scaler.scale
        params = list(runner.parameters())
        reducer = _reducer(params, mesh, world, cfg)
        # a parameter is final after the last backward of its partition on this rank
        backwards = Counter(a.stage for a in runner.actions if a.kind in ("B", "W"))
        count = {id(q): backwards[s] for s, part in runner.partitions.items() for q in part.parameters()}

        def pipe_step(x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int], step: int) -> float:
            if ctx is not None and x is not None:
                ctx.mark(x, spec.input_shape[1:])
            reducer.start_step(expected=lambda q: count[id(q)])
            with amp:
                loss = runner.step(x, y, ids, seed, step)
            reducer.finish()
            return float(loss)

        def pipe_stats() -> dict[str, float]:
            st = runner.stats
            out = {"bubble_or_wait": st.wait_s, **halo_stats()}
            st.forward_s = st.backward_s = st.wait_s = 0.0
            return out

        return Parallel(pipe_step, params, list(runner.modules), reducer, slices,
                        runner.needs_inputs, runner.needs_targets, runner.samples_per_step, pipe_stats,
                        balance=list(runner.balance), first_nonfinite=runner.first_nonfinite,
                        notes=[gather_note] if gather_note else [], quiesce=quiesce, scaler=scaler,
                        transfers=runner.transfers)

    # no pipeline: one forward and backward of the whole (spatial) model
    params = list(seq.parameters())
    reducer = _reducer(params, mesh, world, cfg)
    if p.checkpoint:
        from torch.utils.checkpoint import checkpoint_sequential

        def forward(x: torch.Tensor) -> torch.Tensor:
            return checkpoint_sequential(seq, max(1, len(seq) // 2), x, use_reentrant=False)
    else:
        forward = seq

    finite: dict[int, torch.Tensor | bool] = {}  # position -> all finite? (a device flag: no synchronisation)

    def plain_step(x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int], step: int) -> float:
        assert x is not None and y is not None
        if ctx is not None:
            ctx.mark(x, spec.input_shape[1:])
        reducer.start_step()
        finite[0] = all_finite(x)
        progress.mark("forward")
        with batch_context(seed, step, ids):
            with amp:
                out = forward(x)
            finite[1] = all_finite(out)
            loss = loss_fn(out, y)
            progress.mark("backward")
            scaler.scale(loss).backward()
        reducer.finish()
        return scalar(loss.detach())

    def first_bad() -> int | None:
        return next((pos for pos, ok in sorted(finite.items()) if not bool(ok)), None)

    return Parallel(plain_step, params, [seq], reducer, slices, True, True, local_batch, halo_stats,
                    first_nonfinite=first_bad, notes=[gather_note] if gather_note else [], quiesce=quiesce,
                    scaler=scaler)


def _pipeline_sample(spec: ModelSpec, ctx: Any, slices: tuple[slice, ...] | None) -> tuple[int, ...] | None:
    """The sample shape the pipeline traces its cut shapes with: none for spatial partitions, which talk to
    other ranks while they run, except over a process group that moves no data (the dry run, gems.dryrun),
    where this rank's part is traced with the input's global shape known."""
    if ctx is None:
        return tuple(spec.input_shape)
    if not ctx.shapes_only() or slices is None:
        return None
    local = tuple(s.stop - s.start for s in slices)
    ctx.last_mark = (local, tuple(spec.input_shape[1:]))
    return (spec.input_shape[0], *local)


def preflight(cfg: DictConfig) -> None:
    """Every check that needs the model but not the world, run by the CLI before launching.

    A mesh the model cannot take (too many parts, a missing dim, a layer gems
    cannot partition, a schedule the batch or the layers do not divide) is bad
    input: it must stop with exit 2 before anything is submitted, not fail on
    every rank of a 1024-GPU job.
    """
    import copy

    mesh = mesh_from_config(cfg)
    spec = build_model(cfg.model)
    if spec.name == "custom":  # the built-in models fit their declared input by construction
        check_shapes(spec)
    p = cfg.parallel
    seq = spec.module
    if cfg.data.name == "hdf5":  # a file that does not match the model is named before launch
        make_data(cfg, spec).samples.check_all(int(cfg.train.steps) * int(cfg.train.batch_size), spec.num_outputs)
    check_launch(cfg, mesh.size)  # gloo on GPUs, NCCL on CPUs, more ranks on a node than GPUs
    if mesh.spatial_enabled:
        from gems.spatial import SpatialContext, apply_spatial

        for d in mesh.spatial_dims:
            if d >= spec.spatial_ndim:
                raise ConfigError("parallel.spatial_dims", list(mesh.spatial_dims),
                                  f"dims below {spec.spatial_ndim}: {spec.name} has {spec.spatial_ndim} spatial dims")
        ctx = SpatialContext(None, list(range(mesh.spatial)), mesh.parts, mesh.spatial_dims, (0,) * len(mesh.parts))
        ctx.local_slices(spec.input_shape[1:])
        spec, note = spatial_model(spec, mesh, p.bn_stats)
        if note:
            print(f"gems: note: {note}", file=sys.stderr, flush=True)
        seq = apply_spatial(copy.deepcopy(spec.module), ctx, spec.spatial_end, bn_stats=p.bn_stats)
    resolve(cfg).check_layers(len(seq))  # the schedule, the batch over passes and micro-batches, the balance


def _reducer(params: list[nn.Parameter], mesh: Mesh, world: World, cfg: DictConfig) -> GradientReducer:
    bucket = float(cfg.comm.bucket_mb)
    if world.grad_comm == "mpi":
        group: Any = mpi_group(world.mpi_comm, mesh, world.rank) if len(mesh.ranks("grad")) > 1 else None
    else:
        group = mesh.group("grad")
    return GradientReducer(params, group, bucket)


class _NoParameters:
    """The optimizer of a rank whose partitions hold no parameters (only pooling, say): nothing to step,
    a state that saves and loads like any other (torch's optimizers refuse an empty parameter list)."""

    def __init__(self) -> None:
        self.state: dict[Any, Any] = {}
        self.param_groups: list[dict[str, Any]] = []

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def make_optimizer(cfg: DictConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    t = cfg.train
    if not params:  # a partition without parameters is legitimate (time balance may give a rank pooling only)
        return _NoParameters()  # type: ignore[return-value]
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=float(t.lr), momentum=float(t.momentum))
    return torch.optim.Adam(params, lr=float(t.lr))


# ---------------------------------------------------------------------------- data
def make_data(cfg: DictConfig, spec: ModelSpec, slices: tuple[slice, ...] | None = None) -> Any:
    if cfg.data.name == "hdf5":
        from gems.data.hdf5 import HDF5Samples

        if spec.target != "vector":
            raise ConfigError("data", "hdf5",
                              f"synthetic for {spec.name} (the ExaLearn files carry one target vector per sample)")
        return _HDF5Batches(HDF5Samples(cfg.data.path, spec.input_shape, slices=slices))
    from gems.data.synthetic import SyntheticData

    return SyntheticData(spec, int(cfg.train.seed), int(cfg.data.num_samples))


class _HDF5Batches:
    """The worker's view of HDF5 samples: this rank's hyperslab, inputs or targets as needed."""

    def __init__(self, samples: Any) -> None:
        self.samples = samples

    def batch(self, indices: list[int], slices: Any = None, want_input: bool = True,
              want_target: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not want_input:
            from gems.data.hdf5 import read_target

            return None, torch.stack([read_target(self.samples.files[i % len(self.samples)]) for i in indices])
        x, y = self.samples.batch(indices)
        return x, (y if want_target else None)


def replica_indices(step: int, batch: int, replicas: int, replica: int) -> list[int]:
    """Global sample indices of replica ``replica`` at ``step`` (contiguous shares of the step's batch)."""
    share = batch // replicas
    start = step * batch + replica * share
    return list(range(start, start + share))


def set_up_rank(cfg: DictConfig, world: World, mesh: Mesh, settings: ParallelSettings
                ) -> tuple[Coord, ModelSpec, Parallel, torch.optim.Optimizer]:
    """What a rank builds before its first step, once its groups exist: (its mesh coordinate, the model, its
    parallel step, its optimizer). A run and ``gems plan plan.dry_run=true`` both build it here."""
    coord = mesh.coord(world.rank)
    torch.manual_seed(int(cfg.train.seed))
    spec = build_model(cfg.model)  # same seed everywhere: every copy starts from the same weights
    par = parallelize(spec, mesh, world, cfg, settings)
    return coord, spec, par, make_optimizer(cfg, par.params)


def step_batch(data: Any, par: Parallel, step: int, batch: int, replicas: int, replica: int
               ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
    """(sample indices, input, target) of ``step`` on a rank: its replica's samples, its spatial part of the
    inputs where it runs a first stage, the targets where it runs a last one."""
    ids = replica_indices(step, batch, replicas, replica)
    x, y = data.batch(ids, par.input_slices, want_input=par.needs_input, want_target=par.needs_target)
    return ids, x, y


# ---------------------------------------------------------------------------- the run
class NonFiniteLoss(RunError):
    """The global loss of a step was NaN or Inf and ``train.on_nonfinite=stop``: every rank stops at that step."""


def start_watchdog(cfg: DictConfig, world: World, on_stall: Callable[[str, dict[str, Any]], None]) -> Watchdog | None:
    """This rank's heartbeat thread (``fault.stall_timeout_s``; null switches stall detection off)."""
    f = cfg.fault
    if f.get("stall_timeout_s") is None:
        return None
    jd = rec.job_dir(cfg)

    def report(message: str, failure: dict[str, Any]) -> None:
        reports.write_report(jd, world.rank, message, echo=world.rank not in failure.get("ranks", []),
                             kind=failure.get("kind", "stall"), blame=failure.get("blame"))

    launcher = os.environ.get("GEMS_LAUNCHER_PID")
    return Watchdog(world.rank, world.size, stall_s=float(f.stall_timeout_s), warmup_s=float(f.warmup_timeout_s),
                    addr=os.environ.get("MASTER_ADDR", world.master_addr),
                    port=int(os.environ.get("MASTER_PORT", world.master_port)),
                    on_stall=on_stall if world.rank == 0 else None, on_report=report,
                    launcher_pid=int(launcher) if launcher else None).start()


def train(cfg: DictConfig, world: World, wd: Watchdog | None = None) -> dict[str, Any]:
    """Train on this rank; returns the record (complete on rank 0)."""
    import torch.distributed as dist

    t_start = time.time()
    progress.mark("setup")
    host_memory = HostMemory(str(cfg.train.get("host_memory", "auto")), world.device)
    if cfg.train.threads and world.device.type == "cpu":
        torch.set_num_threads(int(cfg.train.threads))
    mesh = mesh_from_config(cfg, world.size)
    settings = resolve(cfg)
    if world.size > 1:
        mesh.build_groups(world.rank, groups=settings.holder_groups, timeout=world.timeout)
    else:
        mesh.groups.grad_ranks = [0]
    meter = MemoryMeter(world.device)
    meter.reset()
    tensor_peak: int | None = None  # CPU ranks: the largest over the steps profiled for it
    coord, spec, par, opt = set_up_rank(cfg, world, mesh, settings)
    data = make_data(cfg, spec, par.input_slices)
    inject.arm(cfg, world.rank, par.modules)
    B, R = int(cfg.train.batch_size), mesh.replicas
    steps, warm = int(cfg.train.steps), int(cfg.train.warmup_steps)
    # CPU ranks count tensor memory under the profiler (gems/memory.py) on every step before measure_from, which
    # includes a step after the first optimizer step (the optimizer's state exists from then on): with fewer
    # than two warm-up steps the first step after them is profiled too and left out of the timings (the
    # profiler slows a step). GPU ranks read torch.cuda's peak over the whole run.
    measure_from = max(warm, min(2, steps - 1)) if world.device.type == "cpu" else warm
    ckpt_every = int(cfg.train.get("checkpoint_every") or 0)
    on_nonfinite = str(cfg.train.get("on_nonfinite", "stop"))
    # running statistics (BatchNorm) of the copies of a parameter's module see different samples
    buffers = [b for m in par.modules for b in m.buffers() if b.is_floating_point()] if mesh.group("grad") else []

    # resume after a preemption, a time limit or a requeue (gems/checkpoint.py)
    restarts = ckpt.restart_count()
    history: dict[str, Any] = {"losses": [], "step_times": [], "nonfinite_steps": [], "every_step_time": [],
                               "tensor_peaks": [],
                               "breakdown": {k: 0.0 for k in ("compute", "pipeline_comm", "halo", "allreduce",
                                                                "bubble_or_wait", "data")}}
    start = 0
    progress.mark("checkpoint")
    got = ckpt.load(cfg, world.rank, par.modules, opt)
    if got is not None:
        start, history = got
        history.setdefault("nonfinite_steps", [])
        history.setdefault("every_step_time", [])
        history.setdefault("tensor_peaks", [])
        restarts = max(restarts, 1)
        if "loss_scale" in history:  # fp16: the scale and the steps skipped so far, as if never stopped
            par.scaler.load_state_dict(history["loss_scale"])
    if wd is not None:
        wd.warm_until = max(measure_from, start + 1)  # warm-up, profiled steps, the first after a (re)start
    losses: list[float] = history["losses"]
    step_times: list[float] = history["step_times"]
    breakdown: dict[str, float] = history["breakdown"]
    nonfinite: list[int] = history["nonfinite_steps"]
    every_time: list[float] = history["every_step_time"]  # every step's time, warm-up and profiled ones included
    tensor_peaks_seen: list[int] = history["tensor_peaks"]
    context = _StepContext(cfg, world, mesh, par, opt, B, R)
    # (a resumed run splits the pipeline waits of the steps after its restart only: the rest stay bubble_or_wait)
    run_sent: dict[tuple[int, ...], float] = {}
    run_received: dict[tuple[int, ...], tuple[float, float]] = {}
    timers.reset()
    for step in range(start, steps):
        progress.mark("data", step)
        inject.before_step(cfg, world.rank, step)
        if cfg.fault.preempt_at_step == step and restarts == 0:
            _preempt(cfg, world, step, par, opt, history, wd, "fault injection: preempting the job")
        _sync(world.device)
        t0 = time.perf_counter()
        ids, x, y = step_batch(data, par, step, B, R, coord.replica)
        x = inject.poison(cfg, world.rank, step, x)
        x = x.to(world.device, non_blocking=True) if x is not None else None
        y = y.to(world.device, non_blocking=True) if y is not None else None
        t_data = time.perf_counter() - t0
        timers.reset()
        profiling = bool(cfg.train.get("profile")) and step == measure_from and steps - measure_from > 1
        if profiling:
            loss, stop = _profiled(cfg, world, lambda: context.step(x, y, ids, step, quiesce=True))
        elif step < measure_from and world.device.type == "cpu":
            # profiled for the tensor memory a GPU would count (gems/memory.py); the largest over these steps
            held = persistent_bytes(par.params, opt, [b for m in par.modules for b in m.buffers()] +
                                    [t for t in (x, y) if t is not None])  # the batch: read before the step
            box: list[tuple[float, bool]] = []
            tensor_peaks_seen.append(held + step_peak_bytes(
                lambda: box.append(context.step(x, y, ids, step, quiesce=True))))
            loss, stop = box[0]
        else:
            loss, stop = context.step(x, y, ids, step)
        host_memory.after_step(world.rank)
        if par.scaler.enabled:
            history["loss_scale"] = par.scaler.state_dict()  # saved with every checkpoint
        if buffers:
            with progress.waiting("gradient sum"):
                _average_buffers(buffers, mesh)
        _sync(world.device)
        dt = time.perf_counter() - t0
        timers.settle()  # on GPUs the communication waits were CUDA events: read them now (gems.timers)
        losses.append(loss)
        finite = math.isfinite(loss)
        if not finite:
            nonfinite.append(step)
            if on_nonfinite == "stop":
                context.stop_nonfinite(step, loss, losses, restarts)
            elif world.rank == 0:
                print(f"gems: warning: the loss of step {step} is {loss} (train.on_nonfinite=warn: training goes on; "
                      f"the record says so)", file=sys.stderr, flush=True)
        if world.rank == 0:
            what = " (warm-up)" if step < warm else " (profiled for tensor memory)" if step < measure_from else ""
            print(f"gems: step {step + 1}/{steps} {dt:.3f} s loss {loss:.6g}{what}", flush=True)
        t = timers.snapshot()
        extra = par.stats()  # read every step, so warm-up time is not carried into measured steps
        if par.transfers is not None:  # the measured steps' message times, split against the senders' at the end
            if step >= measure_from and not profiling:
                run_sent.update(par.transfers.sent)
                run_received.update(par.transfers.received)
            par.transfers.sent.clear()
            par.transfers.received.clear()
        every_time.append(dt)
        if step >= measure_from and not profiling:  # profiled steps are slower: left out of the timings
            step_times.append(dt)
            breakdown["data"] += t_data
            breakdown["allreduce"] += par.reducer.wait_s
            breakdown["halo"] += t.get("halo", 0.0) + extra.get("halo", 0.0)
            breakdown["pipeline_comm"] += t.get("pipeline_comm", 0.0) + extra.get("pipeline_comm", 0.0)
            breakdown["bubble_or_wait"] += t.get("bubble_or_wait", 0.0) + extra.get("bubble_or_wait", 0.0)
        if stop and step + 1 < steps:  # Slurm's signal before the time limit (or a preemption notice)
            _preempt(cfg, world, step + 1, par, opt, history, wd, "the time limit is near: checkpointing and requeueing")
        if ckpt_every and (step + 1) % ckpt_every == 0 and step + 1 < steps and not nonfinite:
            progress.mark("checkpoint")  # a diverged run keeps its last good checkpoint
            ckpt.save(cfg, world.rank, step + 1, par.modules, opt, history)
    progress.mark("record")
    measured = len(step_times)
    tensor_peak = max(tensor_peaks_seen) if tensor_peaks_seen else None
    for k in breakdown:
        breakdown[k] /= max(1, measured)
    median = statistics.median(step_times)
    breakdown["compute"] = max(0.0, median - sum(v for k, v in breakdown.items() if k != "compute"))

    # gather: peak memory and host of every rank (the losses are already global, step by step)
    peak = meter.peak()
    hosts = [world.hostname]
    peaks = [peak]
    times = torch.tensor(step_times, dtype=torch.float64, device=world.device)  # NCCL takes device tensors only
    if world.size > 1:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
        gathered: list[Any] = [None] * world.size
        dist.all_gather_object(gathered, (world.hostname, peak, tensor_peak, socket.gethostname(), run_sent))
        if run_received:  # rank 0's waits for messages against when their senders sent them (the planner's split)
            everyone: dict[tuple[int, ...], float] = {}
            for g in gathered:
                everyone.update(g[4])
            transfer, _ = split_waits(run_received, everyone)
            breakdown["pipeline_comm"] += transfer / max(1, measured)
            breakdown["bubble_or_wait"] = max(0.0, breakdown["bubble_or_wait"] - transfer / max(1, measured))
        hosts = [g[0] for g in gathered]
        peaks = [int(g[1]) for g in gathered]
        tensor_peaks = [g[2] for g in gathered]
        machines = [g[3] for g in gathered]
    else:
        tensor_peaks = [tensor_peak]
        machines = [socket.gethostname()]
    step_times = times.tolist()
    # samples per step: the whole global batch (every replica line trains B/R; eta replicas included)
    samples = par.samples_per_step * R
    record = rec.build_record(
        cfg, world, mesh, losses=losses, step_times=step_times, global_batch=samples,
        breakdown=breakdown, peaks=peaks, hosts=hosts, wall_s=time.time() - t_start, restarts=restarts,
        tensor_peaks=tensor_peaks if all(t is not None for t in tensor_peaks) else None, balance=par.balance,
        machines=machines,
    )
    record["host_memory"] = host_memory.summary
    record["step_time_s"]["every"] = every_time  # every step's time, warm-up and profiled steps included
    record["step_time_s"]["measured_from"] = measure_from
    if tensor_peaks_seen:
        record["peak_memory_bytes"]["tensor_steps"] = list(range(min(measure_from, len(tensor_peaks_seen))))
    notes = list(par.notes)
    if measure_from > warm:
        notes.append(f"step(s) {warm}-{measure_from - 1} were profiled for tensor memory (after the first optimizer "
                     "step, so the optimizer's state counts) and left out of the timings; train.warmup_steps>=2 "
                     "makes them warm-up steps")
    if measured < 3:
        notes.append(f"the throughput rests on {measured} measured step(s) (train.steps - train.warmup_steps"
                     f"{' - the profiled ones' if measure_from > warm else ''}): one step's time is one sample of a "
                     "noisy machine; 3 or more give a median worth comparing")
        if world.rank == 0:
            print(f"gems: warning: {notes[-1]}", file=sys.stderr, flush=True)
    if notes:
        record["notes"] = notes
    if par.scaler.enabled:
        record["loss_scale"] = par.scaler.summary()
    if nonfinite:
        record["diverged"] = True
        record["nonfinite_steps"] = list(nonfinite)
    return record


class HostMemory:
    """``train.host_memory`` on this rank. ``keep`` keeps freed host memory in the process from the start
    (faster CPU steps, more resident memory: :func:`gems.bootstrap.keep_host_memory`); ``release`` never;
    ``auto`` on CPU ranks runs the first step with glibc's defaults, measures its peak, and keeps freed
    memory from then on only if every rank of the node still fits in its memory at what keeping costs
    (:func:`gems.bootstrap.keeps_host_memory_within`): a run that fits without kept memory is never
    killed for it."""

    def __init__(self, policy: str, device: torch.device) -> None:
        self.policy = policy if device.type == "cpu" or policy == "keep" else "release"
        self.budget = node_memory_bytes()
        self.ranks = ranks_on_this_node()
        self.decided = self.policy != "auto"
        self.summary: dict[str, Any] = {"policy": self.policy, "kept": self.policy == "keep"}
        if self.policy == "keep":
            keep_host_memory()

    def after_step(self, rank: int) -> None:
        if self.decided:
            return
        import resource

        self.decided = True
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        kept = keeps_host_memory_within(peak, self.budget, self.ranks)
        if kept:
            keep_host_memory()
        self.summary.update(kept=kept, first_step_peak_rss=peak, node_budget=self.budget, ranks_on_node=self.ranks)
        if not kept and rank == 0:
            print(f"gems: train.host_memory=auto: freed host memory is released (glibc's defaults): {self.ranks} "
                  f"rank(s) x {peak / 2**30:.2f} GiB x {KEEP_GROWTH} would not fit in "
                  f"{(self.budget or 0) / 2**30:.1f} GiB", file=sys.stderr, flush=True)


def _profiled(cfg: DictConfig, world: World, fn: Callable[[], tuple[float, bool]]) -> tuple[float, bool]:
    """``train.profile``: run one step under torch.profiler and write this rank's chrome trace."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if world.device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        out = fn()
        _sync(world.device)
    d = rec.job_dir(cfg) / "profile"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    prof.export_chrome_trace(str(d / f"rank{world.rank}.json"))
    return out


class _StepContext:
    """One training step on this rank: the strategies' forward and backward, the step's sync over every
    rank (the global loss, a stop request), then the optimizer, unless the loss is not finite."""

    def __init__(self, cfg: DictConfig, world: World, mesh: Mesh, par: Parallel, opt: torch.optim.Optimizer,
                 B: int, R: int) -> None:
        self.cfg, self.world, self.mesh, self.par, self.opt, self.B, self.R = cfg, world, mesh, par, opt, B, R
        self.stop_on_nonfinite = str(cfg.train.get("on_nonfinite", "stop")) == "stop"

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int], step: int,
             quiesce: bool = False) -> tuple[float, bool]:
        """(the global loss of the step, whether any rank asked to stop for a checkpoint); ``quiesce``: the
        step ends with none of this rank's messages in flight (a step run under the profiler)."""
        local = self.par.step(x, y, ids, step)
        if quiesce:
            self.par.quiesce()
        with progress.waiting("step sync"):
            loss, stop = _step_sync(local, ckpt.stop_requested(), self.world)
        if math.isfinite(loss) or not self.stop_on_nonfinite:
            progress.mark("optimizer")
            self.par.scaler.step(self.opt, step)  # fp16: unscaled after the sum; skipped where any rank overflowed
            self.opt.zero_grad(set_to_none=True)
        return loss, stop

    def stop_nonfinite(self, step: int, loss: float, losses: list[float], restarts: int) -> None:
        """Every rank is here at the same step: find where the first non-finite value appeared, have rank 0
        write the failed record, and stop."""
        where, failure = _locate_nonfinite(self.par, self.world, self.mesh, step, self.B, self.R)
        msg = (f"the loss of step {step} is {loss} (train.on_nonfinite=stop); the first non-finite value was in "
               f"{where}")
        if self.world.rank == 0:
            failure.update(kind="nonfinite", step=step, loss=str(loss))
            record = rec.failed_record(self.cfg, msg, failure=failure, losses=losses, restarts=restarts)
            record["nonfinite_steps"] = [step]
            _write_once(rec.record_path(self.cfg), record)
        raise NonFiniteLoss(msg)


def _step_sync(local_loss: float, stop: bool, world: World) -> tuple[float, bool]:
    """The global loss of the step (the weighted local losses summed over every rank, docs/design.md) and
    whether any rank was asked to stop; one small all-reduce, the same result on every rank."""
    if world.size == 1:
        return float(local_loss), bool(stop)
    import torch.distributed as dist

    t = torch.tensor([local_loss, 1.0 if stop else 0.0], dtype=torch.float64, device=world.device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    total, stops = t.tolist()
    return total, stops > 0


def _locate_nonfinite(par: Parallel, world: World, mesh: Mesh, step: int, B: int, R: int) -> tuple[str, dict[str, Any]]:
    """Where the first non-finite value of this step appeared: the earliest position (input, then the
    output of each pipeline partition, then the loss) and, there, the lowest rank. A collective."""
    D = max(1, mesh.pipeline)
    pos = par.first_nonfinite()
    key = float("inf") if pos is None else float(pos * world.size + world.rank)
    if world.size > 1:
        import torch.distributed as dist

        t = torch.tensor([key], dtype=torch.float64, device=world.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        key = float(t.item())
    if not math.isfinite(key):
        return "the loss itself (every input and partition output was finite)", {"where": "loss"}
    pos, rank = divmod(int(key), world.size)
    c = mesh.coord(rank)
    if pos == 0:
        ids = replica_indices(step, B, R, c.replica)
        part = f", spatial part {c.spatial}" if mesh.spatial > 1 else ""
        return (f"the input of rank {rank} (samples {ids[0]}-{ids[-1]}{part})",
                {"where": "input", "rank": rank, "samples": [ids[0], ids[-1]]})
    if pos <= D:
        s = pos - 1
        what = f"the output of pipeline partition {s}" if D > 1 else "the model's output"
        return f"{what} on rank {rank}", {"where": "output", "rank": rank, "partition": s}
    return f"the loss computed on rank {rank}", {"where": "loss", "rank": rank}


def _write_once(path: Any, record: dict[str, Any]) -> None:
    try:
        rec.write_record(path, record)
    except FileExistsError:  # a record is never replaced
        pass


def _average_buffers(buffers: list[torch.Tensor], mesh: Mesh) -> None:
    """Average floating buffers over the ``grad`` group, so every copy keeps the same running
    statistics (replicas and mirrored GEMS partitions see different samples)."""
    import torch.distributed as dist

    flat = torch.cat([b.reshape(-1).float() for b in buffers])
    dist.all_reduce(flat, group=mesh.group("grad"))
    flat /= len(mesh.ranks("grad"))
    off = 0
    for b in buffers:
        b.copy_(flat[off:off + b.numel()].view_as(b))
        off += b.numel()


def _preempt(cfg: DictConfig, world: World, step: int, par: Parallel, opt: torch.optim.Optimizer,
             history: dict[str, Any], wd: Watchdog | None, why: str) -> None:
    """Save before ``step``, then stop as a preempted job does; Slurm or the local launcher resumes it."""
    progress.mark("checkpoint")
    ckpt.save(cfg, world.rank, step, par.modules, opt, history)
    if world.rank == 0:
        print(f"gems: {why} (checkpoint before step {step})", file=sys.stderr, flush=True)
    if wd is not None:
        wd.stop()  # waiting to be ended is no stall
    if world.source == "slurm" or os.environ.get("SLURM_JOB_ID"):
        if world.rank == 0 and not ckpt.request_requeue():
            raise RuntimeError("`scontrol requeue` failed: the checkpoint is saved, but the job was not requeued")
        time.sleep(600)  # Slurm ends every task of a requeued job; this never returns in practice
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(ckpt.PREEMPTED_EXIT)


def _sync(device: torch.device) -> None:
    """Wait for the GPU's queue (the step's kernels and NCCL's communication): a hang on the GPU shows as this
    wait in a stall report, not as whatever the host last marked."""
    if device.type == "cuda":
        with progress.waiting("gpu queue"):
            torch.cuda.synchronize(device)


def run_rank(cfg_yaml: str) -> dict[str, Any] | None:
    """Entry point on every rank; rank 0 writes the record and returns it.

    A rank that fails writes its failure report (:mod:`gems.fault.reports`) before
    the error leaves it, so the launcher can tell the cause from the echoes.
    """
    import torch.distributed as dist

    ckpt.install_time_limit_handler()  # first: Slurm's signal may come while the rank starts
    cfg = OmegaConf.create(cfg_yaml)
    assert isinstance(cfg, DictConfig), "the job's configuration is a mapping"
    rank = _env_rank()
    wd: Watchdog | None = None
    try:
        world = init_world(cfg)
        rank = world.rank

        def on_stall(message: str, failure: dict[str, Any]) -> None:
            _write_once(rec.record_path(cfg), rec.failed_record(cfg, message, failure=failure,
                                                                restarts=ckpt.restart_count()))

        wd = start_watchdog(cfg, world, on_stall)
        with commlog.install_from_env(world.rank, world.device):  # GEMS_COMM_LOG=DIR: every message, in order
            record = train(cfg, world, wd)
        if wd is not None:
            wd.stop()
        if world.rank == 0:
            progress.mark("record")
            rec.write_record(rec.record_path(cfg), record)
            rec.write_steps(rec.record_path(cfg), record)
            return record
        return None
    except NonFiniteLoss:
        raise  # the record says it all
    except BaseException as e:
        if not isinstance(e, (KeyboardInterrupt, SystemExit)) and rank is not None:
            reports.report_exception(rec.job_dir(cfg), rank, e)
        raise
    finally:
        if wd is not None:
            wd.stop()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # the peer may already be gone; the record says why
                pass


def _env_rank() -> int | None:
    for key in ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gems.worker", description="Run one gems rank (launchers call this).")
    ap.add_argument("--config", required=True, help="resolved configuration YAML written by the launcher")
    args = ap.parse_args(argv)
    try:
        with open(args.config) as f:
            text = f.read()
        run_rank(text)
    except ConfigError as e:
        print(f"gems: error: {e}", file=sys.stderr, flush=True)
        return 2
    except NonFiniteLoss as e:
        print(f"gems: error: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception:
        rank = _env_rank()
        print(f"gems: rank {'?' if rank is None else rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
