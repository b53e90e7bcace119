"""Every schedule gives the serial losses and gradients, on real gloo worlds.

Cases are batched into one world per size (processes are the slow part on two
cores); each schedule's cases in a world are a test of their own (``-k zbh1``:
that schedule's, in every world that runs it; ``-k D2-mast``: its cases in the
D = 2 world), and a world runs once, with the cases of the schedules selected.
Each case trains a few SGD steps; per step the global loss must equal
the serial one (gradient accumulation over the same chunks), the step-0
gradient of every partition on every rank must equal the serial gradient
after the sum over the ``grad`` group, the parameters' updates over the run
must equal the serial ones, and all copies of a partition (mirrored ranks, replicas, spatial
parts) must be bit-identical.

Cases ``via="worker"`` are composed by ``gems.rank.compose.parallelize`` as ``gems
run`` composes them: spatial parts inside the pipeline partitions (S > 1),
gradients summed by the real ``GradientReducer`` (bucketed, launched at its points).
Recomputation (``checkpoint``) must run every BatchNorm forward once per chunk
(``num_batches_tracked``); where a partition's only copy sees the chunks in
the serial order (no mirror, no replica) its BatchNorm statistics must equal
the serial ones.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from _pipeline_worlds import pipeline_cases, serial_case

from gems.commlog import OrderError, replay
from gems.launch.world import run_world
from gems.pipeline import make_schedule
from gems.pipeline.schedules import registered


def case(model: str, schedule: str, D: int, m: int = 1, eta: int | None = None, R: int = 1, S: int = 1,
         B: int = 8, checkpoint: bool = False, trace: bool = True, steps: int = 3, balance_by: str = "memory",
         via: str = "pipeline", spatial_dims: tuple[int, ...] = (0,), bucket_mb: float = 0.001,
         balance: list[int] | None = None, v: int | None = None, split: bool = False,
         loss_scaling: bool = False, one_batch: bool = False, timed: str | None = None,
         gloo_order: bool = False) -> dict[str, Any]:
    """``one_batch``: every round one ``batch_isend_irecv`` on the line's one group, as under NCCL (over gloo the
    runtime otherwise issues a round's operations one by one, those up the line on a group of their own).
    ``timed``: after the first step the rounds are placed by the actions' times (PipelineRunner.place_rounds_by_time):
    "real", as the clock measured them; "fake", by _pipeline_worlds.fake_times (uneven stages, every rank's own).
    ``gloo_order``: the steps not recorded, so over gloo the receives go out ahead of their rounds
    (gems.pipeline.exchange.receive_lead), as in a `gems run` on CPUs; such a case is not replayed (a recorded run
    posts as NCCL does: the other cases check that order)."""
    assert S == 1 or via == "worker", "spatial parts are composed by the worker"
    assert not loss_scaling or via == "worker", "loss scaling is the worker's (gems.precision)"
    return dict(model=model, schedule=schedule, D=D, R=R, S=S, m=m, eta=eta, B=B, checkpoint=checkpoint,
                trace=trace, steps=steps, balance_by=balance_by, via=via, spatial_dims=spatial_dims,
                bucket_mb=bucket_mb, balance=balance, v=v, split=split, loss_scaling=loss_scaling,
                one_batch=one_batch, timed=timed, gloo_order=gloo_order)


WORLD2 = [  # D = 2
    case("cosmoflow", "lp", 2),
    case("cosmoflow", "lp", 2, checkpoint=True, steps=2),
    case("cosmoflow", "gpipe", 2, m=4),
    case("cosmoflow", "1f1b", 2, m=4, checkpoint=True),
    case("cosmoflow", "mast", 2),
    case("cosmoflow", "mast", 2, m=2, checkpoint=True),  # Chimera: micro-batches inside each direction
    # the mirrored sum through the real reducer, in many small buckets
    case("cosmoflow", "master", 2, eta=4, via="worker", bucket_mb=0.01),
    case("cosmoflow", "1f1b", 2, m=2, via="worker", bucket_mb=4.0),  # the default buckets: a few, large
    case("cosmoflow", "master", 2, eta=3, B=6, trace=False),  # odd eta; shapes learnt from headers
    case("resnet_bn", "mast", 2),
    case("resnet_bn", "mast", 2, checkpoint=True, steps=2),  # recomputed BN: statistics updated once
    case("resnet_bn", "1f1b", 2, m=2, checkpoint=True),  # recomputation must not update BN statistics twice
    case("resnet_gn", "master", 2, m=2, eta=2, trace=False),
    case("resnet_gn", "1f1b", 2, m=2, balance_by="time", steps=2),  # measured balance: rank 0's is broadcast
    # interleaved stages: two (three) partitions per rank, stage s on rank s mod D
    case("cosmoflow", "interleaved1f1b", 2, m=2, v=2),
    case("cosmoflow", "interleaved1f1b", 2, m=2, v=2, one_batch=True, steps=2),  # NCCL's path: a round one batch
    # rounds placed by measured times from the second step: made-up uneven ones (they move rounds), the clock's
    case("cosmoflow", "1f1b", 2, m=4, timed="fake"),  # recorded: posted as under NCCL, no lead
    # over gloo's receive lead (not recorded): 1F1B's timed rounds would hold one buffer more, so it keeps the unit
    # clock's; gpipe's are adopted
    case("cosmoflow", "1f1b", 2, m=4, timed="fake", gloo_order=True),
    case("cosmoflow", "gpipe", 2, m=4, timed="fake", gloo_order=True),
    case("cosmoflow", "interleaved1f1b", 2, m=2, v=2, one_batch=True, timed="fake"),
    case("cosmoflow", "1f1b", 2, m=2, via="worker", timed="real"),
    case("resnet_bn", "interleaved1f1b", 2, m=4, v=3, checkpoint=True, steps=2),
    case("resnet_gn", "interleaved1f1b", 2, m=2, v=2, via="worker", trace=False, steps=2),
    # the backward split into input and weight gradients (zero bubble; inside GEMS too)
    case("cosmoflow", "zbh1", 2, m=4),
    case("cosmoflow", "mast", 2, split=True),
    case("resnet_bn", "master", 2, m=2, eta=2, split=True, checkpoint=True, steps=2),
    case("resnet_gn", "zbh1", 2, m=2, via="worker", steps=2),
    case("cosmoflow", "gpipe", 2, m=2, split=True, steps=2),
    case("resnet_gn", "1f1b", 2, m=2, split=True, steps=2),
    # fp16's loss scaling in fp32 (a power of two: exact): the last stage scales, every rank unscales after the sum
    case("cosmoflow", "mast", 2, m=2, via="worker", loss_scaling=True, steps=2),
    case("resnet_bn", "1f1b", 2, m=2, checkpoint=True, via="worker", loss_scaling=True, steps=2),
    # gloo's own order: receives posted ahead of their rounds (the rounds' crossing messages, mirrored sums, loops)
    case("cosmoflow", "mast", 2, m=2, gloo_order=True),
    case("resnet_bn", "1f1b", 2, m=4, checkpoint=True, gloo_order=True, steps=2),
    case("cosmoflow", "master", 2, eta=4, via="worker", bucket_mb=0.01, gloo_order=True, steps=2),
    case("resnet_gn", "interleaved1f1b", 2, m=2, v=2, trace=False, gloo_order=True, steps=2),
    # the U-Net: skips cross every cut, packed with the activation (gems.models.skips.Carried), recomputed too
    case("unet", "1f1b", 2, m=2, B=4),
    case("unet", "mast", 2, B=4, checkpoint=True, steps=2),
    case("unet", "gpipe", 2, m=2, B=4, split=True, steps=2),
    case("unet", "interleaved1f1b", 2, m=2, v=2, B=4, steps=2),
]
WORLD3 = [  # odd D: the middle rank holds one partition for both directions
    case("cosmoflow", "mast", 3, B=6),
    case("resnet_gn", "master", 3, eta=3, B=6, checkpoint=True),
]
WORLD4 = [  # D = 4, R = 2 x D = 2 (GEMS-Hybrid), D = 2 x S = 2 (spatial parts inside the partitions)
    case("cosmoflow", "lp", 4, steps=2),
    case("cosmoflow", "gpipe", 4, m=4, steps=2),
    case("cosmoflow", "gpipe", 4, m=2, checkpoint=True, steps=2),
    case("cosmoflow", "1f1b", 4, m=4, steps=2),
    case("cosmoflow", "mast", 4, steps=2),
    case("cosmoflow", "mast", 4, m=2, steps=2),
    case("cosmoflow", "mast", 4, m=2, steps=2, one_batch=True),
    case("cosmoflow", "mast", 4, m=2, timed="fake"),  # rounds moved by uneven stages, agreed by 4 ranks
    case("resnet_gn", "master", 4, m=2, eta=2, steps=2),  # Chimera at D = 4
    case("resnet_gn", "master", 4, eta=4, checkpoint=True, trace=False, steps=2),
    case("cosmoflow", "mast", 2, R=2, steps=2, via="worker"),
    case("resnet_bn", "master", 2, m=2, eta=2, R=2, B=16, steps=2),
    case("cosmoflow", "lp", 2, S=2, steps=2, via="worker"),
    case("resnet_bn", "1f1b", 2, m=2, S=2, steps=2, via="worker"),  # global BN statistics across the parts
    case("cosmoflow", "mast", 2, S=2, steps=2, via="worker"),
    # halos again in the recompute; the cut (the gather is layer 17 of 23) leaves halo layers on both sides
    case("cosmoflow", "mast", 2, S=2, checkpoint=True, steps=2, via="worker", balance=[3, 20]),
    case("resnet_gn", "master", 2, m=2, eta=2, S=2, steps=2, via="worker", spatial_dims=(1,)),
    case("cosmoflow", "interleaved1f1b", 4, m=4, v=2, steps=2),
    case("cosmoflow", "interleaved1f1b", 2, m=2, v=2, S=2, steps=2, via="worker"),
    case("cosmoflow", "zbh1", 4, m=4, steps=2),
    case("cosmoflow", "mast", 2, S=2, split=True, steps=2, via="worker"),  # spatial layers: weights in I
    # replicas summing a split backward's gradients: a block's norm in the I, its convolutions' weights in the W
    case("resnet_bn", "zbh1", 2, m=2, R=2, B=8, steps=2, via="worker"),
    case("cosmoflow", "1f1b", 4, m=4, steps=2, gloo_order=True),
    case("cosmoflow", "mast", 2, S=2, steps=2, via="worker", gloo_order=True),
    case("unet", "1f1b", 4, m=2, B=4, steps=2),  # skips through two middle stages
    case("unet", "mast", 2, R=2, B=8, steps=2),
    # skips across the cut of spatial parts: the packed layout learnt from the first step's header
    case("unet", "1f1b", 2, m=2, S=2, B=4, steps=2, via="worker"),
    case("unet", "mast", 2, S=2, B=4, checkpoint=True, steps=2, via="worker"),
]
WORLD8 = [  # R = 2 x D = 2 x S = 2 and R = 2 x D = 4
    case("cosmoflow", "mast", 2, R=2, S=2, steps=2, via="worker"),
    case("cosmoflow", "1f1b", 2, m=2, R=2, S=2, steps=3, via="worker", timed="real"),  # every line and part agree
    case("resnet_gn", "master", 4, m=2, eta=2, R=2, B=16, steps=2, via="worker"),
]


def _registry_cases() -> list[dict[str, Any]]:
    """One D = 2 case for every registered schedule the lists above do not run, and one split where the schedule
    offers a split backward and none is listed: a new registration runs against the serial model (and is replayed
    under NCCL's rules) with no change to this file."""
    listed = WORLD2 + WORLD3 + WORLD4 + WORLD8
    out = []
    for name, kind in registered().items():
        shape = dict(m=2, eta=2 if kind.passes == "eta" else None, v=2 if kind.virtual else None, steps=2)
        if not any(c["schedule"] == name for c in listed):
            out.append(case("cosmoflow", name, 2, **shape))
        if kind.split == "optional" and not any(c["schedule"] == name and c["split"] for c in listed):
            out.append(case("cosmoflow", name, 2, split=True, **shape))
    return out


WORLD2 = WORLD2 + _registry_cases()


def _model_cases() -> list[dict[str, Any]]:
    """One D = 2 x S = 2 case for every registered model, at its registration's example size (1F1B, 2 micro-batches,
    composed as ``gems run`` composes it): a new model runs against the serial model with no change to this file."""
    from gems.models import registered as models

    return [case(f"registered:{name}", "1f1b", 2, m=2, S=2, B=4, steps=2, via="worker") for name in models()]


WORLD4 = WORLD4 + _model_cases()


def label_of(c: dict[str, Any]) -> str:
    return (f"{c['model']}/{c['schedule']} R={c['R']} D={c['D']} S={c['S']} m={c['m']} eta={c['eta']} "
            f"ckpt={c['checkpoint']} via={c['via']}" + (" one batch a round" if c.get("one_batch") else ""))


def close(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str) -> None:
    """Equal up to ``rel`` of the expected tensor's largest entry. The gradients of CosmoFlow's first
    convolutions (the spatial layers) are ~1e-6 and a parameter moves by less than its gradient times the
    learning rate per step, so a fixed absolute tolerance would pass anything there; updates (final minus
    initial parameters) are compared rather than parameters for the same reason."""
    atol = rel * float(expected.abs().max()) + 1e-12 if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rel, atol=atol, msg=lambda m: f"{what}: {m}")


def check(results: list[list[dict[str, Any]]], cases: list[dict[str, Any]]) -> None:
    world = len(results)
    for ci, c in enumerate(cases):
        label = label_of(c)
        # the schedule's properties choose the checks (its placement: copies of a partition on several ranks)
        sched = make_schedule(c["schedule"], c["D"], c["m"], c.get("eta"), c.get("v"), c.get("split", False))
        per_rank = [results[r][ci] for r in range(world)]
        balance = per_rank[0]["balance"]
        assert all(p["balance"] == balance for p in per_rank), label
        assert all(p["samples_per_step"] == c["B"] // c["R"] for p in per_rank), label
        ref = serial_case(c)
        for p in per_rank:
            torch.testing.assert_close(p["losses"], ref["losses"], rtol=1e-5, atol=1e-7, msg=lambda m: f"{label}: {m}")
        copies: dict[int, list[list[torch.Tensor]]] = {}
        index: dict[int, list[int]] = {}
        for p in per_rank:
            for i, grads in p["grads0"].items():
                assert index.setdefault(i, p["index"][i]) == p["index"][i], f"{label}: copies of part {i} hold other parameters"
                for k, g, w in zip(p["index"][i], grads, p["params"][i], strict=True):
                    close(g, ref["grads0"][k], 1e-4, f"{label}: grad {k} of part {i}")
                    close(w - ref["init"][k], ref["params"][k] - ref["init"][k], 2e-3,
                          f"{label}: update of param {k} of part {i}")
                copies.setdefault(i, []).append(p["params"][i])
                # every BatchNorm forward runs once per chunk, recomputation or not
                want = c["steps"] * p["forwards"][i]
                assert all(n == want for n in p["tracked"][i]), f"{label}: part {i} tracked {p['tracked'][i]}, expected {want}"
                if c["R"] == 1 and not sched.holds_copies:  # the serial chunk order
                    for k, b in p["buffers"][i]:
                        torch.testing.assert_close(b, ref["buffers"][k], rtol=1e-4, atol=1e-6,
                                                   msg=lambda m: f"{label} buffer {k} of part {i}: {m}")
        assert sorted(copies) == list(range(sched.stages)), label  # D partitions, or v x D interleaved
        if c["model"] == "resnet_bn":  # the BatchNorm checks above saw BatchNorm layers
            assert any(p["tracked"][i] and p["buffers"][i] for p in per_rank for i in p["tracked"]), label
        assert sorted(k for ks in index.values() for k in ks) == list(range(len(ref["params"]))), \
            f"{label}: the partitions do not hold every parameter exactly once"
        for i, sets in copies.items():  # a line's copies of a partition: the ranks its placement puts it on
            expect = c["R"] * c["S"] * len({row[i] for row in sched.placement})
            assert len(sets) == expect, f"{label}: partition {i} has {len(sets)} copies, expected {expect}"
            for other in sets[1:]:
                assert all(torch.equal(a, b) for a, b in zip(sets[0], other)), f"{label}: copies of part {i} differ"


def check_nccl_order(results: list[list[dict[str, Any]]], cases: list[dict[str, Any]]) -> None:
    """What every rank issued (set-up, steps, gradient sums), replayed under NCCL's rules (gems.commlog): the
    orders must complete with sends that never block and with sends that wait for their receive, and match
    message for message by order."""
    for ci, c in enumerate(cases):
        ahead = sum(results[r][ci]["posted_ahead"] for r in range(len(results)))
        if c.get("gloo_order"):  # (not recorded) gloo's order: some receive went out ahead of its round
            assert ahead > 0, label_of(c)
            continue
        assert ahead == 0, f"{label_of(c)}: a recorded run posted receives ahead of their rounds ({ahead})"
        logs = {r: results[r][ci]["comm"] for r in range(len(results))}
        for strict in (False, True):
            try:
                ran = replay(logs, strict_sends=strict)
            except OrderError as e:
                raise AssertionError(f"{label_of(c)} (strict sends: {strict}): {e}") from None
            assert ran["messages"] > 0 or c["D"] == 1, label_of(c)
        if c["S"] == 1 and c["D"] > 1:  # (halos go in batches of their own) the rounds batched as the case says
            batched = any(ev.get("batch") is not None and ev.get("kind") in ("send", "recv")
                          for log in logs.values() for ev in log)
            assert batched == bool(c.get("one_batch")), label_of(c)


def check_timed(results: list[list[dict[str, Any]]], cases: list[dict[str, Any]]) -> None:
    """Rounds placed by measured times: every rank adopted one plan, the one the ranks' largest times give (each
    rank measured its own) where it holds no more buffers than the unit clock's with the run's receive lead
    (gems.pipeline.exchange.adoptable), else the unit clock's; the made-up times move rounds, and some case of the
    world adopts them (the exactness and the replay under NCCL's rules are the checks every case gets)."""
    from _pipeline_worlds import fake_times

    from gems.pipeline.exchange import adoptable, microseconds, plan_exchanges, receive_lead
    from gems.pipeline.schedules import make_schedule

    fakes, adopted = 0, 0
    for ci, c in enumerate(cases):
        if not c.get("timed"):
            continue
        got = [results[r][ci]["timed"] for r in range(len(results))]
        assert len({note for note, _ in got}) == 1, (label_of(c), got)
        if c["timed"] != "fake":
            continue
        sched = make_schedule(c["schedule"], c["D"], c["m"], c.get("eta"), c.get("v"), c.get("split", False))
        costs: dict[Any, int] = {}
        for r in range(len(results)):
            for key, s in fake_times(r, sched.actions[r % c["D"]]).items():
                costs[key] = max(costs.get(key, 0), microseconds(s))
        unit, timed = plan_exchanges(sched), plan_exchanges(sched, costs=costs)
        assert timed.layout() != unit.layout(), label_of(c)  # the case moves rounds
        # the lead the run posted at: gloo's where its steps were not recorded (a recorded run posts as NCCL does)
        lead = receive_lead("gloo") if c.get("gloo_order") and not c.get("one_batch") else 0
        want = timed if adoptable(unit, timed, lead) else unit
        fakes, adopted = fakes + 1, adopted + (want is timed)
        assert all(layout == want.layout() for _, layout in got), label_of(c)
        note = got[0][0]
        assert (want is timed) == (note is not None and "a step's" in note), (label_of(c), note)
    assert not fakes or adopted, "no case adopted its timed rounds"

def test_cases_cover_every_registered_schedule() -> None:
    """The worlds below run (and replay) every schedule of the registry, split variants included."""
    cases = WORLD2 + WORLD3 + WORLD4 + WORLD8
    for name, kind in registered().items():
        assert any(c["schedule"] == name for c in cases), f"no case runs {name}"
        if kind.split == "optional":
            assert any(c["schedule"] == name and c["split"] for c in cases), f"no case runs {name} split"
    assert any(c["S"] > 1 and c["D"] > 1 for c in cases) and any(c["R"] > 1 and c["S"] > 1 for c in cases)


#: the worlds, by the id their tests carry: (ranks, cases)
WORLDS = {"D2": (2, WORLD2), "D3": (3, WORLD3), "D4-R2xD2-D2xS2": (4, WORLD4), "R2xD2xS2-R2xD4": (8, WORLD8)}


def _world_schedules() -> list[Any]:
    """(world, schedule) for every schedule a world runs, with the id ``<world>-<schedule>``."""
    return [pytest.param(w, name, id=f"{w}-{name}") for w, (_, cases) in WORLDS.items()
            for name in dict.fromkeys(c["schedule"] for c in cases)]


@pytest.fixture(scope="module")
def worlds_run() -> dict[str, Any]:
    """Each world's run, made by its first test for every schedule selected in it: {world: (cases, results, the
    schedules not checked yet)}, dropped once they all are."""
    return {}


@pytest.mark.parametrize("world,schedule", _world_schedules())
def test_every_schedule_matches_serial(world: str, schedule: str, worlds_run: dict[str, Any],
                                       request: pytest.FixtureRequest) -> None:
    if world not in worlds_run:
        size, cases = WORLDS[world]
        chosen = {item.callspec.params["schedule"] for item in request.session.items
                  if isinstance(item, pytest.Function) and item.originalname == request.node.originalname
                  and item.module is request.module and item.callspec.params["world"] == world}
        cases = [c for c in cases if c["schedule"] in chosen]
        worlds_run[world] = (cases, run_world(pipeline_cases, size, cases, timeout=300), chosen)
    cases, results, unchecked = worlds_run[world]
    unchecked.discard(schedule)
    if not unchecked:
        del worlds_run[world]
    mine = [i for i, c in enumerate(cases) if c["schedule"] == schedule]
    results, cases = [[per_rank[i] for i in mine] for per_rank in results], [cases[i] for i in mine]
    check(results, cases)
    check_nccl_order(results, cases)
    check_timed(results, cases)
