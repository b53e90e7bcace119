"""``gems results``: records -> ``table.md``, ``table.csv`` and a plot per study, written beside its records.

A point of a sweep is one row (the median of its repeats and their spread), its speedup and efficiency taken within
its series under the inferred scaling, its energy where the records hold it, its references marked pass or fail
(:func:`aggregate`; docs/studies.md, "Tables and plots").
"""
from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gems.errors import ConfigError
from gems.results import accuracy

COLUMNS = ("name", "status", "world", "nodes", "mesh", "schedule", "batch", "samples/s", "samples/s/gpu",
           "TFLOP/s/gpu", "flops_frac", "GB/s/gpu", "bytes_frac", "speedup", "efficiency", "step_s", "compute_s",
           "halo_s", "pipe_comm_s", "allreduce_s", "wait_s",
           "data_s", "peak_mem_MiB", "tensor_mem_MiB", "final_loss", "val_mae", "time_to_target_s", "ttt_min_s",
           "ttt_max_s", "target_reached", "n", "samples/s_min", "samples/s_max", "reference", "note", "error")
#: the energy columns, after ``efficiency`` where a row holds them: the run's J a sample and mean W a device
ENERGY_COLUMNS = ("J/sample", "W/gpu")
#: an efficiency above this is flagged: super-linear scaling usually means a slow baseline, not a fast point
SUPERLINEAR = 1.05
#: fewer measured steps than this and a throughput is flagged (one step's time is one sample of a noisy machine)
FEW_STEPS = 3
#: what a reference may bound
REFERENCE_KEYS = {"throughput": "samples/s", "efficiency": "efficiency", "step_time": "step_s"}
#: the keys that make a point and are not part of the point's identity
_RUN_KEYS = ("run_id",)


@dataclass
class Loaded:
    records: list[dict[str, Any]]
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (path, why)


def load_records(root: Path) -> list[dict[str, Any]]:
    return load(root).records


def load(root: Path) -> Loaded:
    """Every gems record under ``root`` (job folders excluded), and what could not be read."""
    out: list[dict[str, Any]] = []
    skipped: list[tuple[str, str]] = []
    for p in sorted(root.rglob("*.json")):
        if ".jobs" in p.parts or p.name.startswith(".") or p.name in ("sweep.json",):
            continue
        try:
            r = json.loads(p.read_text())
        except OSError as e:
            skipped.append((str(p), e.strerror or str(e)))
            continue
        except json.JSONDecodeError as e:
            skipped.append((str(p), f"not JSON ({e.msg})"))
            continue
        if isinstance(r, dict) and str(r.get("schema", "")).startswith("gems.record/"):
            r["_path"] = str(p)
            out.append(r)
        elif isinstance(r, dict) and "status" in r and "run_id" in r:
            skipped.append((str(p), f"schema {r.get('schema')!r} is not gems.record/*"))
    return Loaded(out, skipped)


def _mesh(r: dict[str, Any]) -> str:
    m = r.get("mesh") or {}
    return f"{m.get('replicas', '?')}x{m.get('pipeline', '?')}x{m.get('spatial', '?')}"


def measured(r: dict[str, Any]) -> bool:
    """Whether a record is a data point: ok and not diverged (a failed or diverged run has no throughput)."""
    return r.get("status") == "ok" and not r.get("diverged")


def _status(r: dict[str, Any]) -> str:
    return "diverged" if r.get("status") == "ok" and r.get("diverged") else str(r.get("status"))


def point_of(r: dict[str, Any]) -> str:
    """The sweep point a record belongs to (its combination of the sweep's values)."""
    if r.get("point"):
        return str(r["point"])
    return f"{r.get('name')}|b{r.get('global_batch')}"


def oversubscribed(r: dict[str, Any]) -> bool:
    """Ranks per node beyond the node's GPUs (GPU ranks) or CPUs (CPU ranks x threads), where the record says."""
    env, world, nodes = r.get("env") or {}, r.get("world_size") or 0, max(1, r.get("nodes") or 1)
    per_node = world / nodes
    if env.get("device") == "cuda" and env.get("gpus"):
        return per_node > int(env["gpus"])
    if env.get("device") == "cpu" and env.get("cpus"):
        threads = int(((r.get("config") or {}).get("train") or {}).get("threads") or 1)
        shared = int(env.get("ranks_sharing_cpus") or per_node)
        return shared * max(1, threads) > int(env["cpus"])
    return False


