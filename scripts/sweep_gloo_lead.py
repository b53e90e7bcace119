"""How far ahead of its round a rank should post a round's receives over gloo (one command):

    python scripts/sweep_gloo_lead.py [--leads 1,2,4,8] [--rounds N] [--cycles N] [--models bench,second]
                                      [--cut2 A,B] [--cut4 A,B,C,D] [--out FILE]

Each round runs, for every lead in turn (the order reversed every other round), two gloo ranks of this work tree's
``gems.bench.pipeline._bench_rank`` over lp, mast, master, 1F1B and interleaved 1F1B against torch's same schedules, with
``gems.pipeline.exchange.GLOO_LEAD`` set to that lead in both ranks. Every lead runs at the same cuts per model
(measured once, or given with ``--cut2``/``--cut4``: an uneven four-stage cut is where one action of lead is not
enough). torch's rows do not depend on the lead: they show this machine's noise between the runs, and each gems
schedule is also given over torch's same schedule in the same run. Prints a markdown table (samples/s, medians of
the rounds) with the environment and writes it to ``--out`` with the raw runs beside it (``.json``). A wrong
argument is exit 2 with one line. The run in results/history/pipeline-schedules.md#pipeline-gloo-lead-sweep-second
was made this way.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

from bench_commits import SECOND_MODEL as SECOND  # noqa: E402  (the same second model, the same tables)
from bench_commits import median_rows, ratio_rows  # noqa: E402

ROWS = ["gems lp", "gems mast", "gems mast (m=2 per direction)", "gems master (eta=2, m=2 per pass)",
        "gems 1f1b (m=4)", "torch Schedule1F1B (m=4)", "gems interleaved1f1b (v=2, m=4)",
        "torch ScheduleInterleaved1F1B (v=2, m=4)"]


def _rank(rank: int, world: int, model: str, lead: int, balances: dict[Any, list[int]], cycles: int) -> Any:
    import gems.bench.pipeline as bp
    import gems.pipeline.exchange as ex

    if model == "second":
        bp.MODEL.update(SECOND)
    ex.GLOO_LEAD = lead  # read by receive_lead when the runner is made
    subset = [c for c in bp.CONTENDERS if c["label"] in ROWS]
    return bp._bench_rank(rank, world, subset, balances, cycles, 3)


def _cuts(rank: int, world: int, model: str) -> dict[Any, list[int]]:
    """The cuts bench_pipeline would pick for ``model`` (in a process of its own: ``MODEL`` is module state)."""
    import gems.bench.pipeline as bp

    if model == "second":
        bp.MODEL.update(SECOND)
    size = int(str(bp.MODEL["size"]))
    return {size: bp._balance(size), (size, 4): bp._balance(size, 4)}


def _ints(text: str, n: int) -> list[int] | None:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        return None
    return out if len(out) == n and min(out) >= 1 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leads", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--models", default="bench,second")
    ap.add_argument("--cut2", default="", help="layers per stage of the D=2 cut, e.g. 6,12")
    ap.add_argument("--cut4", default="", help="layers per stage of the four-stage cut, e.g. 3,3,3,9")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    leads = _ints(a.leads, len(a.leads.split(",")))
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    cut2 = _ints(a.cut2, 2) if a.cut2 else []
    cut4 = _ints(a.cut4, 4) if a.cut4 else []
    bad = [(k, v, want) for k, v, ok, want in [
        ("--leads", a.leads, leads is not None, "positive integers, comma-separated"),
        ("--models", a.models, bool(models) and set(models) <= {"bench", "second"}, "bench and/or second"),
        ("--rounds", a.rounds, a.rounds >= 1, "at least 1"), ("--cycles", a.cycles, a.cycles >= 1, "at least 1"),
        ("--cut2", a.cut2, cut2 is not None, "two positive integers, e.g. 6,12"),
        ("--cut4", a.cut4, cut4 is not None, "four positive integers, e.g. 3,3,3,9"),
        ("--models", a.models, not (cut2 or cut4) or len(models) == 1, "one model where a cut is given")] if not ok]
    if bad:
        key, value, want = bad[0]
        print(f"sweep_gloo_lead: {key}={value!r}: {want}", file=sys.stderr)
        return 2
    assert leads is not None and cut2 is not None and cut4 is not None
    import torch

    from gems.bench.common import env_block
    from gems.launch.world import run_world

    torch.set_num_threads(1)
    runs: dict[str, list[dict[str, float]]] = {str(lead): [] for lead in leads}
    cuts = {}
    for model in models:
        cuts[model] = run_world(_cuts, 1, model)[0]
        size = next(k for k in cuts[model] if isinstance(k, int))
        if cut2:
            cuts[model][size] = cut2
        if cut4:
            cuts[model][(size, 4)] = cut4
        print(f"{model}: cuts {cuts[model]}", file=sys.stderr, flush=True)
    import gems.bench.pipeline as bp

    for r in range(a.rounds):
        for lead in (leads if r % 2 == 0 else leads[::-1]):
            got: dict[str, float] = {}
            for model in models:
                res = run_world(_rank, 2, model, lead, cuts[model], a.cycles, timeout=1800)
                subset = [c for c in bp.CONTENDERS if c["label"] in ROWS]
                for i, c in enumerate(subset):
                    step = statistics.median(max(x, y) for x, y in zip(res[0]["times"][i], res[1]["times"][i]))
                    got[f"{c['label']} [{model}]"] = c["B"] / step
            runs[str(lead)].append(got)
            print(f"round {r + 1}: lead {lead} done", file=sys.stderr, flush=True)
    text = median_rows(runs, [f"lead {lead}" for lead in leads], "samples/s") + ratio_rows(runs, models)
    cut_text = "; ".join(f"{m}: D=2 {c[next(k for k in c if isinstance(k, int))]}, four stages "
                         f"{c[next(k for k in c if not isinstance(k, int))]}" for m, c in cuts.items())
    table = "\n".join(text) + f"\n\nCuts (layers per stage): {cut_text}.\n\n" + env_block(
        "python scripts/sweep_gloo_lead.py " + " ".join(sys.argv[1:]))
    print(table)
    if a.out is not None:
        a.out.write_text(table)
        a.out.with_suffix(".json").write_text(json.dumps({"cuts": {m: {str(k): v for k, v in c.items()}
                                                                    for m, c in cuts.items()}, "runs": runs},
                                                          indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
