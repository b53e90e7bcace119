"""The plan's outputs: the JSON object (schema ``gems.plan/1``, keys in :mod:`gems.plan.memory`), the table
with its verdict, predicted step and the run's cost (GPU-hours, node-hours, an energy bound), and ``gems plan``'s
entry point.
"""
from __future__ import annotations

import json
import sys
from typing import Any

from gems.errors import ConfigError
from gems.pipeline.schedules import registered
from gems.plan.make import make_plan
from gems.plan.schema import SCHEMA, GiB, MemoryPlan
from gems.plan.timing import DATA_WARN, data_share, data_warning
from gems.telemetry.limits import power_limit_w


# ============================================================================ output
def to_json(plan: MemoryPlan) -> dict[str, Any]:
    """The plan as one JSON-ready object (keys in the module docstring)."""
    return {
        "schema": SCHEMA, "model": plan.model, "input_shape": plan.input_shape, "world_size": plan.world_size,
        "mesh": plan.mesh, "schedule": plan.schedule, "micro_batches": plan.micro_batches,
        "gems_replicas": plan.gems_replicas, "checkpoint": plan.checkpoint, "precision": plan.precision,
        "optimizer": plan.optimizer, "global_batch": plan.global_batch, "micro_batch": plan.micro_batch,
        "balance": plan.balance, "device": plan.device,
        "positions": [{"pipeline": p.pipeline, "spatial": p.spatial, "grid": p.grid, "partitions": p.partitions,
                       "local_input_shape": p.local_input_shape, "in_flight": {str(k): v for k, v in p.in_flight.items()},
                       "bytes": p.bytes.as_dict(), "activations_detail": p.activations_detail} for p in plan.positions],
        "peak": {"bytes": plan.worst.bytes.total, "pipeline": plan.worst.pipeline, "spatial": plan.worst.spatial},
        "fits": plan.fits, "max_global_batch": plan.max_global_batch, "max_micro_batch": plan.max_micro_batch,
        "min_gems_replicas": plan.min_gems_replicas, "suggestion": plan.suggestion, "verdict": plan.verdict,
        "seconds": plan.seconds, "notes": plan.notes,
        "peak_memory_bytes": {"max": plan.worst.bytes.total, "per_rank": per_rank(plan)},
        "predicted_step_time_s": plan.prediction.as_json() if plan.prediction is not None else None,
        "predicted_throughput_samples_per_s": plan.prediction.throughput if plan.prediction is not None else None,
        "predicted_hardware": plan.hardware,
    }


def per_rank(plan: MemoryPlan) -> list[int]:
    """Peak bytes of every rank of the world, in rank order (rank = (r D + d) S + s; replicas are alike)."""
    m = plan.mesh
    D, S = m["pipeline"], m["spatial"]
    by = {(p.pipeline, s): p.bytes.total for p in plan.positions for s in p.spatial}
    return [by[(d, s)] for _ in range(m["replicas"]) for d in range(D) for s in range(S)]


def render_table(plan: MemoryPlan, width: int = 120, cfg: Any = None) -> str:
    """A readable table: one row per distinct position, the breakdown in GiB, then the verdict."""
    import io

    from rich.console import Console
    from rich.table import Table

    m = plan.mesh
    title = (f"gems plan: {plan.model} {plan.input_shape}, R{m['replicas']} x D{m['pipeline']} x S{m['spatial']} "
             f"= {plan.world_size} ranks, {plan.schedule} m={plan.micro_batches}"
             + (f" eta={plan.gems_replicas}" if registered()[plan.schedule].passes == "eta" else "")
             + f", batch {plan.global_batch} (micro-batch {plan.micro_batch}), {plan.precision}, {plan.optimizer}"
             + (", checkpoint" if plan.checkpoint else ""))
    t = Table(title=title, title_justify="left")
    for col in ("position", "partitions", "local input", "in flight", "params", "grads", "optim", "activ", "halo",
                "comm", "total GiB"):
        t.add_column(col, justify="left" if col in ("position", "partitions", "local input", "in flight") else "right")
    worst = plan.worst
    for p in plan.positions:
        b = p.bytes
        g = lambda v: f"{v / GiB:.2f}"  # noqa: E731
        mark = " *" if p is worst else ""
        t.add_row(p.label + mark, ",".join(map(str, p.partitions)), "x".join(map(str, p.local_input_shape)),
                  " ".join(f"{k}:{v}" for k, v in sorted(p.in_flight.items())) or "-",
                  g(b.parameters), g(b.gradients), g(b.optimizer), g(b.activations), g(b.halo), g(b.communication),
                  g(b.total))
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=False, color_system=None)
    con.print(t)
    dev = plan.device
    con.print(f"device: {dev['name']}: {dev['memory_bytes'] / GiB:.2f} GiB ({dev.get('memory_source', '')}); "
              f"balance {plan.balance}; planned in {plan.seconds:.2f} s", soft_wrap=True)
    con.print(reserve_line(dev), soft_wrap=True)
    for n in plan.notes:
        con.print(f"note: {n}")
    con.print(plan.verdict, soft_wrap=True)
    pr = plan.prediction
    if pr is not None:
        terms = ", ".join(f"{k} {v:.3g}" for k, v in pr.breakdown.items() if v > 0)
        con.print(f"predicted step: {pr.step_s:.3g} s ({terms}; set by {pr.position}) = {pr.throughput:.3g} "
                  f"samples/s", soft_wrap=True)
        if plan.hardware is not None:
            con.print(hardware_line(plan.hardware, "predicted"), soft_wrap=True)
        if pr.staging_s > 0:
            con.print(f"staging to node-local storage (data.stage=node): {pr.staging_s:.3g} s once per job",
                      soft_wrap=True)
        for a in pr.assumptions:
            con.print(f"  assumed: {a}", soft_wrap=True)
        spent = cost(cfg, plan) if cfg is not None else None
        if spent is not None:
            con.print(cost_line(spent), soft_wrap=True)
        if data_share(pr) > DATA_WARN:
            con.print(f"warning: {data_warning(cfg, data_share(pr))}", soft_wrap=True)
    if cfg is not None:
        con.print(disk_line(cfg), soft_wrap=True)
    return buf.getvalue()


