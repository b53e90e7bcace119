"""The validation set's figures on a run's own mesh, BatchNorm recalibrated first where asked: what a run's
evaluations and ``gems eval`` compute."""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from gems.errors import ConfigError
from gems.layers import recalibrating
from gems.rank.data import evaluation_batches, share
from gems.replication import average_buffers


class Validation:
    """Forward only over the validation set on this mesh, the replicas sharing its batches, the metric summed over
    every rank (gems.rank.loss.Metric): the same figures on every rank, equal to one process's. ``met``: a bad
    validation file this rank met (its error)."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.met: BaseException | None = None

    def figures(self, first: bool = True) -> tuple[dict[str, Any] | None, int]:
        """The figures (every rank takes part), and how many batches recalibrated BatchNorm first (``first``: the
        run's first evaluation, where a shortfall is said). A bad validation file on any rank: no figures (None);
        the rank that met it keeps its error in :attr:`met` and evaluates a training batch in its place, whose
        figures count nowhere, so that every rank's collectives still meet, and the world's sum carries whether
        any rank met one."""
        import torch.distributed as dist

        s = self.state
        stepper, B, dev = s.stepper, s.B, s.world.device
        total = torch.zeros(stepper.metric.size, dtype=torch.float64, device=dev)
        assert s.val is not None
        with s.ema.swapped() if s.ema is not None else contextlib.nullcontext():  # train.ema's weights
            recalibrated = self.recalibrate(first)
            bad = False
            for k in range(evaluation_batches(s.val, B)):  # batches of the training batch (data.py: the last)
                ids = share(list(range(k * B, (k + 1) * B)), s.R, s.coord.replica)
                want = dict(want_input=stepper.needs_input, want_target=stepper.needs_target)
                try:
                    x, y = s.val.batch(ids, stepper.input_slices, **want)
                except ConfigError as e:  # a bad file: a training batch in its place, its figures counting nowhere
                    self.met, bad = self.met or e, True
                    x, y = s.data.batch(share(list(range(B)), s.R, s.coord.replica), stepper.input_slices, **want)
                got = stepper.evaluate(x.to(dev) if x is not None else None, y.to(dev) if y is not None else None, ids)
                if got is not None:
                    total += got
        total = torch.cat([total, torch.full((1,), float(bad), dtype=torch.float64, device=dev)])
        if s.world.size > 1:
            dist.all_reduce(total)
        values = total.tolist()  # (one read of the device: the figures and the bad-file flag together)
        if values[-1] > 0:
            return None, recalibrated
        return stepper.metric.report(values[:-1]), recalibrated

    def recalibrate(self, first: bool) -> int:
        """``train.bn_recalibrate``: BatchNorm's running statistics recomputed from that many batches of the
        training set (all its whole batches if it holds fewer; the number used is returned, and said once when
        it is fewer) in its order (gems.layers.recalibrating), forward only on this mesh as in training (spatial
        parts share their statistics, pipeline micro-batches and replicas have their own, as their steps do),
        then averaged over the copies of each layer like training's; part of the evaluation's time."""
        s = self.state
        stepper, B, dev = s.stepper, s.B, s.world.device
        asked = int(s.cfg.train.bn_recalibrate)
        n = min(asked, len(s.data) // B)
        if n < asked and s.world.rank == 0 and first:
            print(f"gems: train.bn_recalibrate={asked}: the training set holds {n} whole batches of "
                  f"{B}; recalibrating from those", flush=True)
        if not n:
            return 0
        with recalibrating(stepper.modules):
            for k in range(n):
                ids = share(list(range(k * B, (k + 1) * B)), s.R, s.coord.replica)
                x, y = s.data.batch(ids, stepper.input_slices, want_input=stepper.needs_input,
                                    want_target=stepper.needs_target)
                stepper.evaluate(x.to(dev) if x is not None else None, y.to(dev) if y is not None else None, ids,
                                 batch_statistics=True)
        if s.buffers:
            average_buffers(s.buffers, s.mesh.group("grad"), len(s.mesh.ranks("grad")))
        return n
