"""Schedules as pure data: checked without any process group."""
from __future__ import annotations

import inspect
import re

import pytest

from gems.errors import ConfigError
from gems.pipeline import schedules as S
from gems.pipeline.schedules import Action, DeadlockError, Schedule, draw, make_schedule, simulate


def all_schedules():
    for D in range(1, 6):
        for m in range(1, 5):
            yield S.lp(D, m)
            yield S.gpipe(D, m)
            yield S.one_f_one_b(D, m)
            if D > 1:
                yield S.mast(D, m)
                for eta in range(1, 6):
                    yield S.master(D, eta, m)


def max_in_flight(sched: Schedule) -> list[list[int]]:
    """Per rank and direction, the most forwards whose backward has not run yet (activations kept)."""
    out = []
    for order in sched.actions:
        cur, peak = [0, 0], [0, 0]
        for a in order:
            d = sched.direction(a.replica)
            cur[d] += 1 if a.kind == "F" else -1
            peak[d] = max(peak[d], cur[d])
        out.append(peak)
    return out


def test_every_schedule_is_complete_ordered_and_deadlock_free():
    n = 0
    for sched in all_schedules():
        span = simulate(sched)  # raises on duplicates, omissions, wrong rank or deadlock
        for a, (start, _) in span.items():
            if a.kind == "B":
                assert span[Action("F", a.replica, a.micro_batch, a.stage)][1] <= start
                if a.stage < sched.stages - 1:
                    assert span[Action("B", a.replica, a.micro_batch, a.stage + 1)][1] <= start
            elif a.stage > 0:
                assert span[Action("F", a.replica, a.micro_batch, a.stage - 1)][1] <= start
        for r, order in enumerate(sched.actions):  # own forward precedes own backward in the list itself
            pos = {a: i for i, a in enumerate(order)}
            assert all(pos[Action("F", a.replica, a.micro_batch, a.stage)] < i for i, a in enumerate(order) if a.kind == "B")
        n += 1
    assert n > 100


def test_mast_places_the_mirrored_replica_on_the_other_end():
    for D in (2, 3, 4, 8):
        sched = S.mast(D)
        for r in range(D):
            assert sched.partitions_of(r) == sorted({r, D - 1 - r})
            stages = {(a.replica, a.stage) for a in sched.actions[r]}
            assert stages == {(0, r), (1, D - 1 - r)}


def test_master_runs_eta_passes_alternating_directions_at_mast_memory():
    for D in (2, 3, 4):
        for eta in (1, 2, 3, 4, 7):
            sched = S.master(D, eta)
            assert sched.replicas == eta  # not capped at two
            passes = {a.replica for order in sched.actions for a in order}
            assert passes == set(range(eta))
            for p in passes:
                assert sched.rank_of(p, 0) == (0 if p % 2 == 0 else D - 1)
            # at most one pass per direction alive on a rank: the memory of MAST, whatever eta
            assert all(max(peak) <= 1 for peak in max_in_flight(sched))


def test_activation_memory_bounds():
    D, m = 4, 6
    assert [max(p) for p in max_in_flight(S.gpipe(D, m))] == [m] * D
    assert [p[0] for p in max_in_flight(S.one_f_one_b(D, m))] == [D - s for s in range(D)]
    assert all(max(p) == 1 for p in max_in_flight(S.lp(D, m)))
    for sched in (S.mast(D, m), S.master(D, 4, m)):  # Chimera bound
        assert all(sum(p) <= D + 1 for p in max_in_flight(sched))


def test_mirrored_schedules_fill_the_bubbles():
    assert S.busy_fraction(S.lp(2)) == pytest.approx(0.5)
    assert S.busy_fraction(S.mast(2)) == pytest.approx(1.0)
    for eta in (2, 4, 6):
        assert S.busy_fraction(S.master(2, eta)) == pytest.approx(1.0)
    for D in (3, 4, 8):
        # same samples per step: lp on the whole batch (forward 2 ticks, backward 4) against mast on halves
        lp_ticks = 2 * 3 * D
        assert S.makespan(S.mast(D)) < lp_ticks
        # more micro-batches per direction (Chimera) only shrink the bubble
        assert S.busy_fraction(S.mast(D, D)) > S.busy_fraction(S.mast(D, 1))
    # 1F1B's bubble: (D-1) / (m + D - 1) of the time with F=1, B=2
    for D, m in ((2, 4), (4, 8)):
        assert S.busy_fraction(S.one_f_one_b(D, m)) == pytest.approx(m / (m + D - 1))