def disk_line(cfg: Any) -> str:
    """What the run writes into ``results.dir`` at most at once, against the room there (gems run refuses less)."""
    from gems.plan.disk import written
    from gems.storage import free_bytes, size

    need = written(cfg)
    free = free_bytes(str(cfg.results.dir))
    room = f"; {size(free)} free in {cfg.results.dir}" if free is not None else ""
    return f"disk: the run writes at most {need.describe()} into results.dir{room}"


def cost(cfg: Any, plan: MemoryPlan) -> dict[str, Any] | None:
    """What the run costs at its predicted step: its steps (``train.steps``, or its epochs of the training set) x the
    step, and the staging once, on its nodes (``cluster.nodes``, or as the launcher places the ranks): GPU-hours (its
    ranks, on GPUs), node-hours, and an energy bound (every GPU at its model's power limit the whole time,
    :mod:`gems.telemetry.limits`). None without a prediction, or where the steps cannot be counted here."""
    from omegaconf import DictConfig, OmegaConf

    from gems.config import place_job
    from gems.rank.data import Sampler, dataset_size

    pr = plan.prediction
    if pr is None:
        return None
    t = cfg.train
    placed = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    assert isinstance(placed, DictConfig)
    try:
        steps = Sampler(dataset_size(cfg), int(t.batch_size), int(t.seed), t.epochs, t.steps).total
        place_job(placed)  # the nodes as the launcher places the ranks (cluster=local: this machine)
    except (ConfigError, OSError):  # a data set not here to count: no cost line
        return None
    nodes = int(placed.cluster.nodes or 1)
    seconds = steps * pr.step_s + pr.staging_s
    out: dict[str, Any] = {"steps": steps, "seconds": seconds, "ranks": plan.world_size, "nodes": nodes,
                           "node_hours": nodes * seconds / 3600}
    if plan.device.get("kind") == "gpu":
        out["gpu_hours"] = plan.world_size * seconds / 3600
        limit = power_limit_w(cfg.cluster.gpu)
        if limit is not None:
            out.update(gpu=str(cfg.cluster.gpu), power_limit_w=limit, energy_bound_j=limit * plan.world_size * seconds)
    return out


def cost_line(c: dict[str, Any], what: str = "the run") -> str:
    """A cost (:func:`cost`, or several summed) in words."""
    text = f"cost of {what}: {c['steps']} step(s) in {c['seconds'] / 3600:.3g} h"
    if "gpu_hours" in c:
        text += f"; {c['gpu_hours']:.3g} GPU-hours ({c['ranks']} GPUs)"
    text += f"; {c['node_hours']:.3g} node-hours ({c['nodes']} node(s))"
    if "energy_bound_j" in c:
        text += (f"; energy at most {c['energy_bound_j'] / 3.6e6:.3g} kWh (every GPU at the {c['gpu']}'s "
                 f"{c['power_limit_w']:g} W limit)")
    elif "gpu_hours" in c:
        text += "; no energy bound (cluster.gpu names no GPU of gems.telemetry.limits)"
    return text


def hardware_line(hw: dict[str, Any], what: str) -> str:
    """A step's distance to the device in words (gems.plan.roofline's figures; ``what``: predicted or measured)."""
    flops, nbytes = hw.get("flops_per_s_per_rank") or 0.0, hw.get("bytes_per_s_per_rank") or 0.0
    text = (f"{what} on the device: the model's {flops / 1e12:.3g} TFLOP/s and {nbytes / 1e9:.3g} GB/s a rank "
            f"({hw['model_flops_per_step'] / 1e9:.4g} GFLOP and {hw['model_bytes_per_step'] / 1e9:.4g} GB a step)")
    if hw.get("flops_fraction") is not None:
        text += (f": {100 * hw['flops_fraction']:.3g}% of {hw['device']}'s {hw['peak_flops_per_s'] / 1e12:g} TFLOP/s "
                 f"and {100 * hw['bytes_fraction']:.3g}% of its {hw['peak_bytes_per_s'] / 1e9:g} GB/s")
    else:
        text += " (no data-sheet peak for this device)"
    return text