def scaling_mode(points: list[dict[str, Any]], asked: str) -> str | None:
    """weak, strong or None (no efficiency): ``asked`` unless auto, else from how the batch follows the world."""
    if asked in ("weak", "strong"):
        return asked
    pairs = {(p["world"], p["batch"]) for p in points if p["world"]}
    if len({w for w, _ in pairs}) < 2:
        return None
    if len({b for _, b in pairs}) == 1:
        return "strong"
    if len({b / w for w, b in pairs}) == 1:
        return "weak"
    return None


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _series_key(r: dict[str, Any]) -> tuple[Any, ...]:
    """What a point is besides its world: model, schedule, micro-batches, precision... (not R, D, S, batch)."""
    c = r.get("config") or {}
    p = c.get("parallel") or {}
    m = c.get("model") or {}
    t = c.get("train") or {}
    return (m.get("name"), m.get("size"), m.get("depth"), m.get("width"), r.get("schedule"), p.get("micro_batches"),
            p.get("gems_replicas"), p.get("virtual_stages"), p.get("split_backward"), p.get("checkpoint"),
            t.get("precision"), (r.get("env") or {}).get("device"))


def rows_for(records: list[dict[str, Any]], sweep: bool = True, scaling: str = "auto",
             reference: dict[str, Any] | None = None, unfinished: list[dict[str, Any]] | None = None
             ) -> list[dict[str, Any]]:
    """The table rows of one study (``sweep``) or of single runs (no speedup or efficiency)."""
    if not sweep:
        return [_row_of([r]) for r in sorted(records, key=lambda r: r.get("run_id") or "")]
    # the newest record per (point, repeat): a re-run point replaces what it re-ran
    newest: dict[tuple[str, int], dict[str, Any]] = {}
    for r in sorted(records, key=lambda r: (r.get("run_id") or "")):
        newest[(point_of(r), int(r.get("repeat") or 0))] = r
    by_point: dict[str, list[dict[str, Any]]] = {}
    for (pt, _), r in sorted(newest.items()):
        by_point.setdefault(pt, []).append(r)
    rows = [_row_of(rs) for rs in by_point.values()]
    groups = [(rs, row) for rs, row in zip(by_point.values(), rows)]
    measured_pts = [row for rs, row in groups if row["_ok"]]
    models = {(row["_model"]) for row in measured_pts}
    mode = scaling_mode([{"world": row["world"], "batch": row["batch"]} for row in measured_pts], scaling) \
        if len(models) == 1 else None
    # speedup and efficiency within each series, against its smallest world
    series: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for rs, row in groups:
        series.setdefault(_series_key(rs[0]), []).append(row)
    for rows_s in series.values():
        ok = sorted((row for row in rows_s if row["_ok"]), key=lambda row: row["world"])
        if not ok or len(models) != 1:
            continue
        base = ok[0]
        for row in ok:
            row["speedup"] = row["samples/s"] / base["samples/s"] if base["samples/s"] else math.nan
            if mode == "weak":
                row["efficiency"] = base["step_s"] / row["step_s"]
            elif mode == "strong":
                row["efficiency"] = base["world"] * base["step_s"] / (row["world"] * row["step_s"])
            row["_scaling"] = mode
            eff = row["efficiency"]
            if isinstance(eff, float) and eff > SUPERLINEAR:
                _note(row, f"super-linear (efficiency {eff:.2f} > {SUPERLINEAR}): check the baseline's step times "
                           f"({base['name']}, {base['step_s']:.3g} s)")
    if reference:
        for row in rows:
            row["reference"] = check_reference(row, reference)
    out = sorted(rows, key=lambda row: (row["world"] or 0, str(row["_label"])))
    for u in unfinished or []:
        row = {c: "" for c in COLUMNS}
        row.update(name=u.get("name", ""), status=u.get("state", "pending"), world=u.get("world", ""),
                   mesh=u.get("mesh", ""), schedule=u.get("schedule", ""), batch=u.get("batch", ""),
                   note=u.get("why", ""), _ok=False, _label=u.get("label", ""), _model=None, _over=False,
                   _spread=None, _scaling=None)
        out.append(row)
    return out


