"""``gems results``: records -> ``table.md``, ``table.csv`` and ``scaling.png`` per sweep.

Records are grouped by their ``sweep`` field (single runs form the group
``runs``). Within a sweep the rows are sorted by world size and compared
with the smallest world of that sweep (p0): speedup is the throughput ratio;
weak-scaling efficiency is T(p0)/T(p) of the median step times, strong
scaling efficiency is p0*T(p0) / (p*T(p)). Failed runs stay in the table
with their error, so a sweep's holes are visible.
"""
from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from gems.errors import ConfigError

COLUMNS = ("name", "status", "world", "nodes", "mesh", "schedule", "batch", "samples/s", "samples/s/gpu",
           "speedup", "efficiency", "step_s", "compute_s", "halo_s", "pipe_comm_s", "allreduce_s", "wait_s",
           "data_s", "peak_mem_MiB", "tensor_mem_MiB", "final_loss")


def load_records(root: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(root.rglob("*.json")):
        if ".jobs" in p.parts or p.name.startswith("."):
            continue
        try:
            r = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(r, dict) and str(r.get("schema", "")).startswith("gems.record/"):
            r["_path"] = str(p)
            out.append(r)
    return out


def _mesh(r: dict[str, Any]) -> str:
    m = r.get("mesh") or {}
    return f"{m.get('replicas', '?')}x{m.get('pipeline', '?')}x{m.get('spatial', '?')}"


def measured(r: dict[str, Any]) -> bool:
    """Whether a record is a data point: ok and not diverged (a failed or diverged run has no throughput)."""
    return r.get("status") == "ok" and not r.get("diverged")


def rows_for(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    recs = sorted(records, key=lambda r: (r.get("world_size") or 0, r.get("run_id") or ""))
    ok = [r for r in recs if measured(r)]
    base = ok[0] if ok else None
    rows = []
    for r in recs:
        row: dict[str, Any] = {c: "" for c in COLUMNS}
        status = "diverged" if r.get("status") == "ok" and r.get("diverged") else r.get("status")
        row.update(name=r.get("name"), status=status, world=r.get("world_size"), nodes=r.get("nodes"),
                   mesh=_mesh(r), schedule=r.get("schedule"), batch=r.get("global_batch"))
        if measured(r) and base is not None:
            p, p0 = r["world_size"], base["world_size"]
            t, t0 = r["step_time_s"]["median"], base["step_time_s"]["median"]
            thr = r["throughput_samples_per_s"]
            scaling = ((r.get("config") or {}).get("results") or {}).get("scaling", "weak")
            eff = (t0 / t) if scaling == "weak" else (p0 * t0) / (p * t)
            bd = r.get("time_breakdown_s") or {}
            loss = r.get("loss") or [math.nan]
            row.update({
                "samples/s": thr, "samples/s/gpu": thr / p, "speedup": thr / base["throughput_samples_per_s"],
                "efficiency": eff, "step_s": t, "compute_s": bd.get("compute"), "halo_s": bd.get("halo"),
                "pipe_comm_s": bd.get("pipeline_comm"), "allreduce_s": bd.get("allreduce"),
                "wait_s": bd.get("bubble_or_wait"), "data_s": bd.get("data"),
                "peak_mem_MiB": r["peak_memory_bytes"]["max"] / 2**20,
                # CPU records: the tensor memory a GPU would count (peak_mem_MiB is RSS growth there)
                "tensor_mem_MiB": (r["peak_memory_bytes"]["tensor_max"] / 2**20
                                   if "tensor_max" in r["peak_memory_bytes"] else None),
                "final_loss": loss[-1],
                "_scaling": scaling,
            })
        elif r.get("diverged"):
            steps = r.get("nonfinite_steps") or []
            row["final_loss"] = f"non-finite loss at step(s) {', '.join(str(x) for x in steps[:5])}"
        else:
            row["final_loss"] = (r.get("error") or "")[:80]
        rows.append(row)
    return rows


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
    buf.write("| " + " | ".join(COLUMNS) + " |\n")
    buf.write("|" + "|".join("---" for _ in COLUMNS) + "|\n")
    for row in rows:
        buf.write("| " + " | ".join(_fmt(row[c]) for c in COLUMNS) + " |\n")
    return buf.getvalue()


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for row in rows:
            w.writerow([row[c] if not isinstance(row[c], float) else repr(row[c]) for c in COLUMNS])


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    if ok:
        ws = [r["world"] for r in ok]
        thr = [r["samples/s"] for r in ok]
        a1.plot(ws, thr, "o-", label="measured")
        scaling = ok[0].get("_scaling", "weak")
        ideal = [thr[0] * w / ws[0] for w in ws]
        a1.plot(ws, ideal, "k--", alpha=0.5, label="ideal")
        a1.set_xscale("log", base=2)
        a1.set_xlabel("GPUs / ranks")
        a1.set_ylabel("samples/s")
        a1.legend()
        a2.plot(ws, [r["efficiency"] for r in ok], "o-")
        a2.axhline(1.0, color="k", ls="--", alpha=0.5)
        a2.set_xscale("log", base=2)
        a2.set_ylim(0, max(1.1, max(r["efficiency"] for r in ok) * 1.1))
        a2.set_xlabel("GPUs / ranks")
        a2.set_ylabel(f"{scaling} scaling efficiency")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def aggregate(root: Path | str, only_sweep: str | None = None) -> dict[str, Path]:
    """Write the tables and plots for every sweep under ``root``; returns sweep -> folder."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError("results.dir", str(root), "a folder holding gems records (run `gems run` first)")
    records = load_records(root)
    if not records:
        raise ConfigError("results.dir", str(root), "a folder holding gems records (*.json with schema gems.record/1)")
    sweeps: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        sweeps.setdefault(r.get("sweep") or "runs", []).append(r)
    out = {}
    for sweep, recs in sorted(sweeps.items()):
        if only_sweep and sweep != only_sweep:
            continue
        folder = root / sweep
        folder.mkdir(parents=True, exist_ok=True)
        rows = rows_for(recs)
        (folder / "table.md").write_text(markdown(rows, sweep))
        write_csv(rows, folder / "table.csv")
        plot(rows, folder / "scaling.png", sweep)
        out[sweep] = folder
    return out
