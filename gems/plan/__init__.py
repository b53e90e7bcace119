"""``gems plan``: before a job queues, whether it fits (memory per rank) and how fast it will run (step time
and throughput), at any world size, in one process.

- :mod:`gems.trace` (below the planner, which shares it with the run): the real (spatial) model run on fake
  tensors at a rank's local shapes, with a shape-only stand-in for its spatial context: what autograd saves, per
  layer, and the FLOPs and bytes of every op;
- :mod:`gems.plan.schema`: what a plan is (per mesh position) and its JSON keys;
- :mod:`gems.plan.memory`: the memory per mesh position from that trace, the largest batch that fits;
- :mod:`gems.plan.suggest`: the smallest change that fits;
- :mod:`gems.plan.predict`: the step-time prediction of a plan (rates, placement, data);
- :mod:`gems.plan.make`: ``make_plan``, the three composed in one place;
- :mod:`gems.plan.fit`: the check before a run launches;
- :mod:`gems.plan.report`: the table, the JSON object and ``gems plan``'s entry point;
- :mod:`gems.plan.devices`: named GPUs' rates and memory, the links of a preset;
- :mod:`gems.plan.cpu`: CPU rates measured on the spot;
- :mod:`gems.plan.reserve`: what a GPU rank holds beside its tensors;
- :mod:`gems.plan.timing`: the step time from those, with the schedule's real action lists simulated;
- :mod:`gems.plan.curves`: every point of a study predicted (``gems plan +experiment=NAME``).
"""
from gems.plan.make import make_plan
from gems.plan.report import plan_main, render_table, to_json
from gems.plan.schema import SCHEMA, Breakdown, GiB, MemoryPlan, Position
from gems.trace.model import saved_bytes

__all__ = ["Breakdown", "Position", "MemoryPlan", "make_plan", "plan_main", "render_table", "to_json", "saved_bytes",
           "SCHEMA", "GiB"]