def _row_of(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One point from its records (its repeats)."""
    r = rs[-1]
    row: dict[str, Any] = {c: "" for c in COLUMNS}
    ok = [x for x in rs if measured(x)]
    statuses = {_status(x) for x in rs}
    status = "ok" if ok and statuses == {"ok"} else ("diverged" if "diverged" in statuses else
                                                      "failed" if "failed" in statuses else _status(r))
    row.update(name=r.get("name"), status=status, world=r.get("world_size"), nodes=r.get("nodes"), mesh=_mesh(r),
               schedule=r.get("schedule"), batch=r.get("global_batch"), n=len(rs))
    row["_ok"], row["_model"] = bool(ok) and status == "ok", ((r.get("config") or {}).get("model") or {}).get("name")
    row["_label"], row["_scaling"], row["_spread"] = r.get("point") or r.get("name"), None, None
    row["_over"] = any(oversubscribed(x) for x in rs)
    if row["_ok"]:
        thr = [float(x["throughput_samples_per_s"]) for x in ok]
        steps = [float(x["step_time_s"]["median"]) for x in ok]
        p = int(r.get("world_size") or 1)
        bd = {k: _median([float((x.get("time_breakdown_s") or {}).get(k) or 0.0) for x in ok])
              for k in ("compute", "halo", "pipeline_comm", "allreduce", "bubble_or_wait", "data")}
        mem = [x["peak_memory_bytes"] for x in ok]
        loss = [((x.get("loss") or [math.nan])[-1]) for x in ok]
        row.update({
            "samples/s": _median(thr), "samples/s/gpu": _median(thr) / p, "step_s": _median(steps),
            "compute_s": bd["compute"], "halo_s": bd["halo"], "pipe_comm_s": bd["pipeline_comm"],
            "allreduce_s": bd["allreduce"], "wait_s": bd["bubble_or_wait"], "data_s": bd["data"],
            "peak_mem_MiB": max(m["max"] for m in mem) / 2**20,
            "tensor_mem_MiB": (max(m["tensor_max"] for m in mem) / 2**20 if all("tensor_max" in m for m in mem)
                               else None),
            "final_loss": loss[-1], "samples/s_min": min(thr), "samples/s_max": max(thr),
        })
        row["_spread"] = (min(thr), max(thr))
        row.update(_training(ok))
        if row.get("_absent"):
            _note(row, f"{', '.join(row['_absent'])}: neither labelled nor predicted in the last validation, no Dice "
                  "(left out of dice_foreground, the foreground classes' mean)")
        row.update(_hardware(r))
        row.update(_energy(ok))
    elif status == "diverged":
        steps_nf = [s for x in rs for s in (x.get("nonfinite_steps") or [])]
        row["final_loss"] = f"non-finite loss at step(s) {', '.join(str(s) for s in sorted(set(steps_nf))[:5])}"
    else:  # a failed point's error goes in its own column, not in the loss's
        row["error"] = (next((x.get("error") for x in rs if x.get("error")), "") or "")[:120]
    row["_predicted"] = bool(r.get("predicted"))
    again = ((r.get("config") or {}).get("cluster") or {}).get("resubmitted")
    if again:  # a node's failed health check (cluster.exclude_bad_nodes): the job ran without it
        _note(row, str(again).rsplit("; ", 1)[-1])
    if row["_over"]:
        _note(row, "oversubscribed: ranks share cores")
    if row["_predicted"]:
        fits = (r.get("peak_memory_bytes") or {}).get("fits")
        _note(row, "predicted by gems plan, not measured" + ("" if fits is not False else "; does not fit")
              + ("; J/sample and W/gpu at the GPUs' power limit (a bound)" if (r.get("telemetry") or {}).get("bound")
                 else ""))
        row["final_loss"] = ""
    elif row["_ok"]:
        few = min(measured_steps(x) for x in ok)
        if few < FEW_STEPS:
            _note(row, f"the throughput rests on {few} measured step(s)")
    return row


def _hardware(r: dict[str, Any]) -> dict[str, Any]:
    """The record's distance to the device (gems.plan.roofline): the model's TFLOP/s and GB/s a rank reached, and
    their fractions of the device's peak (a CPU's: none)."""
    hw = r.get("hardware") or {}
    out: dict[str, Any] = {}
    for col, key, scale in (("TFLOP/s/gpu", "flops_per_s_per_rank", 1e12), ("GB/s/gpu", "bytes_per_s_per_rank", 1e9),
                            ("flops_frac", "flops_fraction", 1.0), ("bytes_frac", "bytes_fraction", 1.0)):
        v = hw.get(key)
        if isinstance(v, (int, float)):
            out[col] = float(v) / scale
    return out


def _energy(ok: list[dict[str, Any]]) -> dict[str, Any]:
    """A point's J a sample and W a device (``telemetry``), the medians over its repeats that hold them."""
    out: dict[str, Any] = {}
    for col, key in zip(ENERGY_COLUMNS, ("j_per_sample", "w_per_device")):
        got = [float(v) for x in ok if isinstance(v := (x.get("telemetry") or {}).get(key), (int, float))]
        if got:
            out[col] = _median(got)
    return out


