"""When a pipeline's messages cross: exchange rounds that NCCL completes, whatever its streams do.

A schedule's messages are turned into meetings (docs/design.md, "Rules of the GPU path": message order): every
message crosses in the round of the tick its producing action ends, one ``batch_isend_irecv`` a rank and round on
the line's one communicator (:func:`plan_exchanges`); :func:`check` replays a plan with sends that wait for their
receive. GEMS's mirrored copies sum their gradients between the rounds every holder shares (:func:`sum_points`).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from gems.pipeline.schedules import Action, DeadlockError, Kind, Schedule, receives, run_orders, sends

__all__ = ["Message", "Round", "ExchangePlan", "plan_exchanges", "check", "pairs", "wanted", "LOOKAHEAD",
           "sum_points", "Bucket", "bucket_parts", "program", "at_points", "Costs", "microseconds", "receive_lead",
           "GLOO_LEAD", "adoptable"]

#: an action's time on the clock rounds are placed by: positive integers (microseconds, as measured) per
#: (kind, stage); None: the unit clock (a forward 1, a backward 2)
Costs = Mapping[tuple[Kind, int], int]

def microseconds(seconds: float) -> int:
    """A measured time on the clock of :data:`Costs`: whole microseconds, at least one."""
    return max(1, round(seconds * 1e6))


#: over gloo a round's receives are posted this many actions before the round (:func:`plan_exchanges`), so that the
#: receive is there before its send: a send that finds it goes out from the sender's own thread, one that does not
#: waits for gloo's I/O thread on a busy core, 2-5 ms a message (a timed step: interleaved 1F1B at an uneven cut).
#: One action covered a round both ends reach together; where the stages are uneven, or the clock the rounds are
#: placed by is not the run's (the unit clock), a sender runs ahead of its receiver by more than one of the
#: receiver's actions. Two brought interleaved 1F1B at the uneven cut from 0.97 of torch's to 1.03; three and
#: four bought nothing more this machine could tell apart
#: (results/history/pipeline-schedules.md#pipeline-gloo-lead-sweep-second,
#: scripts/sweep_gloo_lead.py) and hold more buffers, each counted by the memory plan
#: (:meth:`ExchangePlan.held_during`)
GLOO_LEAD = 2


def receive_lead(backend: str) -> int:
    """How many actions before its round a rank posts the round's receives: :data:`GLOO_LEAD` over gloo, none
    elsewhere (NCCL: a receive is a kernel that holds what the rank issues after it, so it goes in its round)."""
    return GLOO_LEAD if backend == "gloo" else 0


#: a round of receives is posted this many actions before the first that needs what it brings (or at its tick,
#: if that comes first): the transfer overlaps that action's compute, and a rank holds a few buffers, not a
#: step's (one ahead: what the runtime's earlier prefetch held; two held a buffer more at looped BFS's peak)
LOOKAHEAD = 1


@dataclass(frozen=True, order=True)
class Message:
    """One tensor crossing a cut: an activation (``kind`` ACT) going down to ``stage``, or a gradient (GRAD)
    going up to it, of one (pass, micro-batch), from pipeline position ``src`` to ``dst``. Ordered as both ends
    issue the messages of a round."""

    kind: int
    replica: int
    micro_batch: int
    stage: int
    src: int
    dst: int

    @property
    def key(self) -> tuple[int, int, int, int]:
        """(kind, pass, micro-batch, receiving stage): the runtime's name of the message."""
        return (self.kind, self.replica, self.micro_batch, self.stage)


@dataclass(frozen=True)
class Round:
    """Every message whose producing action ends at ``tick``: one batch on each rank that sends or receives
    one of them."""

    tick: float
    messages: tuple[Message, ...]

    def of(self, position: int) -> tuple[Message, ...]:
        """The messages ``position`` sends or receives in this round, in the order it issues them."""
        return tuple(m for m in self.messages if position in (m.src, m.dst))


