"""The training loop of a rank: warm-up, measured and profiled steps, the step's sync, non-finite losses,
preemption and checkpoints, and the record rank 0 writes.

Why one file of this length: :class:`Run` is one rank's run end to end (set-up, step, evaluation, target,
record), and its parts read one state; composition, data, loss and optimizer live beside it in gems/rank/.
"""
from __future__ import annotations

import contextlib
import math
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from gems import capture, progress, timers
from gems import checkpoint as ckpt
from gems.bootstrap import (
    KEEP_GROWTH,
    World,
    keep_host_memory,
    keeps_host_memory_within,
    node_memory_bytes,
    ranks_on_this_node,
)
from gems.config import section
from gems.errors import ConfigError, RunError
from gems.fault import inject, reports
from gems.fault.watchdog import Watchdog
from gems.layers import recalibrating
from gems.memory import MemoryMeter, over_cap, peak_rss_bytes, persistent_bytes, rank_cap_bytes, step_peak_bytes
from gems.mesh import Mesh, mesh_from_config
from gems.models import build_model, registered
from gems.parallel import resolve
from gems.pipeline.runtime import split_waits
from gems.rank.compose import Parallel, set_up_rank
from gems.rank.data import (
    Prefetcher,
    Sampler,
    Staged,
    class_names,
    data_notes,
    evaluation_batches,
    finisher,
    make_data,
    replica_indices,
    share,
    stage,
    step_batch,
    unstage,
)
from gems.rank.loss import described
from gems.rank.optim import LearningRate, WeightAverage
from gems.rank.sync import Posted, Readout, step_sync
from gems.replication import average_buffers, averaged_buffers
from gems.results import record as rec
from gems.results.mlperf import MLPerfLog


# ---------------------------------------------------------------------------- the run
class Stopped(RunError):
    """Every rank stopped at one step for one reason, and rank 0 wrote the failed record saying why: the rank ends
    with that one line and exit status 1, no traceback (the record holds it all)."""


class NonFiniteLoss(Stopped):
    """The global loss of a step was NaN or Inf and ``train.on_nonfinite=stop``: every rank stops at that step."""


class OverMemoryCap(Stopped):
    """A CPU rank's tensors took more than ``cluster.rank_memory_gb`` in the profiled steps: every rank stops there,
    as a GPU of that memory would have run out (:meth:`Run.hold_to_cap`)."""


#: a rank's stop flag for a bad file met ahead (Run.bad_ahead): over any count of ranks asking for a checkpoint
BAD_DATA = 1 << 20


def start_watchdog(cfg: DictConfig, world: World, on_stall: Callable[[str, dict[str, Any]], None]) -> Watchdog | None:
    """This rank's heartbeat thread (``fault.stall_timeout_s``; null switches stall detection off)."""
    f = section(cfg, "fault")
    if f.stall_timeout_s is None:
        return None
    jd = rec.job_dir(cfg)

    def report(message: str, failure: dict[str, Any]) -> None:
        reports.write_report(jd, world.rank, message, echo=world.rank not in failure.get("ranks", []),
                             kind=failure.get("kind", "stall"), blame=failure.get("blame"))

    launcher = os.environ.get("GEMS_LAUNCHER_PID")
    return Watchdog(world.rank, world.size, stall_s=f.stall_timeout_s, warmup_s=f.warmup_timeout_s,
                    addr=os.environ.get("MASTER_ADDR", world.master_addr),
                    port=int(os.environ.get("MASTER_PORT", world.master_port)),
                    on_stall=on_stall if world.rank == 0 else None, on_report=report,
                    launcher_pid=int(launcher) if launcher else None).start()


BREAKDOWN = ("compute", "pipeline_comm", "halo", "allreduce", "bubble_or_wait", "data")


@dataclass
class _Done:
    """A step whose work is queued, its figures still to be read (:meth:`Run.finish`): a graphed run's step is read
    during the next one (gems.rank.sync)."""

    step: int
    begun: float  # the step's start on the host (the stall allowance)
    t0: float  # after any preemption at its start: its timed span starts here
    t_data: float
    measured: bool
    posted: Posted
    start: Any = None  # a GPU rank's event at t0, when its time is read late (the device's span, not the host's)
    host_s: float = 0.0  # the host's time from t0 to the step's end (a CPU rank's step is done when queued)
    terms: dict[str, float] | None = None  # the step's timed terms, taken when it was queued (read late)
    deferred: bool = False
    verdict: bool = False  # its figures end with fp16's overflow verdict, decided on the device (LossScaler.settle)


def train(cfg: DictConfig, world: World, wd: Watchdog | None = None) -> dict[str, Any]:
    """Train on this rank; returns the record (complete on rank 0)."""
    return Run(cfg, world, wd).run()


