"""Pipeline schedules as pure data: which rank runs which forward or backward, in order.

A schedule is decided before any process exists, so it can be drawn, checked
and unit-tested here; :mod:`gems.pipeline.runtime` only executes it. Every
schedule of gems is one list of :class:`Action` per rank:

* ``kind`` ``"F"`` or ``"B"``; ``stage`` the partition index (0 is the model's
  first layers);
* ``replica`` the replica *pass* (0 .. eta-1): pass ``p`` flows *down*
  (partition ``s`` on rank ``s``) when ``p`` is even and *up* (partition ``s``
  on rank ``D-1-s``) when ``p`` is odd and the schedule is mirrored
  (``mast``, ``master``); non-mirrored schedules have one pass, down;
* ``micro_batch`` the micro-batch inside the pass.

So in ``mast`` rank ``r`` holds partition ``r`` of replica A (pass 0) and
partition ``D-1-r`` of replica B (pass 1), exactly as in GEMS-MAST; ``master``
runs eta passes alternating A, B, A, ... on the same ranks and partitions.

The per-rank orders are produced by one list-scheduling simulation with unit
costs (forward 1 tick, backward 2) and a bound on the micro-batches whose
activations a rank keeps per direction (its *in-flight limit*):

=========  ===========================  ===============  ===================
schedule   passes x micro-batches       prefers          in-flight limit
=========  ===========================  ===============  ===================
lp         1 x m                        backward         1
gpipe      1 x m                        forward          m
1f1b       1 x m                        backward         min(D - s, m)
mast       2 x m (mirrored)             backward         min(D - s, m) per
master     eta x m (mirrored)           backward         direction
=========  ===========================  ===============  ===================

``s`` is the stage a rank holds in that direction. With ``m = 1`` ``mast`` is
GEMS-MAST and ``master`` is GEMS-MASTER (one pass per direction in flight: the
memory of MAST, whatever eta); with ``m > 1`` they are the Chimera
generalisation (at most ``D + 1`` micro-batches of activations per rank).
Since the simulation executes each order against the true dependencies, the
orders are a valid interleaving; :func:`simulate` re-checks any schedule
(every forward before its backward, stage order, each action exactly once,
no deadlock under the point-to-point pattern) and :func:`draw` prints the clock
table that each generator's docstring shows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from gems.errors import ConfigError

__all__ = ["Action", "Schedule", "make_schedule", "lp", "gpipe", "one_f_one_b", "mast", "master",
           "simulate", "draw", "DeadlockError", "SCHEDULES"]

SCHEDULES = ("lp", "gpipe", "1f1b", "mast", "master")
F_COST, B_COST = 1, 2


@dataclass(frozen=True, order=True)
class Action:
    """One forward or backward of one micro-batch of one replica pass on one stage."""

    kind: str  # "F" | "B"
    replica: int
    micro_batch: int
    stage: int

    def __str__(self) -> str:
        name = chr(ord("A") + self.replica) if self.replica < 26 else f"[{self.replica}]"
        return f"{self.kind}{name}{self.micro_batch}s{self.stage}"


@dataclass(frozen=True)
class Schedule:
    """A whole step: ``actions[rank]`` is what that pipeline rank runs, in order."""

    name: str
    stages: int
    replicas: int  # eta: replica passes per step
    micro_batches: int  # per pass
    mirrored: bool
    actions: tuple[tuple[Action, ...], ...]

    def direction(self, replica: int) -> int:
        """0: down (partition s on rank s); 1: up (partition s on rank D-1-s)."""
        return replica % 2 if self.mirrored else 0

    def rank_of(self, replica: int, stage: int) -> int:
        return stage if self.direction(replica) == 0 else self.stages - 1 - stage

    def partitions_of(self, rank: int) -> list[int]:
        """Partition indices this rank holds, ascending."""
        dirs = {0, 1} if self.mirrored else {0}
        return sorted({rank if d == 0 else self.stages - 1 - rank for d in dirs})

    @property
    def chunks(self) -> int:
        """How many pieces one step's batch is cut into (passes x micro-batches)."""
        return self.replicas * self.micro_batches


class DeadlockError(RuntimeError):
    """The per-rank orders cannot all run to the end under their dependencies."""