def drawn_tables() -> dict[str, list[tuple[str, str, str]]]:
    """The clock tables the docstrings of gems/pipeline/schedules.py draw, by the name of the schedule that the call
    written before each (``gpipe(2, 3)``::) builds: {name: [(the call, the table drawn, what draw() gives now)]}."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    for fn in vars(S).values():
        doc = inspect.getdoc(fn) if inspect.isfunction(fn) and fn.__module__ == S.__name__ else None
        for block in re.finditer(r"::\n\n((?:    .*\n?)+)", doc or ""):
            fname, args = re.findall(r"``(\w+)\(([\d, ]*)\)``", doc[:block.start()])[-1]  # type: ignore[index]
            sched = getattr(S, fname)(*(int(a) for a in args.split(",")))
            table = "\n".join(line[4:].rstrip() for line in block.group(1).rstrip().splitlines())
            out.setdefault(sched.name, []).append((f"{fname}({args})", table, draw(sched)))
    return out


@pytest.mark.parametrize("name", list(S.registered()))
def test_every_registered_schedule_is_drawn_in_its_docstring_as_it_builds(name):
    drawn = drawn_tables()
    assert name in drawn, f"{name} has no clock table in a docstring of gems/pipeline/schedules.py"
    for call, table, now in drawn[name]:
        assert table == now, f"{call} draws\n{now}"


def test_simulator_finds_cross_rank_deadlock():
    good = S.lp(2, 2)
    r0, r1 = good.actions
    # rank 1 wants micro-batch 1 before micro-batch 0 is done, while rank 0 holds 1 back until 0's backward
    bad_r1 = (Action("F", 0, 1, 1), Action("B", 0, 1, 1), Action("F", 0, 0, 1), Action("B", 0, 0, 1))
    bad = Schedule("bad", 2, 1, 2, False, (r0, bad_r1))
    with pytest.raises(DeadlockError, match="wait on each other"):
        simulate(bad)


def test_simulator_rejects_backward_before_forward_and_bad_lists():
    good = S.gpipe(2, 2)
    r0, r1 = good.actions
    with pytest.raises(DeadlockError):
        simulate(Schedule("bwd-first", 2, 1, 2, False, (tuple(reversed(r0)), r1)))
    with pytest.raises(AssertionError, match="duplicated"):
        simulate(Schedule("dup", 2, 1, 2, False, (r0 + r0[:1], r1)))
    with pytest.raises(AssertionError, match="missing"):
        simulate(Schedule("short", 2, 1, 2, False, (r0[1:], r1)))
    with pytest.raises(AssertionError, match="lives on rank"):
        simulate(Schedule("swapped", 2, 1, 2, False, (r1, r0)))


def test_make_schedule_validates():
    with pytest.raises(ConfigError) as e:
        make_schedule("mast", 1)
    assert e.value.key == "parallel.schedule"
    with pytest.raises(ConfigError) as e:
        make_schedule("master", 1, gems_replicas=4)
    assert e.value.key == "parallel.schedule"
    with pytest.raises(ConfigError) as e:
        make_schedule("zigzag", 2)
    assert e.value.key == "parallel.schedule" and "mast" in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_schedule("mast", 2, gems_replicas=4)
    assert e.value.key == "parallel.gems_replicas" and "master" in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_schedule("1f1b", 2, 4, gems_replicas=3)
    assert e.value.key == "parallel.gems_replicas"
    with pytest.raises(ConfigError) as e:
        make_schedule("gpipe", 2, 0)
    assert e.value.key == "parallel.micro_batches"
    assert make_schedule("master", 2, 1, 6).replicas == 6
    assert make_schedule("master", 2).replicas == 2
    assert make_schedule("lp", 1).actions == ((Action("F", 0, 0, 0), Action("B", 0, 0, 0)),)


def test_a_schedule_built_under_another_name_than_its_registration_is_refused_naming_both(monkeypatch):
    monkeypatch.setitem(S._REGISTRY, "lp2", S.ScheduleKind("lp2", lambda D, m, passes, v, split: S.lp(D, m)))
    with pytest.raises(ValueError, match="registered as 'lp2' builds one named 'lp'"):
        make_schedule("lp2", 2)


# ---- the registry, placement as data, interleaved stages ---------------------------------------------------
def test_every_registered_schedule_is_complete_ordered_and_deadlock_free():
    names = set(S.registered())
    assert {"lp", "gpipe", "1f1b", "mast", "master", "interleaved1f1b"} <= names
    n = 0
    for name, kind in S.registered().items():
        for D in range(max(2, kind.min_ranks), 5):
            for m in (D, 2 * D):
                for v in ((2, 3) if kind.virtual else (None,)):
                    sched = make_schedule(name, D, m, virtual_stages=v)
                    span = simulate(sched)
                    S.check_messages(sched)
                    assert all(sched.rank_of(a.replica, a.stage) == r for r, o in enumerate(sched.actions) for a in o)
                    for a, (start, _) in span.items():
                        for dep in S.needs(a, sched.stages):
                            assert span[dep][1] <= start, (name, a, dep)
                    n += 1
    assert n > 40


def test_placement_is_data_and_says_who_holds_copies():
    assert S.mast(4).holder_groups() == [(0, 3), (1, 2)]
    assert S.mast(3).holder_groups() == [(0, 2), (1,)]
    assert S.one_f_one_b(4, 4).holder_groups() == [(0,), (1,), (2,), (3,)]
    il = S.interleaved_1f1b(4, 2, 4)
    assert il.stages == 8 and il.ranks == 4 and il.placement == ((0, 1, 2, 3, 0, 1, 2, 3),)
    assert il.partitions_of(1) == [1, 5] and il.holder_groups() == [(0,), (1,), (2,), (3,)]
    # a schedule with another placement is expressible: two stages per rank, mirrored rows
    odd = Schedule("custom", 2, 2, 1, False, ((), ()), placement=((0, 1), (1, 0)))
    assert odd.rank_of(1, 0) == 1 and odd.holder_groups() == [(0, 1)]


@pytest.mark.parametrize("D,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (3, 3, 6), (4, 4, 8)])
def test_interleaved_stages_shrink_the_bubble_of_1f1b(D, v, m):
    il, base = S.interleaved_1f1b(D, v, m), S.one_f_one_b(D, m)
    # unit costs per action: an interleaved stage is 1/v of a 1F1B stage, so busy fractions compare directly
    assert S.bubble_fraction(il) < S.bubble_fraction(base)
    # 1F1B's bubble is (D-1)/(m+D-1); interleaving divides the fill-and-drain by about v
    assert S.bubble_fraction(base) == pytest.approx((D - 1) / (m + D - 1))
    assert S.bubble_fraction(il) <= S.bubble_fraction(base) / v * 1.35 + 1e-9
    # the stages of a rank keep at most (D - r - 1) * 2 + (v - 1) * D + 1 micro-batches in flight
    for r in range(D):
        assert S.in_flight(il, r)[0] <= min(v * m, (D - r - 1) * 2 + (v - 1) * D + 1)


def test_interleaved_options_are_checked():
    with pytest.raises(ConfigError) as e:
        make_schedule("interleaved1f1b", 2, 3)
    assert e.value.key == "parallel.micro_batches"
    with pytest.raises(ConfigError) as e:
        make_schedule("1f1b", 2, 2, virtual_stages=2)
    assert e.value.key == "parallel.virtual_stages" and "interleaved1f1b" in str(e.value)
    with pytest.raises(ConfigError) as e:
        make_schedule("interleaved1f1b", 1, 2)
    assert e.value.key == "parallel.schedule"
    assert make_schedule("interleaved1f1b", 2, 2).stages == 4  # two stages per rank by default


# ---- the backward split into input and weight gradients ------------------------------------------------------
#: every registered schedule that takes parallel.split_backward, on a grid of sizes (a new one is checked too)
SPLIT_CASES = [(name, D, m, (4 if m == 1 else 2) if kind.passes == "eta" else None)
               for name, kind in S.registered().items() if kind.split == "optional"
               for D, m in ((2, 1), (2, 4), (3, 3), (4, 8)) if D >= kind.min_ranks and not (kind.virtual and m % D)]


@pytest.mark.parametrize("name,D,m,eta", SPLIT_CASES)
def test_split_backward_schedules_are_complete_and_fill_bubbles_at_the_same_memory(name, D, m, eta):
    whole = make_schedule(name, D, m, eta)
    split = make_schedule(name, D, m, eta, split_backward=True)
    assert split.split and not whole.split
    span = simulate(split)
    S.check_messages(split)
    kinds = {a.kind for o in split.actions for a in o}
    assert kinds == {"F", "I", "W"}
    for a, (start, _) in span.items():  # a W after its own I, an I after the I of the stage after
        for dep in S.needs(a, split.stages):
            assert span[dep][1] <= start
    # the same work in the same memory bound, and never a larger bubble
    assert all(S.in_flight(split, r) <= S.in_flight(whole, r) for r in range(D))
    assert S.bubble_fraction(split) <= S.bubble_fraction(whole) + 1e-9


def test_zero_bubble_shrinks_1f1b_bubble_at_its_memory():
    for D, m in ((2, 4), (3, 4), (4, 8)):
        assert S.bubble_fraction(S.zero_bubble_h1(D, m)) < S.bubble_fraction(S.one_f_one_b(D, m))
        assert S.in_flight(S.zero_bubble_h1(D, m), 0) == S.in_flight(S.one_f_one_b(D, m), 0)
    with pytest.raises(ConfigError) as e:
        make_schedule("lp", 2, split_backward=True)
    assert e.value.key == "parallel.split_backward" and "zbh1" in str(e.value)


def test_interleaved_zero_bubble_beats_zbh1_and_keeps_less_than_megatron_at_d4():
    """The registration added with this test alone: against ZB-H1 a smaller bubble at every size, against
    interleaved 1F1B (v = 2) the figures its docstring gives."""

    def kept(sched):  # the most stage activations a rank keeps at once
        return max(sum(S.in_flight(sched, r)) for r in range(sched.ranks))

    for D, m in ((2, 4), (3, 6), (4, 8), (4, 16)):
        z = S.interleaved_zero_bubble(D, 2, m)
        simulate(z)
        assert S.bubble_fraction(z) < S.bubble_fraction(S.zero_bubble_h1(D, m)), (D, m)
    z, i = S.interleaved_zero_bubble(2, 2, 4), S.interleaved_1f1b(2, 2, 4)
    assert round(S.bubble_fraction(z), 2) == 0.08 and round(S.bubble_fraction(i), 2) == 0.11
    z, i = S.interleaved_zero_bubble(3, 2, 6), S.interleaved_1f1b(3, 2, 6)
    assert S.bubble_fraction(z) == pytest.approx(S.bubble_fraction(i))
    z, i = S.interleaved_zero_bubble(4, 2, 8), S.interleaved_1f1b(4, 2, 8)
    assert (round(S.bubble_fraction(z), 2), round(S.bubble_fraction(i), 2)) == (0.19, 0.16)
    assert (kept(z), kept(i)) == (8, 11)


# ---- looped breadth-first: added with one registration (gems/pipeline/schedules.py) and this test alone ------
def test_looped_bfs_takes_any_micro_batches_and_keeps_every_one():
    """Interleaved 1F1B's bubble where m is a multiple of D, GPipe's memory (every micro-batch on every stage of a
    rank), and any m (interleaved 1F1B refuses m = 3 at D = 2)."""
    for D, m in ((2, 4), (3, 6), (4, 8)):
        bfs = make_schedule("loopedbfs", D, m)
        assert bfs.stages == 2 * D and bfs.kind.keeps_all_in_flight
        assert S.bubble_fraction(bfs) == pytest.approx(S.bubble_fraction(S.interleaved_1f1b(D, 2, m)))
        assert S.bubble_fraction(bfs) < S.bubble_fraction(S.gpipe(D, m))
        assert all(S.in_flight(bfs, r) == [2 * m] for r in range(D))
    for D, m, v in ((2, 3, 2), (4, 2, 2), (3, 5, 3)):
        bfs = make_schedule("loopedbfs", D, m, virtual_stages=v)
        simulate(bfs)
        S.check_messages(bfs)
        assert all(S.in_flight(bfs, r) == [v * m] for r in range(D))
    with pytest.raises(ConfigError):
        make_schedule("interleaved1f1b", 2, 3)


def test_the_planner_bounds_a_looped_bfs_run_closely(tmp_path):
    """The planner knows the new schedule from its action lists alone: each rank's planned memory bounds what its
    tensors reach in a real run within 40%, at the state its action list walks to (all four micro-batches on the
    stage whose backward sets the peak; on the second rank its other stage may be done by then, its input gradients
    sent and held)."""
    import json

    from _cli import gems_here, merged, records

    args = merged("model.size=64", "model.width=0.5", "train.steps=3", "train.warmup_steps=1", "train.batch_size=4",
                  "parallel.pipeline=2", "parallel.schedule=loopedbfs", "parallel.micro_batches=4")
    out = gems_here("run", f"results.dir={tmp_path}", *args)
    assert out.returncode == 0, out.stderr[-3000:]
    (rec,) = records(str(tmp_path))
    measured = rec["peak_memory_bytes"]["tensor_per_rank"]
    out = gems_here("plan", "plan.format=json", "plan.predict=false", *args)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    by_rank = {pos["pipeline"]: pos for pos in plan["positions"]}
    assert len(by_rank) == len(measured) == 2
    for rank, got in enumerate(measured):
        pos = by_rank[rank]
        assert max(pos["in_flight"].values()) == 4, pos["in_flight"]
        assert 1.0 <= pos["bytes"]["total"] / got <= 1.4, (rank, pos["bytes"]["total"], got)


def _exchange_cases():  # type: ignore[no-untyped-def]
    from gems.pipeline.schedules import make_schedule, registered

    for name, kind in registered().items():
        for D in (2, 3, 4):
            for m in (1, 2, 4):
                for eta in ([2, 3] if kind.passes == "eta" else [None]):
                    for v in ([2, 3] if kind.virtual else [None]):
                        for split in ([False, True] if kind.split == "optional" else [False]):
                            try:
                                yield make_schedule(name, D, m, eta, v, split)
                            except ConfigError:
                                continue


def test_every_schedule_exchanges_its_messages_in_meetings() -> None:
    """Every registered schedule's exchange rounds (gems.pipeline.exchange), of a step and of an evaluation's
    forwards, run to the end with sends that wait for their receive, one round at a time per rank; every
    message crosses once, in a round both its ends run, before the action that needs it."""
    from gems.pipeline.exchange import check, plan_exchanges
    from gems.pipeline.schedules import sends

    n = 0
    for sched in _exchange_cases():
        for forward_only in (False, True):
            plan = plan_exchanges(sched, forward_only)
            check(plan)
            made = sum(1 for order in plan.orders for a in order if sends(a, sched.stages) is not None)
            assert sum(len(r.messages) for r in plan.rounds) == made, sched.name
            for p in range(sched.ranks):
                mine = plan.messages(p)
                assert len(mine) == len(set(mine))
            n += 1
    assert n > 150


def test_rounds_placed_by_measured_costs_still_meet() -> None:
    """The rounds' induction holds on any clock whose actions take positive time (gems.pipeline.exchange): every
    registered schedule, its rounds placed by random integer costs per (kind, stage) (few values, so ties happen;
    and microsecond-sized ones), runs to the end with sends that wait for their receive, the mirrored copies' sums
    between the rounds too; every message crosses once. And the costs move rounds: uneven stages give some
    schedule another placement than the unit clock's."""
    import random

    from gems.pipeline.exchange import check, plan_exchanges
    from gems.pipeline.schedules import Kind

    rng = random.Random(42)
    n, moved = 0, 0
    for sched in _exchange_cases():
        for top in (3, 20000):
            costs = {(k, s): rng.randint(1, top) for k in Kind for s in range(sched.stages)}
            for forward_only in (False, True):
                plan = plan_exchanges(sched, forward_only, costs)
                buckets = None if forward_only or not sched.holds_copies else \
                    {p: [k for k in sorted(sched.partitions_of(p), reverse=True) for _ in range(2)]
                     for p in range(sched.ranks)}
                check(plan, buckets)
                for p in range(sched.ranks):
                    mine = plan.messages(p)
                    assert len(mine) == len(set(mine))
                moved += plan.layout() != plan_exchanges(sched, forward_only).layout()
                n += 1
    assert n > 300 and moved > n // 4, (n, moved)


