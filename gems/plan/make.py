"""``make_plan``: the whole plan of a configuration, composed from its parts in one place: the memory per rank
(:mod:`gems.plan.memory`), the smallest change that fits when it does not (:mod:`gems.plan.suggest`), the
largest batch, and the step time (:mod:`gems.plan.predict`)."""
from __future__ import annotations

import time
from typing import Any

from gems.config import typed
from gems.plan.memory import plan_memory
from gems.plan.predict import predict_step
from gems.plan.schema import MemoryPlan
from gems.plan.suggest import recompute_note, suggest_change

__all__ = ["make_plan"]


def make_plan(cfg: Any, suggest: bool = True, quick: bool = False, available: bool = False,
              workspace: bool = True, largest: bool = True, hardware: bool = True, notes: bool = True,
              parts: str = "every", predict_unfit: bool = True) -> MemoryPlan:
    """The plan of the composed configuration ``cfg`` (no process group, no allocation).

    ``suggest``: when it does not fit, search the smallest change that does.
    ``quick``: only whether the configured batch fits (one trace of the middle spatial part; no batch search,
    no prediction). ``available``, ``workspace`` and ``largest``: as :func:`gems.plan.memory.plan_memory` takes
    them; ``hardware``: the predicted step's distance to the device too (:func:`predicted_hardware`); ``notes``:
    the notes that plan a variant of their own (where recomputation saves nothing); ``parts``: as
    :func:`gems.plan.memory.plan_memory` takes it; ``predict_unfit``: the step predicted where the plan does not
    fit too (the mesh search's candidates that do not fit are rejected on their memory alone: most of a large
    world's candidates, whose timing would be half the search's time).
    """
    t0 = time.perf_counter()
    cfg = typed(cfg)  # the typed settings the planner's modules read (gems.config.typed)
    plan, pl, prof = plan_memory(cfg, quick, available, workspace, largest, parts)
    if not quick and notes and (note := recompute_note(cfg, plan)):
        plan.notes.append(note)
    if not plan.fits and suggest:
        plan.suggestion = suggest_change(cfg, pl.st)
        plan.verdict += (f"; try {plan.suggestion}" if plan.suggestion else
                         "; no single change of checkpoint, micro-batches, precision, spatial parts or pipeline found "
                         "to fit")
    if not quick and bool(cfg.plan.predict) and (plan.fits or predict_unfit):
        plan.prediction = predict_step(cfg, pl, prof, plan.global_batch, plan.device, plan.world_size)
        if plan.prediction is not None and hardware:
            plan.hardware = predicted_hardware(cfg, plan)
    if not quick and largest:  # (the quick path searches no batch: there is no maximum to give)
        bits = f"max global batch that fits: {plan.max_global_batch}"
        if plan.min_gems_replicas is not None:
            bits += f"; gems_replicas >= {plan.min_gems_replicas} fits train.batch_size={plan.global_batch}"
        plan.verdict += f" ({bits})"
    plan.seconds = round(time.perf_counter() - t0, 3)
    return plan


def predicted_hardware(cfg: Any, plan: MemoryPlan) -> dict[str, Any]:
    """The predicted step's distance to the device: the model's FLOP/s and bytes/s a rank would reach, and their
    fractions of ``cluster.gpu``'s peak (gems.plan.roofline.hardware; a CPU rank: the rates, no fraction)."""
    from gems.plan.roofline import hardware

    gpu = str(cfg.cluster.gpu) if plan.device.get("kind") == "gpu" and cfg.cluster.gpu else None
    return hardware(cfg, plan.prediction.step_s, plan.world_size, gpu or plan.device.get("name"))