def time_to_target(seconds: list[float]) -> float:
    """MLPerf HPC's figure over a point's repeats: with 3 or more, the fastest and the slowest are dropped and the
    rest averaged (an "olympic" mean); with fewer, the mean."""
    xs = sorted(seconds)
    if len(xs) >= 3:
        xs = xs[1:-1]
    return sum(xs) / len(xs) if xs else math.nan


def _training(ok: list[dict[str, Any]]) -> dict[str, Any]:
    """A point's training figures over its repeats: the last validation error, and with a target, how many
    repeats reached it and their time to it (MLPerf HPC's mean, and the spread)."""
    out: dict[str, Any] = {}
    maes = [float(v[-1]["mae"]) for x in ok if (v := x.get("validation")) and "mae" in v[-1]]
    if maes:
        out["val_mae"] = _median(maes)
    out.update(dice_of(ok))
    targeted = [x for x in ok if x.get("target")]
    if targeted:
        hit = [float(x["time_to_target_s"]) for x in targeted if x["target"].get("reached")]
        out["target_reached"] = f"{len(hit)}/{len(targeted)}"
        if hit:
            out.update(time_to_target_s=time_to_target(hit), ttt_min_s=min(hit), ttt_max_s=max(hit))
    return out


def dice_names(r: dict[str, Any]) -> list[str]:
    """The Dice columns of a record of a class a voxel (its ``classes``: names by label; ``class K`` where a record
    names none), empty for other records."""
    v = r.get("validation") or []
    dice = v[-1].get("dice") if v and isinstance(v[-1], dict) else None
    if not isinstance(dice, list):
        return []
    names = r.get("classes")
    names = names if isinstance(names, list) and len(names) == len(dice) else [f"class {k}" for k in range(len(dice))]
    return [f"dice_{n}" for n in names]


def dice_of(ok: list[dict[str, Any]]) -> dict[str, Any]:
    """Each class's Dice of a point's last validation, by name (:func:`dice_names`), the median over its repeats
    (a class neither predicted nor labelled in a run counts in none; one so in every repeat is named in
    ``_absent``: the table's note says so)."""
    out: dict[str, Any] = {}
    seen: list[str] = []
    for x in ok:
        for col, d in zip(dice_names(x), (x.get("validation") or [{}])[-1].get("dice") or []):
            seen += [col] if col not in seen else []
            if isinstance(d, (int, float)):
                out.setdefault(col, []).append(float(d))
    absent = [col[len("dice_"):] for col in seen if col not in out]
    return {col: _median(vs) for col, vs in out.items()} | ({"_absent": absent} if absent else {})


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """The table's columns: :data:`COLUMNS`, each Dice column a row holds after ``val_mae`` (segmentation), and the
    energy columns after ``efficiency`` where a row holds them."""
    extra: list[str] = []
    for row in rows:
        extra += [c for c in row if c.startswith("dice_") and c not in extra]
    cols = list(COLUMNS)
    at = cols.index("val_mae") + 1
    cols = cols[:at] + extra + cols[at:]
    energy = [c for c in ENERGY_COLUMNS if any(isinstance(row.get(c), float) for row in rows)]
    at = cols.index("efficiency") + 1
    return cols[:at] + energy + cols[at:]


def measured_steps(r: dict[str, Any]) -> int:
    """How many steps a record's throughput rests on (the median of their times)."""
    return len((r.get("step_time_s") or {}).get("all") or [])


def _note(row: dict[str, Any], text: str) -> None:
    row["note"] = f"{row['note']}; {text}" if row.get("note") else text