def test_receives_posted_ahead_keep_each_pairs_order() -> None:
    """Over gloo a rank posts a round's receives ahead of it (gems.pipeline.exchange.receive_lead): for every
    registered schedule, with the mirrored copies' sums, posted 1, 2 and gloo's lead of actions ahead, each pair's
    receiver posts the pair's messages in the order its sender sends them, none after its round nor more than the
    lead before it, and the planner's count of held buffers covers the posted ones. Most plans move some receive
    ahead of its round."""
    from gems.pipeline.exchange import check, plan_exchanges, program, receive_lead

    assert receive_lead("gloo") >= 1 and receive_lead("nccl") == 0
    n, moved = 0, 0
    for sched in _exchange_cases():
        plan = plan_exchanges(sched)
        buckets = {p: [k for k in sorted(sched.partitions_of(p), reverse=True) for _ in range(2)]
                   for p in range(sched.ranks)} if sched.holds_copies else None
        for lead in sorted({1, 2, receive_lead("gloo")}):
            check(plan, buckets, lead)
            for p in range(sched.ranks):
                assert plan.held(p, lead) >= plan.held(p)
                moved += any(kind == "receive" for kind, _ in program(plan, p, lead=lead))
            n += 1
    assert n > 225 and moved > n, (n, moved)