@dataclass(frozen=True)
class ExchangePlan:
    """The rounds of one step (or of one evaluation's forwards) and where each rank runs them.

    ``orders[p]``: the actions position ``p`` runs, in order; ``before[p][k]``: the rounds it runs before its
    action ``k`` (``k == len(orders[p])``: after its last), each holding at least one message of ``p``."""

    schedule: Schedule
    orders: tuple[tuple[Action, ...], ...]
    rounds: tuple[Round, ...]
    before: tuple[tuple[tuple[Round, ...], ...], ...]

    def layout(self) -> tuple[tuple[tuple[tuple[Message, ...], ...], ...], ...]:
        """Where each position exchanges what, without the clock's ticks: per position, per slot of
        :attr:`before`, the messages of each round there (two plans with one layout run alike)."""
        return tuple(tuple(tuple(r.of(p) for r in slot) for slot in slots) for p, slots in enumerate(self.before))

    def posts(self, position: int, lead: int = 0) -> tuple[tuple[Round, ...], ...]:
        """Per action ``k`` of ``position`` (and one after its last), the rounds whose receives it posts just before
        that action, after the rounds due there, ``lead`` actions before their own (:func:`receive_lead`); none with
        ``lead`` 0 (a round then carries its receives) and none for a round due before the first action."""
        slots: list[list[Round]] = [[] for _ in self.before[position]]
        if lead > 0:
            for k, rounds in enumerate(self.before[position]):
                for r in rounds:
                    if k > 0 and any(m.dst == position for m in r.of(position)):
                        slots[max(0, k - lead)].append(r)
        return tuple(tuple(s) for s in slots)

    def messages(self, position: int) -> list[Message]:
        """Everything ``position`` sends or receives in a step, in the order it issues it."""
        return [m for k in self.before[position] for r in k for m in r.of(position)]

    def held(self, position: int, lead: int = 0) -> int:
        """The most messages ``position`` holds received (or posted, with a receive ``lead``: :meth:`posts`) before
        the action that needs them has started (the buffers beside its actions' inputs): the most of
        :meth:`held_during`."""
        return max(self.held_during(position, lead), default=0)

    def held_during(self, position: int, lead: int = 0) -> list[int]:
        """Per action of ``position`` (in its order), how many messages it holds received or posted while that
        action runs, other than the action's own input: what the memory plan adds to the state the action runs in
        (gems.plan.memory), so that buffers posted ahead count where they are alive, not at every state."""
        memo = self.__dict__.setdefault("_held_memo", {})  # (a plan is a value: each position's counted once)
        if (position, lead) not in memo:
            memo[(position, lead)] = self._held_during(position, lead)
        return list(memo[(position, lead)])

    def _held_during(self, position: int, lead: int) -> list[int]:
        needed = _needed(self.schedule, self.orders[position])
        posts = self.posts(position, lead)
        early = {id(r) for slot in posts for r in slot}
        out, waiting = [], 0
        for k, rounds in enumerate(self.before[position][:len(self.orders[position])]):
            for r in [r for r in rounds if id(r) not in early] + list(posts[k]):
                waiting += sum(1 for m in r.of(position) if m.dst == position)
            # the one action k needs now is its input; the others wait
            now = sum(1 for key, at in needed.items() if at == k)
            out.append(waiting - now)
            waiting -= now
        return out

    def delivered(self, position: int) -> dict[tuple[int, int, int, int], tuple[tuple[int, int, int, int], ...]]:
        """Which of ``position``'s sends are known delivered once it has received a message (keyed by what it
        received: its ``key``): those whose receiver started the action that needs them (having waited for them)
        before the action that made the message received. Over gloo a send's work says it completed only once waited
        for, so without this a rank held every buffer it sent until the end of the step; waiting for a send known
        delivered never stalls (on a GPU it came before that receive on the communicator's stream). Each send is
        named once, at the first receive that proves it in the order ``position`` waits for them (its actions').
        Linear in the messages: per peer, the sends sorted by where the peer needs them."""
        sched = self.schedule
        needs = [_needed(sched, order) for order in self.orders]  # per position: message -> the action needing it
        makes = [{m.key: k for k, a in enumerate(order) if (m := _message(sched, a)) is not None}
                 for order in self.orders]
        sent: dict[int, list[tuple[int, tuple[int, int, int, int]]]] = {}  # peer -> (where it needs it, key), sorted
        src: dict[tuple[int, int, int, int], int] = {}  # what this position receives -> its sender
        for r in self.rounds:
            for m in r.messages:
                if m.src == position:
                    sent.setdefault(m.dst, []).append((needs[m.dst][m.key], m.key))
                elif m.dst == position:
                    src[m.key] = m.src
        for todo in sent.values():
            todo.sort(reverse=True)  # popped from the end: the earliest needed first
        out: dict[tuple[int, int, int, int], tuple[tuple[int, int, int, int], ...]] = {}
        for a in self.orders[position]:
            key = wanted(a, sched.stages)
            if key is None or key not in src:
                continue
            making, todo = makes[src[key]][key], sent.get(src[key], [])
            proven = []
            while todo and todo[-1][0] < making:
                proven.append(todo.pop()[1])
            if proven:
                out[key] = tuple(proven)
        return out

    def unconfirmed(self, position: int) -> list[tuple[tuple[int, int], ...]]:
        """Per action of ``position`` (in its order), the (kind, receiving stage) of each message it sent before that
        action and does not yet know delivered (:meth:`delivered`) once the action's own input is here: the send
        buffers it holds beside the action (what the memory plan adds)."""
        proofs = self.delivered(position)
        pending: dict[tuple[int, int, int, int], tuple[int, int]] = {}
        out = []
        for a in self.orders[position]:
            needed = wanted(a, self.schedule.stages)
            for key in proofs.get(needed, ()) if needed is not None else ():
                pending.pop(key, None)
            out.append(tuple(sorted(pending.values())))
            m = _message(self.schedule, a)
            if m is not None:
                pending[m.key] = (m.kind, m.stage)
        return out


