"""A rank's training loop: for each step of the plan, its batch, the step, and the hooks on its result."""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from gems import checkpoint as ckpt
from gems import progress, timers
from gems.bootstrap import World
from gems.config import section
from gems.errors import ConfigError
from gems.fault import inject
from gems.fault.watchdog import Watchdog
from gems.memory import persistent_bytes, step_peak_bytes
from gems.models import build_model
from gems.pipeline.runtime import split_waits
from gems.rank import hooks
from gems.rank.data import Prefetcher, class_names, data_notes, finisher, step_batch, unstage
from gems.rank.hooks import StepResult, Stop
from gems.rank.hooks.faults import NonFiniteLoss, OverMemoryCap, Stopped
from gems.rank.hooks.preemption import preempt
from gems.rank.setup import RankState, set_up
from gems.rank.sync import Posted, Readout, StepFigures, stop_request, with_verdict
from gems.replication import average_buffers
from gems.results import record as rec
from gems.results.recorder import Recorder

__all__ = ["Loop", "NonFiniteLoss", "OverMemoryCap", "Stopped", "train", "write_once"]


def train(cfg: DictConfig, world: World, wd: Watchdog | None = None) -> dict[str, Any]:
    """Train on this rank; returns the record (complete on rank 0)."""
    return Loop(set_up(cfg, world, wd)).run()


@dataclass
class Queued:
    """A step whose work is queued, its figures not yet read (a graphed run reads them during the next step)."""

    step: int
    begun: float  # the step's start on the host (the stall allowance)
    t0: float  # after any stop at its start: its timed span starts here
    data_s: float
    posted: Posted
    verdict: bool  # its figures end with fp16's overflow verdict, decided on the device
    start: Any = None  # a GPU rank's event at t0, where its time is read late (the device's span, not the host's)
    host_s: float = 0.0  # the host's time from t0 to the step's end (a CPU rank's step is done when queued)
    terms: dict[str, float] | None = None  # its timed terms, taken when it was queued (read late)
    deferred: bool = False