def test_the_pair_order_check_catches_receives_posted_out_of_order() -> None:
    """The lead check is not vacuous: a receiver posting two of a pair's messages in swapped order is named."""
    from dataclasses import replace

    from gems.pipeline import exchange
    from gems.pipeline.exchange import check, plan_exchanges

    plan = plan_exchanges(S.gpipe(2, 4))
    check(plan, lead=1)
    real = exchange.ExchangePlan.posts

    def swapped(self, position, lead=0):  # type: ignore[no-untyped-def]
        out = [list(s) for s in real(self, position, lead)]
        full = [k for k, s in enumerate(out) if s]
        if position == 1 and len(full) >= 2:  # the receiver posts its second slot's rounds before its first's
            a, b = full[0], full[1]
            out[a], out[b] = out[b], out[a]
        return tuple(tuple(s) for s in out)

    try:
        exchange.ExchangePlan.posts = swapped  # type: ignore[method-assign]
        with pytest.raises(AssertionError, match="another order|too early"):
            check(replace(plan), lead=1)
    finally:
        exchange.ExchangePlan.posts = real  # type: ignore[method-assign]


def test_exchange_costs_must_be_positive_integers() -> None:
    from gems.pipeline.exchange import plan_exchanges
    from gems.pipeline.schedules import Kind

    sched = S.one_f_one_b(2, 2)
    for bad in (0, 1.5):
        with pytest.raises(AssertionError, match="positive integers"):
            plan_exchanges(sched, costs={(k, s): bad for k in Kind for s in range(2)})


