"""The strategies composed for one rank, in one place and one order (docs/design.md): spatial parts inside each
layer, then pipeline partitions over the layers, then the gradient sum over every copy of each parameter.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from omegaconf import DictConfig
from torch import nn

from gems import progress
from gems.bootstrap import (
    World,
)
from gems.config import section
from gems.fault import all_finite
from gems.layers import batch_context, evaluation_mode, guard_bf16_conv3d
from gems.mesh import Coord, Mesh
from gems.models import ModelSpec, build_model
from gems.models.skips import checkpointed
from gems.parallel import ParallelSettings, recompute_pieces, resolve, spatial_model, stage_balance
from gems.precision import LossScaler, autocast, scaling_enabled
from gems.rank import graphs
from gems.rank.loss import Metric, make_loss_fn
from gems.rank.optim import make_optimizer
from gems.rank.sync import all_reduce_sum, step_sync
from gems.replication import GradientReducer, attach, average_buffers, averaged_buffers, flat_buffers, mpi_group


# ---------------------------------------------------------------------------- composition
@dataclass
class Parallel:
    """What one rank trains: a forward/backward step function and its parameters."""

    #: one step's forward and backward: this rank's weighted loss, on its device (read once a step, by the loop)
    step: Callable[[torch.Tensor | None, torch.Tensor | None, list[int], int], torch.Tensor]
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
    #: a forward of one batch without gradients, in evaluation mode: this rank's metric sums (gems.rank.loss.Metric)
    #: over the outputs it computed, or None where it computes none; ``batch_statistics=True`` (a fourth argument)
    #: leaves the normalisation layers in training mode (gems.layers.evaluation_mode: BatchNorm recalibration)
    evaluate: Callable[..., torch.Tensor | None] = field(default=lambda x, y, ids, batch_statistics=False: None)
    metric: Any = None  # the Metric whose sums evaluate returns
    #: the first step makes the pipeline's first exchanges between some ranks (cut shapes learnt from headers:
    #: gems.pipeline.runtime.PipelineRunner.connected), so it is left out of the timings
    first_step_connects: bool = False
    #: what this rank holds under the whole model's names, the keys of the serial model's ``state_dict``:
    #: {name: (module, attribute)} (gems.checkpoint.held reads the tensors; gems.checkpoint saves and loads them)
    names: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    #: the pipeline's rounds placed by its actions' measured times from the next step on (parallel.rounds_by=time:
    #: PipelineRunner.place_rounds_by_time); collective over every rank, called once, after the same step on each
    place_rounds: Callable[[], None] = field(default=lambda: None)
    #: the step replayed from a CUDA graph (gems.rank.graphs.StepGraph), None where the step runs eager
    graph: Any = None
    #: a pipeline's partitions replayed from graphs between its messages (gems.rank.pieces.Pieces), or None
    pieces: Any = None
    #: a graphed rank's step with its sync (its sums, BatchNorm's averages and the sync inside the graph):
    #: (x, y, ids, step, stop) -> [global loss, stop, input finite, output finite] on the device, not read
    synced_step: Callable[..., torch.Tensor] | None = None
    #: whether the step averages the floating buffers over the copies itself (a graphed one), which ones
    averages_buffers: bool = False
    buffers: list[torch.Tensor] = field(default_factory=list)
    #: whether the step runs the optimizer's update itself (train.graph_optimizer), and how it is handed the
    #: optimizer once made (set_up_rank)
    optimizer_in_step: bool = False
    adopt: Callable[[Any], None] = field(default=lambda opt: None)


def parallelize(spec: ModelSpec, mesh: Mesh, world: World, cfg: DictConfig,
                settings: ParallelSettings | None = None) -> Parallel:
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
    par = c.pipelined() if c.settings.pipelined else c.whole()  # 2., then 3. inside each
    mine = {id(m) for part in par.modules for m in part.modules()}  # this rank's partitions only
    par.names = {name: ref for name, ref in where.items() if id(ref[0]) in mine}
    return par


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

    def halo_stats(self) -> dict[str, float]:
        if self.ctx is None:
            return {}
        out = {"halo": float(sum(self.ctx.halo_seconds.values()))}
        self.ctx.halo_seconds.clear()
        return out

    def quiesce(self) -> None:
        if self.ctx is not None:
            self.ctx.drain_sends()

    def mark(self, x: torch.Tensor | None) -> None:
        if self.ctx is not None and x is not None:
            self.ctx.mark(x, self.spec.input_shape[1:])

    def pipelined(self) -> Parallel:
        """2. The layers in the schedule's partitions, run by the schedule; 3. the gradient sum."""
        from gems.pipeline import apply_pipeline

        st, cfg, device, seed = self.settings, self.cfg, self.world.device, int(self.cfg.train.seed)
        assert st.schedule is not None  # pipelined: resolve() made the schedule, once
        loss_fn = self.loss_fn
        runner = apply_pipeline(
            self.seq, self.mesh, self.world.rank, loss_fn=lambda out, y, n: loss_fn(out, y),
            batch_size=st.line_batch, schedule=st.schedule, balance=self.balance, balance_by=st.balance_by,
            checkpoint=st.checkpoint,
            sample_shape=_pipeline_sample(self.spec, self.ctx, self.slices), device=device, amp=self.amp)
        runner.scale_loss = self.scaler.scale
        runner.memory_format = self.memory_format  # the cuts cross in the format the partitions compute in
        params = list(runner.parameters())
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
        # a parameter is final after the last backward of its partition on this rank
        backwards = Counter(a.stage for a in runner.actions if a.kind.finishes_gradients)
        count = {id(q): backwards[s] for s, part in runner.partitions.items() for q in part.parameters()}

        def pipe_step(x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int], step: int) -> torch.Tensor:
            self.mark(x)
            if pieces is not None:
                if pieces.steps == 0 and graphs.hooked(list(runner.modules), reducer.hook_ids()):
                    pieces.refused = True  # a replay runs no hook: the model's own (a fault injection) must run
                    self.notes.append("train.cuda_graphs: the step runs eager: hooks on the model (a replay would "
                                      "skip them)")
                pieces.begin_step(step)
            reducer.start_step(expected=lambda q: count[id(q)])
            with self.amp():
                loss = runner.step(x, y, ids, seed, step)
            reducer.finish()
            return loss

        def pipe_stats() -> dict[str, float]:
            s = runner.stats
            out = {"bubble_or_wait": s.wait_s, **self.halo_stats()}
            s.forward_s = s.backward_s = s.wait_s = 0.0
            return out

        def pipe_eval(x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int],
                      batch_statistics: bool = False) -> torch.Tensor | None:
            self.mark(x)
            with self.amp():
                return runner.evaluate(x, y, ids, self.metric, batch_statistics)

        if str(cfg.parallel.rounds_by) == "time":
            runner.time_actions()

        def place_rounds() -> None:
            if runner.clock is not None:
                note = runner.place_rounds_by_time()
                if note:
                    self.notes.append(note)

        return Parallel(pipe_step, params, list(runner.modules), reducer, self.slices,
                        runner.needs_inputs, runner.needs_targets, runner.samples_per_step, pipe_stats,
                        balance=list(runner.balance), first_nonfinite=runner.first_nonfinite,
                        notes=self.notes, quiesce=self.quiesce, scaler=self.scaler, transfers=runner.transfers,
                        evaluate=pipe_eval, metric=self.metric, first_step_connects=not runner.connected,
                        place_rounds=place_rounds, pieces=pieces)

    def whole(self) -> Parallel:
        """No pipeline: one forward and backward of the whole (spatial) model; 3. the gradient sum."""
        seq, seed, loss_fn, scaler = self.seq, int(self.cfg.train.seed), self.loss_fn, self.scaler
        params = list(seq.parameters())
        graphed, why = graphs.decide(self.cfg, self.settings, self.mesh, self.world.device)
        if why:
            self.notes.append(why)
        # one reducer for every step, graphed or eager: its sums start at its points in the backward (a capture
        # records them there), so the overlap is what the step runs
        reducer = _reducer(seq, self.mesh, self.world, self.cfg)
        forward: Callable[[torch.Tensor], torch.Tensor] = seq
        if self.settings.checkpoint:  # pieces each recomputed in its backward (but the last), skips carried
            assert self.pieces is not None
            forward = checkpointed(seq, self.pieces)
        finite: dict[int, torch.Tensor | bool] = {}  # position -> all finite? (a device flag: no synchronisation)

        def plain_step(x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int], step: int) -> torch.Tensor:
            assert x is not None and y is not None
            self.mark(x)
            reducer.start_step()
            finite[0] = all_finite(x)
            progress.mark("forward")
            with batch_context(seed, step, ids):
                with self.amp():
                    out = forward(x)
                finite[1] = all_finite(out)
                loss = loss_fn(out, y)
                progress.mark("backward")
                scaler.scale(loss).backward()
            reducer.finish()
            return loss.detach()  # read once, at the end of the step (gems.rank.loop)

        def first_bad() -> int | None:
            return next((pos for pos, ok in sorted(finite.items()) if not bool(ok)), None)

        def plain_eval(x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int],
                       batch_statistics: bool = False) -> torch.Tensor | None:
            assert x is not None and y is not None
            self.mark(x)
            with evaluation_mode([seq], batch_statistics), torch.no_grad(), self.amp():
                out = seq(x)
            return self.metric(out, y, ids)

        par = Parallel(plain_step, params, [seq], reducer, self.slices, True, True, self.settings.line_batch,
                       self.halo_stats, first_nonfinite=first_bad, notes=self.notes, quiesce=self.quiesce,
                       scaler=scaler, evaluate=plain_eval, metric=self.metric)
        if graphed:
            _Graphed(self, par, finite)
        return par



