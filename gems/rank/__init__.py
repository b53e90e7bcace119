"""What every rank runs, one concern a module (``gems.worker`` is the entry that bootstraps the world and calls
:func:`gems.rank.loop.train`):

- :mod:`gems.rank.compose`: the strategies composed for this rank (spatial, pipeline, gradient sum), its set-up;
- :mod:`gems.rank.loss`: the weighted local loss;
- :mod:`gems.rank.optim`: the optimizer of its parameter copies;
- :mod:`gems.rank.data`: the samples of each step (its replica's share, its spatial part);
- :mod:`gems.rank.loop`: the step loop, its sync, faults, checkpoints and the record.
"""