def test_the_meeting_check_catches_rounds_run_out_of_order() -> None:
    """The check is not vacuous: rank 0 running two of its rounds in swapped order hangs; an action placed before
    the round that brings its message is named."""
    from dataclasses import replace

    from gems.pipeline.exchange import check, plan_exchanges

    plan = plan_exchanges(S.one_f_one_b(2, 4))
    slots = [list(s) for s in plan.before[1]]
    rounds = [(k, r) for k, s in enumerate(slots) for r in s]
    (k1, r1), (k2, r2) = rounds[1], rounds[2]
    slots[k1][slots[k1].index(r1)], slots[k2][slots[k2].index(r2)] = r2, r1
    swapped = replace(plan, before=(plan.before[0], tuple(tuple(s) for s in slots)))
    with pytest.raises((DeadlockError, AssertionError)):
        check(swapped)
    late = [list(s) for s in plan.before[1]]
    first = next(k for k, s in enumerate(late) if s)
    late[first + 1] = late[first] + late[first + 1]
    late[first] = []
    with pytest.raises(AssertionError, match="before it has received"):
        check(replace(plan, before=(plan.before[0], tuple(tuple(s) for s in late))))


def test_mirrored_gradient_sums_meet_between_the_same_rounds_on_every_holder() -> None:
    """GEMS's mirrored copies sum each bucket where gems.pipeline.exchange.sum_points puts it (after the action that
    completes it, between the same two rounds on every holder): with every schedule that holds copies (D = 2-4,
    m = 1-4, eta, split) and three buckets a partition, the rounds and the sums run to the end with sends that wait
    for their receive and each sum a collective of its holders, some sum starts before the position's last action
    (the overlap given back: they all waited for the end before), and none before the round that carries what its
    completing action sent."""
    from gems.pipeline.exchange import _message, check, plan_exchanges, program, sum_points

    n, early, spans = 0, 0, 0
    for sched in _exchange_cases():
        if not sched.holds_copies:
            continue
        plan = plan_exchanges(sched)
        buckets = {p: [k for k in sorted(sched.partitions_of(p), reverse=True) for _ in range(3)]
                   for p in range(sched.ranks)}
        check(plan, buckets)
        # buckets filled across a position's partitions (gems.replication): one of each partition's and one of
        # both between them, the last partition's first
        across: dict[int, list[int | tuple[int, ...]]] = {}
        for p in range(sched.ranks):
            ks = sorted(sched.partitions_of(p), reverse=True)
            across[p] = [ks[0], *[tuple(ks[i:i + 2]) for i in range(len(ks) - 1)], ks[-1]]
        check(plan, across)
        spans += any(isinstance(b, tuple) for bs in across.values() for b in bs)
        for p in range(sched.ranks):
            points = sum_points(plan, buckets[p])[p]
            prog = program(plan, p, points)
            kinds = [k for k, _ in prog]
            assert kinds.count("sum") == len(buckets[p])
            # what the completing action sent leaves before the sum: a peer waiting for it never waits behind it
            for b, (_, k) in enumerate(points):
                made = _message(sched, plan.orders[p][k]) if k >= 0 else None
                if made is not None:
                    at = next(i for i, (kind, r) in enumerate(prog) if kind == "round" and made in r.messages)
                    assert at < prog.index(("sum", b)), (sched.name, p, b)
            last_action = max((i for i, k in enumerate(kinds) if k == "action"), default=-1)
            early += any(k == "sum" and i < last_action for i, k in enumerate(kinds))
        n += 1
    assert n > 30 and early > n and spans == n


