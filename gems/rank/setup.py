"""A rank's state before its first step, built once: the world's groups, the composed model and its stepper, the
optimizer, the data, the plan of its steps, and where a resumed run goes on from."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from gems import checkpoint as ckpt
from gems import progress
from gems.bootstrap import World
from gems.config import section
from gems.fault import inject
from gems.fault.watchdog import Watchdog
from gems.memory import MemoryMeter
from gems.mesh import Coord, Mesh, mesh_from_config
from gems.models import ModelSpec, registered
from gems.parallel import resolve
from gems.rank.compose import set_up_rank
from gems.rank.data import Sampler, Staged, make_data, stage
from gems.rank.hooks.steps import HostMemory
from gems.rank.optim import LearningRate, WeightAverage
from gems.rank.phases import StepPlan, plan_steps
from gems.rank.steppers import Stepper
from gems.replication import averaged_buffers
from gems.results.mlperf import MLPerfLog
from gems.results.recorder import new_history


@dataclass(frozen=True)
class RankState:
    """What a rank trains with, made once (:func:`set_up`); the objects it holds change as the run trains."""

    cfg: DictConfig
    world: World
    wd: Watchdog | None
    fault: Any  # the fault injections (FaultConf)
    mesh: Mesh
    coord: Coord
    spec: ModelSpec
    stepper: Stepper
    opt: torch.optim.Optimizer
    data: Any
    val: Any  # the validation set, or None
    sampler: Sampler
    lr: LearningRate
    B: int  # the global batch
    R: int  # replicas
    buffers: list[torch.Tensor]  # the floating buffers averaged over the copies after each step (BatchNorm's)
    hold: ckpt.Holding  # what checkpoints save and load, by whole names
    saver: ckpt.Saver
    ema: WeightAverage | None
    staged: Staged | None
    mlperf: MLPerfLog
    meter: MemoryMeter
    host_memory: HostMemory
    plan: StepPlan
    restarts: int
    resumed: dict[str, Any] | None  # the checkpoint this run went on from (the record's resumed_from)
    history: dict[str, Any]  # the history so far (a resumed run's from its checkpoint)
    t_start: float


def set_up(cfg: DictConfig, world: World, wd: Watchdog | None) -> RankState:
    """Everything a rank builds before its first step, in order: the device's settings, the mesh's groups, the
    model composed on the mesh and its optimizer, the data (staged on the node first where asked), the checkpoint
    it resumes from, and the plan of its steps."""
    t_start = time.time()
    progress.mark("setup")
    t = cfg.train
    host_memory = HostMemory(str(t.host_memory), world.device, world.rank)
    if t.threads and world.device.type == "cpu":
        torch.set_num_threads(int(t.threads))
    if t.tf32 is not None:  # GPU ranks: fp32 convolutions and matmuls in TF32 or not (CPUs have no TF32)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = bool(t.tf32)
    if t.deterministic:  # the same bits from run to run (graphed against eager on a GPU: docs/gpu.md)
        deterministic()
    mesh = mesh_from_config(cfg, world.size)
    mlperf = MLPerfLog(cfg, world.rank)  # a run with a target: MLPerf HPC's log, from init start
    kind = registered().get(str(cfg.model.name))  # the MLPerf HPC benchmark the model is a version of
    mlperf.init_start(device_name(world.device), world.size,
                      (kind.benchmark if kind is not None else None) or str(cfg.model.name))
    settings = resolve(cfg)
    if world.size > 1:
        mesh.build_groups(world.rank, groups=settings.holder_groups, timeout=world.timeout)
    else:
        mesh.groups.grad_ranks = [0]
    meter = MemoryMeter(world.device)
    meter.reset()
    coord, spec, stepper, opt = set_up_rank(cfg, world, mesh, settings)
    gpu = world.device if world.device.type == "cuda" else None  # synthetic samples drawn on the rank's GPU
    staging = cfg.data.stage == "node"
    mlperf.staging(start=True, when=staging)
    staged = stage(cfg, world, str(cfg.run_id or "run"))  # data.stage=node: copied once
    mlperf.staging(start=False, when=staging)
    data = make_data(cfg, spec, stepper.input_slices, device=gpu, staged=staged)
    fault = section(cfg, "fault")
    inject.arm(fault, world.rank, stepper.modules)
    B, R = int(t.batch_size), mesh.replicas
    sampler = Sampler(len(data), B, int(t.seed), t.epochs, t.steps, bool(cfg.data.shuffle), symmetries=data.symmetries)
    lr = LearningRate(t, sampler.steps_per_epoch if t.epochs is not None else 1, sampler.total)
    val = make_data(cfg, spec, stepper.input_slices, validation=True, device=gpu, staged=staged)
    if t.eval_average_crops and val is not None:  # each file's crops averaged too (prepare checks hdf5)
        stepper.metric.group_by(val.samples.group, len(val.samples.files))
    # running statistics (BatchNorm) of the copies of a parameter's module see different samples (a graphed step
    # averages them itself, as the views of one tensor: the same list)
    buffers = stepper.buffers if stepper.averages_buffers else averaged_buffers(stepper.modules, mesh.group("grad"))
    hold = ckpt.Holding(stepper.names, stepper.params, opt)
    saver = ckpt.Saver(cfg, world, mesh, bool(t.checkpoint_async))
    start, restarts, resumed, history = resume(cfg, world, mesh, hold, stepper)
    graphed = stepper.graph is not None or stepper.pieces is not None
    plan = plan_steps(t, sampler.total, start, sampler.steps_per_epoch, cpu=world.device.type == "cpu",
                      graphed=graphed, first_step_connects=stepper.first_step_connects, validates=val is not None)
    if wd is not None:
        wd.warm_until = plan.watchdog_warm_until()
    saver.restarts = restarts  # (a fault injected in a save acts in the job's first attempt only)
    ema = WeightAverage(float(t.ema), stepper.params, history) if t.ema else None  # saved with the history
    hold.average = ema.average if ema is not None else None
    mlperf.init_stop(B, lr.base, len(data), len(val) if val is not None else 0)
    return RankState(cfg, world, wd, fault, mesh, coord, spec, stepper, opt, data, val, sampler, lr, B, R, buffers,
                     hold, saver, ema, staged, mlperf, meter, host_memory, plan, restarts, resumed, history, t_start)


def resume(cfg: DictConfig, world: World, mesh: Mesh, hold: ckpt.Holding, stepper: Stepper
           ) -> tuple[int, int, dict[str, Any] | None, dict[str, Any]]:
    """Where the run starts: (its first step, its restarts, another run it goes on from, its history so far). After
    a preemption, a time limit or a requeue, this job's own latest checkpoint; else ``train.resume_from`` (another
    run's training, on this mesh), ``train.init_from`` (another run's weights, a fresh optimizer) or, for ``gems
    eval``, the trained model."""
    restarts = ckpt.restart_count()
    history = new_history()
    start, resumed = 0, None
    progress.mark("checkpoint")
    t, own = cfg.train, ckpt.ckpt_dir(cfg)
    if world.rank == 0:  # a save a crash cut short: its folder goes before any rank can save again
        ckpt.tidy(own)
    step = ckpt.latest_step(own)
    if step is not None:  # this job's own checkpoint (a requeue, a preemption, the time limit)
        restarts = max(restarts, 1)
        start, resumed = step, restore(cfg, world, mesh, hold, stepper, own / f"step{step:08d}", step, history,
                                       another_run=False)
    elif t.resume_from:  # another run's training, continued on this mesh
        folder = ckpt.find(str(t.resume_from), "train.resume_from")
        step = int(ckpt.read_meta(folder)["step"])
        start, resumed = step, restore(cfg, world, mesh, hold, stepper, folder, step, history, another_run=True)
    elif t.init_from:  # another run's weights, a fresh optimizer
        ckpt.weights(str(t.init_from), "train.init_from")(hold)
    elif cfg.eval.path:  # gems eval: the trained model (a checkpoint's weight average where it has one)
        ckpt.weights(str(cfg.eval.path), "eval", averaged=True)(hold)
    return start, restarts, resumed, history


def restore(cfg: DictConfig, world: World, mesh: Mesh, hold: ckpt.Holding, stepper: Stepper, folder: Path, step: int,
            history: dict[str, Any], another_run: bool) -> dict[str, Any] | None:
    """Continue from the checkpoint in ``folder`` (before ``step``), whatever mesh wrote it: the weights and the
    optimizer into ``hold``, its history into ``history``; returns what the record says of it (``resumed_from``:
    ``own`` for this job's own checkpoint, after a requeue, a preemption or a lost node)."""
    meta = ckpt.load(folder, hold)
    same_mesh = not another_run and meta.get("mesh") == ckpt.mesh_of(mesh) and meta.get("world_size") == world.size
    history.update(ckpt.load_history(folder, world.rank, same_mesh))
    history["weight_average"] = meta["average"]
    if "loss_scale" in history:  # fp16: the scale and the steps skipped so far, as if never stopped
        stepper.scaler.load_state_dict(history["loss_scale"])
    return {"path": str(folder), "step": step, "run_id": meta.get("run_id"), "mesh": meta.get("mesh"),
            "schedule": meta.get("schedule"), "global_batch": meta.get("global_batch"),
            "exact": meta.get("global_batch") == int(cfg.train.batch_size), "own": not another_run}


def deterministic() -> None:
    """train.deterministic: cuDNN's deterministic kernels and no benchmark's choice, torch's deterministic
    algorithms where it has them (a warning where it has none), cuBLAS's workspace fixed (before its first use)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
