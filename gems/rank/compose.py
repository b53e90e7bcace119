"""The strategies composed for one rank, in one place and one order (docs/design.md): spatial parts inside each
layer, then pipeline partitions over the layers, then the gradient sum over every copy of each parameter.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from omegaconf import DictConfig
from torch import nn

from gems.bootstrap import World
from gems.config import section
from gems.layers import guard_bf16_conv3d
from gems.mesh import Coord, Mesh
from gems.models import ModelSpec, build_model
from gems.models.skips import checkpointed
from gems.parallel import ParallelSettings, recompute_pieces, resolve, spatial_model, stage_balance
from gems.precision import LossScaler, autocast, scaling_enabled
from gems.rank import graphs
from gems.rank.loss import Metric, make_loss_fn
from gems.rank.optim import make_optimizer
from gems.rank.steppers import GraphedStepper, Parts, PipelineStepper, PlainStepper, Stepper
from gems.replication import GradientReducer, attach, mpi_group


# ---------------------------------------------------------------------------- composition
def parallelize(spec: ModelSpec, mesh: Mesh, world: World, cfg: DictConfig,
                settings: ParallelSettings | None = None) -> Stepper:
    """Compose the strategies for this rank, in this order:

    1. spatial: each layer works on this rank's part of the sample (S > 1);
    2. pipeline: the layers are split into the schedule's partitions and it
       runs them (D > 1, or a schedule other than lp);
    3. replication: gradients are summed over every rank that holds a copy.

    ``settings`` (:func:`gems.parallel.resolve`) says how; resolved from ``cfg`` when not given.
    """
    c = _Composition(spec, mesh, world, cfg, settings or resolve(cfg))
    c.spatial()  # 1.
    where = whole_names(c.spec.module, c.seq)  # before place(): moving buffers to a device makes new tensors
    c.place()
    stepper = c.pipelined() if c.settings.pipelined else c.whole()  # 2., then 3. inside each
    mine = {id(m) for part in stepper.modules for m in part.modules()}  # this rank's partitions only
    stepper.names = {name: ref for name, ref in where.items() if id(ref[0]) in mine}
    return stepper


def whole_names(serial: nn.Module, composed: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Where each entry of the serial model's ``state_dict`` (parameters, persistent buffers) lives in the composed
    model: {serial name: (module, attribute)}. The spatial layers and the pipeline's partitions hold the serial
    model's own tensors under other names (a gather layer moves the head's indices, a partition counts its layers
    from 0), so the names are matched by the tensors themselves."""
    serial_name = {id(t): n for n, t in serial.state_dict(keep_vars=True).items()}
    out: dict[str, tuple[nn.Module, str]] = {}
    for m in composed.modules():
        for attr, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None and id(t) in serial_name:
                out.setdefault(serial_name[id(t)], (m, attr))
    return out


