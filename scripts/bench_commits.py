"""Benchmark rows of several commits side by side, alternated, on this machine (one command):

    python scripts/bench_commits.py spatial  REV [REV ...] [--rounds N] [--out FILE]
    python scripts/bench_commits.py pipeline REV [REV ...] [--rounds N] [--out FILE]
                                    [--models bench,second] [--only "LABEL,LABEL"] [--cycles N]
    python scripts/bench_commits.py overhead REV [REV ...] [--rounds N] [--out FILE]

Each REV is checked out in a temporary git worktree; ``now`` stands for this work tree. A round runs every commit
once, the order reversed every other round, each run in a subprocess that imports that commit's gems and calls its
own benchmark code, so the commits see the same machine noise:

* spatial: ``gems.bench.spatial.bench_rank`` for S=1 and S=2 with and without overlap (CosmoFlow 128^3);
* pipeline: ``gems.bench.pipeline._bench_rank`` over lp, mast, master, 1F1B and interleaved against torch's, on the
  benchmark's model and on a second one (ResNet-38, BatchNorm, width 0.25, 32^2), every commit at the same cuts
  (measured once, by the first revision's ``_balance``, and printed under the table);
* overhead: ``gems.bench.overhead``'s plain loop, gems loop and R = 1 and 2 runs.

``paired`` runs the pipeline rows of every commit in the *same* two processes instead, step by step in one rotating
order (as ``gems bench pipeline`` runs its contenders), so each cycle pairs the commits' steps under the same noise:

    python scripts/bench_commits.py paired REV [REV ...] [--cycles N] [--out FILE] [--models ...] [--only ...]

Each commit's ``gems`` package is copied under a name of its own (``gems_r0``, ``gems_r1``, ...; imports renamed, and
with them the few strings that start with ``gems.``, such as checkpoint file names, which the pipeline rows never use)
so both import side by side; torch's rows run once per commit too, a control that should read 1.00 between commits. It
prints each row's median, each of :data:`RATIOS` per commit (the median of the per-cycle ratios, with a 90%
bootstrap interval over the cycles), and each ratio of a later commit over the first's.

It prints a markdown table of medians (step seconds for spatial and overhead, samples/s for pipeline; for pipeline
also mast, master over lp and gems's 1F1B and interleaved over torch's as medians of the per-round ratios) and
writes it to ``--out`` with the raw runs beside it (``.json``). The side-by-side runs of commits in
results/history/pipeline-schedules.md were made this way (gradient-sum-points, pipeline-mirror-sums and most
sections after them). A wrong ``--models`` or ``--cycles`` is exit 2 with one line. A REV that is a commit keeps the
run fixed while the work tree changes; ``now`` does not.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: pipeline's second model (``--models second``; scripts/sweep_gloo_lead.py's too): ResNet-38, BatchNorm, width 0.25,
#: on 32^2 images
SECOND_MODEL = dict(depth=38, width=0.25, size=32, norm="batch")
#: the pipeline ratios read round by round: (row, the row it is over)
RATIOS = [("gems mast", "gems lp"), ("gems mast (m=2 per direction)", "gems lp"),
          ("gems master (eta=2, m=2 per pass)", "gems lp"), ("gems 1f1b (m=4)", "torch Schedule1F1B (m=4)"),
          ("gems interleaved1f1b (v=2, m=4)", "torch ScheduleInterleaved1F1B (v=2, m=4)")]


def median_rows(runs: dict[str, list[dict[str, float]]], heads: list[str], unit: str) -> list[str]:
    """A markdown table of each row's median over the rounds, one column per key of ``runs`` (headed ``heads``)."""
    cols = list(runs)
    text = [f"| row ({unit}, median of {len(runs[cols[0]])} alternated rounds) | " + " | ".join(heads) + " |",
            "| --- | " + " | ".join("---:" for _ in cols) + " |"]
    for row in runs[cols[0]][0]:
        text.append(f"| {row} | " + " | ".join(f"{statistics.median(x[row] for x in runs[c]):.4g}" for c in cols)
                    + " |")
    return text