# ---- the generator ---------------------------------------------------------------------------------------
def _generate(name: str, D: int, passes: int, m: int, mirrored: bool, prefer: str,
              limit: Callable[[int], int]) -> Schedule:
    """List scheduling with unit costs; ``limit(stage)`` bounds the micro-batches in flight per direction."""
    def rank_of(p: int, s: int) -> int:
        return s if (not mirrored or p % 2 == 0) else D - 1 - s

    todo: list[set[Action]] = [set() for _ in range(D)]
    for p in range(passes):
        for i in range(m):
            for s in range(D):
                todo[rank_of(p, s)] |= {Action("F", p, i, s), Action("B", p, i, s)}
    done_at: dict[Action, int] = {}
    busy_until = [0] * D
    inflight = [[0, 0] for _ in range(D)]  # per rank, per direction
    orders: list[list[Action]] = [[] for _ in range(D)]
    t = 0

    def deps(a: Action) -> list[Action]:
        if a.kind == "F":
            return [Action("F", a.replica, a.micro_batch, a.stage - 1)] if a.stage > 0 else []
        out = [Action("F", a.replica, a.micro_batch, a.stage)]
        if a.stage < D - 1:
            out.append(Action("B", a.replica, a.micro_batch, a.stage + 1))
        return out

    def ready_time(a: Action) -> int | None:
        ts = [done_at.get(d) for d in deps(a)]
        if any(x is None or x > t for x in ts):
            return None
        return max([x for x in ts if x is not None], default=0)

    while any(todo):
        progressed = False
        for r in range(D):
            if busy_until[r] > t or not todo[r]:
                continue
            cands = []
            for a in todo[r]:
                rt = ready_time(a)
                if rt is None:
                    continue
                direction = a.replica % 2 if mirrored else 0
                if a.kind == "F":
                    if inflight[r][direction] >= limit(a.stage):
                        continue
                    # passes of one direction enter a stage in order
                    if any(b.kind == "F" and (b.replica % 2 if mirrored else 0) == direction
                           and (b.replica, b.micro_batch) < (a.replica, a.micro_batch) for b in todo[r]):
                        continue
                first = (a.kind != prefer)
                cands.append((first, rt, a.replica, a.micro_batch, a))
            if not cands:
                continue
            a = min(cands)[-1]
            todo[r].discard(a)
            orders[r].append(a)
            direction = a.replica % 2 if mirrored else 0
            inflight[r][direction] += 1 if a.kind == "F" else -1
            busy_until[r] = t + (F_COST if a.kind == "F" else B_COST)
            done_at[a] = busy_until[r]
            progressed = True
        if not progressed:
            future = [b for b in busy_until if b > t]
            if not future:
                raise DeadlockError(f"{name}: no rank can progress at tick {t}")  # pragma: no cover - a generator bug
            t = min(future)
    return Schedule(name, D, passes, m, mirrored, tuple(tuple(o) for o in orders))


def lp(D: int, m: int = 1) -> Schedule:
    """Layer parallelism: one micro-batch in the whole pipeline at a time, no overlap.

    ``lp(2, 2)`` (``FA0s1`` = forward of pass A, micro-batch 0, stage 1)::

        tick   0     1     2     3     4     5     6     7     8     9     10    11
        rank0  FA0s0 .     .     .     BA0s0 .     FA1s0 .     .     .     BA1s0 .
        rank1  .     FA0s1 BA0s1 .     .     .     .     FA1s1 BA1s1 .     .     .

    (drawn by :func:`draw`; a backward takes two ticks, ``.`` is idle)
    """
    return _generate("lp", D, 1, m, False, "B", lambda s: 1)


def gpipe(D: int, m: int) -> Schedule:
    """GPipe: all forwards of the step's micro-batches, then all backwards.

    ``gpipe(2, 3)``::

        tick   0     1     2     3     4     5     6     7     8     9     10    11
        rank0  FA0s0 FA1s0 FA2s0 .     .     .     BA0s0 .     BA1s0 .     BA2s0 .
        rank1  .     FA0s1 FA1s1 FA2s1 BA0s1 .     BA1s1 .     BA2s1 .     .     .
    """
    return _generate("gpipe", D, 1, m, False, "F", lambda s: m)


def one_f_one_b(D: int, m: int) -> Schedule:
    """1F1B (PipeDream-flush): stage ``s`` keeps at most ``D - s`` micro-batches.

    ``one_f_one_b(3, 4)``::

        tick   0     1     2     3     4     5     6     7     8     9     10    11    12    13    14    15    16    17
        rank0  FA0s0 FA1s0 FA2s0 .     .     .     .     BA0s0 .     FA3s0 BA1s0 .     .     BA2s0 .     .     BA3s0 .
        rank1  .     FA0s1 FA1s1 .     .     BA0s1 .     FA2s1 BA1s1 .     FA3s1 BA2s1 .     .     BA3s1 .     .     .
        rank2  .     .     FA0s2 BA0s2 .     FA1s2 BA1s2 .     FA2s2 BA2s2 .     FA3s2 BA3s2 .     .     .     .     .
    """
    return _generate("1f1b", D, 1, m, False, "B", lambda s: min(D - s, m))


def mast(D: int, m: int = 1) -> Schedule:
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
    return _generate("mast", D, 2, m, True, "B", lambda s: min(D - s, m))


def master(D: int, eta: int, m: int = 1) -> Schedule:
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
    return _generate("master", D, eta, m, True, "B", lambda s: min(D - s, m))


