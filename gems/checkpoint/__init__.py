"""Checkpoints that do not depend on the mesh, the trained model's file, and resuming on any mesh: checkpoints
written and read through DCP (:mod:`.sharded`), the model file (:mod:`.model_file`) and the time-limit and requeue
signal that asks for a checkpoint (:mod:`.requeue`). Callers use the names below from here."""
from __future__ import annotations

from gems.checkpoint.model_file import check_model, export, inspect, resolve, weights
from gems.checkpoint.requeue import (
    PREEMPTED_EXIT,
    install_time_limit_handler,
    request_requeue,
    restart_count,
    stop_requested,
)
from gems.checkpoint.sharded import (
    HISTORY,
    META,
    TIMINGS,
    Holding,
    Saver,
    at_scale,
    check_fingerprint,
    ckpt_dir,
    complete,
    entries,
    find,
    fingerprint,
    has_checkpoint,
    latest_step,
    layout,
    load,
    load_history,
    mesh_of,
    read_meta,
    retire,
    share_of,
    tidy,
    writer_count,
    writer_ranks,
)

__all__ = ["HISTORY", "META", "PREEMPTED_EXIT", "TIMINGS", "Holding", "Saver", "at_scale", "check_fingerprint",
           "check_model", "ckpt_dir", "complete", "entries", "export", "find", "fingerprint", "has_checkpoint",
           "inspect", "install_time_limit_handler", "latest_step", "layout", "load", "load_history", "mesh_of",
           "read_meta", "request_requeue", "resolve", "restart_count", "retire", "share_of",
           "stop_requested", "tidy", "weights", "writer_count", "writer_ranks"]