def ratio_rows(runs: dict[str, list[dict[str, float]]], models: list[str]) -> list[str]:
    """For each model and each of :data:`RATIOS` whose rows ran: per column, the median over the rounds of the ratio
    within a round (the two rows ran in the same processes, side by side), and each round's in brackets."""
    out = []
    for m in models:
        for a, b in RATIOS:
            ka, kb = f"{a} [{m}]", f"{b} [{m}]"
            if not all(ka in x and kb in x for rounds in runs.values() for x in rounds):
                continue
            cells = []
            for rounds in runs.values():
                rs = [x[ka] / x[kb] for x in rounds]
                cells.append(f"{statistics.median(rs):.3f} ({', '.join(f'{v:.2f}' for v in rs)})")
            out.append(f"| {a} over {b} [{m}], median of the rounds' ratios (each round's) | " + " | ".join(cells)
                       + " |")
    return out


# the code each subprocess runs, with TREE the commit's checkout on sys.path ahead of everything
_CHILD = {
    "spatial": """
from gems.bench.spatial import RUNS, bench_rank, _summary
from gems.launch.world import run_world
out = {}
for name in ("S=1 (serial)", "S=2 (depth, overlap)", "S=2 (depth, no overlap)"):
    world, mode, host = RUNS[name]
    out[name] = _summary([run_world(bench_rank, world, 128, 3, 1, mode, host, timeout=1800)], 3)["step"]
""",
    "pipeline": """
import statistics
from gems.launch.world import run_world
LABELS = ["gems lp", "gems mast", "gems mast (m=2 per direction)", "gems master (eta=2, m=2 per pass)",
          "gems 1f1b (m=4)", "torch Schedule1F1B (m=4)", "gems interleaved1f1b (v=2, m=4)",
          "torch ScheduleInterleaved1F1B (v=2, m=4)"]
subset = [c for c in bp.CONTENDERS if c["label"] in (ONLY or LABELS)]
size = bp.MODEL["size"]
res = run_world(bp._bench_rank, 2, subset, {size: BAL["2"], (size, 4): BAL["4"]}, CYCLES, 3, timeout=1800)
out = {f"{c['label']} [{MODEL}]": c["B"] / statistics.median(max(a, b) for a, b in zip(res[0]["times"][i],
                                                                                        res[1]["times"][i]))
       for i, c in enumerate(subset)}
""",
    # the cuts every commit's pipeline rows run at (measured once, by the first revision's code: one cut for all)
    "balance": """
size = bp.MODEL["size"]
out = {"2": bp._balance(size), "4": bp._balance(size, 4)}
""",
    "overhead": """
from pathlib import Path
import torch
from gems.bootstrap import keep_host_memory
import gems.bench.overhead as o
torch.set_num_threads(1)
keep_host_memory()
runs = Path(TMP) / "runs"
out = {"plain loop": o.plain_loop(2), "gems loop": o.gems_loop(2), "R=1": o.launched(1, 2, runs),
       "R=2": o.launched(2, 2, runs)}
""",
}
_WRAP = """
import json, sys
TREE, MODEL, TMP, ONLY, CYCLES, BAL, SECOND = {tree!r}, {model!r}, {tmp!r}, {only!r}, {cycles!r}, {bal!r}, {second!r}
sys.path.insert(0, TREE)
import gems
assert gems.__file__.startswith(TREE), gems.__file__
import gems.bench.pipeline as bp  # (at the top: the ranks run_world spawns import this file again)
if MODEL == "second":  # pipeline: a second model, a deeper, narrower BatchNorm ResNet on 32^2
    bp.MODEL.update(SECOND)
if __name__ == "__main__":
{body}
    print("RESULT " + json.dumps(out))
"""


