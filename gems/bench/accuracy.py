"""The search's predicted compute held against one rank's measured step (``gems bench search``'s accuracy section, issue
82): every schedule x micro-batches x split the search ranks on a world of CPU ranks, its busiest rank's compute as a
share of one rank's plain step, predicted and measured side by side in one process (:func:`accuracy`). A benchmark,
not a test: on this shared two-core machine a loaded moment moved one candidate's measured share by 2x.
"""
from __future__ import annotations

import time
from typing import Any
from unittest import mock

#: the goal: the predicted share within this fraction of the measured
WITHIN = 0.15


def rank_seconds(over: list[str], rank: int, steps: int = 2) -> float:
    """Seconds of the least of ``steps`` steps (after one) of ``rank`` of the mesh ``over`` sets, alone: its groups
    over torch's fake process group (as ``gems plan plan.dry_run=true`` builds them), on real tensors."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gems.bootstrap import World
    from gems.config import compose, typed
    from gems.data.synthetic import SyntheticData
    from gems.mesh import mesh_from_config
    from gems.parallel import resolve
    from gems.rank.compose import set_up_rank
    from gems.rank.data import step_batch

    cfg = typed(compose(over))
    mesh, settings = mesh_from_config(cfg), resolve(cfg)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=mesh.size)
    try:
        mesh.build_groups(rank, groups=settings.holder_groups)
        world = World(rank=rank, size=mesh.size, local_rank=rank, master_addr="fake", master_port=0, source="single",
                      device=torch.device("cpu"), backend="fake", grad_comm="torch")
        B = int(cfg.train.batch_size)
        coord, spec, par, opt = set_up_rank(cfg, world, mesh, settings)
        ids, x, y = step_batch(SyntheticData(spec, 0, max(B, int(cfg.data.num_samples))), par, 0, B, mesh.replicas,
                               coord.replica)
        best = float("inf")
        for s in range(steps + 1):
            t0 = time.perf_counter()
            par.forward_backward(x, y, ids, s)
            par.quiesce()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if s:
                best = min(best, time.perf_counter() - t0)
        return best
    finally:
        dist.destroy_process_group()


def accuracy(label: str, over: list[str], rounds: int = 3, world: int = 2, steps: int = 2,
             top: int | None = None) -> dict[str, Any]:
    """Of ``over``'s search at ``world`` CPU ranks, every pipeline candidate that fits (each program once; the first
    ``top`` where given): its busiest rank's predicted compute (the search's plan, its ops timed as one rank
    computing alone, as it is measured here) and measured step, each a share of one rank's plain step; how many are
    within :data:`WITHIN`. The busiest rank runs its real step (its stepper, optimizer and pipeline runtime as a run
    builds them) over torch's fake process group, where messages complete at once, so it computes without waiting
    for its peers: what it holds is a rank's compute (micro-batches, split backwards, the runtime's bookkeeping); the
    waits and the messages are what the benchmark's real runs measure. The least of its steps, in rounds that
    alternate the candidates with one rank's plain step."""
    import torch

    import gems.plan.predict as predict
    from gems.config import compose
    from gems.plan import make_plan
    from gems.plan.search import search

    torch.set_num_threads(1)
    with mock.patch.object(predict, "computing_at_once", lambda pl, tasks_per_node: 1):  # (alone, as measured)
        s = search(compose(["parallel=auto", f"parallel.world={world}", *over]))
        alone = make_plan(compose(over), suggest=False).prediction.breakdown["compute"]
    same = s.same()
    cands = [c for i, c in enumerate(s.ranked) if i not in same and c.fits and c.overrides["parallel.pipeline"] > 1]
    cands = cands[:top] if top is not None else cands
    busiest = []
    for c in cands:
        per = [p["breakdown"]["compute"] for p in c.plan.prediction.per_position]
        busiest.append((per.index(max(per)), max(per)))
    plain: list[float] = []
    got: list[list[float]] = [[] for _ in cands]
    for r in range(rounds):
        plain.append(rank_seconds(over, 0, steps))
        order = list(range(len(cands)))
        for k in (order if r % 2 == 0 else order[::-1]):
            got[k].append(rank_seconds([*over, *cands[k].args()], busiest[k][0], steps))
    rows = []
    for c, (d, p), m in zip(cands, busiest, got):
        predicted, measured = p / alone, min(m) / min(plain)
        rows.append({"options": c.options(), "overrides": c.args(), "position": d, "predicted_share": predicted,
                     "measured_share": measured, "ratio": predicted / measured,
                     "within": abs(predicted / measured - 1) <= WITHIN})
    return {"label": label, "overrides": over, "plain_s": min(plain), "plain_predicted_s": alone, "rows": rows,
            "within": sum(r["within"] for r in rows)}


def accuracy_text(results: list[dict[str, Any]], rounds: int) -> str:
    """The benchmark's section: per model, how many candidates are within :data:`WITHIN`, then every one's shares."""
    from gems.bench.common import md_table

    summary, rows = [], []
    for m in results:
        worst = max(m["rows"], key=lambda r: abs(r["ratio"] - 1), default=None)
        summary.append([m["label"], len(m["rows"]), f"{m['within']} of {len(m['rows'])}",
                        f"{worst['ratio']:.2f} ({worst['options']})" if worst else "-",
                        f"{m['plain_predicted_s'] * 1e3:.1f} / {m['plain_s'] * 1e3:.1f}"])
        for r in m["rows"]:
            rows.append([m["label"], r["options"], r["position"], f"{r['predicted_share']:.3f}",
                         f"{r['measured_share']:.3f}", f"{r['ratio']:.2f}", "yes" if r["within"] else "no"])
    text = ("\n### The compute of every schedule, micro-batch count and split the search ranks\n\n"
            "Each pipeline candidate the search ranks on two CPU ranks (each program once): its busiest rank's "
            "compute as a share of one rank's plain step, predicted (ops timed as one rank computing alone) and "
            "measured (the rank's real step over torch's fake process group, where messages complete at once: its "
            f"compute and the runtime's bookkeeping, no waits), the least of its steps over {rounds} rounds that "
            "alternate the candidates with the plain step (gems/bench/accuracy.py). Goal: predicted over measured "
            f"within {100 * WITHIN:g}%.\n\n")
    text += md_table(["model", "candidates", f"within {100 * WITHIN:g}%", "worst predicted / measured",
                      "one rank's plain step, predicted / measured ms"], summary)
    text += "\n" + md_table(["model", "schedule", "busiest position", "predicted share", "measured share",
                             "predicted / measured", "within"], rows)
    return text