def test_a_bucket_sums_where_the_last_of_its_partitions_completes() -> None:
    """A bucket of two partitions (gems.replication fills buckets across a rank's partitions) launches after the
    later of their last backwards, at the cut the later one's bucket alone would take; and one across two
    holders' partitions is refused (every holder of a mirrored bucket holds all its partitions)."""
    from gems.pipeline.exchange import plan_exchanges, sum_points

    for name, d in (("mast", 2), ("mast", 4), ("master", 2)):
        sched = S.make_schedule(name, d, 2)
        plan = plan_exchanges(sched)
        for p in range(d):
            ks = sorted(sched.partitions_of(p), reverse=True)
            alone = sum_points(plan, ks)[p]
            both = sum_points(plan, [tuple(ks)])[p]
            assert both == [max(alone, key=lambda point: point[1])], (name, d, p)
    plan = plan_exchanges(S.make_schedule("mast", 4, 2))
    with pytest.raises(AssertionError, match="spans holders"):
        sum_points(plan, [(0, 1)])


def test_the_sums_an_action_may_start_inside_it_are_those_due_right_after_it() -> None:
    """gems.pipeline.exchange.at_points: with every schedule that holds copies, the sums a position may start inside
    an action are the ones its program issues right after that action, each due there (its sum point's action),
    in bucket order; GEMS-MAST starts every bucket of its last backward inside it, on both positions, and none of
    the partition whose backward sends a gradient (its sums wait for that round)."""
    from gems.pipeline.exchange import at_points, plan_exchanges, program, sum_points

    for sched in _exchange_cases():
        if not sched.holds_copies:
            continue
        plan = plan_exchanges(sched)
        for p in range(sched.ranks):
            bs = [k for k in sorted(sched.partitions_of(p), reverse=True) for _ in range(3)]
            points = sum_points(plan, bs)[p]
            prog = program(plan, p, points)
            inside = at_points(prog)
            for k, due in inside.items():
                assert list(due) == sorted(due) and all(points[b][1] == k for b in due), (sched.name, p, k)
                at = prog.index(("action", k))
                assert prog[at + 1:at + 1 + len(due)] == [("sum", b) for b in due]
    plan = plan_exchanges(S.make_schedule("mast", 2, 2))
    for p in (0, 1):
        bs = [1, 1, 0, 0]
        inside = at_points(program(plan, p, sum_points(plan, bs)[p]))
        assert inside == {len(plan.orders[p]) - 1: (2, 3)}, inside