# ``paired``: every commit's package, renamed, imported side by side in the same two ranks
_PAIRED = """
import importlib, json, os, sys, time
PKGS, MODEL, ONLY, CYCLES, BAL, SECOND, LABELS = {pkgs!r}, {model!r}, {only!r}, {cycles!r}, {bal!r}, {second!r}, \
{labels!r}
WARMUP = 3
sys.path[:0] = PKGS
BPS = [importlib.import_module(f"gems_r{{k}}.bench.pipeline") for k in range(len(PKGS))]
for bp in BPS:
    assert bp.__file__.startswith(PKGS[BPS.index(bp)]), bp.__file__
    if MODEL == "second":
        bp.MODEL.update(SECOND)


def rank_fn(rank, world):
    import torch.distributed as dist
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= world:
        os.sched_setaffinity(0, {{sorted(os.sched_getaffinity(0))[rank]}})
    importlib.import_module("gems_r0.bootstrap").keep_host_memory()
    size = BPS[0].MODEL["size"]
    built = []  # (commit, label, training step)
    for k, bp in enumerate(BPS):
        for c in bp.CONTENDERS:
            if c["label"] in (ONLY or LABELS):
                built.append((k, c["label"], bp._contender(rank, world, c, {{size: BAL["2"], (size, 4): BAL["4"]}})[0]))
    times = [[] for _ in built]
    for cycle in range(WARMUP + CYCLES):
        for j in range(len(built)):
            i = (cycle + j) % len(built)
            dist.barrier()
            t0 = time.perf_counter()
            built[i][2](cycle)
            dist.barrier()
            if cycle >= WARMUP:
                times[i].append(time.perf_counter() - t0)
    return [(k, label, t) for (k, label, _), t in zip(built, times)]


if __name__ == "__main__":
    importlib.import_module("gems_r0.launch.world")
    res = sys.modules["gems_r0.launch.world"].run_world(rank_fn, 2, timeout=7200)
    out = {{f"{{label}} [{{MODEL}}] @{{k}}": [max(a, b) for a, b in zip(t0, t1)]
           for (k, label, t0), (_, _, t1) in zip(res[0], res[1])}}
    print("RESULT " + json.dumps(out))
"""
#: the rows ``paired`` runs unless ``--only`` names others
PAIRED_LABELS = ["gems lp", "gems mast", "gems 1f1b (m=4)", "torch Schedule1F1B (m=4)", "gems gpipe (m=4)",
                 "torch ScheduleGPipe (m=4)", "gems gpipe (m=2)", "torch ScheduleGPipe (m=2)",
                 "gems interleaved1f1b (v=2, m=4)", "torch ScheduleInterleaved1F1B (v=2, m=4)"]
#: the ratios ``paired`` reads: :data:`RATIOS` and gems's gpipe over torch's
_PAIRED_RATIOS = RATIOS + [("gems gpipe (m=4)", "torch ScheduleGPipe (m=4)"),
                           ("gems gpipe (m=2)", "torch ScheduleGPipe (m=2)")]


def _package(tree: str, dest: Path, k: int) -> str:
    """A copy of ``tree``'s gems package as ``gems_r{k}`` under ``dest`` (its imports renamed, conf/ beside it as
    in the tree), so that several commits' packages import in one process; returns the folder to put on sys.path."""
    import shutil

    name = f"gems_r{k}"
    root = dest / f"pkg-{k}"
    shutil.copytree(Path(tree) / "gems", root / name, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "conf").symlink_to(Path(tree) / "conf")
    for f in (root / name).rglob("*.py"):
        text = re.sub(r"\bgems(?=\.[A-Za-z_])", name, f.read_text())
        f.write_text(re.sub(r"\b(from|import) gems\b(?!\.)", rf"\1 {name}", text))
    return str(root)


def _bootstrap(xs: list[float], reps: int = 2000) -> tuple[float, float, float]:
    """The median of ``xs`` and a 90% bootstrap interval of it (resampling the cycles; seeded: the same runs give
    the same interval)."""
    import random

    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(reps))
    return statistics.median(xs), meds[int(0.05 * reps)], meds[int(0.95 * reps) - 1]


