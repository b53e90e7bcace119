"""The parallel settings of a run, resolved once from the configuration.

Every question "how is this run parallel" is answered here, once: the mesh, the
schedule (built from its registration), whether the run is pipelined, which
pipeline ranks hold copies of the same partitions (GEMS's mirrored pairs), the
samples of one micro-batch, the number of partitions (stages: more than the
ranks for interleaved schedules), the balance given or the rule that will
choose it, and recomputation. The worker, the CLI's preflight, the spatial
balance and the planner read :class:`ParallelSettings`; none derives these
again. (In the spirit of torchtitan's ``ParallelDims``.)
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from gems.errors import ConfigError
from gems.mesh import Mesh, mesh_from_config
from gems.pipeline.schedules import Schedule, make_schedule

#: why a balance is what it is
BALANCE_SOURCES = ("given", "memory", "time", "comm", "count", "whole")


@dataclass(frozen=True)
class ParallelSettings:
    mesh: Mesh
    schedule_name: str
    schedule: Schedule | None  # None: not pipelined (lp on one pipeline rank)
    batch: int  # the global batch of one optimizer step
    micro_batches: int
    gems_replicas: int | None
    virtual_stages: int | None
    balance: tuple[int, ...] | None  # parallel.balance, when given (validated against the model later)
    balance_by: str  # memory | time | comm: the rule that cuts when no balance is given (auto resolved)
    balance_by_given: str  # as configured (auto | memory | time | comm)
    checkpoint: bool  # recompute activations in the backward

    # ---- derived -------------------------------------------------------------------------------------------
    @property
    def pipelined(self) -> bool:
        """Whether a schedule runs the step (any pipeline rank count above one, or any schedule but lp)."""
        return self.schedule is not None

    @property
    def stages(self) -> int:
        """Model partitions (``v x D`` for interleaved schedules; 1 without a pipeline)."""
        return self.schedule.stages if self.schedule is not None else 1

    @property
    def holder_groups(self) -> list[tuple[int, ...]]:
        """Pipeline positions whose ranks hold copies of the same partitions (their gradients are summed)."""
        if self.schedule is None:
            return [(d,) for d in range(self.mesh.pipeline)]
        return self.schedule.holder_groups()

    @property
    def mirrored(self) -> bool:
        """Whether some partition has copies on two pipeline ranks (GEMS mast/master)."""
        return any(len(g) > 1 for g in self.holder_groups)

    @property
    def line_batch(self) -> int:
        """Samples one replica line trains per step (``train.batch_size / parallel.replicas``)."""
        return self.batch // self.mesh.replicas

    @property
    def chunk(self) -> int:
        """Samples of one micro-batch of one pass: what one forward of one partition carries."""
        return self.line_batch // (self.schedule.chunks if self.schedule is not None else 1)

    def with_batch(self, batch: int) -> "ParallelSettings":
        """The same settings at another global batch (checked: the planner's search tries many)."""
        out = replace(self, batch=int(batch))
        out.check_batch()
        return out

    def check_batch(self) -> None:
        """ConfigError naming the key when the batch does not split over replicas, passes and micro-batches."""
        B, R = self.batch, self.mesh.replicas
        if B < 1 or B % R:
            raise ConfigError("train.batch_size", B, f"a positive multiple of parallel.replicas={R} (the global batch "
                              "is split over replicas)")
        if self.schedule is None:
            return
        sched, n = self.schedule, B // R
        where = f"the {n} samples a pipeline line gets per step (train.batch_size / parallel.replicas = {B} / {R})"
        if n % sched.replicas:
            if sched.name == "master":
                raise ConfigError("parallel.gems_replicas", sched.replicas, f"a divisor of {where}")
            raise ConfigError("train.batch_size", B, f"a multiple of {sched.replicas * R} ({sched.name} gives each of "
                              f"its {sched.replicas} replica passes an equal share of a line's batch)")
        if (n // sched.replicas) % sched.micro_batches:
            raise ConfigError("parallel.micro_batches", sched.micro_batches,
                              f"a divisor of the {n // sched.replicas} samples of each replica pass ({where}, over "
                              f"{sched.replicas} pass(es))")

    def check_layers(self, n_layers: int) -> None:
        """ConfigError when the model has too few layers for the partitions, or the given balance does not fit."""
        from gems.pipeline.partition import check_balance

        if self.stages > n_layers:
            key, val = (("parallel.virtual_stages", self.virtual_stages) if self.stages > self.mesh.pipeline
                        else ("parallel.pipeline", self.mesh.pipeline))
            raise ConfigError(key, val, f"at most the model's {n_layers} layers in {self.stages} partitions")
        if self.balance is not None and self.pipelined:
            check_balance(list(self.balance), n_layers, self.stages)

    def describe(self) -> str:
        text = self.mesh.describe()
        if self.schedule is not None:
            text += f", {self.schedule_name} in {self.stages} partitions"
        return text


def resolve(cfg: Any, batch: int | None = None) -> ParallelSettings:
    """The settings of ``cfg`` (at ``batch`` instead of ``train.batch_size`` when given), checked."""
    from gems.pipeline.partition import check_comm_cut

    p = cfg.parallel
    mesh = mesh_from_config(cfg)
    name = str(p.schedule)
    D = mesh.pipeline
    eta = None if p.get("gems_replicas") is None else int(p.gems_replicas)
    v = None if p.get("virtual_stages") is None else int(p.virtual_stages)
    m = int(p.micro_batches)
    sched = make_schedule(name, D, m, eta, v) if (name != "lp" or D > 1) else None
    if sched is None:  # lp on one rank: the options of schedules that run nothing must still be sane
        make_schedule(name, D, m, eta, v)
    by_given = str(p.get("balance_by", "auto"))
    if by_given == "comm":
        check_comm_cut(D)
    balance = tuple(int(b) for b in p.balance) if p.get("balance") else None
    settings = ParallelSettings(mesh, name, sched, int(batch if batch is not None else cfg.train.batch_size), m, eta, v,
                                balance, "memory", by_given, bool(p.get("checkpoint", False)))
    settings = replace(settings, balance_by=resolve_balance_by(settings))
    settings.check_batch()
    return settings


def resolve_balance_by(s: ParallelSettings) -> str:
    """``parallel.balance_by=auto``: ``comm`` where every rank holds the whole model whatever the cut (the
    mirrored schedules at D = 2: each rank runs partition 0 of one replica and partition 1 of the other,
    so only the traffic on the critical path depends on the cut, and the smallest crossing wins);
    ``memory`` everywhere else, which is what lets a model that does not fit one device run."""
    if s.balance_by_given != "auto":
        return s.balance_by_given
    return "comm" if s.mesh.pipeline == 2 and s.stages == 2 and s.mirrored else "memory"


def balance_rule(by: str, schedule: str, D: int) -> str:
    """:func:`resolve_balance_by` for a schedule name and pipeline size alone (one micro-batch, no model)."""
    sched = make_schedule(schedule, D, D if schedule == "interleaved1f1b" else 1) if (schedule != "lp" or D > 1) else None
    s = ParallelSettings(Mesh(pipeline=D), schedule, sched, 1, 1, None, None, None, "memory", by, False)
    return resolve_balance_by(s)


def spatial_model(spec: Any, mesh: Mesh, bn_stats: str = "global") -> tuple[Any, str | None]:
    """The model as spatial parallelism runs it: ``spec`` with ``spatial_end`` where the trunk really ends
    (:func:`gems.spatial.gather_point`: before the first layer gems cannot cut, or after a global pooling),
    and the note that says so (None when the model's own ``spatial_end`` holds). The worker, the preflight
    and the planner all take the model from here, so they agree on the gather, the loss weights and the
    balance."""
    import dataclasses

    if mesh.spatial == 1:
        return spec, None
    from gems.spatial import gather_point

    end, note = gather_point(spec.module, spec.spatial_end, mesh.parts, mesh.spatial_dims, bn_stats)
    if note is None:
        return spec, None
    if spec.target == "dense":
        raise ConfigError("model", spec.name, f"a model whose every layer gems can cut (its output is one class per "
                          f"cell, cut like its input): {note.split(';')[0]}")
    return dataclasses.replace(spec, spatial_end=end), note


def spatial_stage_balance(s: ParallelSettings, spec: Any, device: Any = None) -> list[int]:
    """The partitions of a pipeline made of spatial layers, balanced on the serial layers as every rank runs
    them (:func:`gems.pipeline.partition.spatial_balance`); the worker and the planner both call this."""
    from gems.pipeline.partition import spatial_balance

    return spatial_balance(spec.module, s.stages, s.balance_by, (max(1, s.chunk), *spec.input_shape), s.mesh.parts,
                           s.mesh.spatial_dims, spec.spatial_end, device=device)
