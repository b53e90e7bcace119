"""Accuracy against sample size: ``accuracy.md``, ``accuracy.csv`` and ``accuracy.png`` of a study whose points train one
model on samples of different edges (``+experiment=cosmoflow_sample_size``): a row an edge, the validation error per
target, of single crops and of each universe's crops averaged, plotted against the V^-1/2 law and beside ``gems data
baseline``'s power-spectrum errors where the study holds them (docs/science.md).
"""
from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Any, Sequence

#: the targets' names where the records do not say them (CosmoFlow's 4 parameters)
TARGETS = ("Omega_m", "sigma_8", "n_s", "H_0")


def sample_edge(r: dict[str, Any]) -> int | None:
    """The edge of one sample of a record's run: ``data.crop``, else the model's input size."""
    cfg = r.get("config") or {}
    crop = (cfg.get("data") or {}).get("crop")
    size = (cfg.get("model") or {}).get("size")
    edge = crop if crop is not None else size
    return int(edge) if edge is not None else None


def _final(r: dict[str, Any]) -> dict[str, Any] | None:
    vals = r.get("validation") or []
    return vals[-1] if vals and r.get("status") == "ok" else None


def applies(records: list[dict[str, Any]]) -> bool:
    """A study of accuracy against sample size: evaluated points with more than one sample edge."""
    edges = {sample_edge(r) for r in records if _final(r) is not None}
    return len(edges - {None}) > 1


