"""Checkpoints every ``train.checkpoint_every`` steps, so a preempted or failed run loses little."""
from __future__ import annotations

from gems import progress
from gems.rank.hooks.base import Hook, StepResult, Stop


class Checkpoints(Hook):
    """A checkpoint after every ``train.checkpoint_every`` steps (the last step's too: a finished run's training
    can go on, train.resume_from), but none once a loss went non-finite (a diverged run keeps its last good one);
    an asynchronous save's progress polled after every step."""

    def after_step(self, result: StepResult) -> Stop | None:
        s, history = self.state, self.run.recorder.history
        if s.plan.checkpoints(result.step) and not history["nonfinite_steps"]:
            progress.mark("checkpoint")
            self.run.settle()
            s.saver.save(result.step + 1, s.hold, history)
        s.saver.poll()
        return None
