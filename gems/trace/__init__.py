"""A model's trace on fake tensors: its layers run one by one at a rank's local shapes (a shape-only stand-in for
the spatial context, CUDA autocast's casting rules on GPU targets), with what autograd saves per layer, each
layer's output, and every op's FLOPs and bytes.

- :mod:`gems.trace.model`: the trace itself (and the per-layer costs the run's recomputed pieces are cut by,
  :func:`gems.trace.model.piece_costs`);
- :mod:`gems.trace.ops`: the FLOPs and bytes of every op of that trace.

It lies below the run and the planner, which both read it (``gems.parallel.recompute_pieces`` for the run, the
memory and time models of :mod:`gems.plan`), above the strategies whose layers it runs.
"""
