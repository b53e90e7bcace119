"""The parallel settings of a run, resolved once from the configuration (:class:`ParallelSettings`, as torchtitan's
``ParallelDims``): the mesh, the schedule, the mirrored holders, the micro-batch, the stages, the balance or its
rule, recomputation. The worker, the CLI's checks, the spatial balance and the planner read them; none derives them
again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from gems.config import check_comm_cut
from gems.errors import ConfigError
from gems.mesh import Mesh, mesh_from_config
from gems.pipeline.balance import Cut, decide
from gems.pipeline.schedules import Schedule, make_schedule, registered

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
    split_backward: bool
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
        return self.schedule is not None and self.schedule.holds_copies

    @property
    def line_batch(self) -> int:
        """Samples one replica line trains per step (``train.batch_size / parallel.replicas``)."""
        return self.batch // self.mesh.replicas

    @property
    def chunk(self) -> int:
        """Samples of one micro-batch of one pass: what one forward of one partition carries."""
        return self.line_batch // (self.schedule.chunks if self.schedule is not None else 1)

    def norm_note(self, module: Any) -> str:
        """What a run says when BatchNorm normalises over fewer samples than the global batch (replicas, GEMS's
        passes, micro-batches): the serial run it equals accumulates gradients over those chunks ("" otherwise)."""
        from torch.nn.modules.batchnorm import _BatchNorm

        if self.chunk >= self.batch or not any(isinstance(m, _BatchNorm) for m in module.modules()):
            return ""
        return (f"BatchNorm normalises over each chunk of {self.chunk} sample(s), not the global batch of {self.batch} "
                f"({self.batch // self.chunk} chunks a step: replicas, passes, micro-batches): the run trains like one "
                f"process accumulating gradients over those chunks")

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
        if self.schedule is not None:
            from gems.pipeline import check_batch

            check_batch(B // R, self.schedule, R)

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
    p = cfg.parallel
    mesh = mesh_from_config(cfg)
    name = str(p.schedule)
    D = mesh.pipeline
    eta = None if p.gems_replicas is None else int(p.gems_replicas)
    v = None if p.virtual_stages is None else int(p.virtual_stages)
    m = int(p.micro_batches)
    split = bool(p.split_backward)
    sched = make_schedule(name, D, m, eta, v, split) if (name != "lp" or D > 1) else None
    if sched is None:  # lp on one rank: the options of schedules that run nothing must still be sane
        make_schedule(name, D, m, eta, v, split)
        if m != 1:  # nothing would split the batch: a record saying m=8 would claim what did not run
            raise ConfigError("parallel.micro_batches", m, "1 with schedule=lp on one pipeline rank (nothing splits "
                              "the batch there; schedule=gpipe or 1f1b at parallel.pipeline=1 accumulates "
                              "micro-batches)")
    by_given = str(p.balance_by)
    if by_given == "comm":  # the partitions, not the ranks: an interleaved schedule cuts more than D
        check_comm_cut(sched.stages if sched is not None else D, D)
    balance = tuple(int(b) for b in p.balance) if p.balance else None
    settings = ParallelSettings(mesh, name, sched, int(batch if batch is not None else cfg.train.batch_size), m, eta, v,
                                split, balance, "memory", by_given, bool(p.checkpoint))
    settings = replace(settings, balance_by=resolve_balance_by(settings))
    settings.check_batch()
    return settings


def resolve_balance_by(s: ParallelSettings) -> str:
    """``parallel.balance_by`` with ``auto`` resolved (:func:`gems.pipeline.partition.resolve_balance_by`)."""
    from gems.pipeline.partition import resolve_balance_by as rule

    return rule(s.balance_by_given, s.schedule)


def balance_rule(by: str, schedule: str, D: int) -> str:
    """:func:`resolve_balance_by` for a schedule name and pipeline size alone (one micro-batch, no model)."""
    kind = registered()[schedule]
    sched = make_schedule(schedule, D, D if kind.virtual else 1) if (schedule != "lp" or D > 1) else None
    s = ParallelSettings(Mesh(pipeline=D), schedule, sched, 1, 1, None, None, False, None, "memory", by, False)
    return resolve_balance_by(s)


def spatial_model(spec: Any, mesh: Mesh, bn_stats: str = "global", gather_uncut: bool = False) -> tuple[Any, str | None]:
    """The model as spatial parallelism runs it: ``spec`` with ``spatial_end`` where the trunk really ends
    (:func:`gems.spatial.gather_point`: before the first layer gems cannot cut, or after a global pooling),
    and the note that says so (None when the model's own ``spatial_end`` holds). The worker, the preflight
    and the planner all take the model from here, so they agree on the gather, the loss weights and the
    balance. A layer gems cannot cut is refused, naming it, unless ``gather_uncut`` (``parallel.gather_uncut``)."""
    import dataclasses

    if mesh.spatial == 1:
        return spec, None
    from gems.spatial import gather_point

    if spec.target == "dense":  # its output is cut like its input: nothing may be gathered (the refusal below)
        gather_uncut = True
    end, note = gather_point(spec.module, spec.spatial_end, mesh.parts, mesh.spatial_dims, bn_stats, gather_uncut)
    if note is None:
        return spec, None
    if spec.target == "dense":
        raise ConfigError("model", spec.name, f"a model whose every layer gems can cut (its output is one class per "
                          f"cell, cut like its input): {note.split(';')[0]}")
    return dataclasses.replace(spec, spatial_end=end), note


def recompute_pieces(spec: Any, mesh: Mesh) -> list[tuple[int, int]]:
    """The layers [a, e) of each piece ``parallel.checkpoint`` recomputes on the plain path
    (:func:`gems.models.skips.checkpoint_pieces`), weighed on one fake trace of the serial model
    (:func:`gems.trace.model.piece_costs`), so every spatial part cuts the same pieces and their recomputations
    exchange the same halos in the same order. Under a spatial mesh the layers before the model's ``spatial_end``
    count at the largest part's share, and the pieces count the gather :func:`gems.spatial.apply_spatial` inserts
    there as one more layer (its output: the whole activation), as :func:`gems.pipeline.balance.spatial_balance`
    weighs a pipeline's layers. The worker (gems.rank.compose) and the planner both call this."""
    from gems.models.skips import checkpoint_pieces
    from gems.shapes import largest_part
    from gems.trace.model import piece_costs

    costs = piece_costs(spec)
    saved: list[float] = [float(v) for v in costs[0]]
    out: list[float] = [float(v) for v in costs[1]]
    if mesh.spatial_enabled:  # a rank holds its part of each layer before the gather
        extent = [int(v) for v in spec.input_shape[1:]]
        share = math.prod(largest_part(extent, mesh.parts, mesh.spatial_dims)) / max(1, math.prod(extent))
        trunk = len(saved) if spec.spatial_end is None else int(spec.spatial_end)
        # the gather's output: the whole activation leaving the trunk
        whole = out[trunk - 1] if trunk > 0 else 4.0 * math.prod(int(v) for v in spec.input_shape)
        saved = [v * (share if i < trunk else 1.0) for i, v in enumerate(saved)]
        out = [v * (share if i < trunk else 1.0) for i, v in enumerate(out)]
        if spec.spatial_end is not None:
            saved.insert(trunk, 0.0)
            out.insert(trunk, whole)
    return checkpoint_pieces(saved, out)


def stage_balance(s: ParallelSettings, spec: Any, chunk: int | None = None, by: str | None = None,
                  device: Any = None) -> list[int]:
    """The layers of each pipeline partition of ``spec``'s model under these settings: the balance given, or
    the one :func:`gems.pipeline.balance.decide` chooses by ``by`` (default: the resolved ``balance_by``) on
    one micro-batch of ``chunk`` samples (default: the settings' own). A spatial mesh balances the serial
    layers as every rank runs them. The worker and the planner both call this."""
    cut = Cut(s.mesh.parts, s.mesh.spatial_dims, spec.spatial_end) if s.mesh.spatial > 1 else None
    sample = (max(1, s.chunk if chunk is None else int(chunk)), *spec.input_shape)
    return decide(spec.module, s.stages, s.balance_by if by is None else by, sample,
                  given=s.balance if s.pipelined else None, cut=cut, device=device)
