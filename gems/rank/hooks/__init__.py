"""What a run does around its steps, one hook a concern: each may stop the run after a step."""
from gems.rank.hooks.base import Hook, Run, StepResult, Stop
from gems.rank.hooks.checkpoints import Checkpoints
from gems.rank.hooks.evaluation import Evaluation
from gems.rank.hooks.faults import BadData, FaultInjection, MemoryCap, NonFinite
from gems.rank.hooks.preemption import Preemption
from gems.rank.hooks.steps import HostMemory, MLPerfEpochs, PipelineRounds, StepLine
from gems.rank.hooks.telemetry import Telemetry

__all__ = ["BadData", "Checkpoints", "Evaluation", "FaultInjection", "Hook", "HostMemory", "MLPerfEpochs",
           "MemoryCap", "NonFinite", "PipelineRounds", "Preemption", "Run", "StepLine", "StepResult", "Stop",
           "Telemetry"]