def _spread(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per sample edge (smallest first), medians over the repeats."""
    by_edge: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        v, edge = _final(r), sample_edge(r)
        if v is not None and edge is not None and "mae_per_target" in v:
            by_edge.setdefault(edge, []).append(r)
    out = []
    for edge, rs in sorted(by_edge.items()):
        finals = [_final(r) for r in rs]
        n_t = len(finals[0]["mae_per_target"])  # type: ignore[index]
        row: dict[str, Any] = {"edge": edge, "voxels": edge ** 3, "runs": len(rs),
                               "mesh": sorted({"x".join(str((r.get("mesh") or {}).get(k, 1))
                                                        for k in ("replicas", "pipeline", "spatial")) for r in rs}),
                               "batch": sorted({r.get("global_batch") for r in rs}),
                               "epochs": sorted({round(float(f["epoch"]), 3) for f in finals if f}),  # type: ignore
                               "samples": finals[0].get("samples")}  # type: ignore[union-attr]
        for kind, key in (("crop", "mae"), ("avg", "mae_avg_crops")):
            if not all(f and key in f for f in finals):
                continue
            per = [f[f"{key}_per_target"] for f in finals]  # type: ignore[index]
            row[f"mae_{kind}"] = _spread([float(f[key]) for f in finals])  # type: ignore[index]
            for t in range(n_t):
                row[f"{TARGETS[t] if t < len(TARGETS) else t}_{kind}"] = _spread([float(p[t]) for p in per])
            row["groups"] = finals[0].get("groups")  # type: ignore[union-attr]
        out.append(row)
    return out


def _cell(v: Any) -> str:
    if isinstance(v, tuple):
        med, lo, hi = v
        return f"{med:.4f}" + (f" ({lo:.4f}-{hi:.4f})" if hi > lo else "")
    if isinstance(v, list):
        return ", ".join(str(x) for x in v)
    return "" if v is None else str(v)


def columns(rows_: list[dict[str, Any]]) -> list[str]:
    keys: list[str] = []
    for r in rows_:
        keys += [k for k in r if k not in keys]
    return keys


def markdown(rows_: list[dict[str, Any]], title: str, baseline: bool = False) -> str:
    cols = columns(rows_)
    ps = (" ps_ridge: a ridge regression on each crop's power spectrum, fitted on the same training universes "
          "(`gems data baseline`, baseline.json): what a classical estimator reads from a sample of that edge."
          if baseline else "")
    lines = [f"# {title}: validation error against sample edge", "",
             "Last evaluation of each run; mae: single crops; avg: each universe's crops averaged; medians over "
             "repeats (min-max). Targets in [-1, 1]: predicting 0 scores about 0.5." + ps, "",
             "| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows_]
    return "\n".join(lines) + "\n"


def write_csv(rows_: list[dict[str, Any]], path: Path) -> None:
    cols = columns(rows_)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows_:
            w.writerow([(r[c][0] if isinstance(r.get(c), tuple) else _cell(r.get(c))) for c in cols])


def plot(rows_: list[dict[str, Any]], path: Path, title: str, base: dict[int, dict[str, Any]] | None = None) -> None:
    """Error per target against the edge, log-log: single crops solid, crop averages dashed, the V^-1/2 law
    dotted through the smallest edge's mean error, and the power-spectrum baseline's mean error (every edge it
    has) in gray."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    edges = [r["edge"] for r in rows_]
    fig, ax = plt.subplots(figsize=(7, 4.6))
    names = [k[:-5] for k in columns(rows_) if k.endswith("_crop") and k != "mae_crop"
             and not k.startswith("ps_ridge")]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(names + ["mae"]):
        color = "k" if name == "mae" else colors[i % len(colors)]
        label = "mean over targets" if name == "mae" else name
        for kind, style in (("crop", "-o"), ("avg", "--s")):
            pts = [(r["edge"], r[f"{name}_{kind}"]) for r in rows_ if f"{name}_{kind}" in r]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            med = [p[1][0] for p in pts]
            err = [[p[1][0] - p[1][1] for p in pts], [p[1][2] - p[1][0] for p in pts]]
            ax.errorbar(xs, med, yerr=err, fmt=style, color=color, capsize=3, lw=2 if name == "mae" else 1,
                        mfc="white" if kind == "avg" else color,
                        label=f"{label} ({'single crop' if kind == 'crop' else 'crops averaged'})")
    first = rows_[0].get("mae_crop")
    if first:
        ax.plot(edges, [first[0] * (edges[0] / e) ** 1.5 for e in edges], ":", color="gray",
                label="V^-1/2 from the smallest edge")
    if base:
        bx = sorted(base)
        ax.plot(bx, [base[e]["mae"] for e in bx], "-^", color="gray", label="power-spectrum ridge (single crop)")
        ax.plot(bx, [base[e]["mae_avg_crops"] for e in bx], "--^", color="gray", mfc="white",
                label="power-spectrum ridge (crops averaged)")
        edges = sorted(set(edges) | set(bx))
    ax.axhline(0.5, color="gray", lw=0.8, alpha=0.6)
    ax.annotate("predicting 0", (edges[0], 0.5), textcoords="offset points", xytext=(2, 3), fontsize=7, color="gray")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(edges, [f"{e}^3" for e in edges])
    ax.set_xlabel("sample edge (cells)")
    ax.set_ylabel("validation mean absolute error (targets in [-1, 1])")
    ax.set_title(f"{title}: error against sample size")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def read_baseline(folder: Path, records: Sequence[dict[str, Any]] = ()) -> dict[int, dict[str, Any]]:
    """The power-spectrum baseline beside the study's records (``gems data baseline``, :mod:`gems.data.spectrum`)
    by edge; empty when there is none, it cannot be read, or it was computed on other universes than the
    ``records`` read (a warning says so)."""
    import json
    import sys

    try:
        got = json.loads((folder / "baseline.json").read_text())
        by_edge = {int(e["edge"]): e for e in got["edges"]}
        used = (got.get("data") or {}).get("path")
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    read = {str(Path(str(p)).resolve()) for r in records
            if (p := ((r.get("config") or {}).get("data") or {}).get("path")) is not None}
    if used is not None and read and read != {str(Path(str(used)).resolve())}:
        print(f"gems: warning: {folder / 'baseline.json'} was computed on {used}, the runs read "
              f"{', '.join(sorted(read))}: left out of the accuracy table (rerun gems data baseline)", file=sys.stderr)
        return {}
    return by_edge


def with_baseline(rows_: list[dict[str, Any]], base: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with the baseline's errors at its edge (single crops and crops averaged)."""
    for r in rows_:
        b = base.get(int(r["edge"]))
        if b is not None:
            for col, key in (("ps_ridge_mae_crop", "mae"), ("ps_ridge_mae_avg", "mae_avg_crops")):
                r[col] = (float(b[key]),) * 3  # (one fit: no spread over repeats)
    return rows_


def write(records: list[dict[str, Any]], folder: Path, title: str) -> bool:
    """Write the three files beside the study's records when the study is one of accuracy against sample size."""
    if not applies(records):
        return False
    base = read_baseline(folder, records)
    got = with_baseline(rows(records), base)
    (folder / "accuracy.md").write_text(markdown(got, title, bool(base)))
    write_csv(got, folder / "accuracy.csv")
    plot(got, folder / "accuracy.png", title, base)
    return True


__all__ = ["applies", "rows", "markdown", "write_csv", "plot", "write", "sample_edge", "read_baseline", "with_baseline"]
