"""The pipelined step: the schedule's actions run by gems.pipeline's runtime over the rank's partitions."""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from gems.rank import graphs
from gems.rank.steppers.base import Parts, Stepper
from gems.replication import GradientReducer


class PipelineStepper(Stepper):
    """The rank's partitions run by their schedule (gems.pipeline.runtime.PipelineRunner); a parameter's gradient sum
    starts after the last backward of its partition on this rank; ``pieces`` (gems.rank.pieces): each partition's
    forward and backward of a micro-batch replayed from graphs between its messages."""

    def __init__(self, parts: Parts, runner: Any, reducer: GradientReducer, pieces: Any = None) -> None:
        super().__init__(parts, list(runner.parameters()), list(runner.modules), reducer, runner.needs_inputs,
                         runner.needs_targets, runner.samples_per_step)
        self.runner, self.pieces = runner, pieces
        self.balance = list(runner.balance)
        self.transfers = runner.transfers
        self.first_step_connects = not runner.connected
        backwards = Counter(a.stage for a in runner.actions if a.kind.finishes_gradients)
        self.backwards = {id(q): backwards[s] for s, part in runner.partitions.items() for q in part.parameters()}

    def forward_backward(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int],
                         step: int) -> torch.Tensor:
        p, pieces, reducer = self.parts, self.pieces, self.reducer
        p.mark(x)
        if pieces is not None:
            if pieces.steps == 0 and graphs.hooked(list(self.runner.modules), reducer.hook_ids()):
                pieces.refused = True  # a replay runs no hook: the model's own (a fault injection) must run
                self.notes.append("train.cuda_graphs: the step runs eager: hooks on the model (a replay would "
                                  "skip them)")
            pieces.begin_step(step)
        reducer.start_step(expected=lambda q: self.backwards[id(q)])
        with p.amp():
            loss = self.runner.step(x, y, ids, p.seed, step)
        reducer.finish()
        return loss

    def stats(self) -> dict[str, float]:
        s = self.runner.stats
        out = {"bubble_or_wait": s.wait_s, **self.parts.halo_stats()}
        s.forward_s = s.backward_s = s.wait_s = 0.0
        return out

    def evaluate(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int],
                 batch_statistics: bool = False) -> torch.Tensor | None:
        self.parts.mark(x)
        with self.parts.amp():
            return self.runner.evaluate(x, y, ids, self.metric, batch_statistics)

    def first_nonfinite(self) -> int | None:
        return self.runner.first_nonfinite()

    def place_rounds(self) -> None:
        if self.runner.clock is not None:
            note = self.runner.place_rounds_by_time()
            if note:
                self.notes.append(note)

    def replay_note(self) -> str | None:
        if self.pieces is None or not self.pieces.replayed:
            return None
        return graphs.PIECES_NOTE
