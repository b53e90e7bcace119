"""``gems bench search``: does the mesh gems plan's search chooses (``parallel=auto``: gems/plan/search.py) train as fast
as the best one measured? On a world of two CPU ranks, for models where different meshes should win (:data:`MODELS`),
the search's top candidates and the best of every mesh family run as real ``gems run``s in alternating rounds; it
reports the choice over the best measured, the rank correlation of predicted and measured, and the search's own time
at up to 2048 GPUs (:func:`bench_search`; docs/benchmarks.md). Writes ``search.md``.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from gems.bench.common import env_block, md_table, median, write
from gems.plan.search import TIE  # (predictions within it are a tie: the search's own noise, one figure for both)

#: the models (label, overrides), where different meshes should win, among them a compute-bound chain (its work splits
#: over replicas); a large dense head (64 MiB of fp32 weights: summing its gradients over replicas costs more than the
#: step); one sample a step (no replica split: S or D); the U-Net under a cap of 0.29 GiB a rank, planned and held by
#: the run alike, which the meshes that win without it (0.30-0.36 GiB a rank) do not fit (the closest mesh the cap
#: rules out runs too, past the fit check, and must stop at the cap)
MODELS: list[tuple[str, list[str]]] = [
    ("compute-bound chain", ["model=cosmoflow", "model.size=32", "model.width=0.5", "train.batch_size=8"]),
    ("large dense head", ["model=custom", "model._target_=gems.bench.search.dense_head", "model.input_shape=[4,16,16,16]",
                          "model.num_outputs=4", "train.batch_size=4"]),
    ("one sample a step", ["model=cosmoflow", "model.size=64", "model.width=0.25", "train.batch_size=1"]),
    ("3D U-Net, 0.29 GiB a rank", ["model=unet3d", "model.size=64", "model.width=0.25", "train.batch_size=2",
                                   "cluster.rank_memory_gb=0.29"]),
    ("3D U-Net", ["model=unet3d", "model.size=64", "model.width=0.25", "train.batch_size=2"]),
    ("2D ResNet, 512^2 images", ["model=resnet", "model.depth=20", "model.size=512", "model.width=0.25",
                                 "train.batch_size=1"]),
]
#: why the benchmark runs no hybrid mesh (the issue asks for one where two cores allow a clean measurement)
HYBRID = ("a hybrid mesh (R x D or R x S) needs a world of four ranks; on this machine's two cores four ranks take "
          "turns on half a core each, so every mesh of that world measures the scheduler's sharing and gloo's waits "
          "for a descheduled peer, not the mesh: left to a machine of four cores or more")
#: the models whose every schedule, micro-batch count and split the accuracy section holds (gems.bench.accuracy)
ACCURACY: list[tuple[str, list[str]]] = [
    ("compute-bound chain", MODELS[0][1]),
    ("3D U-Net 32^3", ["model=unet3d", "model.size=32", "model.width=0.25", "train.batch_size=2"]),
]
WORLD, STEPS, WARM, ROUNDS = 2, 8, 3, 3
#: the worlds the search's own time is measured at, and its goals (issue 82: first call, cached call, seconds)
WORLDS = (2, 8, 64, 512, 2048)
FIRST_S, CACHED_S = 20.0, 5.0
#: the goals on every model: the chosen over the best measured, Spearman, the pairs measured apart ordered alike
CHOSEN, SPEARMAN, PAIRS = 0.95, 0.8, 0.9
BIG = [("CosmoFlow 512^3", ["model=cosmoflow", "model.size=512", "train.batch_size=64"]),
       ("3D U-Net 256^3", ["model=unet3d", "model.size=256", "train.batch_size=64"])]


def dense_head(width: int = 4096) -> Any:
    """The large dense head model: two 3 x 3 x 3 convolutions of 4 -> 8 channels, pooled to 4^3 (512 values), then
    dense 512 -> ``width`` -> ``width`` -> 4: its gradients are the dense weights' (``width``^2 floats)."""
    from torch import nn

    return nn.Sequential(nn.Conv3d(4, 8, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
                         nn.Conv3d(8, 8, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
                         nn.Flatten(), nn.Linear(512, width), nn.LeakyReLU(0.3), nn.Linear(width, width),
                         nn.LeakyReLU(0.3), nn.Linear(width, 4))


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The rank correlation of ``xs`` and ``ys`` (ties ranked by their mean rank)."""
    def ranks(v: Sequence[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2.0
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (vx * vy) if vx > 0 and vy > 0 else float("nan")


def ordered_pairs(rows: Sequence[dict[str, Any]]) -> tuple[float, int]:
    """(the pairs the prediction orders as measured, the pairs the measurement orders): over the pairs of candidates
    whose rounds do not overlap (every round of one faster than every round of the other, so this machine's noise
    did not order them), how many the prediction puts in the same order, a tie (predictions within :data:`TIE`)
    counting half. What Spearman's rank correlation cannot say where most candidates are measured within their
    noise of each other."""
    agree, n = 0.0, 0
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            if not a["rounds"] or not b["rounds"]:
                continue
            if min(a["rounds"]) > max(b["rounds"]):
                fast, slow = a, b
            elif min(b["rounds"]) > max(a["rounds"]):
                fast, slow = b, a
            else:
                continue
            n += 1
            p, q = fast["predicted"], slow["predicted"]
            agree += 0.5 if abs(p - q) <= TIE * max(p, q) else float(p > q)
    return agree, n


def family(overrides: dict[str, Any]) -> str:
    """The mesh family of a candidate: replicas, pipeline or spatial (the axis its world goes to; a hybrid by its
    largest)."""
    axes = {"replicas": overrides["parallel.replicas"], "pipeline": overrides["parallel.pipeline"],
            "spatial": _parts(overrides["parallel.spatial"])}
    return max(axes, key=lambda k: (axes[k], k == "spatial"))


def _parts(spatial: Any) -> int:
    if isinstance(spatial, int):
        return spatial
    out = 1
    for p in spatial:
        out *= int(p)
    return out


def picked(ranked: list[Any], top: int = 4) -> list[Any]:
    """What the benchmark runs of a search's ranked candidates that fit: the top ``top``, and the best of every
    family not among them."""
    fits = [c for c in ranked if c.fits]
    out = list(fits[:top])
    for fam in ("replicas", "pipeline", "spatial"):
        if not any(family(c.overrides) == fam for c in out):
            best = next((c for c in fits if family(c.overrides) == fam), None)
            if best is not None:
                out.append(best)
    return out


def _record(args: list[str], folder: Path) -> dict[str, Any] | None:
    """One ``gems run`` of ``args`` and its record (None where it wrote none)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "gems.cli", "run", *args, f"train.steps={STEPS}", f"train.warmup_steps={WARM}",
           "train.threads=1", f"results.dir={folder}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    rec = next((json.loads(p.read_text()) for p in folder.glob("*.json")), None)
    if done.returncode != 0 or rec is None or rec.get("status") != "ok":
        print(f"gems bench search: a run failed ({' '.join(args)}): {done.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr, flush=True)
    return rec


def _run(args: list[str], folder: Path) -> float | None:
    """One ``gems run`` of ``args``: its samples/s (the median of its measured steps), None where it failed."""
    rec = _record(args, folder)
    return float(rec["throughput_samples_per_s"]) if rec is not None and rec.get("status") == "ok" else None


def past_the_cap(s: Any, over: list[str], folder: Path) -> dict[str, Any] | None:
    """Under ``cluster.rank_memory_gb``: the candidate the cap rules out that comes closest to fitting (the least
    planned peak among those planned not to fit), run once past the fit check (``train.check_fit=false``). What its
    run did: stopped at the cap (the record's failure of kind ``memory``: the rank and its measured tensor peak) as
    the plan said, or not. None where no cap is set or it rules nothing out."""
    out = [c for c in s.candidates if c.plan is not None and not c.fits]
    if not out or not out[0].plan.device.get("capped"):  # (the plan's own word for a cap that is set)
        return None
    c = min(out, key=lambda c: c.peak or 0)
    rec = _record([*over, *c.args(), "train.check_fit=false"], folder) or {}
    shutil.rmtree(folder, ignore_errors=True)
    failure = rec.get("failure") or {}
    return {"mesh": c.mesh(), "options": c.options(), "overrides": c.args(), "planned_peak_bytes": c.peak,
            "cap_bytes": int(c.plan.device["memory_bytes"]), "ruled_out": len(out), "status": rec.get("status"),
            # a CPU rank stops past the cap (failure kind memory); a GPU's allocator runs out under it
            "stopped_at_cap": failure.get("kind") == "memory" or "out of memory" in str(rec.get("error") or ""),
            "measured_peak_bytes": failure.get("tensor_peak_bytes"),
            "error": rec.get("error")}


def bench_model(label: str, over: list[str], tmp: Path, rounds: int = ROUNDS, world: int = WORLD) -> dict[str, Any]:
    """One model: the search, its picked candidates run in alternating rounds, and the figures."""
    from gems.config import compose
    from gems.plan.search import search

    s = search(compose(["parallel=auto", f"parallel.world={world}", *over]))
    chosen = s.best
    same = s.same()  # (a program run under another name is not run again)
    runs = picked([c for i, c in enumerate(s.ranked) if i not in same])
    got: dict[int, list[float]] = {k: [] for k in range(len(runs))}
    for r in range(rounds):
        order = list(range(len(runs)))
        for k in (order if r % 2 == 0 else order[::-1]):
            folder = tmp / f"{abs(hash(label))}-{k}-{r}"
            rate = _run([*over, *runs[k].args()], folder)
            shutil.rmtree(folder, ignore_errors=True)
            if rate is not None:
                got[k].append(rate)
    measured = {k: median(v) for k, v in got.items() if v}
    rows = []
    for k, c in enumerate(runs):
        rows.append({"mesh": c.mesh(), "options": c.options(), "family": family(c.overrides),
                     "predicted": c.throughput, "measured": measured.get(k), "chosen": c is chosen,
                     "overrides": c.args(), "rounds": list(got[k])})
    ok = [r for r in rows if r["measured"] is not None]
    best = max((r["measured"] for r in ok), default=None)
    mine = next((r["measured"] for r in ok if r["chosen"]), None)
    return {"label": label, "overrides": over, "candidates": len(s.candidates), "seconds": s.seconds, "rows": rows,
            "past_cap": past_the_cap(s, over, tmp / f"{abs(hash(label))}-cap"),
            "chosen_over_best": (mine / best) if mine and best else None,
            "spearman": spearman([r["predicted"] for r in ok], [r["measured"] for r in ok]) if len(ok) > 1 else None,
            "pairs": ordered_pairs(ok)}


def cap_line(m: dict[str, Any]) -> str:
    """What the cap ruled out, and what the closest of those did when run past the fit check (a paragraph; empty
    where the model has no cap)."""
    cap = m.get("past_cap")
    if not cap:
        return ""
    g = 2.0 ** 30
    measured = cap["measured_peak_bytes"]
    did = (f"it stopped at the cap, a rank's tensors measured at {measured / g:.3f} GiB, as planned"
           if cap["stopped_at_cap"] and measured else "it ran out of memory under the cap, as planned"
           if cap["stopped_at_cap"] else
           f"it did not stop at the cap (status {cap['status']}: {cap['error'] or 'no error'}): the plan was wrong")
    fitting = sum(1 for r in m["rows"] if r["measured"] is not None)
    ran = (f"all {fitting} ran to their end under it" if fitting == len(m["rows"]) else
           f"{fitting} of {len(m['rows'])} ran to their end under it (a failed one went past the cap: the plan was "
           "wrong)")
    named = " ".join(cap["overrides"]) or "no mesh key"
    return (f"\n{m['label']}: the cap ({cap['cap_bytes'] / g:.3g} GiB a rank) rules out {cap['ruled_out']} of the "
            f"{m['candidates']} candidates planned; the candidates run above were planned to fit it, and {ran}. "
            f"The closest ruled out, {cap['mesh']} {cap['options']} (`{named}`, planned at "
            f"{cap['planned_peak_bytes'] / g:.3f} GiB), was run past the fit check (`train.check_fit=false`): {did}.\n")


def search_time(over: list[str], world: int) -> tuple[float, float, int]:
    """(seconds of the first call on a fresh trace cache, of a cached call, the candidates) of ``gems plan
    parallel=auto`` at ``world`` GPUs of Perlmutter, each a process of its own."""
    out = []
    cands = 0
    with tempfile.TemporaryDirectory(prefix="gems-search-cache-") as cache:
        for _ in range(2):
            env = dict(os.environ, GEMS_CACHE_DIR=cache)
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "gems.cli", "plan", "parallel=auto",
                                   f"parallel.world={world}", "cluster=perlmutter", "cluster.account=x",
                                   "plan.format=json", *over], capture_output=True, text=True, env=env, timeout=3600)
            out.append(time.perf_counter() - t0)
            if done.returncode == 0:
                cands = int(json.loads(done.stdout)["tried"])
    return out[0], out[1], cands


#: on a GPU (``gems bench search`` where torch sees one: a lease, scripts/gpu_lease.py's search phase), models a GPU
#: trains, each searched twice: as it is, and under a cap between its plain step's planned peak and its recomputing
#: step's (``cluster.rank_memory_gb``: the GPU's allocator limited to it)
GPU_MODELS: list[tuple[str, list[str]]] = [
    ("3D U-Net 128^3, batch 2", ["model=unet3d", "model.size=128", "train.batch_size=2"]),
    ("CosmoFlow 256^3, batch 4", ["model=cosmoflow", "model.size=256", "train.batch_size=4"]),
]
#: the plumbing of the GPU mode on a CPU (``bench_search_gpu(dry=True)``: tests/test_search.py)
DRY_GPU_MODELS: list[tuple[str, list[str]]] = [
    ("3D U-Net 32^3, batch 2", ["model=unet3d", "model.size=32", "model.width=0.25", "train.batch_size=2"]),
]


def capped_between(over: list[str]) -> float | None:
    """A cap (GiB) halfway between what one rank's recomputing step and its plain step need of their device, None
    where recomputation saves under a tenth (no cap would tell the two apart). A GPU rank needs its planned peak and
    its reserve (the context, NCCL's buffers, fragmentation: counted inside the cap); a capped CPU rank its peak."""
    from gems.config import compose
    from gems.plan import make_plan

    def need(checkpoint: str) -> float:
        plan = make_plan(compose([*over, f"parallel.checkpoint={checkpoint}"]), suggest=False)
        dev = plan.device
        reserve = dev["memory_bytes"] - dev["usable_bytes"] if dev["kind"] == "gpu" else 0
        return float(plan.worst.bytes.total + reserve)

    plain, again = need("false"), need("true")
    return None if again > 0.9 * plain else (plain + again) / 2 / 2**30


def bench_search_gpu(out_dir: Path, rounds: int = 2, dry: bool = False) -> str:
    """The GPU half: on one GPU the world is one rank (ranks sharing a GPU would measure shares of it, not GPUs), so
    a model's candidates are its plain step and its recomputing one. Each model is searched as it is and under a cap
    that only the recomputing step fits; the picked candidates run in alternating rounds, and under the cap the plain
    step runs past the fit check and must run out of memory, as planned. Writes ``search-gpu.md`` (``dry``: the
    plumbing on this machine's CPU, a small model)."""
    import torch

    from gems.plan.roofline import gpu_named

    on: list[str] = []
    if not dry:
        name = torch.cuda.get_device_name(0)
        on = ["train.device=cuda", f"cluster.gpu={gpu_named(name) or name}"]
    models: list[dict[str, Any]] = []
    text = ""
    with tempfile.TemporaryDirectory(prefix="gems-bench-search-gpu-") as tmp:
        for label, over in (DRY_GPU_MODELS if dry else GPU_MODELS):
            base = [*over, *on]
            cap = capped_between(base)
            models.append(bench_model(label, base, Path(tmp), rounds, world=1))
            text = _gpu_table(out_dir, models, rounds, dry)  # written after each: a lease's deadline keeps what ran
            if cap is not None:
                models.append(bench_model(f"{label}, {cap:.3g} GiB a rank", [*base, f"cluster.rank_memory_gb={cap:.4f}"],
                                          Path(tmp), rounds, world=1))
                text = _gpu_table(out_dir, models, rounds, dry)
    return text


def _gpu_table(out_dir: Path, models: list[dict[str, Any]], rounds: int, dry: bool) -> str:
    """``search-gpu.md`` and ``search-gpu.json`` of the models measured so far."""
    import torch

    rows = []
    for m in models:
        for r in m["rows"]:
            rows.append([m["label"], r["options"], f"{r['predicted']:.3g}",
                         f"{r['measured']:.3g}" if r["measured"] is not None else "failed",
                         f"{r['measured'] / r['predicted']:.2f}" if r["measured"] and r["predicted"] else "-",
                         "chosen" if r["chosen"] else "", " ".join(r["overrides"]) or "(defaults)"])
    device = "this machine's CPU (dry: the plumbing only)" if dry else torch.cuda.get_device_name(0)
    text = (f"## gems bench search on one GPU ({device})\n\n"
            "One GPU holds a world of one rank: its candidates are the plain step and its recomputation (ranks "
            "sharing the GPU would measure shares of it, not GPUs). Each model is searched as it is and under a "
            "cap halfway between what the two steps need of the device (`cluster.rank_memory_gb`: the GPU's allocator "
            "limited to it), where only the recomputing step fits; the candidates that fit run as real `gems run`s "
            f"({STEPS} steps, the median of those after {WARM} warm-up, CUDA graphs as the run decides), the median "
            f"over {rounds} alternating rounds. Under the cap the plain step is then run past the fit check "
            "(`train.check_fit=false`): it must run out of memory, as the plan says.\n\n")
    text += md_table(["model", "step", "predicted samples/s", "measured samples/s", "measured / predicted", "",
                      "overrides"], rows)
    for m in models:
        text += cap_line(m)
    text += "\n" + env_block("gems bench search (on a machine with a GPU)")
    write(out_dir, "search-gpu", text)
    (out_dir / "search-gpu.json").write_text(json.dumps(models, indent=1, default=str))
    return text


def bench_search(out_dir: Path, rounds: int = ROUNDS, big: bool = True) -> str:
    """The CPU benchmark (a world of two CPU ranks), or on a machine with a GPU its GPU half
    (:func:`bench_search_gpu`)."""
    import torch

    from gems.bench.accuracy import accuracy, accuracy_text

    if torch.cuda.is_available():
        return bench_search_gpu(out_dir)
    models = []
    with tempfile.TemporaryDirectory(prefix="gems-bench-search-") as tmp:
        for label, over in MODELS:
            models.append(bench_model(label, over, Path(tmp), rounds))
    text = _cpu_table(models, rounds)
    held = [accuracy(label, over, rounds) for label, over in ACCURACY]
    text += accuracy_text(held, rounds)
    if big:
        text += _search_times()
    text += "\n" + env_block("gems bench search")
    write(out_dir, "search", text)
    (out_dir / "search.json").write_text(json.dumps({"models": models, "accuracy": held}, indent=1, default=str))
    return text


def _goal(v: float | None, goal: float) -> str:
    return "-" if v is None else ("yes" if v >= goal - 1e-9 else "no")  # (the goal itself, in floats)


def _cpu_table(models: list[dict[str, Any]], rounds: int) -> str:
    """The models' summary, the cap's lines and every candidate run, with its predicted over measured."""
    rows, summary = [], []
    for m in models:
        for r in m["rows"]:
            rows.append([m["label"], r["mesh"], r["options"], r["family"], f"{r['predicted']:.3g}",
                         f"{r['measured']:.3g}" if r["measured"] is not None else "failed",
                         f"{r['predicted'] / r['measured']:.2f}" if r["measured"] else "-",
                         "chosen" if r["chosen"] else "", " ".join(r["overrides"]) or "(defaults)"])
        ratio, rho = m["chosen_over_best"], m["spearman"]
        agree, apart = m["pairs"]
        summary.append([m["label"], m["candidates"], f"{m['seconds']:.1f}",
                        f"{ratio:.2f}" if ratio is not None else "-", _goal(ratio, CHOSEN),
                        f"{rho:.2f}" if rho is not None else "-", _goal(rho, SPEARMAN),
                        f"{agree:g} of {apart}" if apart else "none", _goal(agree / apart if apart else None, PAIRS)])
    text = ("## gems bench search\n\n"
            f"The mesh `gems plan parallel=auto` chooses, against the meshes it ranked, measured: a world of {WORLD} "
            f"CPU ranks on this machine (one compute thread a rank, gloo), each candidate a real `gems run` of its "
            f"overrides ({STEPS} steps, the median of the {STEPS - WARM} after {WARM} warm-up steps), the median over "
            f"{rounds} rounds that alternate the candidates. Run: the search's top four and the best-ranked of every "
            f"mesh family (replicas, pipeline, spatial) not among them. Goals (issue 82): the chosen one at {CHOSEN:g} "
            f"of the best measured or more on every model; predicted and measured in the same order (Spearman >= "
            f"{SPEARMAN:g}); of the pairs measured apart, {100 * PAIRS:g}% or more ordered alike. Pairs measured "
            "apart: the pairs of candidates whose rounds do not overlap (every round of one faster than every round of "
            "the other: an order this machine's noise did not make), and how many of them the prediction orders alike "
            f"(a tie, predictions within {100 * TIE:g}% of each other, the search's own tie, counting half); the rounds "
            f"of each candidate are in search.json. Not run: {HYBRID}.\n\n")
    text += md_table(["model", "candidates planned", "search s", "chosen / best measured", f">= {CHOSEN:g}",
                      "Spearman", f">= {SPEARMAN:g}", "pairs measured apart: ordered alike",
                      f">= {100 * PAIRS:g}%"], summary)
    for m in models:
        text += cap_line(m)
    text += "\n" + md_table(["model", "mesh", "schedule", "family", "predicted samples/s", "measured samples/s",
                             "predicted / measured", "", "overrides"], rows)
    return text


def _search_times() -> str:
    """The search's own time at every world of :data:`WORLDS`, first and cached calls, against the goals."""
    times = []
    for label, over in BIG:
        for world in WORLDS:
            first, cached, n = search_time(over, world)
            times.append([label, world, n, f"{first:.1f}", f"{cached:.1f}",
                          "yes" if first < FIRST_S and cached < CACHED_S else "no"])
    text = ("\n### The search's own time\n\n"
            "`gems plan parallel=auto parallel.world=N cluster=perlmutter` (A100s), a global batch of 64, the "
            "whole command (its start and table included), each call a process of its own: the first on a fresh "
            "trace cache (`GEMS_CACHE_DIR`: every cut's parts traced, on this machine's two cores), then a "
            f"cached one (the traces kept on disk; gems.plan.store). Goal: under {FIRST_S:g} s the first call, under "
            f"{CACHED_S:g} s cached.\n\n")
    return text + md_table(["model", "GPUs", "candidates", "first call s", "cached call s",
                            f"under {FIRST_S:g} s and {CACHED_S:g} s"], times)


if __name__ == "__main__":
    from gems.bench.common import out_dir_from_argv

    print(bench_search(Path(out_dir_from_argv(sys.argv, "python -m gems.bench.search [OUT_DIR]"))))
