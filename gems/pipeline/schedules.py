"""Pipeline schedules as pure data: which rank runs which forward or backward, in order. A schedule is one list of
:class:`Action` a rank plus its placement (the rank of each stage, per pass), decided before any process exists, so
it is drawn (:func:`draw`), checked (:func:`simulate`) and tested here; the runtime only executes it. What an action
waits for is stated once (:func:`needs`, :func:`sends`, :func:`receives`); schedules are registered by name
(:func:`register`; docs/parallelism.md), their facts asked of the registration, never of the name.
"""
from __future__ import annotations

import enum
import functools
import heapq
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from gems.config import owned
from gems.errors import ConfigError

__all__ = ["Action", "Kind", "Schedule", "ScheduleKind", "make_schedule", "register", "registered", "lp", "gpipe",
           "one_f_one_b", "mast", "master", "interleaved_1f1b", "interleaved_zero_bubble", "needs", "sends", "receives",
           "simulate", "draw", "DeadlockError", "SCHEDULES"]

ACT, GRAD = 0, 1  # what crosses a cut: an activation (down) or its gradient (up)


class Kind(str, enum.Enum):
    """What an action computes, and every fact about it that the runtime, the gradient sum and the planner
    count by: none of them compares kinds by letter.

    ``F`` forward; ``B`` backward (input and weight gradients); a *split* backward is ``I`` (the input
    gradient, which the stage before waits for) then ``W`` (the weight gradients, which nothing waits for).
    """

    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (the zero-bubble papers' letter)
    W = "W"

    def __str__(self) -> str:
        return self.value

    @property
    def forward(self) -> bool:
        return self is Kind.F

    @property
    def input_gradient(self) -> bool:
        """It computes the gradient the stage before waits for (B, I): the backward's working set is live."""
        return self in (Kind.B, Kind.I)

    @property
    def frees(self) -> bool:
        """The micro-batch's activations on its stage are released once it has run (its last backward action)."""
        return self in (Kind.B, Kind.W)

    @property
    def finishes_gradients(self) -> bool:
        """The stage's weight gradients for the micro-batch are accumulated by it (what the gradient sum waits
        for: a parameter is final after its stage's last such action)."""
        return self in (Kind.B, Kind.W)

    @property
    def backward_share(self) -> float:
        """The share of its stage's backward work it does: all (B), half each (I and W), none (F)."""
        return {Kind.F: 0.0, Kind.B: 1.0}.get(self, 0.5)

    @property
    def unit_cost(self) -> int:
        """Ticks in the unit-cost model: a forward 1, a backward twice a forward (B 2, I and W 1 each)."""
        return 1 if self.forward else round(2 * self.backward_share)


#: ticks of each kind of action in the unit-cost model (Kind.unit_cost)
COST = {k.value: k.unit_cost for k in Kind}
F_COST, B_COST = Kind.F.unit_cost, Kind.B.unit_cost


@dataclass(frozen=True, order=True)
class Action:
    """One forward or backward of one micro-batch of one replica pass on one stage: ``replica`` the pass (0 ..
    eta-1), ``micro_batch`` inside the pass, ``stage`` the partition index (0 is the model's first layers)."""

    kind: Kind  # given as a Kind or its letter
    replica: int
    micro_batch: int
    stage: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", Kind(self.kind))

    def __str__(self) -> str:
        name = chr(ord("A") + self.replica) if self.replica < 26 else f"[{self.replica}]"
        return f"{self.kind.value}{name}{self.micro_batch}s{self.stage}"


@dataclass(frozen=True)
class Schedule:
    """A whole step: ``actions[rank]`` is what that pipeline rank runs, in order.

    ``stages`` is the number of model partitions; ``placement`` (one row per
    direction of the passes) says which rank runs each stage. Without an
    explicit placement, stage ``s`` runs on rank ``s``, and on ``D-1-s`` for
    the odd passes of a ``mirrored`` schedule.
    """

    name: str
    stages: int
    replicas: int  # eta: replica passes per step
    micro_batches: int  # per pass
    mirrored: bool
    actions: tuple[tuple[Action, ...], ...]
    placement: tuple[tuple[int, ...], ...] = field(default=())
    split: bool = False  # backward split into I (input gradient) and W (weight gradient) actions

    def __post_init__(self) -> None:
        if not self.placement:
            down = tuple(range(self.stages))
            rows = (down, tuple(reversed(down))) if self.mirrored else (down,)
            object.__setattr__(self, "placement", rows)

    @property
    def ranks(self) -> int:
        """Pipeline ranks (``parallel.pipeline``)."""
        return len(self.actions)

    def direction(self, replica: int) -> int:
        """The placement row of a pass (0: down; 1: up, for the odd passes of a mirrored schedule)."""
        return replica % len(self.placement)

    def rank_of(self, replica: int, stage: int) -> int:
        return self.placement[self.direction(replica)][stage]

    def partitions_of(self, rank: int) -> list[int]:
        """Partition indices this rank holds, ascending."""
        return sorted({s for row in self.placement for s, r in enumerate(row) if r == rank})

    def holder_groups(self) -> list[tuple[int, ...]]:
        """Pipeline ranks that hold copies of the same partitions (their gradients are summed together):
        ``(d, D-1-d)`` pairs under GEMS, every rank alone in a plain or interleaved pipeline."""
        return list(self._holder_groups)

    @functools.cached_property
    def _holder_groups(self) -> tuple[tuple[int, ...], ...]:  # (a schedule is a value: found once)
        groups: list[set[int]] = []
        for s in range(self.stages):
            holders = {row[s] for row in self.placement}
            for g in [g for g in groups if g & holders]:
                holders |= g
                groups.remove(g)
            groups.append(holders)
        return tuple(sorted(tuple(sorted(g)) for g in groups))

    def links(self) -> list[tuple[int, int]]:
        """(sending rank, receiving rank) of every message the schedule sends, sorted: the directed links of its
        ranks (what the planner counts NCCL's point-to-point connections by; the messages themselves go on the
        line's one communicator in exchange rounds: :mod:`gems.pipeline.exchange`)."""
        out = set()
        for order in self.actions:
            for a in order:
                got = sends(a, self.stages)
                if got is not None:
                    out.add((self.rank_of(a.replica, a.stage), self.rank_of(a.replica, got[1])))
        return sorted(out)

    @property
    def holds_copies(self) -> bool:
        """Whether some partition has copies on several pipeline ranks (GEMS's mirrored pairs), from the placement:
        the one answer the runtime, the balance rule and the planner take."""
        return any(len(g) > 1 for g in self.holder_groups())

    @property
    def kind(self) -> "ScheduleKind":
        """The registration this schedule was built from (what options it takes, asked by capability)."""
        return _REGISTRY[self.name]

    @property
    def chunks(self) -> int:
        """How many pieces one step's batch is cut into (passes x micro-batches)."""
        return self.replicas * self.micro_batches


class DeadlockError(RuntimeError):
    """The per-rank orders cannot all run to the end under their dependencies."""


# ---- the one rule of what waits for what ------------------------------------------------------------------
def needs(a: Action, stages: int) -> list[Action]:
    """The actions whose results ``a`` waits for: a forward the forward of the stage before; a backward
    (``B``, or the input gradient ``I`` of a split one) its own forward and the same backward of the
    stage after; a weight gradient ``W`` the input gradient of its own stage (what it reuses)."""
    if a.kind is Kind.F:
        return [Action(Kind.F, a.replica, a.micro_batch, a.stage - 1)] if a.stage > 0 else []
    if a.kind is Kind.W:
        return [Action(Kind.I, a.replica, a.micro_batch, a.stage)]
    out = [Action(Kind.F, a.replica, a.micro_batch, a.stage)]
    if a.stage < stages - 1:
        out.append(Action(a.kind, a.replica, a.micro_batch, a.stage + 1))
    return out


def sends(a: Action, stages: int) -> tuple[int, int] | None:
    """(ACT or GRAD, the stage it goes to) of what ``a`` produces for another stage, or None."""
    if a.kind == "F" and a.stage < stages - 1:
        return ACT, a.stage + 1
    if a.kind in ("B", "I") and a.stage > 0:
        return GRAD, a.stage - 1
    return None


def receives(a: Action, stages: int) -> tuple[int, int] | None:
    """(ACT or GRAD, this stage) of what ``a`` needs from another stage, or None: the message that
    :func:`sends` sends from the action :func:`needs` names."""
    if a.kind == "F" and a.stage > 0:
        return ACT, a.stage
    if a.kind in ("B", "I") and a.stage < stages - 1:
        return GRAD, a.stage
    return None


def backward_kinds(split: bool) -> tuple[Kind, ...]:
    return (Kind.I, Kind.W) if split else (Kind.B,)


# ---- the registry ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleKind:
    """A registered schedule: how to build it and which options it takes."""

    name: str
    build: Callable[[int, int, int, int, bool], Schedule]  # (ranks, micro-batches, passes, virtual stages, split)
    passes: str = "one"  # "one" | "two" (mast) | "eta" (master: parallel.gems_replicas, default 2)
    min_ranks: int = 1
    virtual: bool = False  # takes parallel.virtual_stages
    about: str = ""
    split: str = "no"  # "no" | "optional" (parallel.split_backward) | "always"

    @property
    def in_flight(self) -> str:
        """Micro-batches a stage keeps in flight, read off the schedule's own action lists (one built at 8
        micro-batches): "one" (lp: they take turns), "all" (gpipe: every forward of a rank before its first
        backward), "depth" (1F1B's bound, min(D - s, m) per direction). The planner walks the real action lists;
        this is what the suggestion search asks (does cutting the batch finer shrink what is kept?)."""
        got = _IN_FLIGHT.get(self.name)
        if got is None:
            sched = make_schedule(self.name, max(2, self.min_ranks), 8, None, 2 if self.virtual else None,
                                  self.split == "always")
            kept, every = [], True
            for rank, order in enumerate(sched.actions):
                peak = in_flight(sched, rank)
                forwards = [0] * len(peak)
                for a in order:
                    forwards[sched.direction(a.replica)] += a.kind.forward
                kept += peak
                every = every and all(p == f for p, f in zip(peak, forwards) if f)
            got = _IN_FLIGHT[self.name] = "one" if max(kept) == 1 else "all" if every else "depth"
        return got

    @property
    def overlaps(self) -> bool:
        """Whether stages compute at once (every schedule but one that keeps one micro-batch in flight)."""
        return self.in_flight != "one"

    @property
    def keeps_all_in_flight(self) -> bool:
        """Whether every micro-batch's activations are kept until the backward (more micro-batches save nothing)."""
        return self.in_flight == "all"


_REGISTRY: dict[str, ScheduleKind] = {}
#: each schedule's :attr:`ScheduleKind.in_flight`, read off its action lists once
_IN_FLIGHT: dict[str, str] = {}


Builder = Callable[[int, int, int, int, bool], Schedule]


def register(name: str, *, passes: str = "one", min_ranks: int = 1, virtual: bool = False, split: str = "no",
             about: str = "") -> Callable[[Builder], Builder]:
    """Register a schedule builder ``(ranks, micro_batches, passes, virtual_stages, split) -> Schedule`` under
    ``name`` (the value of ``parallel.schedule``)."""
    def deco(fn: Builder) -> Builder:
        _REGISTRY[name] = ScheduleKind(name, fn, passes, min_ranks, virtual, about, split)
        _IN_FLIGHT.pop(name, None)
        return fn
    return deco


def registered() -> dict[str, ScheduleKind]:
    return dict(_REGISTRY)


owned("parallel.schedule", registered)  # the configuration checks and prints the names (gems.config.owned)


# ---- the generator ---------------------------------------------------------------------------------------
def _generate(name: str, D: int, passes: int, m: int, mirrored: bool, prefer: str,
              limit: Callable[[int], int], split: bool = False,
              placement: tuple[tuple[int, ...], ...] = ()) -> Schedule:
    """List scheduling with unit costs (a forward 1 tick, a backward 2); ``limit(stage)`` bounds the micro-batches
    a rank keeps in flight on a stage (per direction of the passes): 1 for ``lp``, every micro-batch for ``gpipe``,
    ``min(D - s, m)`` for ``1f1b`` and, per direction, for ``mast`` and ``master``.

    With ``split`` the backward is an ``I`` (what the stage before waits for) and a ``W`` that nothing
    waits for: it runs only when no ``I`` or ``F`` can, so weight gradients fill the bubbles, and a
    micro-batch stays in flight (its activations kept) until its ``W``. ``placement``: the rank of each
    stage (default: stage s on rank s, mirrored or not); its length is the number of stages.
    """
    stages = len(placement[0]) if placement else D
    shape = Schedule(name, stages, passes, m, mirrored, tuple(() for _ in range(D)), placement)
    orders = _ListScheduler(shape, prefer, limit, split).run()
    return Schedule(name, stages, passes, m, mirrored, tuple(tuple(o) for o in orders), placement, split=split)


class _ListScheduler:
    """The state of :func:`_generate`: what each rank has left, when it is free, what it keeps in flight.

    Event-driven: an action joins its rank's ready set when the last action it waits for has ended (each action
    counts its unmet needs; the ends are a heap, taken as the clock reaches them), so a rank chooses among the
    actions it could start now, not among all it has left (a schedule of many micro-batches asked millions of
    readiness questions). What it chooses is the same: the ready and admitted action of the least (preferred
    kind, ready time, pass, micro-batch)."""

    def __init__(self, shape: Schedule, prefer: str, limit: Callable[[int], int], split: bool) -> None:
        R, S = shape.ranks, shape.stages
        self.shape, self.prefer, self.limit, self.R, self.S = shape, prefer, limit, R, S
        self.left_todo = [0] * R
        rank_of: dict[Action, int] = {}
        for p in range(shape.replicas):
            for i in range(shape.micro_batches):
                for s in range(S):
                    r = shape.rank_of(p, s)
                    for k in (Kind.F, *backward_kinds(split)):
                        rank_of[Action(k, p, i, s)] = r
                        self.left_todo[r] += 1
        self.rank_of = rank_of
        # what each action waits for, counted; who waits for each action
        self.unmet: dict[Action, int] = {}
        self.waiting: dict[Action, list[Action]] = {}
        self.ready_at: dict[Action, int] = {}  # the latest end among an action's needs met so far
        self.ready: list[dict[Action, int]] = [{} for _ in range(R)]  # per rank: action -> ready time
        for a in rank_of:
            ns = set(needs(a, S))
            self.unmet[a] = len(ns)
            for d in ns:
                self.waiting.setdefault(d, []).append(a)
            if not ns:
                self.ready[rank_of[a]][a] = 0
        # the forwards each rank has left per direction of the passes, by (pass, micro-batch): a forward enters only
        # after the earlier ones of its direction (admits), the smallest left found at once (a heap, lazily pruned)
        self.left: dict[tuple[int, int], dict[tuple[int, int], int]] = {}
        self.heaps: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for a, r in rank_of.items():
            if a.kind.forward:
                key, at = (r, shape.direction(a.replica)), (a.replica, a.micro_batch)
                counts = self.left.setdefault(key, {})
                counts[at] = counts.get(at, 0) + 1
        for key, counts in self.left.items():
            self.heaps[key] = sorted(counts)
        self.ends: list[tuple[int, Action]] = []  # (end tick, action) of the actions started, not yet taken
        self.busy_until = [0] * R
        # micro-batches in flight per (rank, direction, stage): a rank's one stage per direction in the schedules
        # that hold one (the limit per direction), each of its stages where it holds several
        self.inflight: dict[tuple[int, int, int], int] = {}
        self.orders: list[list[Action]] = [[] for _ in range(R)]
        self.t = 0

    def _take_ends(self) -> None:
        """The actions that have ended by now: those waiting for them that wait for nothing more are ready."""
        while self.ends and self.ends[0][0] <= self.t:
            end, d = heapq.heappop(self.ends)
            for a in self.waiting.get(d, ()):
                self.unmet[a] -= 1
                at = max(self.ready_at.get(a, 0), end)
                self.ready_at[a] = at
                if self.unmet[a] == 0:
                    self.ready[self.rank_of[a]][a] = at

    def admits(self, r: int, a: Action) -> bool:
        """A forward enters only within the in-flight limit, and after the earlier passes of its direction."""
        if not a.kind.forward:
            return True
        direction = self.shape.direction(a.replica)
        if self.inflight.get((r, direction, a.stage), 0) >= self.limit(a.stage):
            return False
        return self._first_left((r, direction)) >= (a.replica, a.micro_batch)

    def _first_left(self, key: tuple[int, int]) -> tuple[int, int]:
        """The smallest (pass, micro-batch) of a forward rank and direction ``key`` has left."""
        heap, counts = self.heaps[key], self.left[key]
        while counts.get(heap[0], 0) == 0:
            heapq.heappop(heap)
        return heap[0]

    def pick(self, r: int) -> Action | None:
        """The action rank ``r`` runs next: ready and admitted; the preferred kind first, weight gradients last."""
        cands = []
        for a, rt in self.ready[r].items():
            if not self.admits(r, a):
                continue
            rank = 2 if a.kind is Kind.W else (0 if a.kind.forward == (self.prefer == "F") else 1)
            cands.append((rank, rt, a.replica, a.micro_batch, a))
        return min(cands)[-1] if cands else None

    def run(self) -> list[list[Action]]:
        while any(self.left_todo):
            self._take_ends()
            progressed = False
            for r in range(self.R):
                if self.busy_until[r] > self.t or not self.left_todo[r]:
                    continue
                a = self.pick(r)
                if a is None:
                    continue
                del self.ready[r][a]
                self.left_todo[r] -= 1
                self.orders[r].append(a)
                if a.kind.forward:
                    self.left[(r, self.shape.direction(a.replica))][(a.replica, a.micro_batch)] -= 1
                key = (r, self.shape.direction(a.replica), a.stage)
                if a.kind.forward:
                    self.inflight[key] = self.inflight.get(key, 0) + 1
                elif a.kind.frees:
                    self.inflight[key] -= 1
                self.busy_until[r] = self.t + a.kind.unit_cost
                heapq.heappush(self.ends, (self.busy_until[r], a))
                progressed = True
            if not progressed:
                future = [b for b in self.busy_until if b > self.t]
                if not future:  # pragma: no cover - a generator bug
                    raise DeadlockError(f"{self.shape.name}: no rank can progress at tick {self.t}")
                self.t = min(future)
        return self.orders


@register("lp", about="layer parallelism: one micro-batch in the pipeline at a time")
def _lp(D: int, m: int, passes: int, v: int, split: bool) -> Schedule:
    return lp(D, m)


def lp(D: int, m: int = 1) -> Schedule:
    """Layer parallelism: one micro-batch in the whole pipeline at a time, no overlap.

    ``lp(2, 2)`` (``FA0s1`` = forward of pass A, micro-batch 0, stage 1)::

        tick   0     1     2     3     4     5     6     7     8     9     10    11
        rank0  FA0s0 .     .     .     BA0s0 .     FA1s0 .     .     .     BA1s0 .
        rank1  .     FA0s1 BA0s1 .     .     .     .     FA1s1 BA1s1 .     .     .

    (drawn by :func:`draw`; a backward takes two ticks, ``.`` is idle)

    Its orders in closed form: every rank runs each micro-batch's forward then its backward, in turn (what the
    list scheduler gives for an in-flight limit of one: tests/test_schedules.py holds the two equal).
    """
    return Schedule("lp", D, 1, m, False, tuple(tuple(Action(k, 0, i, r) for i in range(m) for k in (Kind.F, Kind.B))
                                                for r in range(D)))


@register("gpipe", split="optional", about="GPipe: all forwards, then all backwards")
def _gpipe(D: int, m: int, passes: int, v: int, split: bool) -> Schedule:
    return gpipe(D, m, split)


def gpipe(D: int, m: int, split: bool = False) -> Schedule:
    """GPipe: all forwards of the step's micro-batches, then all backwards.

    ``gpipe(2, 3)``::

        tick   0     1     2     3     4     5     6     7     8     9     10    11
        rank0  FA0s0 FA1s0 FA2s0 .     .     .     BA0s0 .     BA1s0 .     BA2s0 .
        rank1  .     FA0s1 FA1s1 FA2s1 BA0s1 .     BA1s1 .     BA2s1 .     .     .
    """
    return _generate("gpipe", D, 1, m, False, "F", lambda s: m, split)


@register("1f1b", split="optional", about="1F1B (PipeDream-flush): stage s keeps at most D - s micro-batches")
def _1f1b(D: int, m: int, passes: int, v: int, split: bool) -> Schedule:
    return one_f_one_b(D, m, split)


def one_f_one_b(D: int, m: int, split: bool = False) -> Schedule:
    """1F1B (PipeDream-flush): stage ``s`` keeps at most ``D - s`` micro-batches.

    ``one_f_one_b(3, 4)``::

        tick   0     1     2     3     4     5     6     7     8     9     10    11    12    13    14    15    16    17
        rank0  FA0s0 FA1s0 FA2s0 .     .     .     .     BA0s0 .     FA3s0 BA1s0 .     .     BA2s0 .     .     BA3s0 .
        rank1  .     FA0s1 FA1s1 .     .     BA0s1 .     FA2s1 BA1s1 .     FA3s1 BA2s1 .     .     BA3s1 .     .     .
        rank2  .     .     FA0s2 BA0s2 .     FA1s2 BA1s2 .     FA2s2 BA2s2 .     FA3s2 BA3s2 .     .     .     .     .
    """
    return _generate("1f1b", D, 1, m, False, "B", lambda s: min(D - s, m), split)


@register("mast", passes="two", min_ranks=2, split="optional",
          about="GEMS-MAST: a mirrored replica flows up while A flows down")
def _mast(D: int, m: int, passes: int, v: int, split: bool) -> Schedule:
    return mast(D, m, split)


def mast(D: int, m: int = 1, split: bool = False) -> Schedule:
    """GEMS-MAST: replica A flows down the ranks while its mirror B flows up.

    Rank ``r`` holds partition ``r`` of A and ``D-1-r`` of B; B's work fills the
    time A leaves idle. ``m > 1`` micro-batches per direction is Chimera.
    ``mast(4)``::

        tick   0     1     2     3     4     5     6     7     8     9     10    11
        rank0  FA0s0 .     .     FB0s3 BB0s3 .     .     .     .     .     BA0s0 .
        rank1  .     FA0s1 FB0s2 .     .     .     BB0s2 .     BA0s1 .     .     .
        rank2  .     FB0s1 FA0s2 .     .     .     BA0s2 .     BB0s1 .     .     .
        rank3  FB0s0 .     .     FA0s3 BA0s3 .     .     .     .     .     BB0s0 .
    """
    return _generate("mast", D, 2, m, True, "B", lambda s: min(D - s, m), split)


@register("master", passes="eta", min_ranks=2, split="optional",
          about="GEMS-MASTER: eta replica passes per step in MAST's memory")
def _master(D: int, m: int, passes: int, v: int, split: bool) -> Schedule:
    return master(D, passes, m, split)


def master(D: int, eta: int, m: int = 1, split: bool = False) -> Schedule:
    """GEMS-MASTER: ``eta`` replica passes per step, alternating down and up, on MAST's ranks and memory.

    Pass ``p`` runs down when even, up when odd. With ``m = 1`` a direction
    admits its next pass on a stage only once the previous one has left it, so
    the activation memory is MAST's for any eta (MPI4DL trains two replicas
    whatever ``--times`` says; gems does not); with ``m > 1`` the Chimera bound
    of ``D + 1`` micro-batches per rank holds. ``master(2, 4)``::

        tick   0     1     2     3     4     5     6     7     8     9     10    11
        rank0  FA0s0 FB0s1 BB0s1 .     BA0s0 .     FC0s0 FD0s1 BD0s1 .     BC0s0 .
        rank1  FB0s0 FA0s1 BA0s1 .     BB0s0 .     FD0s0 FC0s1 BC0s1 .     BD0s0 .

    (passes are lettered A, B, C, D, ...: A and C flow down, B and D up)
    """
    if eta < 1:
        raise ConfigError("parallel.gems_replicas", eta, "a positive integer (replica passes per step)")
    return _generate("master", D, eta, m, True, "B", lambda s: min(D - s, m), split)


def looped(D: int, v: int) -> tuple[tuple[int, ...], ...]:
    """The placement of the interleaved schedules: the model in ``v x D`` stages, stage ``s`` on rank ``s mod D``
    (``v`` checked: ``parallel.virtual_stages``)."""
    if v < 1:
        raise ConfigError("parallel.virtual_stages", v, "a positive integer (stages per rank)")
    return (tuple(s % D for s in range(v * D)),)


@register("interleaved1f1b", min_ranks=2, virtual=True,
          about="interleaved 1F1B: v stages per rank (parallel.virtual_stages), a smaller bubble")
def _interleaved(D: int, m: int, passes: int, v: int, split: bool) -> Schedule:
    return interleaved_1f1b(D, v, m)


def interleaved_1f1b(D: int, v: int, m: int) -> Schedule:
    """Interleaved 1F1B: the model in ``v x D`` stages, stage ``s`` on rank ``s mod D``.

    Each rank runs ``v`` small stages instead of one large one, so the
    pipeline fills and drains ``v`` times faster: the bubble shrinks by ``v``
    for ``v`` times the activation messages. Micro-batches enter in groups of
    ``D``; a rank runs ``(D - r - 1) x 2 + (v - 1) x D`` forwards before its
    first backward, then alternates (Megatron-LM's order; ``m`` must be a
    multiple of ``D``). ``interleaved_1f1b(2, 2, 2)``::

        tick   0     1     2     3     4     5     6     7     8     9     10    11    12    13    14
        rank0  FA0s0 FA1s0 FA0s2 FA1s2 .     .     BA0s2 .     .     BA1s2 .     BA0s0 .     BA1s0 .
        rank1  .     FA0s1 FA1s1 FA0s3 BA0s3 .     FA1s3 BA1s3 .     BA0s1 .     BA1s1 .     .     .

    (``s2`` and ``s3`` are the second stage of rank 0 and rank 1; backward takes two ticks)
    """
    placement = looped(D, v)
    if m % D:
        raise ConfigError("parallel.micro_batches", m, f"a multiple of parallel.pipeline={D} (interleaved 1F1B "
                          "sends micro-batches through in groups of one per rank)")
    S = v * D
    total = v * m  # forwards (and backwards) per rank

    def forward(k: int, r: int) -> Action:
        group, within = divmod(k, D * v)
        chunk, i = divmod(within, D)
        return Action(Kind.F, 0, group * D + i, chunk * D + r)

    def backward(k: int, r: int) -> Action:
        group, within = divmod(k, D * v)
        chunk, i = divmod(within, D)
        return Action(Kind.B, 0, group * D + i, (v - 1 - chunk) * D + r)

    orders = []
    for r in range(D):
        warm = min(total, (D - r - 1) * 2 + (v - 1) * D)
        order = [forward(k, r) for k in range(warm)]
        for k in range(total - warm):
            order += [forward(warm + k, r), backward(k, r)]
        order += [backward(k, r) for k in range(total - warm, total)]
        orders.append(tuple(order))
    return Schedule("interleaved1f1b", S, 1, m, False, tuple(orders), placement)


@register("zbh1", split="always", about="zero bubble (ZB-H1): 1F1B with the backward split, weight gradients "
                                      "in the bubbles")
def _zbh1(D: int, m: int, passes: int, v: int, split: bool) -> Schedule:
    return zero_bubble_h1(D, m)


def zero_bubble_h1(D: int, m: int) -> Schedule:
    """Zero bubble in the spirit of ZB-H1 (Qi et al., ICLR 2024): 1F1B's order and memory bound with each
    backward split into its input gradient ``I`` (what the stage before waits for) and its weight
    gradient ``W`` (what nothing waits for). The list scheduler runs a ``W`` only when no forward or
    input gradient can run, so weight gradients fill what would be bubbles; a micro-batch counts as in
    flight until its ``W`` (1F1B's memory). With a forward, an input and a weight gradient of one tick
    each, 1F1B's bubble of 3 x 4 ticks at D = 3, m = 4 (1/3 of the step) shrinks to 1/4 here.
    ``zero_bubble_h1(3, 4)``::

        tick   0     1     2     3     4     5     6     7     8     9     10    11    12    13    14    15
        rank0  FA0s0 FA1s0 FA2s0 .     .     IA0s0 WA0s0 FA3s0 IA1s0 WA1s0 .     IA2s0 WA2s0 .     IA3s0 WA3s0
        rank1  .     FA0s1 FA1s1 .     IA0s1 WA0s1 FA2s1 IA1s1 WA1s1 FA3s1 IA2s1 WA2s1 .     IA3s1 WA3s1 .
        rank2  .     .     FA0s2 IA0s2 WA0s2 FA1s2 IA1s2 WA1s2 FA2s2 IA2s2 WA2s2 FA3s2 IA3s2 WA3s2 .     .

    (``I`` and ``W``: the input and weight halves of a backward)
    """
    return replace(one_f_one_b(D, m, split=True), name="zbh1")


@register("interleavedzb", min_ranks=2, virtual=True, split="always",
          about="interleaved zero bubble: v stages per rank (parallel.virtual_stages), the backward split, weight "
                "gradients in the bubbles")
def _interleaved_zb(D: int, m: int, passes: int, v: int, split: bool) -> Schedule:
    return interleaved_zero_bubble(D, v, m)


def interleaved_zero_bubble(D: int, v: int, m: int) -> Schedule:
    """Interleaved zero bubble: interleaved 1F1B's placement (the model in ``v x D`` stages, stage ``s`` on rank
    ``s mod D``) with each backward split into its input gradient ``I`` and weight gradient ``W``, the order
    found by the list scheduler (forwards first where they are admitted, weight gradients only where nothing
    else can run), each stage ``s`` keeping at most ``v D - s`` micro-batches in flight. Against Megatron's
    interleaved 1F1B at ``v = 2`` (unit costs): a smaller bubble at ``D = 2`` (0.08 against 0.11 at ``m = 4``),
    the same at ``D = 3``, a slightly larger one at ``D = 4`` (0.19 against 0.16 at ``m = 8``), keeping fewer
    stage activations at ``D = 4`` (8 against 11 per rank at ``m = 8``); ZB-H1's bubble is larger at every
    size tested. No multiple-of-``D`` rule on ``m``.
    ``interleaved_zero_bubble(2, 2, 2)``::

        tick   0     1     2     3     4     5     6     7     8     9     10    11    12    13    14
        rank0  FA0s0 .     FA0s2 FA1s0 .     FA1s2 IA0s2 WA0s2 .     IA0s0 IA1s2 WA0s0 IA1s0 WA1s2 WA1s0
        rank1  .     FA0s1 .     FA0s3 FA1s1 IA0s3 WA0s3 FA1s3 IA0s1 IA1s3 WA0s1 IA1s1 WA1s3 WA1s1 .

    (``s2`` and ``s3`` are the second stage of rank 0 and rank 1)
    """
    placement = looped(D, v)
    S = v * D
    return _generate("interleavedzb", D, 1, m, False, "F", lambda s: min(S - s, m), True, placement)


@register("loopedbfs", min_ranks=2, virtual=True,
          about="looped breadth-first: v stages per rank (parallel.virtual_stages), every micro-batch through a "
                "rank's stage before its next; no multiple-of-D rule")
def _looped_bfs(D: int, m: int, passes: int, v: int, split: bool) -> Schedule:
    return looped_bfs(D, v, m)


def looped_bfs(D: int, v: int, m: int) -> Schedule:
    """Looped breadth-first (Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023): interleaved 1F1B's
    placement (the model in ``v x D`` stages, stage ``s`` on rank ``s mod D``), each rank running every
    micro-batch through its first stage, then through its second, and so on; then the backwards, last stage
    first. Its bubble is interleaved 1F1B's where ``m`` is a multiple of ``D`` (unit costs: 0.11 at ``D = 2,
    m = 4``; GPipe's is 0.2) and it takes any ``m``; like GPipe it keeps every micro-batch's activations until
    the backwards (``v m`` stage activations per rank against interleaved 1F1B's ``(D - r - 1) 2 + (v - 1) D +
    1``), and a stage's weight gradients are complete as soon as its backwards are, the last stages' first
    (the sum over replicas overlaps the rest). ``looped_bfs(2, 2, 2)``::

        tick   0     1     2     3     4     5     6     7     8     9     10    11    12    13    14
        rank0  FA0s0 FA1s0 FA0s2 FA1s2 .     .     .     BA0s2 .     BA1s2 .     BA0s0 .     BA1s0 .
        rank1  .     FA0s1 FA1s1 FA0s3 FA1s3 BA0s3 .     BA1s3 .     BA0s1 .     BA1s1 .     .     .

    (``s2`` and ``s3`` are the second stage of rank 0 and rank 1)
    """
    placement = looped(D, v)
    orders = []
    for r in range(D):
        forwards = [Action(Kind.F, 0, i, c * D + r) for c in range(v) for i in range(m)]
        backwards = [Action(Kind.B, 0, i, c * D + r) for c in reversed(range(v)) for i in range(m)]
        orders.append(tuple(forwards + backwards))
    return Schedule("loopedbfs", v * D, 1, m, False, tuple(orders), placement)


#: the names ``parallel.schedule`` takes (registration order)
SCHEDULES = tuple(_REGISTRY)


def make_schedule(name: str, D: int, micro_batches: int = 1, gems_replicas: int | None = None,
                  virtual_stages: int | None = None, split_backward: bool = False) -> Schedule:
    """The schedule named by ``parallel.schedule``, validated against what its registration says it takes. A
    schedule is a value (frozen): one made once for its arguments is handed out again (gems plan's mesh search
    asks for the same schedules thousands of times; generating one of many micro-batches takes milliseconds)."""
    key = (name, D, micro_batches, gems_replicas, virtual_stages, bool(split_backward))
    made = _MADE.get(key)
    if made is None:
        made = _make_schedule(name, D, micro_batches, gems_replicas, virtual_stages, split_backward)
        if len(_MADE) < 4096:
            _MADE[key] = made
    return made


#: schedules made, by their arguments (make_schedule); a refusal is not kept (it raises anew)
_MADE: dict[tuple[Any, ...], Schedule] = {}


def _make_schedule(name: str, D: int, micro_batches: int = 1, gems_replicas: int | None = None,
                   virtual_stages: int | None = None, split_backward: bool = False) -> Schedule:
    kind = _REGISTRY.get(name)
    if kind is None:
        raise ConfigError("parallel.schedule", name, "one of " + ", ".join(_REGISTRY))
    if not isinstance(D, int) or D < 1:
        raise ConfigError("parallel.pipeline", D, "a positive integer")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ConfigError("parallel.micro_batches", micro_batches, "a positive integer")
    if D < kind.min_ranks:
        others = ", ".join(k for k, v in _REGISTRY.items() if v.min_ranks <= D)
        raise ConfigError("parallel.schedule", name, f"{others} at parallel.pipeline={D} ({name} needs at least "
                          f"{kind.min_ranks} pipeline ranks)")
    if kind.passes == "two" and gems_replicas not in (None, 2):
        raise ConfigError("parallel.gems_replicas", gems_replicas, f"2 (or unset) for {name}; use schedule=master for more")
    if kind.passes == "one" and gems_replicas not in (None, 1):
        raise ConfigError("parallel.gems_replicas", gems_replicas, f"1 (or unset) for schedule={name}; "
                          "replica passes need schedule=master")
    if not kind.virtual and virtual_stages not in (None, 1):
        takes = ", ".join(k for k, v in _REGISTRY.items() if v.virtual)
        raise ConfigError("parallel.virtual_stages", virtual_stages, f"1 (or unset) for schedule={name}; "
                          f"{takes} take(s) several stages per rank")
    if split_backward and kind.split == "no":
        takes = ", ".join(k for k, v in _REGISTRY.items() if v.split != "no")
        raise ConfigError("parallel.split_backward", True, f"false for schedule={name}; {takes} split the backward")
    passes = {"one": 1, "two": 2}.get(kind.passes, 2 if gems_replicas is None else int(gems_replicas))
    v = int(virtual_stages) if virtual_stages is not None else (2 if kind.virtual else 1)
    sched = kind.build(D, micro_batches, passes, v, kind.split == "always" or bool(split_backward))
    if sched.name != name:  # a new schedule's slip: everything after looks its registration up by its name
        raise ValueError(f"the schedule registered as {name!r} builds one named {sched.name!r} "
                         f"({kind.build.__qualname__}): name the Schedule {name!r} as it is registered")
    return sched


# ---- checking and drawing ----------------------------------------------------------------------------------
def simulate(sched: Schedule, f_cost: int = F_COST, b_cost: int = B_COST, cost: Callable[[Action], float] | None = None,
             transfer: Callable[[Action], float] | None = None, start: Sequence[float] | None = None
             ) -> dict[Action, tuple[Any, Any]]:
    """Run the per-rank orders as the runtime would; return each action's (start, end) tick.

    ``cost`` (seconds of an action) and ``transfer`` (seconds for what an action :func:`sends` to reach
    another rank) replace the unit costs: the performance model (:mod:`gems.plan.timing`) runs the same
    orders with measured or predicted times; ``start`` (seconds, per rank) is when each rank can begin (its
    data made).

    Each rank executes its list in order; an action starts once what it
    :func:`needs` has run, whichever rank ran it; a rank stuck on what another
    has not run is the only way to hang here: :class:`DeadlockError` names the
    stuck ranks (how the messages themselves are exchanged without a hang is
    :mod:`gems.pipeline.exchange`'s). Also checks that every
    (pass, micro-batch, stage) forward and backward appears exactly once, on
    the rank that holds that stage for that pass.
    """
    if id(sched) not in _CHECKED or _CHECKED[id(sched)] is not sched:  # (a schedule is a value: checked once)
        check_complete(sched)
        if len(_CHECKED) < 4096:
            _CHECKED[id(sched)] = sched
    return run_orders(sched, sched.actions, f_cost, b_cost, cost, transfer, start)


#: the schedules found complete (simulate), by identity, each held with its id
_CHECKED: dict[int, Schedule] = {}


@functools.lru_cache(maxsize=1 << 17)
def _needs(a: Action, stages: int) -> tuple[Action, ...]:
    """:func:`needs` of ``a``, kept (the clock below asks for every action's at every simulation)."""
    return tuple(needs(a, stages))


def check_complete(sched: Schedule) -> None:
    """Every (pass, micro-batch, stage) forward and backward appears exactly once, on the rank that holds that
    stage for that pass (AssertionError naming the first few that do not)."""
    S = sched.stages
    expected = {Action(k, p, i, s) for k in (Kind.F, *backward_kinds(sched.split)) for p in range(sched.replicas)
                for i in range(sched.micro_batches) for s in range(S)}
    seen: list[Action] = [a for order in sched.actions for a in order]
    if len(seen) != len(set(seen)) or set(seen) != expected:
        dup = sorted({a for a in seen if seen.count(a) > 1})
        raise AssertionError(f"{sched.name}: actions duplicated {dup[:4]}, missing {sorted(expected - set(seen))[:4]}, "
                             f"unexpected {sorted(set(seen) - expected)[:4]}")
    for r, order in enumerate(sched.actions):
        for a in order:
            if sched.rank_of(a.replica, a.stage) != r:
                raise AssertionError(f"{sched.name}: {a} on rank {r}, but its stage lives on rank "
                                     f"{sched.rank_of(a.replica, a.stage)}")


def run_orders(sched: Schedule, orders: Sequence[Sequence[Action]], f_cost: int = F_COST, b_cost: int = B_COST,
               cost: Callable[[Action], float] | None = None, transfer: Callable[[Action], float] | None = None,
               start: Sequence[float] | None = None) -> dict[Action, tuple[Any, Any]]:
    """The clock of :func:`simulate` over any per-rank ``orders`` of the schedule's actions (all of them, or a
    subsequence such as the forwards of an evaluation): each action's (start, end), or :class:`DeadlockError`."""
    S = sched.stages
    R = len(orders)
    end: dict[Action, Any] = {}  # ticks (int) under unit costs, seconds (float) with ``cost``
    span: dict[Action, tuple[Any, Any]] = {}
    pos = [0] * R
    clock: list[Any] = list(start) if start is not None else [0] * R
    while any(pos[r] < len(orders[r]) for r in range(R)):
        moved = False
        for r in range(R):
            while pos[r] < len(orders[r]):
                a = orders[r][pos[r]]
                need = _needs(a, S)
                if any(n not in end for n in need):
                    break
                ready = [end[n] + (transfer(n) if transfer is not None and sched.rank_of(n.replica, n.stage) != r else 0)
                         for n in need]
                begin = max([clock[r]] + ready)
                if cost is not None:
                    end[a] = begin + cost(a)
                else:
                    end[a] = begin + (f_cost if a.kind.forward else b_cost if a.kind is Kind.B else b_cost // 2)
                span[a] = (begin, end[a])
                clock[r] = end[a]
                pos[r] += 1
                moved = True
        if not moved:
            stuck = {r: str(orders[r][pos[r]]) for r in range(R) if pos[r] < len(orders[r])}
            raise DeadlockError(f"{sched.name}: ranks wait on each other forever at {stuck}")
    return span


def makespan(sched: Schedule) -> int:
    """Ticks from the first action to the last under the unit costs."""
    return max(e for _, e in simulate(sched).values())


def draw(sched: Schedule) -> str:
    """The clock table of a schedule: one row per rank, one column per tick."""
    span = simulate(sched)
    ticks = max(e for _, e in span.values())
    cell = max(5, max(len(str(a)) for a in span))
    grid = [["." for _ in range(ticks)] for _ in range(sched.ranks)]
    for a, (s, _) in span.items():
        grid[sched.rank_of(a.replica, a.stage)][s] = str(a)
    head = "tick   " + " ".join(f"{t:<{cell}}" for t in range(ticks))
    rows = [f"rank{r:<2} " + " ".join(f"{c:<{cell}}" for c in grid[r]) for r in range(sched.ranks)]
    return "\n".join([head.rstrip()] + [row.rstrip() for row in rows])


def busy_fraction(sched: Schedule) -> float:
    """Compute ticks over rank-ticks: 1.0 means no bubble."""
    span = simulate(sched)
    work = sum(e - s for s, e in span.values())
    return work / (sched.ranks * max(e for _, e in span.values()))


def bubble_fraction(sched: Schedule) -> float:
    """Idle rank-ticks over rank-ticks under the unit costs (``1 - busy_fraction``)."""
    return 1.0 - busy_fraction(sched)


def in_flight(sched: Schedule, rank: int) -> list[int]:
    """Per placement row, the most forwards on ``rank`` whose backward has not run yet (activations kept)."""
    cur = [0] * len(sched.placement)
    peak = [0] * len(sched.placement)
    for a in sched.actions[rank]:
        d = sched.direction(a.replica)
        if a.kind.forward:
            cur[d] += 1
        elif a.kind.frees:
            cur[d] -= 1
        peak[d] = max(peak[d], cur[d])
    return peak


def check_messages(sched: Schedule) -> None:
    """Every message an action receives is what the action it needs on another stage sends (and only then)."""
    for order in sched.actions:
        for a in order:
            got = receives(a, sched.stages)
            src = [n for n in needs(a, sched.stages) if n.stage != a.stage]
            assert (got is None) == (not src), a
            for n in src:
                assert sends(n, sched.stages) == got, (a, n)