def paired_rows(runs: dict[str, list[float]], revs: list[str], models: list[str]) -> list[str]:
    """``paired``'s table: each row's median step per commit, and each later commit's throughput over the first's
    (the median over the cycles of the ratio within a cycle, 90% interval: torch's rows are the control); then each
    ratio of :data:`_PAIRED_RATIOS` per commit and over the first commit's, the same way. A row a commit lacks reads
    "-"."""
    def cell(xs: list[float] | None) -> str:
        if xs is None:
            return "-"
        m, lo, hi = _bootstrap(xs)
        return f"{m:.3f} ({lo:.3f}-{hi:.3f})"

    def over(per: list[list[float] | None]) -> list[str]:
        first = per[0]
        return [cell([y / x for x, y in zip(first, now)] if first and now else None) for now in per[1:]]

    n = len(next(iter(runs.values())))
    text = [f"| row (median step in ms over {n} cycles; ratios: median of the per-cycle ratios, 90% interval) | "
            + " | ".join(revs) + " | " + " | ".join(f"{r} over {revs[0]}" for r in revs[1:]) + " |",
            "| --- | " + " | ".join("---:" for _ in range(2 * len(revs) - 1)) + " |"]
    for row in dict.fromkeys(k.rsplit(" @", 1)[0] for k in runs):
        steps = [runs.get(f"{row} @{k}") for k in range(len(revs))]
        speed = [[1.0 / t for t in x] if x else None for x in steps]
        text.append(f"| {row} | " + " | ".join(f"{1e3 * statistics.median(x):.2f}" if x else "-" for x in steps)
                    + " | " + " | ".join(over(speed)) + " |")
    for m in models:
        for a, b in _PAIRED_RATIOS:
            ka, kb = f"{a} [{m}]", f"{b} [{m}]"
            per = [[tb / ta for ta, tb in zip(runs[f"{ka} @{k}"], runs[f"{kb} @{k}"])]
                   if f"{ka} @{k}" in runs and f"{kb} @{k}" in runs else None for k in range(len(revs))]
            if any(per):  # a ratio of throughputs: b's step over a's
                text.append(f"| {a} over {b} [{m}] | " + " | ".join(cell(x) for x in per) + " | "
                            + " | ".join(over(per)) + " |")
    return text


def _run(kind: str, tree: str, model: str, tmp: str, only: list[str], cycles: int,
         bal: dict[str, list[int]] | None = None) -> dict[str, Any]:
    body = "\n".join("    " + ln for ln in _CHILD[kind].strip().splitlines())
    script = Path(tmp) / f"child_{kind}.py"
    script.write_text(_WRAP.format(tree=tree, model=model, tmp=tmp, only=only, cycles=cycles, bal=bal,
                                   second=SECOND_MODEL, body=body))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=tree)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode or line is None:
        raise SystemExit(f"{kind} on {tree}: {out.stderr[-3000:]}")
    return dict(json.loads(line[len("RESULT "):]))