def adoptable(unit: ExchangePlan, timed: ExchangePlan, lead: int = 0) -> bool:
    """Whether rounds placed on measured times (``timed``) replace the unit clock's (``unit``), with receives posted
    ``lead`` actions ahead (the run's: :func:`receive_lead`, none where the run's log stands for an NCCL run's
    order): where they move some round and no position then holds more messages at once (:meth:`ExchangePlan.held`).
    The memory plan follows the unit clock's rounds, so a timed plan that held more could outgrow it
    (:meth:`gems.pipeline.runtime.PipelineRunner.place_rounds_by_time`). Over gloo, with its lead of two, timed 1F1B
    at D = 2 holds one buffer more on its last position and is not adopted."""
    return timed.layout() != unit.layout() and all(timed.held(p, lead) <= unit.held(p, lead)
                                                   for p in range(len(unit.orders)))


def wanted(a: Action, stages: int) -> tuple[int, int, int, int] | None:
    """The message an action needs, as (kind, pass, micro-batch, receiving stage), or None
    (:func:`~gems.pipeline.schedules.receives`): one name for it in the plan and the runtime."""
    got = receives(a, stages)
    return None if got is None else (got[0], a.replica, a.micro_batch, got[1])


def _needed(sched: Schedule, order: Sequence[Action]) -> dict[tuple[int, int, int, int], int]:
    """Message -> the index in ``order`` of the action that needs it."""
    return {key: k for k, a in enumerate(order) if (key := wanted(a, sched.stages)) is not None}


def _message(sched: Schedule, a: Action) -> Message | None:
    got = sends(a, sched.stages)
    if got is None:
        return None
    kind, stage = got
    src, dst = sched.rank_of(a.replica, a.stage), sched.rank_of(a.replica, stage)
    assert src != dst, f"{sched.name}: {a} sends to its own rank"
    return Message(kind, a.replica, a.micro_batch, stage, src, dst)


