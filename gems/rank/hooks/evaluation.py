"""Evaluations on the validation set during training, and the run's target (``train.target_mae``)."""
from __future__ import annotations

import time
from typing import Any

from gems import progress
from gems.rank.data import class_names
from gems.rank.hooks.base import Hook, Run, StepResult, Stop
from gems.rank.loss import described
from gems.rank.validation import Validation


class Evaluation(Hook):
    """After every ``train.eval_every`` steps and the last: the validation set's figures on this mesh (out of the step
    times, kept in the record); the first evaluation that reaches the run's target ends the run (:meth:`Stop.done`).
    A bad validation file keeps the training (its checkpoint and model) and stops the run (``bad``'s stop)."""

    def __init__(self, run: Run, bad: Any) -> None:
        super().__init__(run)
        self.bad = bad
        self.validation = Validation(run.state)

    def after_step(self, result: StepResult) -> Stop | None:
        s, step = self.state, result.step
        if not s.plan.evaluates(step):
            return None
        history = self.run.recorder.history
        progress.mark("evaluate", step)
        epochs_done = s.sampler.epoch_of(step + 1)
        s.mlperf.evaluation(epochs_done, None, start=True)
        t0 = time.perf_counter()
        figures, recalibrated = self.validation.figures(first=not history["validation"])
        if figures is None:  # a bad validation file: the training is kept (its checkpoint and model), then it stops
            self.bad.met = self.bad.met or self.validation.met
            return self.bad.stop(step + 1, during="validation")
        entry = {"step": step + 1, "epoch": round(s.sampler.epoch_of(step + 1), 6), **figures,
                 "seconds": time.perf_counter() - t0}
        if s.cfg.train.bn_recalibrate:
            entry["bn_recalibrate_batches"] = recalibrated  # what was used: the setting, or the set's whole batches
        history["validation"].append(entry)
        s.mlperf.evaluation(epochs_done, figures.get(str(s.cfg.train.target_metric)), start=False)
        if s.world.rank == 0:
            shown = described(figures, class_names(s.val, s.stepper.metric))
            print(f"gems: validation after step {step + 1}: {shown}", flush=True)
        return Stop.done() if self.reached(entry) else None

    def reached(self, entry: dict[str, Any]) -> bool:
        """Whether an evaluation reached ``train.target_mae`` (on ``train.target_metric``); the first that does
        records the time to it (from the first step, evaluations included, as MLPerf counts it)."""
        t, history = self.state.cfg.train, self.run.recorder.history
        if t.target_mae is None or history.get("target"):
            return False
        value = entry.get(t.target_metric)
        if value is None:
            return False
        if value >= float(t.target_mae) if t.target_metric == "accuracy" else value <= float(t.target_mae):
            history["target"] = {"step": entry["step"], "epoch": entry["epoch"], "value": value,
                                 "time_to_target_s": self.run.recorder.elapsed()}
            return True
        return False