def _paired(a: argparse.Namespace, trees: dict[str, str], models: list[str], cuts: dict[str, Any],
            only: list[str], tmp: Path) -> int:
    """``paired``: every commit's rows in the same two processes, one model at a time; print and write the table."""
    pkgs = [_package(tree, tmp, k) for k, tree in enumerate(trees.values())]
    runs: dict[str, list[float]] = {}
    for model in models:
        script = tmp / "child_paired.py"
        script.write_text(_PAIRED.format(pkgs=pkgs, model=model, only=only, cycles=a.cycles, bal=cuts[model],
                                         second=SECOND_MODEL, labels=PAIRED_LABELS))
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp,
                             env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=""))
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if out.returncode or line is None:
            raise SystemExit(f"paired on {model}: {out.stderr[-3000:]}")
        got = json.loads(line[len("RESULT "):])
        if not got:
            print(f"bench_commits: --only={a.only!r}: no row of the benchmark has these labels (see its CONTENDERS' "
                  f"labels, e.g. 'gems lp,gems mast')", file=sys.stderr)
            return 2
        runs.update(got)
        print(f"{model} done", file=sys.stderr, flush=True)
        if a.out is not None:  # the raw runs as they come (a model's hour is not lost to a later failure)
            a.out.with_suffix(".json").write_text(json.dumps(runs, indent=1))
    table = "\n".join(paired_rows(runs, list(trees), models)) + "\n"
    table += "\nEvery commit ran at the same cuts (D=2; D=4 stages): " + ", ".join(
        f"{m} {c['2']}; {c['4']}" for m, c in cuts.items()) + "\n"
    print(table)
    if a.out is not None:
        a.out.write_text(table)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=sorted(set(_CHILD) - {"balance"} | {"paired"}))
    ap.add_argument("revs", nargs="+", help="git revisions; 'now' is this work tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--models", default="bench,second", help="pipeline: which models (bench, second)")
    ap.add_argument("--only", default="", help="pipeline: these rows only, by label, comma-separated")
    ap.add_argument("--cycles", type=int, default=12, help="pipeline: measured steps of each row a run")
    a = ap.parse_args()
    # labels hold commas of their own, inside brackets ("gems interleaved1f1b (v=2, m=4)"): split outside them only
    only = [x.strip() for x in re.split(r",(?![^()]*\))", a.only) if x.strip()]
    models = [m.strip() for m in a.models.split(",") if m.strip()] if a.kind in ("pipeline", "paired") \
        else ["bench"]
    if not set(models) <= {"bench", "second"} or a.cycles < 1:
        print(f"bench_commits: --models={a.models!r} --cycles={a.cycles}: models are bench and/or second, cycles at "
              f"least 1", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        trees: dict[str, str] = {}
        try:
            for rev in a.revs:
                if rev == "now":
                    trees[rev] = str(ROOT)
                    continue
                path = str(Path(tmp) / f"tree-{len(trees)}")
                made = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", path, rev],
                                      capture_output=True, text=True)
                if made.returncode:
                    print(f"bench_commits: revision {rev!r}: not a commit of this repository (a hash, a branch, or "
                          f"'now')", file=sys.stderr)
                    return 2
                trees[rev] = path
            runs: dict[str, list[dict[str, float]]] = {rev: [] for rev in trees}
            # one cut per model for every commit, so a row differs by the commits' code alone (each measuring its
            # own, from layer times this noisy machine gives, moved interleaved1f1b's cut between runs)
            cuts = {m: _run("balance", trees[a.revs[0]], m, tmp, only, a.cycles) for m in models} \
                if a.kind in ("pipeline", "paired") else {}
            if cuts:
                print(f"cuts (D=2, D=4 stages): {cuts}", file=sys.stderr, flush=True)
            if a.kind == "paired":
                return _paired(a, trees, models, cuts, only, Path(tmp))
            for r in range(a.rounds):
                for rev in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                    got: dict[str, float] = {}
                    for model in models:
                        got.update({k: float(v) for k, v in
                                    _run(a.kind, trees[rev], model, tmp, only, a.cycles, cuts.get(model)).items()})
                    if not got:
                        print(f"bench_commits: --only={a.only!r}: no row of {rev}'s benchmark has these labels (see "
                              f"its CONTENDERS' labels, e.g. 'gems lp,gems mast')", file=sys.stderr)
                        return 2
                    runs[rev].append(got)
                    print(f"round {r + 1}: {rev} done", file=sys.stderr, flush=True)
        finally:
            for rev, path in trees.items():
                if rev != "now":
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", path],
                                   capture_output=True)
    text = median_rows(runs, a.revs, "samples/s" if a.kind == "pipeline" else "median step (s)")
    text += ratio_rows(runs, models) if a.kind == "pipeline" else []
    table = "\n".join(text) + "\n"
    if cuts:
        table += "\nEvery commit ran at the same cuts (D=2; D=4 stages): " + ", ".join(
            f"{m} {c['2']}; {c['4']}" for m, c in cuts.items()) + "\n"
    print(table)
    if a.out is not None:
        a.out.write_text(table)
        a.out.with_suffix(".json").write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