def reserve_line(dev: dict[str, Any]) -> str:
    """The reserve a rank sets aside beside its planned tensors, part by part (GiB, 2^30 bytes)."""
    r = dev.get("reserve") or {"source": "plan.reserve_gb", "bytes": dev["reserve_bytes"]}
    g = lambda v: f"{v / GiB:.2f}"  # noqa: E731
    usable = f"; usable {g(dev['usable_bytes'])} GiB" if "usable_bytes" in dev else ""
    if dev.get("capped") and dev["kind"] == "cpu":
        return f"reserve: none (the cap, cluster.rank_memory_gb, counts the tensors alone, as the run measures them){usable}"
    if r["source"] != "modelled":
        why = "CPU ranks: the interpreter and allocator, " if dev["kind"] == "cpu" else ""
        bound = ", at most 0.5" if dev["kind"] == "cpu" else ""
        return f"reserve: {g(r['bytes'])} GiB a rank ({why}plan.reserve_gb{bound}){usable}"
    p = r["parts"]
    comms = r["communicators"]
    used = [c for c in comms if c["used"]]
    idle = [c for c in comms if not c["used"]]
    where = f" at d={r['pipeline_position']}" if any(c["name"].startswith("link") for c in comms) else ""
    nccl = (f"NCCL {g(p['nccl'])} ({len(used)} communicator(s){where} with buffers: "
            + ", ".join(f"{c['name']} of {c['size']} {g(c['bytes'])}" for c in used)
            + ("; created but idle: " + ", ".join(f"{c['name']} of {c['size']}" for c in idle) if idle else "") + ")"
            if comms else "NCCL 0 (one rank: no communicator)")
    return (f"reserve: {g(r['bytes'])} GiB a rank, modelled: CUDA context {g(p['cuda_context'])} + {nccl} + "
            f"fragmentation {g(p['fragmentation'])} ({100 * r['fragmentation_fraction']:g}% of the peak; cuDNN's "
            f"and cuBLAS's workspaces come from the caching allocator: counted in the activations){usable}; "
            "plan.reserve_gb=<GiB> replaces it")


def plan_main(cfg: Any, given: list[str] | None = None) -> int:
    """``gems plan``: print the plan as ``plan.format`` says; 0 whether or not it fits (bad input raises ConfigError).
    With ``parallel=auto`` every mesh of the world, ranked (gems.plan.search; ``given``: the command's overrides,
    for the command line that runs the best)."""
    fmt = str(cfg.plan.format)
    if fmt not in ("table", "json"):
        raise ConfigError("plan.format", fmt, "table or json")
    if cfg.parallel.get("auto"):
        from gems.plan.search import search_main

        return search_main(cfg, given)
    if bool(cfg.plan.dry_run):
        return _dry_run_main(cfg, fmt)
    plan = make_plan(cfg)
    if fmt == "json":
        from gems.plan.disk import written

        need = written(cfg)
        print(json.dumps({**to_json(plan), "cost": cost(cfg, plan),
                          "disk": {"peak_bytes": need.peak, "checkpoint_bytes": need.checkpoint,
                                   "checkpoints_at_once": need.kept, "model_file_bytes": need.model_file}}))
    else:
        print(render_table(plan, cfg=cfg), end="")
    return 0


def _dry_run_main(cfg: Any, fmt: str) -> int:
    """``plan.dry_run=true``: one rank's real step at full size (:mod:`gems.dryrun`); 1 when the real code
    fails there, with the rank and the error."""
    import traceback

    from gems.dryrun import dry_run

    try:
        out = dry_run(cfg)
    except ConfigError:
        raise
    except Exception as e:  # the finding itself: what would have failed on the cluster
        where = f"rank {cfg.plan.dry_run_rank}"
        if fmt == "json":
            print(json.dumps({"dry_run": "failed", "rank": int(cfg.plan.dry_run_rank),
                              "error": f"{type(e).__name__}: {e}"}))
        print(f"gems plan: dry run of {where} failed: {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exc(file=sys.stderr)
        return 1
    if fmt == "json":
        print(json.dumps({"dry_run": "ok", **out}))
        return 0
    c = out["coord"]
    print(f"dry run: rank {out['rank']} of {out['world_size']} (replica {c['replica']}, pipeline {c['pipeline']}, "
          f"spatial {c['spatial']} at {c['spatial_grid']}) ran one step of the real code over torch's fake process "
          f"group in {out['seconds']:.2f} s")
    groups = ", ".join(f"{axis} {g['size']}" for axis, g in out["groups"].items() if g["size"] > 1) or "none"
    print(f"  its groups (ranks): {groups}; partitions {out['partitions']}; {out['parameters']} parameters; "
          f"input part {out['input_part']}")
    for note in out["notes"]:
        print(f"  note: {note}")
    return 0