def check_reference(row: dict[str, Any], reference: dict[str, Any]) -> str:
    """``pass``, ``fail (...)`` or empty: the point against its reference (``all`` points' bounds, and its
    world size's, which win where both bound one metric)."""
    by = {str(k): v for k, v in reference.items()}
    ref = {**(by.get("all") or by.get("*") or {}), **(by.get(str(row["world"])) or {})}  # the world's own bounds win
    if not ref:
        return ""
    if not row["_ok"]:
        return f"fail ({row['status']})"
    for what, bounds in ref.items():
        col = REFERENCE_KEYS.get(what)
        if col is None:
            raise ConfigError(f"results.reference.{what}", bounds, "bounds on " + ", ".join(REFERENCE_KEYS))
        val = row.get(col)
        if val in ("", None) or (isinstance(val, float) and math.isnan(val)):
            return f"fail (no {what})"
        lo, hi = (list(bounds) + [None, None])[:2]
        if lo is not None and val < float(lo):
            return f"fail ({what} {val:.4g} < {lo})"
        if hi is not None and val > float(hi):
            return f"fail ({what} {val:.4g} > {hi})"
    return "pass"


def check_reference_spec(reference: Any) -> None:
    """ConfigError for a reference that names no metric gems has, or bounds that are not two numbers."""
    if not reference:
        return
    from omegaconf import OmegaConf

    if OmegaConf.is_config(reference):
        reference = OmegaConf.to_container(reference, resolve=True)
    if not isinstance(reference, dict):
        raise ConfigError("results.reference", reference, "a mapping: world size (or all) -> {metric: [low, high]}")
    for where, ref in reference.items():
        if not (str(where).isdigit() or str(where) in ("all", "*")):
            raise ConfigError(f"results.reference.{where}", ref, "a world size (e.g. 4) or all, for every point")
        if not isinstance(ref, dict):
            raise ConfigError(f"results.reference.{where}", ref, "{throughput|efficiency|step_time: [low, high]}")
        for what, bounds in ref.items():
            if what not in REFERENCE_KEYS:
                raise ConfigError(f"results.reference.{where}.{what}", bounds, "bounds on one of " + ", ".join(REFERENCE_KEYS))
            if not isinstance(bounds, (list, tuple)) or len(bounds) != 2 or not all(
                    b is None or isinstance(b, (int, float)) for b in bounds):
                raise ConfigError(f"results.reference.{where}.{what}", bounds, "[low, high] (null for no bound)")


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return "" if v is None else str(v)


def markdown(rows: list[dict[str, Any]], title: str = "") -> str:
    buf = io.StringIO()
    if title:
        buf.write(f"### {title}\n\n")
    if rows and all(r.get("_predicted") for r in rows if r.get("status")):
        buf.write("Predicted by `gems plan`, not measured: every figure below is the planner's.\n\n")
    cols = columns(rows)
    buf.write("| " + " | ".join(cols) + " |\n")
    buf.write("|" + "|".join("---" for _ in cols) + "|\n")
    for row in rows:
        buf.write("| " + " | ".join(_fmt(row.get(c, "")) for c in cols) + " |\n")
    return buf.getvalue()


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        cols = columns(rows)
        w.writerow(cols)
        for row in rows:
            w.writerow([row.get(c, "") if not isinstance(row.get(c), float) else repr(row[c]) for c in cols])