def test_the_meeting_check_catches_a_sum_out_of_place() -> None:
    """The check with sums is not vacuous: position 0 of GEMS-MAST launching its first bucket before any round
    while its mirror launches it where sum_points says hangs."""
    from gems.pipeline import exchange

    plan = exchange.plan_exchanges(S.make_schedule("mast", 2, 2))
    buckets = {p: [1, 1, 0, 0] for p in (0, 1)}
    real = exchange.sum_points

    def early(plan, bs):  # type: ignore[no-untyped-def]
        out = real(plan, bs)
        out[0][0] = (-1, -1)  # position 0: bucket 0 at once
        return out

    exchange.check(plan, buckets)
    try:
        exchange.sum_points = early  # type: ignore[assignment]
        with pytest.raises(DeadlockError):
            exchange.check(plan, buckets)
    finally:
        exchange.sum_points = real  # type: ignore[assignment]


def test_a_receiver_holds_what_came_early_as_the_planner_counts_it() -> None:
    """GPipe's stages receive each activation (gradient) one action before the action that needs it (LOOKAHEAD),
    so each holds one beside the one in use; looped BFS receives a stage's forwards while it runs another:
    the buffers held beside the input are what ExchangePlan.held says."""
    from gems.pipeline.exchange import LOOKAHEAD, plan_exchanges
    from gems.pipeline.schedules import gpipe, looped_bfs

    assert [plan_exchanges(gpipe(2, 4)).held(p) for p in (0, 1)] == [LOOKAHEAD, LOOKAHEAD]
    bfs = plan_exchanges(looped_bfs(2, 2, 4))
    assert max(bfs.held(p) for p in (0, 1)) >= 2


