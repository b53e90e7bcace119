"""What a run leaves: its trained model's file and its record, made from the rank's state and history."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

from gems import checkpoint as ckpt
from gems import progress
from gems.config import section
from gems.fault.reports import read_requeues
from gems.models import build_model
from gems.pipeline.runtime import split_waits
from gems.rank.data import class_names, data_notes
from gems.rank.determinism import note
from gems.results import record as rec
from gems.results.recorder import Recorder
from gems.telemetry.figures import combine


def export_model(state: Any, steps_trained: int) -> Path | None:
    """The trained model in one file beside the record (rank 0 writes it; every rank takes part): the averaged
    weights of a ``train.ema`` run, the last step's otherwise (gems.checkpoint.export)."""
    progress.mark("model file")
    with torch.device("meta"):  # the serial state_dict's order, without allocating the model
        order = list(build_model(section(state.cfg, "model")).module.state_dict())
    path = rec.record_path(state.cfg).with_suffix(".model.pt")
    return ckpt.export(state.cfg, state.world, state.hold, state.saver, steps_trained, path, order)


def make_record(state: Any, recorder: Recorder, telemetry: dict[str, Any] | None = None,
                nondeterministic: set[str] | None = None) -> dict[str, Any]:
    """The run's record (complete on rank 0; every rank takes part): the recorder's figures of every rank, every
    rank's ``telemetry`` summary (gems.telemetry.figures.combine), and what the run says of how it ran
    (``nondeterministic``: the ops this rank ran without a deterministic kernel under train.deterministic)."""
    s, stepper, h = state, state.stepper, recorder.history
    measured = len(h["step_times"])
    plan_notes = s.plan.notes(measured)
    if measured < 3 and s.world.rank == 0:
        print(f"gems: warning: {plan_notes[-1]}", file=sys.stderr, flush=True)
    notes = list(stepper.notes) + plan_notes + ([s.staged.note()] if s.staged else [])
    notes += data_notes(s.cfg, s.data)  # the files' layout, the readers' cap, a slow path taken
    if s.cfg.train.deterministic:  # every rank's: a spatial part may run an op its peers do not
        said = note(set().union(*gather_to_rank0(s.world, sorted(nondeterministic or ()))))
        if said:
            notes.append(said)
    replay = stepper.replay_note()  # what a replay from CUDA graphs covered, and what stayed eager around it
    if replay:
        notes.append(replay)
    requeued = read_requeues(rec.job_dir(s.cfg))  # nodes lost under the job (Slurm's NODE_FAIL: gems.launch.watch)
    if requeued:
        last = requeued[-1]
        notes.append(f"Slurm requeued job {last['slurm_job_id']} after node(s) {', '.join(last['nodes'])} failed "
                     f"(NODE_FAIL): it went on from its checkpoint before step {s.plan.start} without them")
    if s.resumed is not None and not s.resumed["exact"]:
        notes.append(f"resumed from a checkpoint of global batch {s.resumed['global_batch']} at batch "
                     f"{s.cfg.train.batch_size}: the steps after it are not those of one uninterrupted run")
    record = recorder.record(
        s.cfg, s.world, s.mesh, s.meter, global_batch=stepper.samples_per_step * s.R, balance=stepper.balance,
        wall_s=time.time() - s.t_start, restarts=s.restarts,
        measured_from=s.plan.measure_from + int(s.plan.traced_at is not None),
        profiled_steps=s.plan.profiled_to, notes=notes, split=split_waits)
    record["host_memory"] = s.host_memory.summary
    if telemetry is not None:
        per = gather_to_rank0(s.world, telemetry)
        if s.world.rank == 0:  # the steps this process measured (a resumed run's history holds earlier ones too)
            record["telemetry"] = combine(per, stepper.samples_per_step * s.R, int(telemetry.get("steps") or 0),
                                          window=int(s.cfg.telemetry.straggler_window))
    if stepper.scaler.enabled:
        record["loss_scale"] = stepper.scaler.summary()
    if s.saver.saves:  # how long checkpoints held the steps (an async save: the copy to host memory only)
        record["checkpoint"] = {"saves": s.saver.saves, "held_s": s.saver.held_s,
                                "held_s_per_save": s.saver.held_s / s.saver.saves, "async": s.saver.asynchronous}
    if s.resumed is not None:
        record["resumed_from"] = s.resumed
    if requeued:
        record["requeued"] = requeued
    record.update(recorder.training_figures(s.cfg.train, s.plan.steps, s.plan.steps_per_epoch))
    names = class_names(s.val if s.val is not None else s.data, stepper.metric)
    if names:
        record["classes"] = names  # the Dice columns' names, by label (gems.results.table)
    record["cuda_graphs"] = replay is not None
    if s.cfg.parallel.get("chosen"):  # parallel=auto: the mesh was chosen by gems plan's search
        from omegaconf import OmegaConf

        record["chosen"] = OmegaConf.to_container(s.cfg.parallel.chosen, resolve=True)
    return record


def gather_to_rank0(world: Any, mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order, on rank 0 (elsewhere an empty list; one collective)."""
    if world.size == 1:
        return [mine]
    import torch.distributed as dist

    out: list[Any] = [None] * world.size if world.rank == 0 else []
    dist.gather_object(mine, out if world.rank == 0 else None, dst=0)
    return out