class Run:
    """One rank's training run: its set-up (mesh, groups, the composed model, data, a checkpoint to resume
    from), every step, and the record.

    Steps before ``measure_from`` are left out of the timings: the warm-up steps and, on CPU ranks, the steps
    profiled for tensor memory, which include one after the first optimizer step (the optimizer's state exists
    from then on: with fewer than two warm-up steps the first step after them is profiled too). GPU ranks read
    torch.cuda's peak over the whole run.
    """

    def __init__(self, cfg: DictConfig, world: World, wd: Watchdog | None) -> None:
        self.cfg, self.world, self.wd = cfg, world, wd
        self.fault = section(cfg, "fault")  # the fault injections of every step, typed once
        self.t_start = time.time()
        progress.mark("setup")
        t = cfg.train
        self.host_memory = HostMemory(str(t.host_memory), world.device)
        if t.threads and world.device.type == "cpu":
            torch.set_num_threads(int(t.threads))
        if t.tf32 is not None:  # GPU ranks: fp32 convolutions and matmuls in TF32 or not (CPUs have no TF32)
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = bool(t.tf32)
        if t.deterministic:  # the same bits from run to run (graphed against eager on a GPU: docs/gpu.md)
            deterministic()
        self.mesh = mesh = mesh_from_config(cfg, world.size)
        self.mlperf = MLPerfLog(cfg, world.rank)  # a run with a target: MLPerf HPC's log, from init start
        kind = registered().get(str(cfg.model.name))  # the MLPerf HPC benchmark the model is a version of
        self.mlperf.init_start(_device_name(world.device), world.size,
                               (kind.benchmark if kind is not None else None) or str(cfg.model.name))
        settings = resolve(cfg)
        if world.size > 1:
            mesh.build_groups(world.rank, groups=settings.holder_groups, timeout=world.timeout)
        else:
            mesh.groups.grad_ranks = [0]
        self.meter = MemoryMeter(world.device)
        self.meter.reset()
        self.coord, spec, self.par, self.opt = set_up_rank(cfg, world, mesh, settings)
        gpu = world.device if world.device.type == "cuda" else None  # synthetic samples drawn on the rank's GPU
        staging = cfg.data.stage == "node"
        self.mlperf.staging(start=True, when=staging)
        self.staged = stage(cfg, world, str(cfg.run_id or "run"))  # data.stage=node: copied once
        self.mlperf.staging(start=False, when=staging)
        self.data = make_data(cfg, spec, self.par.input_slices, device=gpu, staged=self.staged)
        inject.arm(self.fault, world.rank, self.par.modules)
        self.B, self.R = int(t.batch_size), mesh.replicas
        self.sampler = Sampler(len(self.data), self.B, int(t.seed), t.epochs, t.steps, bool(cfg.data.shuffle),
                               symmetries=self.data.symmetries)
        self.steps, self.warm = self.sampler.total, int(t.warmup_steps)
        if self.warm >= self.steps:
            raise ConfigError("train.warmup_steps", self.warm, f"fewer than the run's {self.steps} steps")
        self.measure_from = max(self.warm, min(2, self.steps - 1)) if world.device.type == "cpu" else self.warm
        if self.par.first_step_connects:  # the pipeline's first exchanges: no timed step makes one
            self.measure_from = max(self.measure_from, min(1, self.steps - 1))
        self.profiled_to = self.measure_from  # (the steps before it were profiled for tensor memory, on CPU ranks)
        self.readout = Readout(world.device)  # the steps' figures, copied to the host (gems.rank.sync)
        self.pending: _Done | None = None  # a step queued whose figures are read during the next one
        self.stopping = False  # a step read late asked to stop: the one queued since is read at once, then saved
        self.lr = LearningRate(t, self.sampler.steps_per_epoch if t.epochs is not None else 1, self.steps)
        self.val = make_data(cfg, spec, self.par.input_slices, validation=True, device=gpu, staged=self.staged)
        if t.eval_average_crops and self.val is not None:  # each file's crops averaged too (prepare checks hdf5)
            self.par.metric.group_by(self.val.samples.group, len(self.val.samples.files))
        every = t.eval_every if t.eval_every is not None else (self.sampler.steps_per_epoch if t.epochs else 0)
        self.eval_every = int(every)
        self.ckpt_every = int(t.checkpoint_every or 0)
        # running statistics (BatchNorm) of the copies of a parameter's module see different samples
        par = self.par
        # (a graphed step averages them itself, as the views of one tensor: the same list)
        self.buffers = par.buffers if par.averages_buffers else averaged_buffers(par.modules, mesh.group("grad"))
        self.hold = ckpt.Holding(par.names, par.params, self.opt)  # what checkpoints save and load, by whole names
        self.saver = ckpt.Saver(cfg, world, mesh, bool(t.checkpoint_async))
        self.resume()
        graphed = par.graph is not None or par.pieces is not None
        if graphed:  # the graphs' eager step, their capture and a replay whose device ops are counted: untimed
            self.graphed_from = min(self.start + 2, self.steps - 1)
            self.measure_from = max(self.measure_from, min(self.graphed_from + 1, self.steps - 1))
            if self.wd is not None:
                self.wd.warm_until = max(self.wd.warm_until, self.measure_from)
        # the step whose device ops are counted (gems.rank.graphs.DeviceOps): the last before the timed ones (a
        # dispatch mode slows it), a replay in a graphed run; none where there is no such step
        self.count_at: int | None = self.measure_from - 1 if self.measure_from > self.start else None
        if graphed and self.count_at is not None and self.count_at < self.graphed_from:
            self.count_at = None
        self.saver.restarts = self.restarts  # (a fault injected in a save acts in the job's first attempt only)
        self.ema = WeightAverage(float(t.ema), par.params, self.history) if t.ema else None  # saved with the history
        self.hold.average = self.ema.average if self.ema is not None else None
        self.context = _StepContext(cfg, world, mesh, par, self.opt, self.B, self.R)
        self.context.bad_ahead = self.bad_ahead
        self.bad_data: BaseException | None = None  # what this rank's reader met ahead of the step (bad_ahead)
        self.bad_stop = False  # a step read late said that a rank met a bad file: the next one read stops the run
        # (a resumed run splits the pipeline waits of the steps after its restart only: the rest stay bubble_or_wait)
        self.run_sent: dict[tuple[int, ...], float] = {}
        self.run_received: dict[tuple[int, ...], tuple[float, float]] = {}
        self.mlperf.init_stop(self.B, self.lr.base, len(self.data), len(self.val) if self.val is not None else 0)

    def resume(self) -> None:
        """After a preemption, a time limit or a requeue (gems/checkpoint.py): the step to start from and the
        history so far (losses, times, the fp16 loss scale)."""
        self.restarts = ckpt.restart_count()
        self.history: dict[str, Any] = {"losses": [], "step_times": [], "nonfinite_steps": [], "every_step_time": [],
                                        "tensor_peaks": [], "breakdown": {k: 0.0 for k in BREAKDOWN}, "lrs": [],
                                        "validation": [], "elapsed_s": 0.0, "reader_s": 0.0}
        self.start = 0
        self.resumed: dict[str, Any] | None = None
        progress.mark("checkpoint")
        t, own = self.cfg.train, ckpt.ckpt_dir(self.cfg)
        if self.world.rank == 0:  # a save a crash cut short: its folder goes before any rank can save again
            ckpt.tidy(own)
        step = ckpt.latest_step(own)
        if step is not None:  # this job's own checkpoint (a requeue, a preemption, the time limit)
            self.restarts = max(self.restarts, 1)
            self.restore(own / f"step{step:08d}", step, another_run=False)
        elif t.resume_from:  # another run's training, continued on this mesh
            folder = ckpt.find(str(t.resume_from), "train.resume_from")
            step = int(ckpt.read_meta(folder)["step"])
            self.restore(folder, step, another_run=True)
        elif t.init_from:  # another run's weights, a fresh optimizer
            ckpt.weights(str(t.init_from), "train.init_from")(self.hold)
        elif self.cfg.eval.path:  # gems eval: the trained model (a checkpoint's weight average where it has one)
            ckpt.weights(str(self.cfg.eval.path), "eval", averaged=True)(self.hold)
        if self.wd is not None:
            self.wd.warm_until = max(self.measure_from, self.start + 1)  # warm-up, profiled, first after a restart

    def restore(self, folder: Path, step: int, another_run: bool) -> None:
        """Continue from the checkpoint in ``folder`` (before ``step``), whatever mesh wrote it."""
        meta = ckpt.load(folder, self.hold)
        same_mesh = not another_run and meta.get("mesh") == ckpt.mesh_of(self.mesh) and \
            meta.get("world_size") == self.world.size
        got = ckpt.load_history(folder, self.world.rank, same_mesh)
        self.start = step
        self.history.update(got)
        self.history["weight_average"] = meta["average"]
        if another_run or not same_mesh:
            batch = int(self.cfg.train.batch_size)
            self.resumed = {"path": str(folder), "step": step, "run_id": meta.get("run_id"), "mesh": meta.get("mesh"),
                            "schedule": meta.get("schedule"), "global_batch": meta.get("global_batch"),
                            "exact": meta.get("global_batch") == batch}
        if "loss_scale" in self.history:  # fp16: the scale and the steps skipped so far, as if never stopped
            self.par.scaler.load_state_dict(self.history["loss_scale"])

    # ---- the steps ---------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        timers.reset()
        self.t_begin = time.time()  # time to target counts from the first training step (MLPerf's run start)
        self.prefetch = Prefetcher(self.fetch, range(self.start, self.steps), int(self.cfg.data.prefetch),
                                   self.world.device, self.finisher())
        self.mlperf.run_start()
        try:
            for step in range(self.start, self.steps):
                with self.counting(step):
                    if self.one_step(step):
                        break  # the target reached: every rank evaluated the same figures
            self.drain()
            self.mlperf.run_stop(reached=bool(self.history.get("target")))
        except BaseException:
            if self.staged is not None:  # a failure: the node's copies go with it (the others stop too)
                self.staged.discard(self.world)
            raise
        finally:
            self.mlperf.pause()  # stopped to be requeued, or failed: the next job appends
            self.prefetch.close()
            self.history["reader_s"] += self.prefetch.reader_s
        progress.mark("record")
        self.saver.finish()  # an async checkpoint still being written: complete, and latest moved to it
        model_file = self.export()
        record = self.record()
        if model_file is not None:
            record["model_file"] = str(model_file)
        unstage(self.staged, self.world, self.barrier)
        return record

    @contextlib.contextmanager
    def counting(self, step: int) -> Any:
        """Around step ``step``: the device ops of the last step before the timed ones are counted
        (gems.rank.graphs.DeviceOps: what it launches outside a replay), for the record; the count's dispatch mode
        slows the step it counts, which is therefore never timed."""
        if step != self.count_at:
            yield
            return
        from gems.rank.graphs import DeviceOps

        with DeviceOps(self.world.device) as ops:
            yield
        self.history["device_ops"] = {"step": step, "per_step": ops.count, "ops": dict(sorted(ops.names.items()))}

    def export(self) -> Path | None:
        """The trained model in one file beside the record (rank 0 writes it; every rank takes part): the averaged
        weights of a ``train.ema`` run, the last step's otherwise (gems.checkpoint.export)."""
        progress.mark("model file")
        with torch.device("meta"):  # the serial state_dict's order, without allocating the model
            order = list(build_model(section(self.cfg, "model")).module.state_dict())
        path = rec.record_path(self.cfg).with_suffix(".model.pt")
        return ckpt.export(self.cfg, self.world, self.hold, self.saver, len(self.history["losses"]), path, order)

    def barrier(self) -> None:
        """Every rank of the job here (a one-rank job: nothing to wait for)."""
        import torch.distributed as dist

        if self.world.size > 1:
            dist.barrier()

    def elapsed(self) -> float:
        """Seconds of training since the first step, evaluations included, across restarts."""
        return float(self.history["elapsed_s"]) + time.time() - self.t_begin

    def settle_history(self) -> None:
        """Before the history is saved (a checkpoint, a preemption): the training time and the reader's time so far
        move into it, so that a resumed run counts them as if it had not stopped."""
        h = self.history
        h["elapsed_s"], self.t_begin = self.elapsed(), time.time()
        h["reader_s"] += self.prefetch.reader_s
        self.prefetch.reader_s = 0.0

    def finisher(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What finishes a fetched input where the step runs (read counts transformed on the rank's device), or
        None when :meth:`fetch` gives finished ones."""
        return finisher(self.data)

    def fetch(self, step: int) -> tuple[list[int], Any, Any]:
        """Step ``step``'s sample ids, this rank's input part and targets, on the host (the reader's work): read
        inputs as their counts where :meth:`finisher` finishes them."""
        return step_batch(self.data, self.par, step, self.B, self.R, self.coord.replica, self.sampler,
                          raw=self.finisher() is not None)

    def one_step(self, step: int) -> bool:
        """The step; True when an evaluation after it reached the run's target. A graphed run reads a step's
        figures during the next step, once that one's work is queued (gems.rank.sync); at once where they are
        needed (:meth:`read_now`)."""
        cfg, world, par, h = self.cfg, self.world, self.par, self.history
        progress.mark("data", step)
        begun = time.perf_counter()  # the whole step's wall time, for the stall allowance
        spe = self.sampler.steps_per_epoch
        if step % spe == 0:
            self.mlperf.epoch(start=True, epoch=step // spe)
        inject.before_step(self.fault, world.rank, step, self.restarts)
        if self.fault.preempt_at_step == step and self.restarts == 0:
            self.drain()
            self.settle_history()
            _preempt(world, step, self.saver, self.hold, h, self.wd, "fault injection: preempting the job",
                     self.staged)
        t0 = time.perf_counter()
        late = par.graph is not None  # a graphed run's figures are read late: the device's span is timed by events
        start = _event() if late and world.device.type == "cuda" else None
        try:
            (ids, x, y), t_data = self.prefetch.get(step)  # t_data: the exposed data time
        except ConfigError as e:  # a bad file: where this rank alone trains, nothing else need agree to keep it all
            if world.size > 1:
                raise  # (the ranks agree before the batch is needed where a reader runs ahead: bad_ahead)
            self.drain()
            self.bad_data = e
            self.stop_on_bad_data(step)
        x = inject.poison(self.fault, world.rank, step, x)
        h["lrs"].append(self.lr.apply(self.opt, step))
        timers.reset()
        profiling = bool(cfg.train.profile) and step == self.measure_from and self.steps - self.measure_from > 1
        figures = self.compute(step, ids, x, y, profiling)
        t_data += self.prefetch.peek_s  # the wait for a batch ahead (bad_ahead): data time too
        self.prefetch.peek_s = 0.0
        if self.ema is not None:
            self.ema.update(step)
        self.host_memory.after_step(world.rank)
        if self.buffers and not par.averages_buffers:
            with progress.waiting("gradient sum"):
                average_buffers(self.buffers, self.mesh.group("grad"), len(self.mesh.ranks("grad")))
        done = _Done(step, begun, t0, t_data, step >= self.measure_from and not profiling,
                     self.readout.post(figures), start, verdict=self.context.verdict)
        reached = False
        if self.pending is not None:  # the step before: its work is done or under way behind this one's
            reached, self.pending = self.finish(self.pending), None
        if late and not (self.stopping or reached or self.read_now(step)):
            done.host_s, done.terms, done.deferred = time.perf_counter() - t0, self.terms(), True
            self.pending = done
            self.saver.poll()
            return False
        return self.finish(done) or reached

    def read_now(self, step: int) -> bool:
        """Whether step ``step``'s figures are read before the next step starts: what follows it needs them (an
        evaluation, a checkpoint, the end of the run, of an epoch, of the warm-up whose times place the pipeline's
        rounds, a profiled step), or its timed terms are CUDA events still to settle."""
        spe = self.sampler.steps_per_epoch
        return (step + 1 >= self.steps or self.evaluation_due(step) or step < self.measure_from
                or (self.ckpt_every > 0 and (step + 1) % self.ckpt_every == 0) or (step + 1) % spe == 0
                or step == max(self.start, self.warm - 1) or timers.pending())

    def drain(self) -> None:
        """Read the step still pending (before a preemption's save)."""
        if self.pending is not None:
            done, self.pending = self.pending, None
            self.finish(done)

    def finish(self, done: _Done) -> bool:
        """Read step ``done``'s figures (waiting for its work where it is not done) and do what follows the step:
        the loss kept and checked, the step timed, a stop, an evaluation, a checkpoint. True when an evaluation
        reached the run's target."""
        world, par, h, step = self.world, self.par, self.history, done.step
        values = self.readout.read(done.posted)
        loss, stop = values[0], values[1] > 0
        self.bad_stop = self.bad_stop or values[1] >= BAD_DATA  # a rank met a bad file ahead: every rank stops
        if done.verdict:  # fp16: the step's skip was decided on the device; the host's record of it now
            par.scaler.settle(step, values[-1] > 0)
        if par.scaler.enabled:
            h["loss_scale"] = par.scaler.state_dict()  # saved with every checkpoint
        if done.start is not None and done.posted.event is not None:  # the device's span of the step
            dt = done.start.elapsed_time(done.posted.event) / 1e3
        else:  # a CPU rank's step is done when queued; read at once, the read waited for its work
            dt = done.host_s if done.deferred else time.perf_counter() - done.t0
        if self.wd is not None and step > self.start:  # the stall allowance grows with the run's slowest step
            self.wd.saw_step(_took(done, dt, time.perf_counter()))
        timers.settle()  # on GPUs the communication waits were CUDA events: read them now (gems.timers)
        self.check_loss(step, loss, first_bad=_first_bad(values))
        if step == self.profiled_to - 1 and world.device.type == "cpu":  # the last step profiled for its tensors
            self.hold_to_cap(step)
        if world.rank == 0:
            what = " (warm-up)" if step < self.warm else " (profiled for tensor memory)" if step < self.profiled_to \
                else " (the graph's warm-up)" if step < self.measure_from else ""
            print(f"gems: step {step + 1}/{self.steps} {dt:.3f} s loss {loss:.6g}{what}", flush=True)
        self.account(step, dt, done.t_data, measured=done.measured, terms=done.terms)
        if step == max(self.start, self.warm - 1):  # the last warm-up step (or this process's first): every rank
            par.place_rounds()  # places the pipeline's rounds by what its actions took so far (parallel.rounds_by)
        if stop and step + 1 < self.steps:  # Slurm's signal before the time limit (or a preemption notice)
            if done.deferred:  # the next step is queued already: it is read at once, and saved after
                self.stopping = True
                return False
            self.settle_history()
            if self.bad_stop:  # a rank met a bad file ahead (bad_ahead): saved, the model written, then stopped
                self.stop_on_bad_data(step + 1)
            _preempt(world, step + 1, self.saver, self.hold, h, self.wd,
                     "the time limit is near: checkpointing and requeueing", self.staged)
        spe = self.sampler.steps_per_epoch
        if (step + 1) % spe == 0:
            self.mlperf.epoch(start=False, epoch=step // spe)
        reached = self.evaluate(step) if self.evaluation_due(step) else False
        if self.ckpt_every and (step + 1) % self.ckpt_every == 0 and not h["nonfinite_steps"]:  # the last step too:
            # a finished run's training can go on (train.resume_from)
            progress.mark("checkpoint")  # a diverged run keeps its last good checkpoint
            self.settle_history()
            self.saver.save(step + 1, self.hold, h)
        self.saver.poll()
        return reached

    # ---- a bad file met after training started: nothing trained is lost -----------------------------------
    def bad_ahead(self, step: int) -> bool:
        """Whether this rank's reader met a bad file in a batch the run will need after step ``step``, asked before
        the step's sync (gems.rank.loop._StepContext): the batch after it, or the one after that where the step's
        figures are read a step late (a graphed step: the next is queued before they are read). Every rank then
        stops after the same step, with its checkpoint and model file (:meth:`stop_on_bad_data`). A one-rank run
        stops where the read fails (:meth:`one_step`); with ``data.prefetch`` under what is needed, no reader runs
        that far ahead and a bad file ends the run where a rank reads it, as a failed rank does."""
        if self.world.size == 1:
            return False
        if self.bad_data is None:
            self.bad_data = self.prefetch.failed_ahead(step, 2 if self.par.graph is not None else 1)
        return self.bad_data is not None and isinstance(self.bad_data, ConfigError)

    def stop_on_bad_data(self, step: int, during: str = "training") -> None:
        """A rank met a bad file (its :attr:`bad_data`) and every rank is here, before step ``step``: the run keeps
        what it trained (a checkpoint of its state before ``step``, the trained model file), rank 0 writes the
        failed record saying which step it reached and which file stopped it, and every rank raises the file's
        ConfigError (exit 2). The same command, once the file is mended, resumes from the checkpoint
        (gems.prepare.resume_stopped); ``during``: training or validation."""
        world, h = self.world, self.history
        error, found = self.agreed_error()
        key = error.key if isinstance(error, ConfigError) else None
        progress.mark("checkpoint")
        self.settle_history()
        self.saver.save(step, self.hold, h, wait=True)
        self.saver.finish()
        model_file = self.export()
        folder = ckpt.ckpt_dir(self.cfg) / f"step{step:08d}"
        message = (f"{error} (met by rank {found} during {during} after step {step}: the run stopped there and kept "
                   f"its checkpoint, {folder}, and its trained model, {model_file}; mend the file and run the same "
                   "command again to resume from the checkpoint)")
        if world.rank == 0:
            record = rec.failed_record(self.cfg, message, failure={
                "kind": "bad_data", "exception": type(error).__name__, "rank": found, "step": step, "during": during,
                "key": key, "checkpoint": str(folder)}, losses=h["losses"], restarts=self.restarts)
            record["model_file"] = str(model_file) if model_file is not None else None
            record["validation"] = h["validation"]
            write_once(rec.record_path(self.cfg), record)
        self.barrier()  # the record is there before any rank ends (the launcher reads it then)
        if isinstance(error, ConfigError):
            raise ConfigError(error.key, error.value, f"{error.expected} (the run stopped after step {step}, its "
                              "checkpoint and trained model kept: mend the file and run the same command again)")
        raise error

    def agreed_error(self) -> tuple[Exception, int]:
        """(the bad file's error, the rank that met it), the same on every rank: the first rank's that met one (its
        :attr:`bad_data`), gathered from every rank (one collective; every rank is here)."""
        import torch.distributed as dist

        mine = self.bad_data
        said = None if mine is None else ((mine.key, mine.value, mine.expected) if isinstance(mine, ConfigError)
                                          else (None, None, str(mine)))
        gathered: list[Any] = [said]
        if self.world.size > 1:
            gathered = [None] * self.world.size
            dist.all_gather_object(gathered, said)
        found = next((r for r, g in enumerate(gathered) if g is not None), 0)
        key, value, expected = gathered[found] or ("data.path", None, "readable files")
        return (ConfigError(key, value, expected) if key is not None else RunError(expected)), found

    # ---- evaluation --------------------------------------------------------------------------------------------
    def evaluation_due(self, step: int) -> bool:
        """After every ``train.eval_every`` steps (with epochs: once an epoch by default) and after the last."""
        if self.val is None:
            return False
        done = step + 1
        return done == self.steps or (self.eval_every > 0 and done % self.eval_every == 0)

    def evaluate(self, step: int) -> bool:
        """Forward only over the validation set on this mesh, the replicas sharing its batches, the metric summed
        over every rank (gems.rank.loss.Metric); kept in the record, out of the step times. True when the run's
        target is reached."""
        progress.mark("evaluate", step)
        epochs_done = self.sampler.epoch_of(step + 1)
        self.mlperf.evaluation(epochs_done, None, start=True)
        t0 = time.perf_counter()
        figures, recalibrated = self.measure()
        if figures is None:  # a bad validation file: the training is kept (its checkpoint and model), then it stops
            self.settle_history()
            self.stop_on_bad_data(step + 1, during="validation")
        assert figures is not None
        entry = {"step": step + 1, "epoch": round(self.sampler.epoch_of(step + 1), 6), **figures,
                 "seconds": time.perf_counter() - t0}
        if self.cfg.train.bn_recalibrate:
            entry["bn_recalibrate_batches"] = recalibrated  # what was used: the setting, or the set's whole batches
        self.history["validation"].append(entry)
        self.mlperf.evaluation(epochs_done, figures.get(str(self.cfg.train.target_metric)), start=False)
        if self.world.rank == 0:
            shown = described(figures, class_names(self.val, self.par.metric))
            print(f"gems: validation after step {step + 1}: {shown}", flush=True)
        return self.target_reached(entry)

    def measure(self) -> tuple[dict[str, Any] | None, int]:
        """The validation set's figures on this mesh (every rank takes part; the same on every rank), and how many
        batches recalibrated BatchNorm first. A bad validation file on any rank: no figures (None; the rank that met
        it keeps its error in :attr:`bad_data`). That rank evaluates a training batch in its place, whose figures
        count nowhere, so that every rank's collectives still meet, and the world's sum carries whether any rank
        met one."""
        import torch.distributed as dist

        par, B, dev = self.par, self.B, self.world.device
        total = torch.zeros(par.metric.size, dtype=torch.float64, device=dev)
        assert self.val is not None
        with self.ema.swapped() if self.ema is not None else contextlib.nullcontext():  # train.ema's weights
            recalibrated = self.recalibrate()
            bad = False
            for k in range(evaluation_batches(self.val, B)):  # batches of the training batch (data.py: the last)
                ids = share(list(range(k * B, (k + 1) * B)), self.R, self.coord.replica)
                want = dict(want_input=par.needs_input, want_target=par.needs_target)
                try:
                    x, y = self.val.batch(ids, par.input_slices, **want)
                except ConfigError as e:  # a bad file: a training batch in its place, its figures counting nowhere
                    self.bad_data, bad = self.bad_data or e, True
                    x, y = self.data.batch(share(list(range(B)), self.R, self.coord.replica), par.input_slices, **want)
                got = par.evaluate(x.to(dev) if x is not None else None, y.to(dev) if y is not None else None, ids)
                if got is not None:
                    total += got
        total = torch.cat([total, torch.full((1,), float(bad), dtype=torch.float64, device=dev)])
        if self.world.size > 1:
            dist.all_reduce(total)
        values = total.tolist()  # (one read of the device: the figures and the bad-file flag together)
        if values[-1] > 0:
            return None, recalibrated
        return par.metric.report(values[:-1]), recalibrated

    def recalibrate(self) -> int:
        """``train.bn_recalibrate``: BatchNorm's running statistics recomputed from that many batches of the
        training set (all its whole batches if it holds fewer; the number used is returned, and said once when
        it is fewer) in its order (gems.layers.recalibrating), forward only on this mesh as in training (spatial
        parts share their statistics, pipeline micro-batches and replicas have their own, as their steps do),
        then averaged over the copies of each layer like training's; part of the evaluation's time."""
        par, B, dev = self.par, self.B, self.world.device
        asked = int(self.cfg.train.bn_recalibrate)
        n = min(asked, len(self.data) // B)
        if n < asked and self.world.rank == 0 and not self.history["validation"]:
            print(f"gems: train.bn_recalibrate={asked}: the training set holds {n} whole batches of "
                  f"{B}; recalibrating from those", flush=True)
        if not n:
            return 0
        with recalibrating(par.modules):
            for k in range(n):
                ids = share(list(range(k * B, (k + 1) * B)), self.R, self.coord.replica)
                x, y = self.data.batch(ids, par.input_slices, want_input=par.needs_input, want_target=par.needs_target)
                par.evaluate(x.to(dev) if x is not None else None, y.to(dev) if y is not None else None, ids,
                             batch_statistics=True)
        if self.buffers:
            average_buffers(self.buffers, self.mesh.group("grad"), len(self.mesh.ranks("grad")))
        return n

    def target_reached(self, entry: dict[str, Any]) -> bool:
        """Whether an evaluation reached ``train.target_mae`` (on ``train.target_metric``); the first that does
        records the time to it (from the first step, evaluations included, as MLPerf counts it)."""
        t = self.cfg.train
        if t.target_mae is None or self.history.get("target"):
            return False
        value = entry.get(t.target_metric)
        if value is None:
            return False
        if value >= float(t.target_mae) if t.target_metric == "accuracy" else value <= float(t.target_mae):
            self.history["target"] = {"step": entry["step"], "epoch": entry["epoch"], "value": value,
                                      "time_to_target_s": self.elapsed()}
            return True
        return False

    def compute(self, step: int, ids: list[int], x: Any, y: Any, profiling: bool) -> torch.Tensor:
        """The step's forward, backward, sync and update: under the profiler (``train.profile``), profiled for
        tensor memory (CPU ranks, before ``measure_from``), or plain; its figures on the device (not read)."""
        context, par = self.context, self.par
        if profiling:
            return _profiled(self.cfg, self.world, lambda: context.step(x, y, ids, step, quiesce=True))
        if step < self.profiled_to and self.world.device.type == "cpu":
            # the tensor memory a GPU would count (gems/memory.py); the largest over these steps
            held = persistent_bytes(par.params, self.opt, [b for m in par.modules for b in m.buffers()] +
                                    (self.ema.average if self.ema is not None else []) +  # train.ema's copy
                                    [t for t in (x, y) if t is not None])  # the batch: read before the step
            box: list[torch.Tensor] = []
            self.history["tensor_peaks"].append(held + step_peak_bytes(
                lambda: box.append(context.step(x, y, ids, step, quiesce=True))))
            return box[0]
        return context.step(x, y, ids, step)

    def hold_to_cap(self, step: int) -> None:
        """CPU ranks under ``cluster.rank_memory_gb``, after the steps profiled for their tensors (every rank here
        at step ``step``): every rank's tensor peak gathered (one collective of every rank, the same on each), and
        where one went past the cap, rank 0 writes the failed record naming it and every rank stops
        (:class:`OverMemoryCap`). A GPU rank's allocator holds to the cap itself (gems.memory.limit_gpu)."""
        import torch.distributed as dist

        cap = rank_cap_bytes(self.cfg)
        if cap is None:
            return
        peaks = torch.zeros(self.world.size, dtype=torch.float64, device=self.world.device)
        peaks[self.world.rank] = float(max(self.history["tensor_peaks"], default=0))
        if self.world.size > 1:
            dist.all_reduce(peaks)
        over = over_cap(cap, [int(v) for v in peaks.tolist()])
        if over is None:
            return
        rank, peak = over
        gib = 2.0 ** 30
        msg = (f"rank {rank}'s tensors took {peak / gib:.3f} GiB in the steps profiled for them (to step {step}), "
               f"past cluster.rank_memory_gb={float(self.cfg.cluster.rank_memory_gb):g}: a device of that memory "
               "would have run out (gems plan parallel=auto finds a mesh that fits it)")
        if self.world.rank == 0:
            write_once(rec.record_path(self.cfg), rec.failed_record(
                self.cfg, msg, failure={"kind": "memory", "rank": rank, "step": step, "tensor_peak_bytes": peak,
                                        "cap_bytes": cap}, losses=self.history["losses"], restarts=self.restarts))
        self.barrier()  # the record is there before any rank ends (the launcher reads it then)
        raise OverMemoryCap(msg)

    def check_loss(self, step: int, loss: float, first_bad: int | None | bool = False) -> None:
        """Keep the step's global loss; a non-finite one stops every rank or is warned about (train.on_nonfinite).
        ``first_bad``: where this rank first saw a non-finite value in that step, where the step's figures say
        (a graphed step's; False: ask the composition, whose flags are the last step's)."""
        self.history["losses"].append(loss)
        if math.isfinite(loss):
            return
        self.history["nonfinite_steps"].append(step)
        if str(self.cfg.train.on_nonfinite) == "stop":
            self.context.stop_nonfinite(step, loss, self.history["losses"], self.restarts, first_bad)
        elif self.world.rank == 0:
            print(f"gems: warning: the loss of step {step} is {loss} (train.on_nonfinite=warn: training goes on; "
                  f"the record says so)", file=sys.stderr, flush=True)

    def terms(self) -> dict[str, float]:
        """The step's timed terms, read (and reset) now: its waits on the host's clock, or CUDA events settled."""
        par = self.par
        t = timers.snapshot()
        extra = par.stats()  # read every step, so warm-up time is not carried into measured steps
        out = {k: t.get(k, 0.0) + extra.get(k, 0.0) for k in ("halo", "pipeline_comm", "bubble_or_wait")}
        out["allreduce"] = par.reducer.wait_s
        return out

    def account(self, step: int, dt: float, t_data: float, measured: bool,
                terms: dict[str, float] | None = None) -> None:
        """The step's time and its terms (only measured steps count; every step's time is kept); ``terms`` taken
        when the step was queued (a step read late), else now."""
        par, h = self.par, self.history
        terms = self.terms() if terms is None else terms
        if par.transfers is not None:  # the measured steps' message times, split against the senders' at the end
            if measured:
                self.run_sent.update(par.transfers.sent)
                self.run_received.update(par.transfers.received)
            par.transfers.sent.clear()
            par.transfers.received.clear()
        h["every_step_time"].append(dt)
        if not measured:
            return
        h["step_times"].append(dt)
        bd = h["breakdown"]
        bd["data"] += t_data
        for k, v in terms.items():
            bd[k] += v

    # ---- the record --------------------------------------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        """The run's record (complete on rank 0): step times and terms, memory and hosts of every rank."""
        h, world, par = self.history, self.world, self.par
        step_times, breakdown = h["step_times"], h["breakdown"]
        measured = len(step_times)
        seen = h["tensor_peaks"]
        tensor_peak = max(seen) if seen else None
        for k in breakdown:
            breakdown[k] /= max(1, measured)
        peaks, hosts, tensor_peaks, machines, times, requested = self.gather(tensor_peak, measured)  # splits waits
        # compute is what is left of this rank's median step after its measured terms; the record's step is the
        # slowest rank's (a step ends when its slowest rank ends), and the time this rank waits beyond its own
        # step for the slowest one is a wait: the terms sum to the recorded median
        here = statistics.median(step_times) if step_times else 0.0  # (a run that met its target at once)
        slowest = statistics.median(times) if times else 0.0
        breakdown["compute"] = max(0.0, here - sum(v for k, v in breakdown.items() if k != "compute"))
        breakdown["bubble_or_wait"] += max(0.0, slowest - sum(breakdown.values()))
        record = rec.build_record(
            self.cfg, world, self.mesh, losses=h["losses"], step_times=times,
            global_batch=par.samples_per_step * self.R,  # the whole global batch (every replica line trains B/R)
            breakdown=breakdown, peaks=peaks, hosts=hosts, wall_s=time.time() - self.t_start, restarts=self.restarts,
            tensor_peaks=tensor_peaks if all(t is not None for t in tensor_peaks) else None, balance=par.balance,
            machines=machines,
        )
        asked = [r[0] for r in requested if r[0] is not None]
        if asked and len(asked) == len(requested):  # GPU ranks: what the tensors asked for, beside what CUDA counted
            record["peak_memory_bytes"].update(cuda_requested_max=max(asked), cuda_requested_per_rank=asked)
        held = [r[1] for r in requested if r[1] is not None]
        if held and len(held) == len(requested):  # and what the allocator held (a graph's pool too)
            record["peak_memory_bytes"].update(cuda_reserved_max=max(held), cuda_reserved_per_rank=held)
        record["host_memory"] = self.host_memory.summary
        record["step_time_s"]["every"] = h["every_step_time"]  # every step's time, warm-up and profiled ones too
        traced = bool(self.cfg.train.profile) and self.steps - self.measure_from > 1  # its trace step is left out too
        record["step_time_s"]["measured_from"] = self.measure_from + int(traced)
        if seen:
            record["peak_memory_bytes"]["tensor_steps"] = list(range(min(self.profiled_to, len(seen))))
        notes = list(par.notes) + self.notes(measured) + ([self.staged.note()] if self.staged else [])
        notes += data_notes(self.cfg, self.data)  # the files' layout, the readers' cap, a slow path taken
        # the step replayed from a CUDA graph, or a pipeline's pieces from theirs
        replayed = any(g is not None and g.replayed for g in (par.graph, par.pieces))
        if replayed:  # what the replay covers, and what stays eager around it
            notes.append(graphed_note(par, self.mesh.spatial > 1))
        if notes:
            record["notes"] = notes
        if par.scaler.enabled:
            record["loss_scale"] = par.scaler.summary()
        if self.saver.saves:  # how long checkpoints held the steps (an async save: the copy to host memory only)
            record["checkpoint"] = {"saves": self.saver.saves, "held_s": self.saver.held_s,
                                    "held_s_per_save": self.saver.held_s / self.saver.saves,
                                    "async": self.saver.asynchronous}
        if self.resumed is not None:
            record["resumed_from"] = self.resumed
            if not self.resumed["exact"]:
                notes.append(f"resumed from a checkpoint of global batch {self.resumed['global_batch']} at batch "
                             f"{self.cfg.train.batch_size}: the steps after it are not those of one uninterrupted run")
                record["notes"] = notes
        if h["nonfinite_steps"]:
            record["diverged"] = True
            record["nonfinite_steps"] = list(h["nonfinite_steps"])
        record.update(self.training_figures())
        names = class_names(self.val if self.val is not None else self.data, par.metric)
        if names:
            record["classes"] = names  # the Dice columns' names, by label (gems.results.table)
        record["cuda_graphs"] = replayed
        if self.cfg.parallel.get("chosen"):  # parallel=auto: the mesh was chosen by gems plan's search
            from omegaconf import OmegaConf

            record["chosen"] = OmegaConf.to_container(self.cfg.parallel.chosen, resolve=True)
        if "device_ops" in h:  # what the last untimed step launched outside a replay (gems.rank.graphs.DeviceOps)
            record["device_ops"] = h["device_ops"]
        return record

    def training_figures(self) -> dict[str, Any]:
        """What the record keeps of training to a result: the learning rate of every step, the evaluations, the
        reader's own time, and the target (reached or not, and when)."""
        h, t = self.history, self.cfg.train
        ran = max(1, len(h["losses"]))
        out: dict[str, Any] = {"lr": list(h["lrs"]), "validation": list(h["validation"]),
                               "data_reader_s": float(h["reader_s"]) / ran, "steps_planned": self.steps,
                               "epochs": t.epochs, "steps_per_epoch": self.sampler.steps_per_epoch}
        if t.target_mae is not None:
            hit = h.get("target")
            out["target"] = {"metric": t.target_metric, "value": float(t.target_mae), "reached": bool(hit),
                             **(hit or {})}
            out["time_to_target_s"] = hit["time_to_target_s"] if hit else None
            out["epochs_to_target"] = hit["epoch"] if hit else None
        return out

    def gather(self, tensor_peak: int | None, measured: int) -> tuple[list[int], list[str], list[Any], list[str],
                                                                         list[float], list[tuple[int | None, int | None]]]:
        """Every rank's peak memory, host and tensor peak, the step times as the slowest rank took them, rank 0's
        pipeline waits split against every rank's send times (the planner's pipeline_comm), and every rank's peak
        of requested bytes and of reserved ones (GPU ranks; None on CPU)."""
        import torch.distributed as dist

        world, bd = self.world, self.history["breakdown"]
        peak, requested = self.meter.peak(), (self.meter.requested_peak(), self.meter.reserved_peak())
        times = torch.tensor(self.history["step_times"], dtype=torch.float64, device=world.device)  # NCCL: on device
        if world.size == 1:
            return [peak], [world.hostname], [tensor_peak], [socket.gethostname()], times.tolist(), [requested]
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank ends
        gathered: list[Any] = [None] * world.size
        dist.all_gather_object(gathered, (world.hostname, peak, tensor_peak, socket.gethostname(), self.run_sent,
                                          requested))
        if self.run_received:
            everyone: dict[tuple[int, ...], float] = {}
            for g in gathered:
                everyone.update(g[4])
            transfer, _ = split_waits(self.run_received, everyone)
            bd["pipeline_comm"] += transfer / max(1, measured)
            bd["bubble_or_wait"] = max(0.0, bd["bubble_or_wait"] - transfer / max(1, measured))
        return ([int(g[1]) for g in gathered], [g[0] for g in gathered], [g[2] for g in gathered],
                [g[3] for g in gathered], times.tolist(), [g[5] for g in gathered])

    def notes(self, measured: int) -> list[str]:
        """What the record should say about how its figures were measured."""
        out = []
        warm, start = self.warm, self.profiled_to
        if (self.par.graph is not None or self.par.pieces is not None) and self.measure_from > max(warm, start):
            out.append(f"step(s) {max(warm, start, self.start)}-{self.measure_from - 1} ran the graph's eager step(s), "
                       "its capture and a replay whose device ops were counted (gems.rank.graphs) and were left out "
                       "of the timings")
        if self.par.first_step_connects and warm == 0 and start >= 1:
            out.append("step 0 made the pipeline's first exchanges at the sizes of its messages (the cut shapes "
                       "are learnt from headers where partitions cannot be traced) and was left out of the timings")
        if start > warm:
            after = " (after the first optimizer step, so the optimizer's state counts)" if start >= 2 else ""
            out.append(f"step(s) {warm}-{start - 1} were profiled for tensor memory{after} and left out of the "
                       "timings; train.warmup_steps>=2 makes them warm-up steps")
        if self.world.device.type == "cpu" and 0 < start < 2:
            out.append("the tensor memory was measured on step 0 only, before the optimizer's state exists: it "
                       "leaves that state out; train.steps>=3 profiles a step after the first update too")
        if measured < 3:
            out.append(f"the throughput rests on {measured} measured step(s) (train.steps - train.warmup_steps"
                       f"{' - the profiled ones' if self.measure_from > warm else ''}): one step's time is one sample of a "
                       "noisy machine; 3 or more give a median worth comparing")
            if self.world.rank == 0:
                print(f"gems: warning: {out[-1]}", file=sys.stderr, flush=True)
        return out


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
        self.decided = True
        peak = peak_rss_bytes()  # since the meter's reset before the rank's set-up: the model, the data, a step
        kept = keeps_host_memory_within(peak, self.budget, self.ranks)
        if kept:
            keep_host_memory()
        self.summary.update(kept=kept, first_step_peak_rss=peak, node_budget=self.budget, ranks_on_node=self.ranks)
        if not kept and rank == 0:
            print(f"gems: train.host_memory=auto: freed host memory is released (glibc's defaults): {self.ranks} "
                  f"rank(s) x {peak / 2**30:.2f} GiB x {KEEP_GROWTH} would not fit in "
                  f"{(self.budget or 0) / 2**30:.1f} GiB", file=sys.stderr, flush=True)


def _profiled(cfg: DictConfig, world: World, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
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
        self.stop_on_nonfinite = str(cfg.train.on_nonfinite) == "stop"
        #: whether this rank met a bad file in a batch ahead (Run.bad_ahead)
        self.bad_ahead: Callable[[int], bool] = lambda step: False
        self.verdict = False  # whether the last step's figures end with fp16's verdict (gems.precision.LossScaler)

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int], step: int,
             quiesce: bool = False) -> torch.Tensor:
        """The step's figures on the device, not read (gems.rank.sync: the global loss, whether any rank asked to
        stop for a checkpoint, and a graphed step's finiteness flags); ``quiesce``: the step ends with none of
        this rank's messages in flight (a step run under the profiler).

        Nothing here waits for the device (fp16 decides whether the update runs on the device, its fused kernel
        handed the world's overflow verdict, which travels with the figures; only a step that makes the
        optimizer's state reads it at once: gems.precision.LossScaler.step_late): the loop reads the figures after
        the optimizer's update is queued, a graphed
        run's during the next step. A non-finite loss is known only then: with ``train.on_nonfinite=stop`` the
        run stops after that update (and a graphed run after the next step's), which nothing saves (checkpoints
        are written only after finite steps, read at once)."""
        par = self.par
        if par.synced_step is not None:  # a graphed step: its sync is inside it (gems.rank.compose)
            stop = self.stop(step)
            with progress.waiting("step sync"):
                figures = par.synced_step(x, y, ids, step, stop)
        else:
            local = par.step(x, y, ids, step)  # this rank's weighted loss, on its device (not read)
            if quiesce:
                par.quiesce()
            stop = self.stop(step)  # (asked after the backward: the reader had the step to make the next batch)
            with progress.waiting("step sync"):
                figures = step_sync(local, stop, self.world)
        progress.mark("optimizer")
        verdict = None
        if not par.optimizer_in_step:  # fp16: unscaled after the sum; skipped where any rank overflowed, decided on
            verdict = par.scaler.step_late(self.opt, step)  # the device after the first step (read with the figures)
        self.opt.zero_grad(set_to_none=True)
        self.verdict = verdict is not None
        return figures if verdict is None else torch.cat([figures, verdict])

    def stop(self, step: int) -> int:
        """This rank's stop flag in the step's sync (summed over the ranks): 1 for a checkpoint before the time
        limit or a preemption, :data:`BAD_DATA` more for a bad file met ahead (Run.bad_ahead)."""
        return int(ckpt.stop_requested()) + (BAD_DATA if self.bad_ahead(step) else 0)

    def stop_nonfinite(self, step: int, loss: float, losses: list[float], restarts: int,
                       first_bad: int | None | bool = False) -> None:
        """Every rank is here at the same step: find where the first non-finite value appeared, have rank 0
        write the failed record, and stop. ``first_bad``: this rank's position where the step's figures give it
        (False: the composition's flags)."""
        pos = self.par.first_nonfinite() if first_bad is False else first_bad
        where, failure = _locate_nonfinite(pos, self.world, self.mesh, step, self.B, self.R)
        msg = (f"the loss of step {step} is {loss} (train.on_nonfinite=stop); the first non-finite value was in "
               f"{where}")
        if self.world.rank == 0:
            failure.update(kind="nonfinite", step=step, loss=str(loss))
            record = rec.failed_record(self.cfg, msg, failure=failure, losses=losses, restarts=restarts)
            record["nonfinite_steps"] = [step]
            write_once(rec.record_path(self.cfg), record)
        raise NonFiniteLoss(msg)


def graphed_note(par: Parallel, spatial: bool = False) -> str:
    """What the record of a graphed run says the replay covered, and what ran around it (``spatial``: a spatial
    part's step, its halo exchanges captured in the graph: train.graph_spatial)."""
    from gems.rank.graphs import EAGER_STEPS, GRAPHED_NOTE, PIECES_NOTE

    if par.graph is None:
        return PIECES_NOTE
    return GRAPHED_NOTE.format(eager=EAGER_STEPS, halos=" with its halo exchanges (train.graph_spatial)" if spatial else "",
                               optimizer="" if par.optimizer_in_step else "the optimizer's update (one fused kernel), ")


def _took(done: _Done, dt: float, now: float) -> float:
    """What step ``done`` took, for the watchdog's allowance: a step read at once, its wall time on the host; one
    read late (a graphed step), the longer of the device's span ``dt`` and the host's time to queue it (the host's
    alone is its launches, about a millisecond, where the device may take far longer)."""
    return max(dt, done.host_s) if done.deferred else now - done.begun


def _first_bad(values: list[float]) -> int | None | bool:
    """Where a graphed step's figures say this rank first saw a non-finite value (0 its input, 1 its output, None
    neither); False where the figures hold no flags (the composition's are asked)."""
    if len(values) < 4:
        return False
    return 0 if values[2] < 1 else 1 if values[3] < 1 else None


def _event() -> Any:
    """A timing event recorded now on the current CUDA stream."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _locate_nonfinite(pos: int | None, world: World, mesh: Mesh, step: int, B: int,
                      R: int) -> tuple[str, dict[str, Any]]:
    """Where the first non-finite value of this step appeared: the earliest position (input, then the
    output of each pipeline partition, then the loss; ``pos``: this rank's first) and, there, the lowest rank.
    A collective."""
    D = max(1, mesh.pipeline)
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


def write_once(path: Any, record: dict[str, Any]) -> None:
    try:
        rec.write_record(path, record)
    except FileExistsError:  # a record is never replaced
        pass


def _preempt(world: World, step: int, saver: ckpt.Saver, hold: ckpt.Holding, history: dict[str, Any],
             wd: Watchdog | None, why: str, staged: Staged | None = None) -> None:
    """Save before ``step`` (complete before it returns), then stop as a preempted job does; Slurm or the local
    launcher resumes it (the node's staged copies removed: the job may resume on other nodes)."""
    progress.mark("checkpoint")
    saver.save(step, hold, history, wait=True)
    if staged is not None:
        staged.discard(world)
    if world.rank == 0:
        print(f"gems: {why} (checkpoint before step {step})", file=sys.stderr, flush=True)
    # its CUDA graphs released, as every way a rank ends does (gems.capture; gems.worker.end_rank): the watchdog
    # still watches the device's queue
    capture.release(world.device, waiting=lambda: progress.waiting("gpu queue"))
    if wd is not None:
        wd.stop()  # waiting to be ended is no stall
    if world.source == "slurm" or os.environ.get("SLURM_JOB_ID"):
        if world.rank == 0 and not ckpt.request_requeue():
            raise RuntimeError("`scontrol requeue` failed: the checkpoint is saved, but the job was not requeued")
        time.sleep(600)  # Slurm ends every task of a requeued job; this never returns in practice
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(ckpt.PREEMPTED_EXIT)


def deterministic() -> None:
    """train.deterministic: cuDNN's deterministic kernels and no benchmark's choice, torch's deterministic
    algorithms where it has them (a warning where it has none), cuBLAS's workspace fixed (before its first use)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _sync(device: torch.device) -> None:
    """Wait for the GPU's queue (the step's kernels and NCCL's communication): a hang on the GPU shows as this
    wait in a stall report, not as whatever the host last marked."""
    if device.type == "cuda":
        with progress.waiting("gpu queue"):
            torch.cuda.synchronize(device)