def plan_exchanges(sched: Schedule, forward_only: bool = False, costs: Costs | None = None) -> ExchangePlan:
    """The exchange rounds of ``sched``; ``forward_only``: of its forwards alone, in their order (an evaluation);
    ``costs``: the clock's time of each (kind, stage) (:data:`Costs`; None: unit costs). On the unit clock a
    schedule's rounds are planned once (schedules are values, made once for their arguments:
    gems.pipeline.schedules.make_schedule; gems plan's mesh search asks for the same ones again and again).

    The per-rank orders run on the clock (:func:`gems.pipeline.schedules.run_orders`), and every message crosses in
    the round of the tick its producing action ends, in one order both ends derive (:class:`Message`'s). Each rank
    runs its rounds in tick order: after its previous round, after the actions that made its sends in the round,
    and, where the round brings it messages, :data:`LOOKAHEAD` actions before the first action that needs one (or
    before its first action that starts at or after the tick, if that is earlier), so the transfer overlaps the
    compute between; the receiver keeps a buffer from its round to its action (:meth:`ExchangePlan.held`, what the
    planner counts).

    Why no rank can hang, by induction on the ticks: suppose every round before tick ``t`` has completed. What a rank
    must have done before its round ``t`` is its rounds before ``t`` and the actions placed before the round, all
    of which start before ``t``; an action that starts before ``t`` needs only messages of rounds at or before its
    start, so before ``t``: done. Every rank of round ``t`` therefore reaches it, and within it every message has
    both ends in their rank's current group, so the round completes, even with sends that wait for their receive and
    with nothing issued after the round able to run before it. What a rank computes after its round ``t`` is never
    what round ``t`` waits for, so the round may run beside that compute. The clock may be any whose actions take a
    positive time, the same on every rank: the induction uses only that each action starts once what it needs has
    ended and that a rank starts its actions in its order, which ``run_orders`` keeps for any costs. Integer costs
    keep ties exact: two messages the clock ends at one tick share a round on every rank alike.

    Over gloo a rank posts a round's receives :func:`receive_lead` actions ahead (:meth:`ExchangePlan.posts`) and
    the round carries its sends: a posted gloo receive is a buffer that holds nothing else, and on each direction's
    group a pair has one sender and one receiver, which issue its messages in round order, so a run that completes
    as rounds completes with the receives posted earlier (:func:`check` checks both orders)."""
    if costs is not None:
        return _plan_exchanges(sched, forward_only, costs)
    got = _UNIT.get((id(sched), forward_only))
    if got is None or got[0] is not sched:
        got = (sched, _plan_exchanges(sched, forward_only, None))
        if len(_UNIT) < 4096:
            _UNIT[(id(sched), forward_only)] = got
    return got[1]


#: unit-clock exchange plans by (the schedule's identity, forward only), the schedule held with it (ids stay unique)
_UNIT: dict[tuple[int, bool], tuple[Schedule, ExchangePlan]] = {}


def _plan_exchanges(sched: Schedule, forward_only: bool, costs: Costs | None) -> ExchangePlan:
    orders = tuple(tuple(a for a in order if a.kind.forward or not forward_only) for order in sched.actions)
    if costs is not None:
        table = dict(costs)
        bad = {k: v for k, v in table.items() if not isinstance(v, int) or v < 1}
        assert not bad, f"exchange costs must be positive integers, got {bad}"
        span = run_orders(sched, orders, cost=lambda a: table[(a.kind, a.stage)])
    else:
        span = run_orders(sched, orders)
    by_tick: dict[float, list[Message]] = {}
    made_by: dict[Message, int] = {}  # message -> the index of the action that makes it, in its rank's order
    needed_by: dict[tuple[int, int, int, int], int] = {}  # message -> the index of the action that needs it
    for order in orders:
        needed_by.update(_needed(sched, order))
        for k, a in enumerate(order):
            m = _message(sched, a)
            if m is not None:
                by_tick.setdefault(span[a][1], []).append(m)
                made_by[m] = k
    rounds = tuple(Round(t, tuple(sorted(ms))) for t, ms in sorted(by_tick.items()))
    before = []
    for p, order in enumerate(orders):
        starts = [span[a][0] for a in order]
        slots: list[list[Round]] = [[] for _ in range(len(order) + 1)]
        at = 0
        for r in rounds:
            mine = r.of(p)
            if not mine:
                continue
            # after this rank's round before it and the actions that make its sends; its receives posted
            # LOOKAHEAD actions before the first that needs one, never later than the tick's place
            at = max([at] + [made_by[m] + 1 for m in mine if m.src == p])
            need = [needed_by[m.key] for m in mine if m.dst == p]
            if need:
                at = max(at, min(bisect.bisect_left(starts, r.tick), min(need) - LOOKAHEAD))
            slots[at].append(r)
        before.append(tuple(tuple(s) for s in slots))
    return ExchangePlan(sched, orders, rounds, tuple(before))