def test_the_buffers_held_beside_each_action_are_those_its_program_has_posted_and_not_used() -> None:
    """ExchangePlan.held_during, what the memory plan adds to each state, recounted from the program the runtime
    runs (gems.pipeline.exchange.program, with gloo's receive lead and without): before action k, every message
    received in a round or posted ahead and not yet needed by an earlier action, less the one k itself takes, for
    every registered schedule; its most is ExchangePlan.held, and with a lead some action holds more than without."""
    from gems.pipeline.exchange import plan_exchanges, program, receive_lead, wanted

    more = 0
    for sched in _exchange_cases():
        plan = plan_exchanges(sched)
        for lead in (0, receive_lead("gloo")):
            for p in range(sched.ranks):
                got, counted = set(), []
                for kind, item in program(plan, p, lead=lead):
                    if kind in ("round", "receive"):
                        got |= {m.key for m in item.of(p) if m.dst == p}
                    elif kind == "action":
                        key = wanted(plan.orders[p][item], sched.stages)
                        got.discard(key)
                        counted.append(len(got))
                assert plan.held_during(p, lead) == counted, (sched.name, p, lead)
                assert plan.held(p, lead) == max(counted, default=0)
                more += lead > 0 and max(counted, default=0) > max(plan.held_during(p), default=0)
    assert more > 0


def test_a_send_is_known_delivered_once_its_receiver_has_answered():
    """ExchangePlan.delivered: a rank learns a send arrived from a message its receiver made after needing it. Under
    1F1B a position holds as many at any action whatever m (its warm-up's activations, a gradient or two); under
    GPipe the last backwards' input gradients
    have no answer within the step (held to its end, m - 1 on the last position); every send named is one this
    position made, named once, and its receiver needed it before making the message that names it."""
    from gems.pipeline.exchange import plan_exchanges
    from gems.pipeline.schedules import receives, sends

    for D, m in ((2, 8), (4, 8)):
        one = plan_exchanges(make_schedule("1f1b", D, m))
        longer = plan_exchanges(make_schedule("1f1b", D, 2 * m))
        for p in range(D):
            most = max(len(u) for u in one.unconfirmed(p))
            assert most == max(len(u) for u in longer.unconfirmed(p)) and most <= D - 1
        gp = plan_exchanges(make_schedule("gpipe", D, m))
        assert max(len(u) for u in gp.unconfirmed(D - 1)) == m - 1
        for plan in (one, gp):
            S = plan.schedule.stages
            for p in range(D):
                made = {m_.key: m_ for r in plan.rounds for m_ in r.messages if m_.src == p and m_.dst != p}
                named = [k for keys in plan.delivered(p).values() for k in keys]
                assert len(named) == len(set(named)) and set(named) <= set(made)
                for got, keys in plan.delivered(p).items():
                    sender = next(m_.src for r in plan.rounds for m_ in r.messages if m_.key == got and m_.dst == p)
                    order = plan.orders[sender]
                    making = next(i for i, a in enumerate(order)
                                  if (s := sends(a, S)) and (s[0], a.replica, a.micro_batch, s[1]) == got)
                    for k in keys:
                        needing = next(i for i, a in enumerate(order)
                                       if (n := receives(a, S)) and (n[0], a.replica, a.micro_batch, n[1]) == k)
                        assert needing < making


def test_layer_parallelism_in_closed_form_is_the_list_schedulers_and_schedules_are_kept_once_made() -> None:
    """lp's orders are written in closed form (each micro-batch's forward then backward, in turn: the search plans
    pipelines of many micro-batches, where the list scheduler took seconds); they are what the list scheduler
    gives at an in-flight limit of one. A schedule made is a value handed out again for the same arguments."""
    from gems.pipeline.schedules import _generate, lp, make_schedule

    for D in (1, 2, 3, 5):
        for m in (1, 2, 3, 7):
            assert lp(D, m).actions == _generate("lp", D, 1, m, False, "B", lambda s: 1).actions
    assert make_schedule("1f1b", 3, 4) is make_schedule("1f1b", 3, 4)
    assert make_schedule("1f1b", 3, 4, split_backward=True) is not make_schedule("1f1b", 3, 4)