class Loop:
    """One rank's run of its steps (:meth:`run`) on the state :func:`gems.rank.setup.set_up` made."""

    def __init__(self, state: RankState) -> None:
        self.state = state
        self.recorder = Recorder(state.history)
        self.readout = Readout(state.world.device)  # the steps' figures, copied to the host (gems.rank.sync)
        self.pending: Queued | None = None  # a step queued whose figures are read during the next one
        self.stopping = False  # a step read late asked to stop: the one queued since is read at once
        self.prefetch: Any = None
        self.bad = hooks.BadData(self)
        # in this order on every rank: the hooks' collectives meet
        self.hooks: list[Any] = [
            state.host_memory, hooks.NonFinite(self), hooks.MemoryCap(self), hooks.StepLine(self),
            hooks.PipelineRounds(self), self.bad, hooks.Preemption(self), hooks.MLPerfEpochs(self),
            hooks.FaultInjection(self), hooks.Evaluation(self, self.bad), hooks.Checkpoints(self)]

    # ---- the loop ------------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        s = self.state
        timers.reset()
        self.recorder.begin()
        self.prefetch = Prefetcher(self.fetch, range(s.plan.start, s.plan.steps), int(s.cfg.data.prefetch),
                                   s.world.device, self.finisher())
        s.mlperf.run_start()
        try:
            for step in range(s.plan.start, s.plan.steps):
                with self.counting(step):
                    if self.one_step(step):
                        break  # the target reached: every rank evaluated the same figures
            self.drain()
            s.mlperf.run_stop(reached=bool(self.recorder.history.get("target")))
        except BaseException:
            if s.staged is not None:  # a failure: the node's copies go with it (the others stop too)
                s.staged.discard(s.world)
            raise
        finally:
            s.mlperf.pause()  # stopped to be requeued, or failed: the next job appends
            self.prefetch.close()
            self.recorder.history["reader_s"] += self.prefetch.reader_s
        progress.mark("record")
        s.saver.finish()  # an async checkpoint still being written: complete, and latest moved to it
        model_file = self.export()
        record = self.record()
        if model_file is not None:
            record["model_file"] = str(model_file)
        unstage(s.staged, s.world, self.barrier)
        return record

    def one_step(self, step: int) -> bool:
        """Step ``step``, and the hooks on it; True when the run is done (its target reached). A graphed run reads a
        step's figures during the next step, once that one's work is queued; at once where they are needed."""
        s = self.state
        progress.mark("data", step)
        begun = time.perf_counter()  # the whole step's wall time, for the stall allowance
        for hook in self.hooks:
            self.stop(hook.before_step(step))
        t0 = time.perf_counter()
        late = s.stepper.graph is not None  # a graphed run's figures are read late: its span timed by events
        start = _event() if late and s.world.device.type == "cuda" else None
        try:
            (ids, x, y), data_s = self.prefetch.get(step)  # data_s: the exposed data time
        except ConfigError as e:  # a bad file: where this rank alone trains, nothing else need agree to keep it all
            if s.world.size > 1:
                raise  # (the ranks agree before the batch is needed where a reader runs ahead: BadData.ahead)
            self.drain()
            self.bad.met = e
            self.stop(self.bad.stop(step))
        x = inject.poison(s.fault, s.world.rank, step, x)
        self.recorder.history["lrs"].append(s.lr.apply(s.opt, step))
        timers.reset()
        figures, verdict = self.profiled_step(step, ids, x, y)
        data_s += self.prefetch.peek_s  # the wait for a batch ahead (BadData.ahead): data time too
        self.prefetch.peek_s = 0.0
        queued = Queued(step, begun, t0, data_s, self.readout.post(figures), verdict, start)
        done = False
        if self.pending is not None:  # the step before: its work is done or under way behind this one's
            previous, self.pending = self.pending, None
            done = self.after(previous)
        if late and not (self.stopping or done or s.plan.reads_now(step) or timers.pending()):
            queued.host_s, queued.terms, queued.deferred = time.perf_counter() - t0, self.terms(), True
            self.pending = queued
            s.saver.poll()
            return False
        return self.after(queued) or done

    def train_step(self, step: int, ids: list[int], x: Any, y: Any, quiesce: bool = False) -> tuple[torch.Tensor, bool]:
        """The step: the stepper's forward, backward, gradient sums and sync, then the optimizer's update, the
        weights' average and the floating buffers averaged over the copies. Its figures stay on the device (fp16's
        verdict last where the device decided the update: the bool), read after it (:meth:`after`)."""
        s = self.state
        figures = s.stepper.step(x, y, ids, step, stop=lambda: self.stop_request(step), quiesce=quiesce)
        progress.mark("optimizer")
        verdict = None
        if not s.stepper.optimizer_in_step:  # fp16: unscaled after the sum; skipped where any rank overflowed
            verdict = s.stepper.scaler.step_late(s.opt, step)
        s.opt.zero_grad(set_to_none=True)
        return with_verdict(figures, verdict), verdict is not None

    def after_update(self, step: int) -> None:
        s = self.state
        if s.ema is not None:
            s.ema.update(step)
        if s.buffers and not s.stepper.averages_buffers:  # BatchNorm's statistics averaged over the copies
            with progress.waiting("gradient sum"):
                average_buffers(s.buffers, s.mesh.group("grad"), len(s.mesh.ranks("grad")))

    def after(self, queued: Queued) -> bool:
        """Read step ``queued``'s figures (waiting for its work where it is not done), then its hooks; True when the
        run is done."""
        result = self.read(queued)
        done = False
        for hook in self.hooks:
            stop = hook.after_step(result)
            done = self.stop(stop) or done
        return done

    # ---- around the step --------------------------------------------------------------------------------------
    def finisher(self) -> Any:
        """What finishes a fetched input on the rank's device (read counts transformed), or None where
        :meth:`fetch` gives finished ones."""
        return finisher(self.state.data)

    def fetch(self, step: int) -> tuple[list[int], Any, Any]:
        """Step ``step``'s sample ids, this rank's input part and targets, on the host (the reader's work): read
        inputs as their counts where :meth:`finisher` finishes them."""
        s = self.state
        return step_batch(s.data, s.stepper, step, s.B, s.R, s.coord.replica, s.sampler,
                          raw=self.finisher() is not None)

    def stop_request(self, step: int) -> int:
        """This rank's stop request in step ``step``'s sync: a checkpoint before the time limit, a bad file ahead."""
        return stop_request(ckpt.stop_requested(), self.bad.ahead(step))

    def profiled_step(self, step: int, ids: list[int], x: Any, y: Any) -> tuple[torch.Tensor, bool]:
        """:meth:`train_step` under torch's profiler (``train.profile``), profiled for tensor memory (CPU ranks,
        before the measured steps), or plain."""
        s = self.state
        if step == s.plan.traced_at:
            out = _profiled(s.cfg, s.world, lambda: self.train_step(step, ids, x, y, quiesce=True))
        elif s.plan.profiles_memory(step):  # the tensor memory a GPU would count (gems/memory.py): the largest
            held = persistent_bytes(s.stepper.params, s.opt, [b for m in s.stepper.modules for b in m.buffers()] +
                                    (s.ema.average if s.ema is not None else []) +  # train.ema's copy
                                    [t for t in (x, y) if t is not None])  # the batch: read before the step
            box: list[tuple[torch.Tensor, bool]] = []
            self.recorder.history["tensor_peaks"].append(held + step_peak_bytes(
                lambda: box.append(self.train_step(step, ids, x, y, quiesce=True))))
            out = box[0]
        else:
            out = self.train_step(step, ids, x, y)
        self.after_update(step)
        return out

    def read(self, queued: Queued) -> StepResult:
        """Step ``queued``'s figures and time, the loss kept, fp16's scale settled, the watchdog told."""
        s, h, step = self.state, self.recorder.history, queued.step
        figures = StepFigures.read(self.readout.read(queued.posted), queued.verdict)
        scaler = s.stepper.scaler
        if figures.overflow is not None:  # fp16: the step's skip was decided on the device; the host's record now
            scaler.settle(step, figures.overflow)
        if scaler.enabled:
            h["loss_scale"] = scaler.state_dict()  # saved with every checkpoint
        if queued.start is not None and queued.posted.event is not None:  # the device's span of the step
            dt = queued.start.elapsed_time(queued.posted.event) / 1e3
        else:  # a CPU rank's step is done when queued; read at once, the read waited for its work
            dt = queued.host_s if queued.deferred else time.perf_counter() - queued.t0
        if s.wd is not None and step > s.plan.start:  # the stall allowance grows with the run's slowest step
            s.wd.saw_step(took(queued, dt, time.perf_counter()))
        timers.settle()  # on GPUs the communication waits were CUDA events: read them now (gems.timers)
        h["losses"].append(figures.loss)
        terms = queued.terms if queued.terms is not None else self.terms()
        return StepResult(step, figures, dt, queued.data_s, s.plan.measured(step), queued.deferred, terms)

    def terms(self) -> dict[str, float]:
        """The step's timed terms, read (and reset) now: its waits on the host's clock, or CUDA events settled."""
        s = self.state
        t = timers.snapshot()
        extra = s.stepper.stats()  # read every step, so warm-up time is not carried into measured steps
        out = {k: t.get(k, 0.0) + extra.get(k, 0.0) for k in ("halo", "pipeline_comm", "bubble_or_wait")}
        out["allreduce"] = s.stepper.reducer.wait_s
        return out

    def drain(self) -> None:
        """Read the step still pending (before a stop's save)."""
        if self.pending is not None:
            queued, self.pending = self.pending, None
            self.after(queued)

    @contextlib.contextmanager
    def counting(self, step: int) -> Any:
        """Around step ``step``: the device ops of the last step before the timed ones are counted
        (gems.rank.graphs.DeviceOps: what it launches outside a replay), for the record."""
        if step != self.state.plan.counted_at:
            yield
            return
        from gems.rank.graphs import DeviceOps

        with DeviceOps(self.state.world.device) as ops:
            yield
        self.recorder.history["device_ops"] = {"step": step, "per_step": ops.count,
                                               "ops": dict(sorted(ops.names.items()))}

    # ---- stopping ------------------------------------------------------------------------------------------------
    def stop(self, stop: Stop | None) -> bool:
        """What a hook's :class:`Stop` asks: True where the run is done; a requeue saves and ends the process; a
        failure has rank 0 write the failed record, then every rank raises (the launcher reads the record)."""
        if stop is None:
            return False
        if stop.kind == "done":
            return True
        s = self.state
        if stop.kind == "requeue":
            self.drain()
            self.settle()
            preempt(s, stop.before, self.recorder.history, stop.message)
        assert stop.error is not None
        if s.world.rank == 0:
            record = rec.failed_record(s.cfg, stop.message, failure=stop.failure, losses=self.recorder.history["losses"],
                                       restarts=s.restarts)
            record.update(stop.extra)
            write_once(rec.record_path(s.cfg), record)
        self.barrier()  # the record is there before any rank ends (the launcher reads it then)
        raise stop.error

    def settle(self) -> None:
        """Before the history is saved: the training and reader time so far move into it."""
        self.recorder.settle(self.prefetch.reader_s)
        self.prefetch.reader_s = 0.0

    def keep(self, before: int) -> tuple[Path, Path | None]:
        """A checkpoint before step ``before`` and the trained model file, both complete (every rank takes part)."""
        s = self.state
        progress.mark("checkpoint")
        self.settle()
        s.saver.save(before, s.hold, self.recorder.history, wait=True)
        s.saver.finish()
        return ckpt.ckpt_dir(s.cfg) / f"step{before:08d}", self.export()

    def barrier(self) -> None:
        """Every rank of the job here (a one-rank job: nothing to wait for)."""
        import torch.distributed as dist

        if self.state.world.size > 1:
            dist.barrier()

    # ---- the end ---------------------------------------------------------------------------------------------------
    def export(self) -> Path | None:
        """The trained model in one file beside the record (rank 0 writes it; every rank takes part): the averaged
        weights of a ``train.ema`` run, the last step's otherwise (gems.checkpoint.export)."""
        s = self.state
        progress.mark("model file")
        with torch.device("meta"):  # the serial state_dict's order, without allocating the model
            order = list(build_model(section(s.cfg, "model")).module.state_dict())
        path = rec.record_path(s.cfg).with_suffix(".model.pt")
        return ckpt.export(s.cfg, s.world, s.hold, s.saver, len(self.recorder.history["losses"]), path, order)

    def record(self) -> dict[str, Any]:
        """The run's record (complete on rank 0)."""
        s, stepper, h = self.state, self.state.stepper, self.recorder.history
        measured = len(h["step_times"])
        notes = list(stepper.notes) + s.plan.notes(measured) + ([s.staged.note()] if s.staged else [])
        if measured < 3 and s.world.rank == 0:
            print(f"gems: warning: {s.plan.notes(measured)[-1]}", file=sys.stderr, flush=True)
        notes += data_notes(s.cfg, s.data)  # the files' layout, the readers' cap, a slow path taken
        replay = stepper.replay_note()  # what a replay from CUDA graphs covered, and what stayed eager around it
        if replay:
            notes.append(replay)
        if s.resumed is not None and not s.resumed["exact"]:
            notes.append(f"resumed from a checkpoint of global batch {s.resumed['global_batch']} at batch "
                         f"{s.cfg.train.batch_size}: the steps after it are not those of one uninterrupted run")
        record = self.recorder.record(
            s.cfg, s.world, s.mesh, s.meter, global_batch=stepper.samples_per_step * s.R, balance=stepper.balance,
            wall_s=time.time() - s.t_start, restarts=s.restarts,
            measured_from=s.plan.measure_from + int(s.plan.traced_at is not None),
            profiled_steps=s.plan.profiled_to, notes=notes, split=split_waits)
        record["host_memory"] = s.host_memory.summary
        if stepper.scaler.enabled:
            record["loss_scale"] = stepper.scaler.summary()
        if s.saver.saves:  # how long checkpoints held the steps (an async save: the copy to host memory only)
            record["checkpoint"] = {"saves": s.saver.saves, "held_s": s.saver.held_s,
                                    "held_s_per_save": s.saver.held_s / s.saver.saves, "async": s.saver.asynchronous}
        if s.resumed is not None:
            record["resumed_from"] = s.resumed
        record.update(self.recorder.training_figures(s.cfg.train, s.plan.steps, s.plan.steps_per_epoch))
        names = class_names(s.val if s.val is not None else s.data, stepper.metric)
        if names:
            record["classes"] = names  # the Dice columns' names, by label (gems.results.table)
        record["cuda_graphs"] = replay is not None
        if s.cfg.parallel.get("chosen"):  # parallel=auto: the mesh was chosen by gems plan's search
            from omegaconf import OmegaConf

            record["chosen"] = OmegaConf.to_container(s.cfg.parallel.chosen, resolve=True)
        return record


def took(queued: Queued, dt: float, now: float) -> float:
    """What step ``queued`` took, for the watchdog's allowance: read at once, its wall time on the host; read late (a
    graphed step), the longer of the device's span ``dt`` and the host's time to queue it (the host's alone is its
    launches, about a millisecond, where the device may take far longer)."""
    return max(dt, queued.host_s) if queued.deferred else now - queued.begun


def _profiled(cfg: DictConfig, world: World, fn: Any) -> Any:
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


def _event() -> Any:
    """A timing event recorded now on the current CUDA stream."""
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    return ev


def _sync(device: torch.device) -> None:
    """Wait for the GPU's queue (the step's kernels and NCCL's communication): a hang on the GPU shows as this
    wait in a stall report, not as whatever the host last marked."""
    if device.type == "cuda":
        with progress.waiting("gpu queue"):
            torch.cuda.synchronize(device)


def write_once(path: Any, record: dict[str, Any]) -> None:
    """Write a record unless one is there already (a record is never replaced)."""
    try:
        rec.write_record(path, record)
    except FileExistsError:
        pass