Bucket = int | tuple[int, ...]


def bucket_parts(b: Bucket) -> tuple[int, ...]:
    """The partitions a gradient bucket holds parameters of: one, or several where a bucket fills across
    partitions (:class:`gems.replication.GradientReducer`)."""
    return (b,) if isinstance(b, int) else tuple(b)


def sum_points(plan: ExchangePlan, buckets: Sequence[Bucket]) -> list[list[tuple[int, int]]]:
    """Where each position sums its gradient buckets with the other holders of its partitions (GEMS's mirrored
    copies, in its own pipeline line), so that the sums overlap the step's rounds and never cross them.
    ``buckets``: the partition (or partitions: :func:`bucket_parts`) of each bucket, in the order the gradient sum
    launches them (the same list on every holder). Returns, per position, one ``(round, action)`` per bucket:
    launch it once the position has run its action ``action`` (-1: none) and every round of its with index
    ``<= round`` in ``plan.rounds`` (-1: none), before any later round of its. A bucket of several partitions is
    completed by the last of their backwards on a holder; every holder of one of them holds them all (a mirrored
    holder's partitions are its mirror's: D - 1 - p beside p).

    Why every holder issues the sums and the rounds in one order: for bucket ``b`` the cut ``J_b`` is the highest
    round any holder of its partition runs before the action after the one that completes the bucket there (its
    last backward or weight-gradient action of that partition, or the previous bucket's, whichever is later): the
    rounds that carry what the completing action sent go before the sum, so a peer waiting for that message does
    not wait behind the sum too (under the least NCCL promises what a rank issued first may hold what it issued
    after). Any cut at or past the rounds before the completing action is as safe, as long as it grows. Each holder
    launches ``b`` after its rounds up to ``J_b`` and that action, before its rounds after ``J_b``; ``J_b`` and the
    actions only grow from bucket to bucket. So every holder's program is a subsequence of one sequence, the
    rounds in index order with bucket ``b``'s sum right after round ``J_b``: a pair of holders meets each
    round and each sum in the same order, and by the rounds' own induction (:func:`plan_exchanges`) nothing waits on
    what comes after it. A position that holds no copy of a bucket's partition launches nothing for it."""
    sched = plan.schedule
    index = {id(r): i for i, r in enumerate(plan.rounds)}
    positions = range(len(plan.orders))
    parts = [bucket_parts(b) for b in buckets]
    holders = {b: [p for p in positions if set(b) & set(sched.partitions_of(p))] for b in set(parts)}
    for b, ps in holders.items():
        assert all(set(b) <= set(sched.partitions_of(p)) for p in ps), f"{sched.name}: a bucket of {b} spans holders"
    last = {(p, s): max((k for k, a in enumerate(plan.orders[p]) if a.stage == s and a.kind.finishes_gradients),
                        default=-1) for b in holders for p in holders[b] for s in b}
    out: list[list[tuple[int, int]]] = [[] for _ in positions]
    action = {p: -1 for p in positions}
    cut = -1
    for b in parts:
        for p in holders[b]:
            action[p] = max([action[p]] + [last[(p, s)] for s in b])
        # the highest round a holder runs before the action after the one that completes the bucket there
        cut = max([cut] + [index[id(r)] for p in holders[b] for k in range(action[p] + 2)
                           for r in plan.before[p][k]])
        for p in holders[b]:
            out[p].append((cut, action[p]))
    return out


