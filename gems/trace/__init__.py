"""A model's trace on fake tensors: its layers run one by one at a rank's local shapes, with what autograd saves per
layer, each layer's output (:mod:`gems.trace.model`), and every op's FLOPs and bytes (:mod:`gems.trace.ops`).

It lies below the run and the planner, which both read it (the run's recomputed pieces, the planner's memory and
time), and above the strategies whose layers it runs.
"""
