"""``gems plan +experiment=NAME`` (or any sweep syntax): every point of a study predicted before it runs.

Each point is planned as ``gems plan`` plans one configuration; its prediction becomes a record marked
``predicted`` in ``<results.dir>/<sweep>-predicted/``, and the table and plot are the ones ``gems results``
writes for measured studies (speedup, scaling efficiency, the breakdown per point), so the curve is seen
before a node is asked for, and ``gems results --compare results/<sweep> results/<sweep>-predicted`` puts
the measured study beside it. The study's cost is the sum of its points' (GPU-hours, node-hours, the energy
bound: :func:`gems.plan.report.cost`), each point's bound a sample its record's ``J/sample``.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["predict_study", "predicted_record"]


def predicted_record(cfg: Any, plan: Any, sweep: str, point: str, spent: dict[str, Any] | None = None) -> dict[str, Any]:
    """A record of what the plan predicts for ``cfg``: the fields ``gems results`` reads, ``predicted: true``;
    ``spent``: its cost (:func:`gems.plan.report.cost`), whose energy bound is its ``telemetry`` (the limit's J a
    sample and W a GPU: a bound, not a measurement)."""
    from omegaconf import OmegaConf

    from gems.results.record import SCHEMA, default_name, new_run_id

    pr = plan.prediction
    step = pr.step_s
    name = default_name(cfg)
    c = cfg.cluster
    return {
        "schema": SCHEMA, "run_id": new_run_id(name), "name": name, "sweep": sweep, "point": point, "repeat": 0,
        "status": "ok", "predicted": True, "config": OmegaConf.to_container(cfg, resolve=True),
        "world_size": plan.world_size, "nodes": int(c.nodes or 1), "mesh": plan.mesh, "schedule": plan.schedule,
        "global_batch": plan.global_batch, "steps": 0, "warmup_steps": 0,
        "throughput_samples_per_s": pr.throughput,
        "step_time_s": {"median": step, "min": step, "max": step, "all": [step]},
        "time_breakdown_s": dict(pr.breakdown),
        "peak_memory_bytes": {"max": plan.worst.bytes.total, "tensor_max": plan.worst.bytes.total,
                              "kind": "planned", "fits": plan.fits},
        "loss": [], "restarts": 0, "hardware": plan.hardware,
        "env": {"predicted_by": "gems plan", "assumptions": pr.assumptions,
                "device": "cuda" if plan.device.get("kind") == "gpu" else "cpu", "device_name": plan.device.get("name")},
        **({"telemetry": {"source": "power limit (gems plan)", "bound": True, "w_per_device": spent["power_limit_w"],
                          "j_per_sample": spent["power_limit_w"] * plan.world_size * step / plan.global_batch,
                          "cost": spent}} if spent and "power_limit_w" in spent else {}),
    }


def summed(costs: list[dict[str, Any]]) -> dict[str, Any]:
    """Points' costs added up: steps, hours, node-hours, GPU-hours and the energy bound (where every point has
    one); the GPUs and nodes are the largest point's."""
    out: dict[str, Any] = {"steps": sum(c["steps"] for c in costs), "seconds": sum(c["seconds"] for c in costs),
                           "ranks": max(c["ranks"] for c in costs), "nodes": max(c["nodes"] for c in costs),
                           "node_hours": sum(c["node_hours"] for c in costs)}
    for key in ("gpu_hours", "energy_bound_j"):
        if all(key in c for c in costs):
            out[key] = sum(c[key] for c in costs)
    if "energy_bound_j" in out:
        out.update(gpu=costs[0]["gpu"], power_limit_w=costs[0]["power_limit_w"])
    return out


def predict_study(combos: list[list[str]], experiment: str | None) -> int:
    from omegaconf import open_dict

    from gems.config import compose
    from gems.errors import ConfigError
    from gems.paths import writable_dir
    from gems.plan.make import make_plan
    from gems.plan.report import cost, cost_line
    from gems.plan.timing import DATA_WARN, data_share, data_warning
    from gems.results.manifest import point_name
    from gems.results.table import write_studies

    base = [o for o in combos[0] if all(o in c for c in combos)]
    first = compose(combos[0])
    sweep = (first.results.sweep or experiment or "sweep") + "-predicted"
    folder = Path(first.results.dir) / sweep
    cfgs, plans, costs = [], [], []
    for combo in combos:  # every point planned before anything is written
        cfg = compose(combo)
        with open_dict(cfg):
            cfg.results.sweep = sweep
        if cfg.parallel.get("auto"):  # the point's mesh chosen as gems sweep parallel=auto would choose it
            from gems.plan.search import apply_choice, said

            print(f"{point_name(combo, base)}: {said(apply_choice(cfg))}", flush=True)
        plan = make_plan(cfg, suggest=False)
        if plan.prediction is None:
            raise ConfigError("cluster.gpu", None, "the GPU model of the cluster (e.g. cluster.gpu=a100-40gb): a "
                              "study's curve needs a prediction at every point")
        cfgs.append(cfg)
        plans.append(plan)
        costs.append(cost(cfg, plan))
        pr = plan.prediction
        print(f"{point_name(combo, base)}: {plan.world_size} ranks, predicted {pr.step_s:.3g} s a step, "
              f"{pr.throughput:.4g} samples/s; {plan.verdict}", flush=True)
        share = data_share(pr)
        if share > DATA_WARN:
            print(f"gems: warning: {point_name(combo, base)}: {data_warning(cfg, share)}", file=sys.stderr, flush=True)
    seen: list[str] = []  # the assumptions behind every figure, once for the study
    for plan in plans:
        seen += [a for a in plan.prediction.assumptions if a not in seen]
    print("predicted by gems plan, not measured; assumed:" + "".join(f"\n  {a}" for a in seen), flush=True)
    if costs and all(c is not None for c in costs):
        print(cost_line(summed([c for c in costs if c is not None]), f"the study's {len(costs)} point(s)"), flush=True)
    writable_dir("results.dir", str(folder), "a folder for the predicted study")
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.json"):  # the study's previous prediction: replaced, not repeated
        try:
            if json.loads(old.read_text()).get("env", {}).get("predicted_by") == "gems plan":
                old.unlink()
        except (OSError, ValueError):
            continue
    for combo, cfg, plan, spent in zip(combos, cfgs, plans, costs):
        rec = predicted_record(cfg, plan, sweep, point_name(combo, base), spent)
        (folder / f"{rec['run_id']}.json").write_text(json.dumps(rec, indent=1))
        time.sleep(0.001)  # run ids are time-ordered
    write_studies(folder, sweep)
    print(f"table: {folder / 'table.md'}\nplot: {folder / 'scaling.png'}")
    return 0