def program(plan: ExchangePlan, position: int, sums: Sequence[tuple[int, int]] = (),
            lead: int = 0) -> list[tuple[str, Any]]:
    """``position``'s step in issue order: ``("round", Round)``, ``("action", k)`` and, with ``sums`` (its part of
    :func:`sum_points`), ``("sum", b)`` where bucket ``b``'s sum is launched: as soon as its action has run and
    its rounds up to the bucket's cut have, before any later round; with a receive ``lead``
    (:func:`receive_lead`), ``("receive", Round)`` where the round's receives are posted (:meth:`ExchangePlan.posts`;
    its ``("round", Round)`` then carries the rest). The runtime runs this list."""
    index = {id(r): i for i, r in enumerate(plan.rounds)}
    mine = [index[id(r)] for slot in plan.before[position] for r in slot]
    need = [sum(1 for i in mine if i <= cut) for cut, _ in sums]
    out: list[tuple[str, Any]] = []
    rounds_done, actions_done, b = 0, 0, 0

    def launch() -> None:
        nonlocal b
        while b < len(sums) and actions_done > sums[b][1] and rounds_done >= need[b]:
            out.append(("sum", b))
            b += 1

    posts = plan.posts(position, lead)
    launch()
    for k, slot in enumerate(plan.before[position]):
        for r in slot:
            out.append(("round", r))
            rounds_done += 1
            launch()
        out += [("receive", r) for r in posts[k]]
        if k < len(plan.orders[position]):
            out.append(("action", k))
            actions_done = k + 1
            launch()
    assert b == len(sums), f"position {position}: {len(sums) - b} gradient sum(s) never due"
    return out


def at_points(prog: Sequence[tuple[str, Any]]) -> dict[int, tuple[int, ...]]:
    """The sums a :func:`program` issues right after an action, before its next round, receive or action: ``{action
    k: those buckets, in order}``. Each of them is due at that action (its sum point's action is ``k``: a sum that
    waited for a round follows the round), so it may start inside the action instead, at the gradient sum's points
    (:class:`gems.replication.GradientReducer`, :meth:`~gems.replication.GradientReducer.at_points`), and overlap the
    action's own backward as data-parallel buckets do:

    moving them there changes no order a pair of holders meets in. Nothing else is issued on the pipeline line or the
    gradient group between the action's start and those sums (its rounds, receives and the sums before go out before
    the action), so each holder's program keeps the rounds and the sums in the one sequence :func:`sum_points`
    argues; the sums keep their order, because the reducer starts the action's buckets in bucket order and stops at
    the first it cannot start yet; and the only communication inside the action, its spatial halos, meets the
    gradient sum's points in the same order on every part of a holder (the points' own argument, gems.replication)."""
    out: dict[int, list[int]] = {}
    after: int | None = None
    for kind, item in prog:
        if kind == "action":
            after = item
        elif kind == "sum" and after is not None:
            out.setdefault(after, []).append(item)
        else:
            after = None
    return {k: tuple(v) for k, v in out.items()}


