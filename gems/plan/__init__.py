"""``gems plan``: before a job queues, whether it fits (memory per rank) and how fast it will run (step time
and throughput), at any world size, in one process.

- :mod:`gems.plan.memory`: the trace of the real (spatial) model on fake tensors, the memory per mesh
  position, the largest batch that fits, suggestions, the table and JSON output;
- :mod:`gems.plan.cost`: the FLOPs and bytes of every op of that trace;
- :mod:`gems.plan.devices`: named GPUs' rates, CPU rates measured on the spot, the links of a preset;
- :mod:`gems.plan.timing`: the step time from those, with the schedule's real action lists simulated.
"""
from gems.plan.memory import (
                              SCHEMA,
                              Breakdown,
                              GiB,
                              MemoryPlan,
                              Position,
                              make_plan,
                              plan_main,
                              render_table,
                              saved_bytes,
                              to_json,
)

__all__ = ["Breakdown", "Position", "MemoryPlan", "make_plan", "plan_main", "render_table", "to_json", "saved_bytes",
           "SCHEMA", "GiB"]
