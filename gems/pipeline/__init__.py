"""Pipelines and GEMS: a flat model cut over the pipeline axis and run by a schedule.

:func:`apply_pipeline`, the one entry point, cuts the ``nn.Sequential`` into the schedule's stages, keeps those this
rank holds under the schedule's placement, and returns a :class:`PipelineRunner`. Gradients are left per rank: their
sum over ``mesh.group("grad")`` gives every holder of a partition the serial gradient.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from gems.errors import ConfigError
from gems.mesh import Mesh
from gems.models.skips import carry
from gems.pipeline.balance import decide
from gems.pipeline.partition import boundary_shapes, resolve_balance_by, split
from gems.pipeline.runtime import LossFn, PipelineRunner
from gems.pipeline.schedules import SCHEDULES, Action, Schedule, make_schedule

__all__ = ["apply_pipeline", "PipelineRunner", "Schedule", "Action", "make_schedule", "split", "SCHEDULES",
           "is_mirrored"]


def is_mirrored(schedule: str, D: int = 2) -> bool:
    """Whether the schedule puts copies of a partition on two pipeline ranks (:attr:`Schedule.holds_copies`)."""
    try:
        return make_schedule(schedule, max(2, D)).holds_copies
    except ConfigError:
        return False


def check_batch(batch_size: int, sched: Schedule, replicas: int = 1) -> int:
    """Samples per chunk, or a ConfigError naming the key that does not divide the line's share."""
    n = batch_size
    where = f"the {n} samples a pipeline line gets per step (train.batch_size / parallel.replicas = {n * replicas} / {replicas})"
    if n < 1:
        raise ConfigError("train.batch_size", n * replicas, "a positive multiple of parallel.replicas")
    if n % sched.replicas:
        if sched.kind.passes == "eta":  # the passes are parallel.gems_replicas's (master)
            raise ConfigError("parallel.gems_replicas", sched.replicas, f"a divisor of {where}")
        raise ConfigError("train.batch_size", n * replicas, f"a multiple of {sched.replicas * replicas} "
                          f"({sched.name} gives each of its {sched.replicas} replica passes an equal share of a line's batch)")
    if (n // sched.replicas) % sched.micro_batches:
        raise ConfigError("parallel.micro_batches", sched.micro_batches,
                          f"a divisor of the {n // sched.replicas} samples of each replica pass "
                          f"({where}, over {sched.replicas} pass(es))")
    return n // sched.chunks


def apply_pipeline(seq: nn.Sequential, mesh: Mesh, rank: int, *, loss_fn: LossFn, batch_size: int,
                   schedule: Schedule | str = "mast", micro_batches: int = 1, gems_replicas: int | None = None,
                   balance: Sequence[int] | None = None, balance_by: str = "auto", checkpoint: bool = False,
                   sample_shape: Sequence[int] | None = None, dtype: torch.dtype = torch.float32,
                   virtual_stages: int | None = None,
                   split_backward: bool = False, device: torch.device | None = None,
                   amp: Callable[[], Any] | None = None) -> PipelineRunner:
    """Partition ``seq`` over the pipeline axis of ``mesh`` and return this rank's runner.

    * ``schedule``: the resolved :class:`Schedule` (``gems.parallel.resolve`` makes it once, and the worker hands
      it over as it is), or a registered name, made here with ``micro_batches``, ``gems_replicas``,
      ``virtual_stages`` and ``split_backward`` (the Python API's shorthand; those four are ignored with a
      resolved schedule).
    * ``batch_size``: samples of one step for this pipeline line, i.e.
      ``train.batch_size / parallel.replicas`` (``runner.samples_per_step``).
    * ``loss_fn(output_chunk, target_chunk, chunk_size)`` returns the *weighted*
      loss of the chunk (sum of per-sample losses / global batch).
    * ``balance``: layers per partition; None balances automatically by
      ``balance_by`` = ``"auto"`` (``comm`` for mast/master at D = 2, else ``memory``:
      :func:`~gems.pipeline.partition.resolve_balance_by`), ``"memory"`` (parameters + activations from a fake-tensor
      trace, deterministic), ``"time"`` (measured; rank 0's result is
      broadcast) or, at D = 2, ``"comm"`` (the cut with the smallest crossing
      activation: the fastest for ``mast``/``master``/``lp``, see
      :func:`~gems.pipeline.partition.balance_by_comm`) on one micro-batch of ``sample_shape``; without a
      ``sample_shape`` the layers are split evenly by count (:func:`gems.pipeline.balance.decide`).
    * ``sample_shape``: ``(C, *spatial)`` of the activation entering the first
      layer *on this rank* (local shape under spatial parallelism). When the
      partitions can be traced on fake tensors it gives the cut shapes in
      advance; pass None when partitions communicate (spatial layers): the
      runtime then learns the shapes at the first send.
    * ``checkpoint``: recompute each partition's activations in its backward.
    * ``virtual_stages``: stages per rank, for interleaved schedules (the model
      is cut into ``virtual_stages x D`` partitions).
    * ``split_backward``: each backward as an input-gradient and a weight-gradient
      action, the weight gradients filling the bubbles (:mod:`gems.pipeline.deferred`).
    * ``device``: the rank's device, where every buffer it receives into lives (default: that of its
      first parameter, else the CPU).
    * ``amp``: the autocast region the step runs in (:func:`gems.precision.autocast`): the cut shapes are
      traced in it, so activations cross at the dtype they are made in (bf16: half of fp32's bytes).

    The mesh's groups must exist (``mesh.build_groups(rank, groups=schedule.holder_groups())``)
    when ``mesh.pipeline > 1``.
    """
    D = mesh.pipeline
    n_layers = len(seq)
    sched = schedule if isinstance(schedule, Schedule) else \
        make_schedule(schedule, D, micro_batches, gems_replicas, virtual_stages, split_backward)
    chunk = check_batch(batch_size, sched, mesh.replicas)
    S, balance_by = sched.stages, resolve_balance_by(balance_by, sched)
    if S > n_layers:
        raise ConfigError("parallel.pipeline" if S == D else "parallel.virtual_stages", D if S == D else S // D,
                          f"at most the model's {n_layers} layers in {S} partitions")
    sample = None if sample_shape is None else (chunk, *[int(v) for v in sample_shape])
    bal = decide(seq, S, balance_by, sample, given=balance, dtype=dtype)  # the one place a balance is decided
    # skips that cross a cut travel packed with its activation (gems.models.skips), at shapes traced on the sample
    parts, shapes = carry(split(seq, bal), bal, sample, dtype, amp)
    if shapes is None and sample is not None and S > 1:
        try:
            shapes = boundary_shapes(parts, sample, dtype, amp)
        except Exception:  # a partition that cannot be traced (it communicates, or returns a non-tensor)
            shapes = None
    coord = mesh.coord(rank)
    peers = mesh.pipeline_ranks(coord.replica, coord.spatial)
    held = {i: parts[i] for i in sched.partitions_of(coord.pipeline)}
    if D > 1 and not mesh.groups.built:
        raise RuntimeError(f"apply_pipeline: call mesh.build_groups(rank, groups={sched.holder_groups()}) first")
    runner = PipelineRunner(held, sched, coord.pipeline, peers, mesh.groups.pipeline, batch_size, loss_fn, checkpoint,
                            shapes, balance=bal, device=device, up_group=mesh.groups.pipeline_up)
    if D > 1:
        runner.connect()
    return runner