def check(plan: ExchangePlan, buckets: dict[int, Sequence[Bucket]] | None = None, lead: int = 0) -> None:
    """Run ``plan`` under the rules of :func:`plan_exchanges`: every send waits for its receive, a rank runs its
    rounds one at a time in its order and computes only what it has received; with ``buckets`` (each position's
    bucket partitions, as its gradient sum lists them) the mirrored copies' sums too, each a collective of its
    partitions' holders, issued where :func:`program` puts it (:func:`sum_points`). With a receive ``lead`` (gloo's:
    :func:`receive_lead`), also that each pair's receiver posts the pair's messages in the order their sender sends
    them, each before the round that sends it. Raises :class:`DeadlockError` naming where it would hang, or
    AssertionError where an action would run before its message arrived or a pair's orders differ."""
    sched = plan.schedule
    buckets = buckets or {}
    sums = [sum_points(plan, buckets.get(p, []))[p] if buckets.get(p) else [] for p in range(len(plan.orders))]
    if lead:
        _check_lead(plan, sums, lead)
    for p, order in enumerate(plan.orders):
        got: set[tuple[int, int, int, int]] = set()
        for k, a in enumerate(order):
            got |= {m.key for r in plan.before[p][k] for m in r.of(p) if m.dst == p}
            key = wanted(a, sched.stages)
            assert key is None or key in got, f"{sched.name}: rank {p} runs {a} before it has received {key}"
    positions = range(len(plan.orders))
    programs = [[(kind, item) for kind, item in program(plan, p, sums[p]) if kind != "action"] for p in positions]
    holders = {p: [q for q in positions if buckets.get(q) and buckets.get(q) == buckets.get(p)] for p in positions}
    at = [0] * len(programs)
    done: set[Message] = set()
    while True:
        current = {p: prog[at[p]] for p, prog in enumerate(programs) if at[p] < len(prog)}
        if not current:
            return
        rounds = {p: item for p, (kind, item) in current.items() if kind == "round"}
        # a message crosses once both its ends are at its round (a send waits for its receive)
        done |= {m for p, r in rounds.items() for m in r.of(p) if rounds.get(m.src) is r and rounds.get(m.dst) is r}
        moved = False
        for p, (kind, item) in current.items():
            if kind == "round":
                ok = all(m in done for m in item.of(p))
            else:  # a sum: a collective of the bucket's holders (the positions of its partitions), each at it
                part = set(bucket_parts(buckets[p][item]))
                ok = all(current.get(q) == ("sum", item) for q in holders[p] if part <= set(sched.partitions_of(q)))
            if ok:
                at[p] += 1
                moved = True
        if not moved:
            raise DeadlockError(f"{sched.name}: exchange rounds and sums wait on each other at "
                                f"{ {p: (k, getattr(i, 'tick', i)) for p, (k, i) in current.items()} }")


def _check_lead(plan: ExchangePlan, sums: Sequence[Sequence[tuple[int, int]]], lead: int) -> None:
    """gloo's order with receives posted ``lead`` actions ahead (:func:`check`): per (sender, receiver), the
    messages in the sender's issue order and in the receiver's posting order are one list, and no receive is posted
    after the round that sends it or more than ``lead`` actions before that round."""
    issued: dict[tuple[int, int], tuple[list[Message], list[Message]]] = {}
    for p in range(len(plan.orders)):
        posted: dict[Message, int] = {}  # message -> the number of actions run when its receive was posted
        actions = 0
        for kind, item in program(plan, p, sums[p], lead):
            if kind == "action":
                actions += 1
                continue
            if kind == "sum":
                continue
            for m in item.of(p):
                pair = issued.setdefault((m.src, m.dst), ([], []))
                if m.src == p and kind == "round":
                    pair[0].append(m)
                elif m.dst == p and m not in posted:
                    posted[m] = actions
                    pair[1].append(m)
                elif m.dst == p and kind == "round":
                    assert actions - posted[m] <= lead, f"{plan.schedule.name}: rank {p} posts {m} too early"
    for (src, dst), (sent, received) in issued.items():
        assert sent == received, f"{plan.schedule.name}: {src} sends to {dst} in another order than {dst} posts them"


def pairs(plan: ExchangePlan) -> list[tuple[int, int]]:
    """The pairs of positions that exchange messages, sorted: the one global order connections are made in."""
    return sorted({(min(m.src, m.dst), max(m.src, m.dst)) for r in plan.rounds for m in r.messages})
