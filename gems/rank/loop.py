"""A rank's training loop: for each step of the plan, its batch, the step, and the hooks on its result."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig

from gems import checkpoint as ckpt
from gems import progress, timers
from gems.bootstrap import World
from gems.errors import ConfigError
from gems.fault import inject
from gems.fault.watchdog import Watchdog
from gems.rank import hooks, profiling
from gems.rank.data import Prefetcher, finisher, step_batch, unstage
from gems.rank.determinism import nondeterministic_ops
from gems.rank.hooks import StepResult, Stop
from gems.rank.hooks.faults import NonFiniteLoss, OverMemoryCap, Stopped, storage_stop
from gems.rank.hooks.preemption import preempt
from gems.rank.report import export_model, make_record
from gems.rank.setup import RankState, set_up
from gems.rank.sync import Queued, Readout, StepFigures, event, stop_request, took, with_verdict
from gems.replication import average_buffers
from gems.results import record as rec
from gems.results.recorder import Recorder
from gems.storage import StorageFailed

__all__ = ["Loop", "NonFiniteLoss", "OverMemoryCap", "Stopped", "train", "write_once"]


def train(cfg: DictConfig, world: World, wd: Watchdog | None = None) -> dict[str, Any]:
    """Train on this rank; returns the record (complete on rank 0)."""
    return Loop(set_up(cfg, world, wd)).run()


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
        self.telemetry = hooks.Telemetry(self)
        self.nondeterministic: set[str] = set()  # ops run without a deterministic kernel (train.deterministic)
        # in this order on every rank: the hooks' collectives meet
        self.hooks: list[Any] = [
            self.telemetry, state.host_memory, hooks.NonFinite(self), hooks.MemoryCap(self), hooks.StepLine(self),
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
            self.telemetry.start()
            with nondeterministic_ops(self.nondeterministic) if s.cfg.train.deterministic else contextlib.nullcontext():
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
            self.telemetry.stop()
            s.mlperf.pause()  # stopped to be requeued, or failed: the next job appends
            self.prefetch.close()
            self.recorder.history["reader_s"] += self.prefetch.reader_s
        progress.mark("record")
        try:
            s.saver.finish()  # an async checkpoint still being written: complete, and latest moved to it
            model_file = export_model(s, len(self.recorder.history["losses"]))
        except StorageFailed as e:
            self.stop(storage_stop(self, e, len(self.recorder.history["losses"])))
        record = make_record(s, self.recorder, self.telemetry.summary(), self.nondeterministic)
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
            self.stop(self.guarded(lambda: hook.before_step(step), step))
        t0 = time.perf_counter()
        late = s.stepper.graph is not None  # a graphed run's figures are read late: its span timed by events
        start = event() if late and s.world.device.type == "cuda" else None
        try:
            (ids, x, y), data_s = self.prefetch.get(step)  # data_s: the exposed data time
        except ConfigError as e:  # a bad file: where this rank alone trains, nothing else need agree to keep it all
            if s.world.size > 1:
                raise  # (the ranks agree before the batch is needed where a reader runs ahead: BadData.ahead)
            self.drain()
            self.bad.met = e
            self.stop(self.guarded(lambda: self.bad.stop(step), step))
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
        """One training step: the forward, the loss, the backward with the gradient sums over every copy of each
        parameter, and the step's sync (the stepper: gems.rank.steppers), then the optimizer's update. Its figures
        stay on the device (fp16's verdict last where the device decided the update: the bool), read after it."""
        s = self.state
        # forward, loss, backward, gradient sums, the step's sync (the global loss, stop requests)
        figures = s.stepper.step(x, y, ids, step, stop=lambda: self.stop_request(step), quiesce=quiesce)
        progress.mark("optimizer")
        verdict = None
        if not s.stepper.optimizer_in_step:  # the update (fp16: unscaled after the sum, skipped where any rank
            verdict = s.stepper.scaler.step_late(s.opt, step)  # overflowed, decided on the device)
        s.opt.zero_grad(set_to_none=True)
        return with_verdict(figures, verdict), verdict is not None

    def after_update(self, step: int) -> None:
        """After the update: the weights' moving average (train.ema), BatchNorm's statistics averaged over the copies
        (a graphed step averages them itself)."""
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
            done = self.stop(self.guarded(lambda: hook.after_step(result), result.step + 1)) or done
        return done

    def guarded(self, call: Callable[[], Stop | None], before: int) -> Stop | None:
        """A hook's ``call``; a save in it that every rank took part in (a checkpoint, the model file) failing for the
        storage's reason stops the run before step ``before`` (:func:`gems.rank.hooks.faults.storage_stop`)."""
        try:
            return call()
        except StorageFailed as e:
            return storage_stop(self, e, before)

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
        before the measured steps), or plain; then the update's followers (:meth:`after_update`)."""
        s = self.state
        if step == s.plan.traced_at:
            out = profiling.traced(s.cfg, s.world, lambda: self.train_step(step, ids, x, y, quiesce=True))
        elif s.plan.profiles_memory(step):  # the tensor memory a GPU would count: the largest of these steps
            out, peak = profiling.tensor_peak(s, [x, y], lambda: self.train_step(step, ids, x, y, quiesce=True))
            self.recorder.history["tensor_peaks"].append(peak)
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
            try:
                preempt(s, stop.before, self.recorder.history, stop.message)
            except StorageFailed as e:
                stop = storage_stop(self, e, stop.before)
        assert stop.error is not None
        if s.world.rank == 0:
            record = rec.failed_record(s.cfg, stop.message, failure=stop.failure, losses=self.recorder.history["losses"],
                                       restarts=s.restarts)
            record.update(stop.extra, lr=list(self.recorder.history["lrs"]))
            write_once(rec.record_path(s.cfg), record)
            with contextlib.suppress(Exception):  # the losses so far, a line a step (the record has them too)
                rec.write_steps(rec.record_path(s.cfg), record)
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
        return ckpt.ckpt_dir(s.cfg) / f"step{before:08d}", export_model(s, len(self.recorder.history["losses"]))

    def barrier(self) -> None:
        """Every rank of the job here (a one-rank job: nothing to wait for)."""
        import torch.distributed as dist

        if self.state.world.size > 1:
            dist.barrier()


def write_once(path: Any, record: dict[str, Any]) -> None:
    """Write a record unless one is there already (a record is never replaced)."""
    try:
        rec.write_record(path, record)
    except FileExistsError:
        pass
