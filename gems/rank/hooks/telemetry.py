"""The rank's device seen while it trains (gems.telemetry): power, energy, clocks and throttling over the measured
steps, each rank's step times for the straggler scores, and the device's state for a stall's report."""
from __future__ import annotations

from typing import Any

from gems.rank.hooks.base import Hook, Run, StepResult, Stop
from gems.telemetry.rank import RankTelemetry


class Telemetry(Hook):
    """A sampler of the rank's GPU through NVML (a CPU rank: its node's RAPL counters) started with the run, told each
    step's bounds; :meth:`summary` is what rank 0 gathers for the record (gems.telemetry.figures.combine)."""

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        s = self.state
        t = s.cfg.telemetry
        device = s.world.device
        self.meter = RankTelemetry(device.index if device.type == "cuda" else None, s.world.rank,
                                   None if t.interval_s is None else float(t.interval_s), int(t.trace_points))

    def start(self) -> None:
        self.meter.start()
        if self.state.wd is not None and self.meter.metered():  # a stall's report says what the device was doing
            self.state.wd.describe_device = self.meter.describe_now

    def stop(self) -> None:
        self.meter.stop()
        if self.state.wd is not None:  # (no reading of a stopped sampler sent on)
            self.state.wd.describe_device = None

    def before_step(self, step: int) -> Stop | None:
        self.meter.step_began(step, self.state.plan.measured(step))
        return None

    def after_step(self, result: StepResult) -> Stop | None:
        # the rank's own work: its waits for peers (the gradient sums, a pipeline's bubbles) left out, so that the
        # straggler scores compare what each rank itself took
        waits = result.terms.get("allreduce", 0.0) + result.terms.get("bubble_or_wait", 0.0)
        s = self.state
        self.meter.step_ended(result.step, max(0.0, result.seconds - waits), s.stepper.samples_per_step * s.R,
                              result.measured)
        return None

    def summary(self) -> dict[str, Any]:
        """This rank's figures; its trace (for the power and clock plot) from the first :data:`TRACED` ranks only,
        so that a record of thousands of ranks stays small."""
        out = self.meter.summary()
        if self.state.world.rank < TRACED:
            out["trace"] = self.meter.trace()
        return out


#: ranks whose samples the record keeps for the plot (one line a rank)
TRACED = 16