class _Graphed:
    """The plain path's step as one function of static tensors, replayed from a CUDA graph (gems.rank.graphs):
    the forward, the loss, the backward into the graph's own gradients, the sums (at the reducer's points), the
    BatchNorm averages over the copies, the step's sync and (``train.graph_optimizer``) the update. A batch of
    another shape, or a model with hooks a replay would skip (a fault injection's), runs the eager step with the
    same sums, averages and sync, in the same order; :meth:`synced` is the step either way."""

    def __init__(self, c: _Composition, par: Parallel, finite: dict[int, torch.Tensor | bool]) -> None:
        # what it needs of ``par``, not ``par``: par holds this object's methods (synced_step, adopt), and a cycle
        # would keep the graph alive past the rank's release (gems.capture: NCCL's teardown waits for it)
        self.c, self.finite = c, finite
        self.reducer, self.plain, self.params = par.reducer, par.step, par.params
        reducer, mesh, cfg = par.reducer, c.mesh, c.cfg
        self.grads = reducer.static_grads()  # the graph's own gradients: they never alias a buffer unsafely
        self.zeroed = [b.flat for b in reducer.buckets if b.flat is not None] + \
            [g for _, g in self.grads if g._base is None]
        self.group = mesh.group("grad")
        self.buffers = averaged_buffers([c.seq], self.group)
        self.flat = flat_buffers([c.seq], self.buffers)  # one sum in place over the copies
        self.copies = len(mesh.ranks("grad"))
        self.in_graph = bool(cfg.train.graph_optimizer) and not c.scaler.enabled  # fp16 decides its skip on the host
        if bool(cfg.train.graph_optimizer) and c.scaler.enabled:
            c.notes.append("train.graph_optimizer: fp16's skipped steps are decided on the host: the optimizer stays "
                           "outside the graph")
        self.optimizer: Any = None  # made after the composition (set_up_rank hands it over: Parallel.adopt)
        self.graph = graphs.StepGraph(self.body, c.world.device, c.world.rank, self.touched, grads=self.grads,
                                      static=self.static)
        self.own_hooks = reducer.hook_ids()
        par.graph, par.synced_step, par.averages_buffers, par.buffers = self.graph, self.synced, True, self.buffers
        par.optimizer_in_step = self.in_graph
        par.adopt = self.adopt

    def adopt(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def flag(self, ok: torch.Tensor | bool) -> torch.Tensor:
        """A finiteness flag as float64 (a fill, not a copy from the host: capturable)."""
        return ok.to(torch.float64).reshape(1) if isinstance(ok, torch.Tensor) else \
            torch.full((1,), float(ok), dtype=torch.float64, device=self.c.world.device)

    def body(self, s: graphs.Static) -> None:
        c, reducer = self.c, self.reducer
        reducer.start_step()
        for p, g in self.grads:  # attached again each step: zero_grad in either form leaves them as they were made
            p.grad = g
        torch._foreach_zero_(self.zeroed)
        ok_in = all_finite(s.x)
        progress.mark("forward")
        with batch_context(int(c.cfg.train.seed), 0, range(s.x.shape[0]), keys=s.keys):
            with graphs.uncached(c.amp):
                out = c.seq(s.x)
            ok_out = all_finite(out)
            loss = c.loss_fn(out, s.y)
            progress.mark("backward")
            c.scaler.scale_on_device(loss).backward()
        reducer.finish(timed=False)  # (no event may be timed inside a capture)
        if self.buffers:
            average_buffers(self.buffers, self.group, self.copies, self.flat)
        pair = torch.stack([loss.detach().reshape(()).to(torch.float64), s.stop.to(torch.float64)])
        all_reduce_sum(pair, c.world)  # the step's sync (gems.rank.sync.step_sync's collective)
        s.figures.copy_(torch.cat([pair, self.flag(ok_in), self.flag(ok_out)]))
        if self.in_graph:
            self.optimizer.step()

    def eager(self, x: torch.Tensor, y: torch.Tensor, ids: list[int], step: int, stop: int) -> torch.Tensor:
        local = self.plain(x, y, ids, step)
        if self.buffers:
            average_buffers(self.buffers, self.group, self.copies, self.flat)
        pair = step_sync(local, stop, self.c.world)
        if self.in_graph:
            self.optimizer.step()
        return torch.cat([pair, self.flag(self.finite[0]), self.flag(self.finite[1])])

    def static(self) -> list[torch.Tensor]:
        """What the body reads that outlives it, besides what it changes: the parameters, the sums' buffers, the
        optimizer's rate where it is a tensor (the stand-in holds each replay to these: gems.rank.graphs.Trace)."""
        out = [p.detach() for p in self.params] + [b.flat for b in self.reducer.buckets if b.flat is not None]
        out += [self.flat] if self.flat is not None else []
        if self.optimizer is not None:
            out += [g["lr"] for g in self.optimizer.param_groups if isinstance(g.get("lr"), torch.Tensor)]
        return out

    def touched(self) -> list[torch.Tensor]:
        """What a step changes beyond its outputs (the stand-in's capture puts it back)."""
        out = list(self.c.seq.buffers())
        if self.in_graph:
            out += [p.detach() for p in self.params]
            out += [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    def synced(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int], step: int,
               stop: int) -> torch.Tensor:
        """The step with its sync: [global loss, stop, input finite, output finite] on the device."""
        assert x is not None and y is not None
        graph = self.graph
        if graph.ran == 0 and not graph.refused:
            foreign = graphs.hooked([self.c.seq], self.own_hooks)
            hooks, shapes = self.agree(foreign is not None, x, y)
            if hooks or shapes:  # every rank's step eager
                graph.refused = True
                why = (f"hooks on the model ({foreign}; a replay would skip them)" if foreign else
                       "hooks on another rank's model (a replay would skip them there)" if hooks else
                       "the ranks' batches differ in shape")
                every = ("; every rank runs it eager (NCCL asks that a collective be captured on every rank or on "
                         "none)") if self.c.world.size > 1 else ""
                self.c.notes.append(f"train.cuda_graphs: the step runs eager: {why}{every}")
        if graph.refused or not graph.fits(x, y):
            return self.eager(x, y, ids, step, stop)
        return graph.run(x, y, int(self.c.cfg.train.seed), step, ids, stop)

    def agree(self, hooked: bool, x: torch.Tensor, y: torch.Tensor) -> tuple[bool, bool]:
        """Before the first step, alike on every rank: (whether some rank's model has hooks a replay would skip,
        whether the ranks' batches differ in shape). Whether a collective is captured must be the same on every
        rank that takes part in it (NCCL's rule; the body's sums and sync span the world), so one rank's reason to
        run eager (a fault injection's hook is on one rank) is every rank's: one all-reduce over the world, at the
        first step (not timed). A later batch of another shape is another shape on every rank: every rank trains
        whole batches in equal shares of one data set (gems.rank.data), so a rank runs that step eager where all
        do."""
        world = self.c.world
        if world.size == 1:
            return hooked, False
        import zlib

        import torch.distributed as dist

        shape = zlib.crc32(repr((tuple(x.shape), x.dtype, tuple(y.shape), y.dtype)).encode())
        t = torch.tensor([int(hooked), shape, -shape], dtype=torch.int64, device=world.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        got = t.tolist()
        return got[0] > 0, got[1] != -got[2]


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
                ) -> tuple[Coord, ModelSpec, Parallel, torch.optim.Optimizer]:
    """What a rank builds before its first step, once its groups exist: (its mesh coordinate, the model, its
    parallel step, its optimizer). A run and ``gems plan plan.dry_run=true`` both build it here."""
    coord = mesh.coord(world.rank)
    torch.manual_seed(int(cfg.train.seed))
    spec = build_model(section(cfg, "model"))  # same seed everywhere: every copy starts from the same weights
    par = parallelize(spec, mesh, world, cfg, settings)
    opt = make_optimizer(cfg, par.params)
    par.adopt(opt)
    return coord, spec, par, opt