class _Composition:
    """The state :func:`parallelize` builds up, one strategy after the other."""

    def __init__(self, spec: ModelSpec, mesh: Mesh, world: World, cfg: DictConfig, settings: ParallelSettings) -> None:
        self.mesh, self.world, self.cfg, self.settings = mesh, world, cfg, settings
        self.spec, gather_note = spatial_model(spec, mesh, cfg.parallel.bn_stats, bool(cfg.parallel.gather_uncut))
        self.notes = [n for n in (gather_note, settings.norm_note(self.spec.module)) if n]
        self.loss_fn = make_loss_fn(self.spec, mesh, int(cfg.train.batch_size))
        self.seq: nn.Sequential = self.spec.module
        self.ctx: Any = None
        self.memory_format = torch.contiguous_format  # what the layers compute in (place: channels-last on GPUs)
        self.slices: tuple[slice, ...] | None = None
        self.balance = list(settings.balance) if settings.balance else None
        #: the plain path's recomputed pieces, weighed on the serial model while it is still on the host
        self.pieces = recompute_pieces(self.spec, mesh) if settings.checkpoint and not settings.pipelined else None
        t, device = cfg.train, world.device
        if device.type == "cpu" and t.precision == "bf16":
            guard_bf16_conv3d(self.seq)  # torch's bf16 Conv3d weight gradient on CPU is wrong for inputs 2 cells deep
        self.scaler = LossScaler(device, scaling_enabled(str(t.precision), str(t.loss_scaling)),
                                 float(t.loss_scale_init), int(t.loss_scale_growth_interval))
        # a whole-sample output computed by every spatial part (the trunk gathered before the head) counts once
        gathered = mesh.spatial_enabled and self.spec.spatial_end is not None
        self.metric = Metric(self.spec, mesh, counts=not gathered or mesh.coord(world.rank).spatial == 0)

    def amp(self) -> Any:
        return autocast(self.cfg.train.precision, self.world.device)

    def spatial(self) -> None:
        """1. Each layer on this rank's part of the sample (S > 1): the spatial layers replace the serial ones."""
        if not self.mesh.spatial_enabled:
            return
        from gems.spatial import SpatialContext, apply_spatial

        p, st = self.cfg.parallel, self.settings
        self.ctx = SpatialContext.from_mesh(self.mesh, self.world.rank, p.overlap)
        self.slices = tuple(self.ctx.local_slices(self.spec.input_shape[1:]))
        if st.pipelined and self.balance is None and st.stages > 1:  # balanced on the serial layers, as ranks run them
            self.balance = stage_balance(st, self.spec, device=self.world.device)
        self.seq = apply_spatial(self.seq, self.ctx, self.spec.spatial_end, bn_stats=p.bn_stats)

    def place(self) -> None:
        """The model on the rank's device (channels-last for convolutions on GPUs)."""
        device, seq = self.world.device, self.seq
        if any(t.device != device for t in [*seq.parameters(), *seq.buffers()]):  # (fake parameters cannot be moved)
            seq = seq.to(device)
        if (device.type == "cuda" or graphs.gpu_layout(device)) and self.spec.spatial_ndim in (2, 3):
            self.memory_format = torch.channels_last if self.spec.spatial_ndim == 2 else torch.channels_last_3d
            seq = seq.to(memory_format=self.memory_format)  # type: ignore[call-overload]
        self.seq = seq

    def parts(self) -> Parts:
        """What the stepper runs of this composition."""
        return Parts(self.world, self.seq, self.loss_fn, self.scaler, self.metric, self.amp, int(self.cfg.train.seed),
                     self.ctx, tuple(self.spec.input_shape[1:]), self.slices, self.notes)

    def pipelined(self) -> Stepper:
        """2. The layers in the schedule's partitions, run by the schedule; 3. the gradient sum."""
        from gems.pipeline import apply_pipeline

        st, cfg, device = self.settings, self.cfg, self.world.device
        assert st.schedule is not None  # pipelined: resolve() made the schedule, once
        loss_fn = self.loss_fn
        runner = apply_pipeline(
            self.seq, self.mesh, self.world.rank, loss_fn=lambda out, y, n: loss_fn(out, y),
            batch_size=st.line_batch, schedule=st.schedule, balance=self.balance, balance_by=st.balance_by,
            checkpoint=st.checkpoint,
            sample_shape=_pipeline_sample(self.spec, self.ctx, self.slices), device=device, amp=self.amp)
        runner.scale_loss = self.scaler.scale
        runner.memory_format = self.memory_format  # the cuts cross in the format the partitions compute in
        graphed, why = graphs.decide(cfg, st, self.mesh, device)  # a partition's pieces replayed (gems.rank.pieces)
        if why:
            self.notes.append(why)
        # replayed pieces run no points inside a partition: the sums start after each backward action (flush)
        reducer = _reducer(runner.partitions, self.mesh, self.world, cfg, overlap=not graphed)
        attach(reducer, runner)
        pieces = None
        if graphed:
            from gems.rank.pieces import Pieces

            pieces = Pieces(device, self.world.rank, self.amp, lambda: list(runner.buffers()))
            runner.call_part = pieces
        if str(cfg.parallel.rounds_by) == "time":
            runner.time_actions()
        return PipelineStepper(self.parts(), runner, reducer, pieces)

    def whole(self) -> Stepper:
        """No pipeline: one forward and backward of the whole (spatial) model; 3. the gradient sum."""
        graphed, why = graphs.decide(self.cfg, self.settings, self.mesh, self.world.device)
        if why:
            self.notes.append(why)
        # one reducer for every step, graphed or eager: its sums start at its points in the backward (a capture
        # records them there), so the overlap is what the step runs
        reducer = _reducer(self.seq, self.mesh, self.world, self.cfg)
        forward: Callable[[torch.Tensor], torch.Tensor] = self.seq
        if self.settings.checkpoint:  # pieces each recomputed in its backward (but the last), skips carried
            assert self.pieces is not None
            forward = checkpointed(self.seq, self.pieces)
        plain = PlainStepper(self.parts(), reducer, self.settings.line_batch, forward)
        return GraphedStepper(plain, self.mesh, bool(self.cfg.train.graph_optimizer)) if graphed else plain


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



def _reducer(model: nn.Sequential | dict[int, nn.Sequential], mesh: Mesh, world: World, cfg: DictConfig,
             overlap: bool = True) -> GradientReducer:
    """The gradient sum of ``model`` (the rank's layers, or its partitions by index) over the ``grad`` group;
    ``overlap=False``: every sum starts after the backward."""
    bucket = float(cfg.comm.bucket_mb)
    if world.grad_comm == "mpi":
        group: Any = mpi_group(world.mpi_comm, mesh, world.rank) if len(mesh.ranks("grad")) > 1 else None
    else:
        group = mesh.group("grad")
    return GradientReducer(model, group, bucket, overlap=overlap)



def set_up_rank(cfg: DictConfig, world: World, mesh: Mesh, settings: ParallelSettings
                ) -> tuple[Coord, ModelSpec, Stepper, torch.optim.Optimizer]:
    """What a rank builds before its first step, once its groups exist: (its mesh coordinate, the model, its
    stepper, its optimizer). A run and ``gems plan plan.dry_run=true`` both build it here."""
    coord = mesh.coord(world.rank)
    torch.manual_seed(int(cfg.train.seed))
    spec = build_model(section(cfg, "model"))  # same seed everywhere: every copy starts from the same weights
    stepper = parallelize(spec, mesh, world, cfg, settings)
    opt = make_optimizer(cfg, stepper.params)
    stepper.adopt(opt)
    return coord, spec, stepper, opt