def plot(rows: list[dict[str, Any]], path: Path, title: str, compare: list[tuple[str, list[dict[str, Any]]]] | None = None
         ) -> None:
    """Throughput (with its spread over repeats) and efficiency against the world, and the energy a sample where the
    records hold it; labelled bars when every point has the same world (a comparison, not a scaling curve).
    ``compare``: more studies on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    studies = [(title, rows)] + list(compare or [])
    ok_all = [r for _, rs in studies for r in rs if r.get("_ok")]
    energy = [r for r in ok_all if isinstance(r.get("J/sample"), float)]
    fig, axes = plt.subplots(1, 2 + bool(energy), figsize=(11 + 5.5 * bool(energy), 4.2))
    a1, a2 = axes[0], axes[1]
    if energy:
        energy_panel(axes[-1], studies)
    worlds = {r["world"] for r in ok_all}
    if ok_all and len(worlds) == 1:  # a comparison at one world size: labelled bars
        labels = [f"{name}: {r['_label']}" if compare else str(r["_label"]) for name, rs in studies for r in rs if r["_ok"]]
        vals = [r["samples/s"] for _, rs in studies for r in rs if r["_ok"]]
        errs = [[r["samples/s"] - r["_spread"][0] for _, rs in studies for r in rs if r["_ok"]],
                [r["_spread"][1] - r["samples/s"] for _, rs in studies for r in rs if r["_ok"]]]
        xs = range(len(vals))
        a1.bar(xs, vals, yerr=errs, capsize=3, color="tab:blue")
        a1.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
        a1.set_ylabel("samples/s")
        a1.set_title(f"{next(iter(worlds))} ranks each")
        a2.axis("off")
    elif ok_all:
        for name, rs in studies:
            ok = sorted((r for r in rs if r["_ok"]), key=lambda r: r["world"])
            if not ok:
                continue
            ws = [r["world"] for r in ok]
            thr = [r["samples/s"] for r in ok]
            err = [[t - r["_spread"][0] for t, r in zip(thr, ok)], [r["_spread"][1] - t for t, r in zip(thr, ok)]]
            what = "predicted by gems plan" if all(r.get("_predicted") for r in ok) else "measured"
            line = a1.errorbar(ws, thr, yerr=err, fmt="-", capsize=3, label=f"{name} ({what})" if compare else what)
            color = line[0].get_color()
            for hollow in (False, True):
                pts = [(w, t) for w, t, r in zip(ws, thr, ok) if bool(r["_over"]) == hollow]
                if pts:
                    said = any(h.get_label().startswith("oversubscribed") for h in a1.get_lines())
                    a1.plot(*zip(*pts), "o", color=color, mfc="white" if hollow else color, zorder=3,
                            label="oversubscribed (not a scaling result)" if hollow and not said else "_")
            if not compare and thr:
                a1.plot(ws, [thr[0] * w / ws[0] for w in ws], "k--", alpha=0.5, label="ideal")
            eff = [(r["world"], r["efficiency"], r["_over"]) for r in ok if isinstance(r.get("efficiency"), float)]
            if eff:
                a2.plot([e[0] for e in eff], [e[1] for e in eff], "-", color=color, label=name)
                a2.scatter([e[0] for e in eff], [e[1] for e in eff], color=color, zorder=3,
                           facecolors=["white" if e[2] else color for e in eff])
                sup = [e for e in eff if e[1] > SUPERLINEAR]
                if sup:  # super-linear: a slow baseline more often than a fast point
                    a2.scatter([e[0] for e in sup], [e[1] for e in sup], marker="x", s=80, color="tab:red", zorder=4,
                               label=f"super-linear (> {SUPERLINEAR}): check the baseline")
                    for w, e, _ in sup:
                        a2.annotate(f"{e:.2f}", (w, min(e, 1.4)), textcoords="offset points", xytext=(4, 4),
                                    fontsize=7, color="tab:red")
        for ax in (a1, a2):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GPUs / ranks")
        a1.set_yscale("log")  # against a log world axis: ideal scaling is a straight line
        a1.set_ylabel("samples/s (log)")
        a1.legend(fontsize=8)
        modes = {str(r["_scaling"]) for r in ok_all if r.get("_scaling")}
        a2.axhline(1.0, color="k", ls="--", alpha=0.5)
        a2.set_ylabel(f"{'/'.join(sorted(modes)) or 'no'} scaling efficiency")
        top = max([1.15] + [min(1.5, float(r["efficiency"]) + 0.1) for r in ok_all
                            if isinstance(r.get("efficiency"), float)])
        a2.set_ylim(0, top)
        if compare or any(isinstance(r.get("efficiency"), float) and r["efficiency"] > SUPERLINEAR for r in ok_all):
            a2.legend(fontsize=8)
    predicted = ok_all and all(r.get("_predicted") for r in ok_all)
    head = title if not compare else " vs ".join(n for n, _ in studies)
    fig.suptitle(head + (" (predicted by gems plan, not measured)" if predicted else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def energy_panel(ax: Any, studies: list[tuple[str, list[dict[str, Any]]]]) -> None:
    """J a sample against the world, one line a study (its points that hold it)."""
    for name, rs in studies:
        pts = sorted((r["world"], r["J/sample"]) for r in rs if r.get("_ok") and isinstance(r.get("J/sample"), float))
        if pts:
            ax.plot(*zip(*pts), "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("GPUs / ranks")
    ax.set_ylabel("J/sample")
    ax.set_title("energy a sample")
    ax.legend(fontsize=8)


def trace_plot(record: dict[str, Any], path: Path) -> bool:
    """The record's power and SM clock over the steps, one line a rank (``telemetry.trace``); False where it has
    none. A step's samples are spread over it in the order read."""
    trace = (record.get("telemetry") or {}).get("trace") or {}
    if not trace:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (pw, sm) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for rank, rows in sorted(trace.items(), key=lambda kv: int(kv[0])):
        xs = _over_steps([int(r[1]) for r in rows])
        for ax, k in ((pw, 2), (sm, 3)):
            pts = [(x, r[k]) for x, r in zip(xs, rows) if r[k] is not None]
            if pts:
                ax.plot(*zip(*pts), "-", lw=1, label=f"rank {rank}")
    pw.set_ylabel("power (W)")
    sm.set_ylabel("SM clock (MHz)")
    sm.set_xlabel("step")
    pw.legend(fontsize=7, ncol=4)
    fig.suptitle(f"{record.get('run_id')}: power and SM clock, one line a rank")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _over_steps(steps: list[int]) -> list[float]:
    """Each sample's place on a step axis: a step's samples spread evenly over it."""
    out: list[float] = []
    i = 0
    while i < len(steps):
        j = i
        while j < len(steps) and steps[j] == steps[i]:
            j += 1
        out += [steps[i] + (k - i) / (j - i) for k in range(i, j)]
        i = j
    return out