def make_schedule(name: str, D: int, micro_batches: int = 1, gems_replicas: int | None = None) -> Schedule:
    """The schedule named by ``parallel.schedule``, validated."""
    if name not in SCHEDULES:
        raise ConfigError("parallel.schedule", name, "one of " + ", ".join(SCHEDULES))
    if not isinstance(D, int) or D < 1:
        raise ConfigError("parallel.pipeline", D, "a positive integer")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ConfigError("parallel.micro_batches", micro_batches, "a positive integer")
    if name in ("mast", "master") and D < 2:
        raise ConfigError("parallel.schedule", name, f"lp, gpipe or 1f1b at parallel.pipeline=1 ({name} mirrors the "
                          "model over at least 2 pipeline ranks)")
    if name == "mast" and gems_replicas not in (None, 2):
        raise ConfigError("parallel.gems_replicas", gems_replicas, "2 (or unset) for mast; use schedule=master for more")
    if name not in ("mast", "master") and gems_replicas not in (None, 1):
        raise ConfigError("parallel.gems_replicas", gems_replicas, f"1 (or unset) for schedule={name}; "
                          "replica passes need schedule=master")
    if name == "lp":
        return lp(D, micro_batches)
    if name == "gpipe":
        return gpipe(D, micro_batches)
    if name == "1f1b":
        return one_f_one_b(D, micro_batches)
    if name == "mast":
        return mast(D, micro_batches)
    return master(D, 2 if gems_replicas is None else int(gems_replicas), micro_batches)


# ---- checking and drawing ----------------------------------------------------------------------------------
def simulate(sched: Schedule, f_cost: int = F_COST, b_cost: int = B_COST) -> dict[Action, tuple[int, int]]:
    """Run the per-rank orders as the runtime would; return each action's (start, end) tick.

    Each rank executes its list in order; an action starts once its inputs have
    arrived (the forward of the previous stage, or the backward of the next
    stage, whichever rank ran it) and its own forward has run. Sends never block
    (the runtime's ``isend``), so a rank stuck on a receive is the only way to
    hang: :class:`DeadlockError` names the stuck ranks. Also checks that every
    (pass, micro-batch, stage) forward and backward appears exactly once, on
    the rank that holds that stage for that pass.
    """
    D = sched.stages
    expected = {Action(k, p, i, s) for k in "FB" for p in range(sched.replicas)
                for i in range(sched.micro_batches) for s in range(D)}
    seen: list[Action] = [a for order in sched.actions for a in order]
    if len(seen) != len(set(seen)) or set(seen) != expected:
        dup = sorted({a for a in seen if seen.count(a) > 1})
        raise AssertionError(f"{sched.name}: actions duplicated {dup[:4]}, missing {sorted(expected - set(seen))[:4]}, "
                             f"unexpected {sorted(set(seen) - expected)[:4]}")
    for r, order in enumerate(sched.actions):
        for a in order:
            if sched.rank_of(a.replica, a.stage) != r:
                raise AssertionError(f"{sched.name}: {a} on rank {r}, but its stage lives on rank {sched.rank_of(a.replica, a.stage)}")
    end: dict[Action, int] = {}
    span: dict[Action, tuple[int, int]] = {}
    pos = [0] * D
    clock = [0] * D
    while any(pos[r] < len(sched.actions[r]) for r in range(D)):
        moved = False
        for r in range(D):
            while pos[r] < len(sched.actions[r]):
                a = sched.actions[r][pos[r]]
                if a.kind == "F":
                    need = [Action("F", a.replica, a.micro_batch, a.stage - 1)] if a.stage > 0 else []
                else:
                    need = [Action("F", a.replica, a.micro_batch, a.stage)]
                    if a.stage < D - 1:
                        need.append(Action("B", a.replica, a.micro_batch, a.stage + 1))
                if any(n not in end for n in need):
                    break
                start = max([clock[r]] + [end[n] for n in need])
                end[a] = start + (f_cost if a.kind == "F" else b_cost)
                span[a] = (start, end[a])
                clock[r] = end[a]
                pos[r] += 1
                moved = True
        if not moved:
            stuck = {r: str(sched.actions[r][pos[r]]) for r in range(D) if pos[r] < len(sched.actions[r])}
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
    grid = [["." for _ in range(ticks)] for _ in range(sched.stages)]
    for a, (s, _) in span.items():
        grid[sched.rank_of(a.replica, a.stage)][s] = str(a)
    head = "tick   " + " ".join(f"{t:<{cell}}" for t in range(ticks))
    rows = [f"rank{r:<2} " + " ".join(f"{c:<{cell}}" for c in grid[r]) for r in range(sched.stages)]
    return "\n".join([head.rstrip()] + [row.rstrip() for row in rows])


def busy_fraction(sched: Schedule) -> float:
    """Compute ticks over rank-ticks: 1.0 means no bubble."""
    span = simulate(sched)
    work = sum(e - s for s, e in span.values())
    return work / (sched.stages * max(e for _, e in span.values()))


def orders_as_text(sched: Schedule) -> Sequence[str]:
    return [" ".join(str(a) for a in order) for order in sched.actions]
