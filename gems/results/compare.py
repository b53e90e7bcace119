"""``gems results --compare A B``: two studies side by side (mast against lp, this month against last).

Rows are matched by world size (by mesh where a study has several points of
one world size); the table gives both throughputs and efficiencies and the
ratio B/A, and one plot holds both curves (or both sets of bars). The files go
beside study A's records: ``compare-<A>-vs-<B>.md``, ``.csv`` and ``.png``.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from gems.errors import ConfigError

#: the step and its terms (time_breakdown_s) as the table names them
TERM_COLUMNS = ("step_s", "compute_s", "halo_s", "pipe_comm_s", "allreduce_s", "wait_s", "data_s")


def _study(arg: str) -> Any:
    from gems.results.table import studies

    for cand in (Path(arg), Path("results") / arg):
        if cand.is_dir():
            found = [s for s in studies(cand)[0] if s.sweep is not None and s.folder == cand]
            if not found:
                found = [s for s in studies(cand)[0] if s.sweep is not None]
            if len(found) == 1:
                return found[0]
            if len(found) > 1:
                raise ConfigError("results --compare", arg, "one study (this folder holds "
                                  + ", ".join(s.title for s in found) + ")")
    raise ConfigError("results --compare", arg, "a study: a sweep folder, or a sweep name under results/ "
                      "holding its records")


def _key(row: dict[str, Any], by_mesh: bool) -> Any:
    return row["mesh"] if by_mesh else row["world"]


def compare(a_arg: str, b_arg: str) -> int:
    from gems.results.table import plot

    a, b = _study(a_arg), _study(b_arg)
    ra = [r for r in a.rows if r.get("_ok")]
    rb = [r for r in b.rows if r.get("_ok")]
    by_mesh = len({r["world"] for r in ra}) < len(ra) or len({r["world"] for r in rb}) < len(rb)
    ia = {_key(r, by_mesh): r for r in ra}
    ib = {_key(r, by_mesh): r for r in rb}
    keys = sorted(set(ia) | set(ib), key=lambda k: (str(type(k)), k))
    # the step and each of its terms, A beside B: a predicted study (gems plan +experiment=NAME) against the
    # measured one compares term by term, as the planner and the runtime define them alike (README)
    terms = [t for t in TERM_COLUMNS if any(isinstance(r.get(t), float) for r in ra + rb)]
    cols = ["mesh" if by_mesh else "world", f"{a.title} samples/s", f"{b.title} samples/s", "ratio (B/A)",
            f"{a.title} efficiency", f"{b.title} efficiency"]
    cols += [f"{s.title} {t}" for t in terms for s in (a, b)] + ["note"]
    lines = []
    for k in keys:
        x, y = ia.get(k), ib.get(k)
        thr_a = x["samples/s"] if x else math.nan
        thr_b = y["samples/s"] if y else math.nan
        line = [k, thr_a, thr_b, thr_b / thr_a if x and y and thr_a else math.nan,
                x.get("efficiency", "") if x else "", y.get("efficiency", "") if y else ""]
        line += [r.get(t, math.nan) if r else math.nan for t in terms for r in (x, y)]
        line.append("oversubscribed: ranks share cores" if any(r and r.get("_over") for r in (x, y)) else "")
        lines.append(line)
    name = f"compare-{a.title}-vs-{b.title}"

    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) and not math.isnan(v) else ("" if isinstance(v, float) else str(v))

    md = [f"### {a.title} (A: {a.folder}) vs {b.title} (B: {b.folder})", "",
          "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    md += ["| " + " | ".join(fmt(v) for v in line) + " |" for line in lines]
    text = "\n".join(md) + "\n"
    (a.folder / f"{name}.md").write_text(text)
    with open(a.folder / f"{name}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        w.writerows(lines)
    plot(a.rows, a.folder / f"{name}.png", a.title, compare=[(b.title, b.rows)])
    print(text)
    print(f"table: {a.folder / (name + '.md')}\nplot: {a.folder / (name + '.png')}")
    return 0