@dataclass
class Study:
    """One table: the records of a sweep in one folder, or the single runs of a folder."""

    folder: Path
    sweep: str | None
    records: list[dict[str, Any]]
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def title(self) -> str:
        return self.sweep or "runs"

    def failed_references(self) -> list[str]:
        return [f"{self.title}: {r['name']}: {r['reference']}" for r in self.rows if str(r["reference"]).startswith("fail")]


def studies(root: Path | str) -> tuple[list[Study], list[tuple[str, str]]]:
    """The studies under ``root`` (grouped by folder and sweep) and the files that could not be read."""
    from gems.results.manifest import unfinished_points

    root = Path(root)
    got = load(root)
    groups: dict[tuple[str, str | None], list[dict[str, Any]]] = {}
    for r in got.records:
        groups.setdefault((str(Path(r["_path"]).parent), r.get("sweep")), []).append(r)
    out = []
    for (folder, sweep), recs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] or "")):
        cfg_res = ((recs[-1].get("config") or {}).get("results") or {})
        unfinished = unfinished_points(Path(folder), recs) if sweep else []
        rows = rows_for(recs, sweep=sweep is not None, scaling=str(cfg_res.get("scaling") or "auto"),
                        reference=cfg_res.get("reference") or None, unfinished=unfinished)
        out.append(Study(Path(folder), sweep, recs, rows))
    return out, got.skipped


def aggregate(root: Path | str, only_sweep: str | None = None) -> dict[str, Path]:
    """Write the tables and plots of every study under ``root`` beside its records; returns title -> folder."""
    return {s.title: s.folder for s in write_studies(root, only_sweep)[0]}


def write_studies(root: Path | str, only_sweep: str | None = None) -> tuple[list[Study], list[tuple[str, str]]]:
    root = Path(root)
    if not root.is_dir():
        raise ConfigError("results.dir", str(root), "a folder holding gems records (run `gems run` first)")
    found, skipped = studies(root)
    if not found:
        raise ConfigError("results.dir", str(root), "a folder holding gems records (*.json with schema gems.record/1)")
    out = []
    for s in found:
        if only_sweep and s.sweep != only_sweep:
            continue
        (s.folder / "table.md").write_text(markdown(s.rows, s.title))
        write_csv(s.rows, s.folder / "table.csv")
        if s.sweep is not None:
            plot(s.rows, s.folder / "scaling.png", s.title)
            accuracy.write(s.records, s.folder, s.title)  # a study of accuracy against sample size
        for r in s.records:  # a run's power and clock over its steps, once
            png = Path(r["_path"]).with_suffix(".power.png")
            if not png.exists():
                trace_plot(r, png)
        out.append(s)
    return out, skipped
