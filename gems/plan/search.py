"""``parallel=auto``: every mesh of a world that runs the same global batch exactly, planned and ranked.

``gems plan parallel=auto`` answers the question a user with N GPUs has before "does this mesh fit": which mesh.
The world is ``parallel.world``, else ``cluster.nodes`` times the GPUs a node of the preset holds. Every candidate
trains like one process on the user's global batch and precision (gems's contract: docs/design.md), so they differ
only in speed and memory, and the planner's model of both (:func:`gems.plan.make.make_plan`, the same a single
plan makes: memory a rank, the step's time broken down as a record breaks it, each candidate placed on nodes as the
launcher would place it: gems.plan.suggest.variant) ranks them:

* **R x D x S**: every factorisation of the world with ``R`` dividing the global batch;
* **S**, every cut the model might take: depth only, pencils, cubes (2D models: rows, tiles), each cut's parts in
  non-increasing order over the dims (a cube's permutations plan alike; the one that cuts depth most is kept: a
  depth slab is the reader's cheapest part). A cut the model refuses (a part thinner than a layer's halo, a layer
  that cannot be cut there) is rejected as such, by the planner's own check;
* **D**, every registered schedule (gems.pipeline.schedules: its registration says what it takes) with its options:
  micro-batches (divisors of what a replica line runs a pass), GEMS-MASTER's replica passes, an interleaved
  schedule's virtual stages, a split backward; the partitions balanced as a run balances them;
* **recomputation** (``parallel.checkpoint``) where a candidate does not fit without it (it never makes a step
  faster: the planner prices its second forward), and CUDA graphs as a run of that mesh decides them
  (gems.rank.graphs.decide: the same rule, the plan's notes).

**Pruning**, where the candidates outgrow what a login node plans in a minute (the tests hold a pruned search to
the exhaustive one on small worlds):

* each count of cut dims keeps its most even cut (the others hold more halo cells on as many neighbours);
* a cut is planned by its largest part (the one that sets the peak and the step), and the ten the table shows
  planned again part by part, as a single plan plans them;
* micro-batch counts are tried in increasing order, each schedule's only up to where its predicted step stops
  falling (after the first that fits); a split backward and a schedule's other virtual stages only at the best
  count; recomputation only where the candidate does not fit;
* a pipeline mesh whose bound (its plain mesh's compute over D: no schedule beats it) is under the best found is
  not planned; of the others, the :data:`REFINED` best by one representative schedule get every schedule.

Each candidate is kept with its overrides (``key=value`` strings that, added to the user's command, run it), its
predicted samples/s, its peak bytes a rank and whether it fits; rejected ones with their reason. ``gems run
parallel=auto`` and ``gems sweep parallel=auto`` run the best (gems.prepare: the record says so, and the runner-up's
prediction).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from gems.errors import ConfigError, RunError
from gems.plan.schema import gib

#: rejection reasons, by the key a refusal names
_REASONS = {"parallel.spatial": "the model refuses the cut", "parallel.spatial_dims": "the model refuses the cut",
            "model.size": "the model refuses the cut", "parallel.micro_batches": "the batch does not divide",
            "train.batch_size": "the batch does not divide", "parallel.gems_replicas": "the batch does not divide",
            "parallel.pipeline": "the layers do not split into the stages",
            "parallel.balance": "the layers do not split into the stages",
            "parallel.virtual_stages": "the layers do not split into the stages"}
NOT_FIT = "does not fit"
#: the prediction's own noise: candidates predicted within this fraction of each other are a tie (the planner does
#: not claim to order them), and of tied candidates the simpler mesh is chosen (:meth:`Candidate.simplicity`)
TIE = 0.02


@dataclass
class Candidate:
    """One mesh and its options: ``overrides`` (key -> value) on the user's configuration, its plan (None where the
    planner refused it), and why it is out where it is (:data:`NOT_FIT`, or a refusal's class and its words)."""

    overrides: dict[str, Any]
    plan: Any = None
    reason: str | None = None
    detail: str = ""

    @property
    def fits(self) -> bool:
        return self.plan is not None and bool(self.plan.fits)

    @property
    def throughput(self) -> float:
        p = self.plan
        return float(p.prediction.throughput) if p is not None and p.prediction is not None else 0.0

    @property
    def peak(self) -> int | None:
        return int(self.plan.worst.bytes.total) if self.plan is not None else None

    def program(self) -> tuple[Any, ...]:
        """What its ranks run: the mesh, recomputation and, on a pipeline, the schedule's action lists and placement.
        Two candidates with one program are one run under two names (at one micro-batch GPipe, 1F1B and ZB-H1 with
        a split backward are the same lists): the search shows the one with the shorter command (:attr:`Search.ranked`)."""
        from gems.pipeline.schedules import make_schedule

        o = self.overrides
        mesh = (o["parallel.replicas"], o["parallel.pipeline"], _text(o["parallel.spatial"]),
                _text(o["parallel.spatial_dims"]), bool(o.get("parallel.checkpoint")))
        if o["parallel.pipeline"] == 1 and o.get("parallel.schedule", "lp") == "lp":
            return mesh
        sched = make_schedule(str(o["parallel.schedule"]), int(o["parallel.pipeline"]), int(o["parallel.micro_batches"]),
                              o.get("parallel.gems_replicas"), o.get("parallel.virtual_stages"),
                              bool(o.get("parallel.split_backward")))
        return (*mesh, sched.actions, sched.placement, sched.split)

    def simplicity(self) -> tuple[int, int]:
        """How much a candidate asks of its ranks, the less the simpler: the ranks each one talks to (its replicas,
        its pipeline neighbours, its spatial neighbours), then the options its command sets."""
        o = self.overrides
        spatial = o["parallel.spatial"]
        parts = [spatial] if isinstance(spatial, int) else list(spatial)
        peers = (int(o["parallel.replicas"]) - 1 + min(int(o["parallel.pipeline"]) - 1, 2)
                 + sum(min(int(p) - 1, 2) for p in parts))
        return peers, len(self.args())

    def args(self) -> list[str]:
        """The ``key=value`` strings that, added to the user's command, run this candidate (a key at its default
        left out: the command holds no mesh key beside parallel=auto)."""
        return [f"{k}={_text(v)}" for k, v in self.overrides.items() if _text(v) != _DEFAULTS.get(k)]

    def mesh(self) -> str:
        o = self.overrides
        spatial = o["parallel.spatial"]
        s = (f"S{spatial}" if isinstance(spatial, int) else "S" + "x".join(map(str, spatial)))
        return f"R{o['parallel.replicas']} x D{o['parallel.pipeline']} x {s}"

    def options(self) -> str:
        o = self.overrides
        if o["parallel.pipeline"] == 1:
            bits = ["plain"]
        else:
            bits = [str(o["parallel.schedule"]), f"m={o['parallel.micro_batches']}"]
            if o.get("parallel.gems_replicas"):
                bits.append(f"eta={o['parallel.gems_replicas']}")
            if o.get("parallel.virtual_stages"):
                bits.append(f"v={o['parallel.virtual_stages']}")
            if o.get("parallel.split_backward"):
                bits.append("split")
        if o.get("parallel.checkpoint"):
            bits.append("recompute")
        return " ".join(bits)


#: the mesh keys' defaults, as text (gems.config.ParallelConf)
_DEFAULTS = {"parallel.replicas": "1", "parallel.pipeline": "1", "parallel.spatial": "1", "parallel.spatial_dims": "null",
             "parallel.schedule": "lp", "parallel.micro_batches": "1", "parallel.checkpoint": "false",
             "parallel.split_backward": "false"}


def _text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(map(str, v)) + "]"
    return "null" if v is None else str(v)


@dataclass
class Search:
    """What a search found: every candidate, best first (those that fit, by predicted samples/s; then those that
    do not, the least memory first; then the rejected), how long it took, and the world it searched."""

    world: int
    candidates: list[Candidate] = field(default_factory=list)
    seconds: float = 0.0
    #: pipeline meshes not planned: their bound under the best throughput found (gems.plan.search.bound)
    pruned: int = 0

    @property
    def ranked(self) -> list[Candidate]:
        """Those that fit, by predicted samples/s, ties within :data:`TIE` the simpler first (:meth:`ties`; of one
        program, the shortest command: :meth:`Candidate.program`); then those that fit but run the program of one
        above (:meth:`same`); then those that do not fit, the least memory first; then the rejected."""
        return self._ranking()[0]

    def same(self) -> dict[int, int]:
        """Of :attr:`ranked`, each candidate that runs the program of one ranked before it: its index -> that one's."""
        return self._ranking()[1]

    def ties(self) -> dict[int, int]:
        """Of :attr:`ranked`, each candidate predicted within :data:`TIE` of one ranked before it, the first of its
        tie (the fastest left, and every candidate within TIE of it, the simplest first): its index -> that one's."""
        return self._ranking()[2]

    def _ranking(self) -> tuple[list[Candidate], dict[int, int], dict[int, int]]:
        ok = sorted((c for c in self.candidates if c.fits), key=lambda c: (-c.throughput, len(c.args())))
        firsts: dict[tuple[Any, ...], int] = {}  # program -> its place among the distinct ones
        distinct: list[Candidate] = []
        again: list[tuple[Candidate, int]] = []
        for c in ok:
            key = c.program()
            if key in firsts:
                again.append((c, firsts[key]))
            else:
                firsts[key] = len(distinct)
                distinct.append(c)
        distinct, ties = tied(distinct)
        where = {c.program(): k for k, c in enumerate(distinct)}
        tight = sorted((c for c in self.candidates if c.plan is not None and not c.fits), key=lambda c: c.peak or 0)
        out = sorted((c for c in self.candidates if c.plan is None), key=lambda c: c.reason or "")
        same = {len(distinct) + k: where[c.program()] for k, (c, _) in enumerate(again)}
        return distinct + [c for c, _ in again] + tight + out, same, ties

    @property
    def best(self) -> Candidate | None:
        r = self.ranked
        return r[0] if r and r[0].fits else None

    def rejected(self) -> dict[str, int]:
        """How many candidates were rejected, by reason."""
        out: dict[str, int] = {}
        for c in self.candidates:
            if not c.fits:
                why = c.reason or NOT_FIT
                out[why] = out.get(why, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def tied(ranked: list[Candidate]) -> tuple[list[Candidate], dict[int, int]]:
    """``ranked`` (by predicted samples/s, the fastest first) in ties: the fastest left leads every candidate
    predicted within :data:`TIE` of it, ordered simplest first (:meth:`Candidate.simplicity`, then the faster);
    then the next fastest left. The order, and each tied candidate's index -> its tie's first's: the one place a
    tie is decided (the choice, the table and the JSON read it)."""
    left, out, ties = list(ranked), list[Candidate](), dict[int, int]()
    while left:
        lead = left[0].throughput
        group = [c for c in left if c.throughput >= lead * (1.0 - TIE)]
        group.sort(key=lambda c: (c.simplicity(), -c.throughput))
        first = len(out)
        ties.update({first + k: first for k in range(1, len(group))})
        out += group
        ids = {id(c) for c in group}
        left = [c for c in left if id(c) not in ids]
    return out, ties


# ---------------------------------------------------------------------------- the world and its meshes
def world_of(cfg: Any) -> int:
    """The ranks to search over: ``parallel.world``, else ``cluster.nodes`` x the preset's GPUs a node."""
    p, c = cfg.parallel, cfg.cluster
    if p.get("world") is not None:
        return int(p.world)
    if c.get("nodes") and int(c.get("gpus_per_node") or 0) > 0:
        return int(c.nodes) * int(c.gpus_per_node)
    raise ConfigError("parallel.world", None, "the ranks to choose a mesh for with parallel=auto: parallel.world=N, "
                      "or cluster.nodes=K on a preset whose nodes hold GPUs (cluster=perlmutter cluster.nodes=16)")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def cuts(S: int, extents: list[int], every: bool = False) -> list[tuple[list[int], list[int]]]:
    """(parts per cut dim, the dims) of the ways to cut a sample in ``S`` parts over its first k dims, the parts
    non-increasing over the dims and at most each dim's extent (module docstring): for each k, the cut whose parts
    are the most even (the others hold more halo cells, on as many neighbours, in parts of the same cells), or
    with ``every`` each of them (the exhaustive search)."""
    if S == 1:
        return [([1], [0])]
    out = []
    for k in range(1, len(extents) + 1):
        ways = [list(parts) for parts in _factor(S, k)
                if all(p >= 2 for p in parts) and list(parts) == sorted(parts, reverse=True)
                and all(p <= e for p, e in zip(parts, extents))]
        if not every and ways:
            ways = [min(ways, key=lambda parts: _spread(parts, extents))]
        out += [(parts, list(range(k))) for parts in ways]
    return out


def _spread(parts: list[int], extents: list[int]) -> float:
    """How uneven a cut's parts are: the largest of their edges over the smallest, over the cut dims."""
    edges = [e / p for p, e in zip(parts, extents)]
    return max(edges) / min(edges)


def _factor(n: int, k: int) -> Iterator[tuple[int, ...]]:
    if k == 1:
        yield (n,)
        return
    for d in divisors(n):
        for rest in _factor(n // d, k - 1):
            yield (d, *rest)


def schedule_options(name: str, kind: Any, D: int, line: int, layers: int) -> list[dict[str, Any]]:
    """Every option set of schedule ``name`` at ``D`` stages for a replica line of ``line`` samples a step (before
    the micro-batches, which the search walks itself): GEMS-MASTER's passes, an interleaved schedule's virtual
    stages (as many stages as the layers allow), a split backward where it is optional."""
    passes = {"one": [None], "two": [None]}.get(kind.passes, [e for e in (2, 4) if line % e == 0])
    virtual = [v for v in (2, 4) if D * v <= layers] if kind.virtual else [None]
    split = [False, True] if kind.split == "optional" else [False]
    out = []
    for eta, v, sp in itertools.product(passes, virtual, split):
        o: dict[str, Any] = {"parallel.schedule": name}
        if eta is not None:
            o["parallel.gems_replicas"] = eta
        if v is not None:
            o["parallel.virtual_stages"] = v
        if sp:
            o["parallel.split_backward"] = True
        out.append(o)
    return out


# ---------------------------------------------------------------------------- planning one
#: the keys a candidate sets besides its own: where its ranks go (placed as the launcher places them)
_PLACED = ("cluster.nodes", "cluster.tasks_per_node", "cluster.ntasks")


class _Planner:
    """Plans candidates on the user's configuration (each once): one typed configuration, each candidate's keys
    set on it for its plan and put back after (a copy a candidate cost more than its plan)."""

    def __init__(self, cfg: Any, layers: int) -> None:
        from omegaconf import open_dict

        from gems.config import typed

        self.base = typed(cfg).copy()
        with open_dict(self.base):  # (parallel.world stays: a study's batch may be written in terms of it)
            self.base.parallel.auto = False
        self.layers = layers
        self.done: dict[tuple[Any, ...], Candidate] = {}
        self.plain: dict[tuple[Any, ...], float | None] = {}

    @contextlib.contextmanager
    def configured(self, overrides: dict[str, Any]) -> Iterator[Any]:
        """The base configuration with ``overrides`` set and its ranks placed, put back as it was afterwards."""
        from omegaconf import OmegaConf, open_dict

        from gems.config import place
        from gems.mesh import mesh_from_config

        c = self.base
        keys = [*overrides, *_PLACED]
        was = {k: OmegaConf.select(c, k) for k in keys}
        try:
            with open_dict(c):
                for k, v in overrides.items():
                    OmegaConf.update(c, k, v, merge=False)
                if c.cluster.launcher == "slurm" or c.cluster.name != "local":  # placed like any run of its size
                    size = mesh_from_config(c).size
                    c.cluster.nodes, c.cluster.tasks_per_node = place(c.cluster, size)
                    c.cluster.ntasks = size
            yield c
        finally:
            with open_dict(c):
                for k in keys:
                    OmegaConf.update(c, k, was[k], merge=False)

    def plan(self, overrides: dict[str, Any]) -> Candidate:
        key = tuple(sorted((k, _text(v)) for k, v in overrides.items()))
        if key in self.done:
            return self.done[key]
        cand = Candidate(dict(overrides))
        try:
            with self.configured(overrides) as c:
                cand.plan = _plan(c, self.layers)
            if not cand.plan.fits:
                cand.reason, cand.detail = NOT_FIT, cand.plan.verdict
        except ConfigError as e:
            cand.reason, cand.detail = _REASONS.get(e.key, f"refused ({e.key})"), str(e)
        except RunError as e:
            cand.reason, cand.detail = "the model refuses the cut", str(e)
        self.done[key] = cand
        return cand

    def compute(self, base: dict[str, Any]) -> float | None:
        """The compute seconds a step of the plain mesh of ``base``'s replicas and cut (no pipeline: R x S ranks)
        takes on a rank, planned once (None where the planner refuses it): what bounds every pipeline of that cut
        from below (:func:`bound`)."""
        key = (base["parallel.replicas"], _text(base["parallel.spatial"]), _text(base["parallel.spatial_dims"]))
        if key not in self.plain:
            plain = {**base, "parallel.pipeline": 1, "parallel.schedule": "lp", "parallel.micro_batches": 1}
            try:
                with self.configured(plain) as c:
                    got = _plan(c, self.layers, timed=True)
                pr = got.prediction
                self.plain[key] = float(pr.breakdown["compute"]) if pr is not None else None
            except (ConfigError, RunError):
                self.plain[key] = None
        return self.plain[key]


def _plan(c: Any, layers: int, parts: str = "largest", timed: bool = False) -> Any:
    """The plan of the typed configuration ``c`` (a candidate's), checked as a run checks its schedule first;
    ``parts``: its spatial parts planned by the largest one (the search) or every one (:func:`gems.plan.make`'s
    single plan: the candidates shown). A candidate planned by its largest part that does not fit is rejected on
    its memory, its step not predicted, but where ``timed`` (a plain mesh's compute: the pipelines' bound)."""
    from gems.parallel import resolve
    from gems.plan.make import make_plan

    resolve(c).check_layers(layers)  # the schedule, the batch over passes and micro-batches, the stages
    return make_plan(c, suggest=False, largest=False, hardware=False, notes=False, parts=parts,
                     predict_unfit=timed or parts != "largest")


def bound(planner: _Planner, base: dict[str, Any], batch: int) -> float:
    """The most samples a second any pipeline of ``base``'s mesh (R x D x S) can reach: its step takes at least its
    busiest stage's compute, at least 1/D of one replica line's compute on its S parts (a stage's micro-batches
    take no less than its share of the whole batch: a kernel's time falls at most linearly with its batch, and a
    stage holds at least 1/D of the layers' work where it is the busiest), which the plain mesh R x S plans.
    Infinite where that plan is refused (no bound: the pipeline is planned)."""
    t = planner.compute(base)
    return math.inf if t is None or t <= 0 else batch * base["parallel.pipeline"] / t


# ---------------------------------------------------------------------------- the search
#: pipeline meshes whose every schedule and option is planned, the best representatives first (module docstring)
REFINED = 6


def search(cfg: Any, exhaustive: bool = False) -> Search:
    """Every candidate of ``cfg``'s world (module docstring); ``exhaustive``: no pruning (the tests' reference).

    The plain meshes (D = 1) first, each planned (recomputing where it does not fit). Then the pipeline meshes in
    the order of their :func:`bound`, the highest first: one whose bound is under the best throughput found so
    far cannot win and is not planned (counted as pruned); the others get a representative (:func:`_representative`).
    Last, the :data:`REFINED` best representatives' meshes, and those whose representative does not fit but whose
    lightest candidate does, each still above the best found, with every registered schedule and option."""
    from gems.config import section
    from gems.models import build_model

    t0 = time.perf_counter()
    N = world_of(cfg)
    B = int(cfg.train.batch_size)
    spec = build_model(section(cfg, "model"))
    layers = len(spec.module)
    extents = [int(n) for n in spec.input_shape[1:1 + int(spec.spatial_ndim)]] if spec.spatial_ndim else []
    planner = _Planner(cfg, layers)
    out = Search(N)
    plains: list[dict[str, Any]] = []
    pipes: list[dict[str, Any]] = []
    for R in divisors(N):
        if B % R:
            out.candidates.append(Candidate(_mesh(R, N // R, 1, [1], [0]), reason="the batch does not divide",
                                            detail=f"train.batch_size={B} over {R} replicas"))
            continue
        M = N // R
        for D in divisors(M):
            if D > layers:
                continue
            S = M // D
            for parts, dims in cuts(S, extents, exhaustive) if extents else ([([1], [0])] if S == 1 else []):
                (plains if D == 1 else pipes).append(_mesh(R, D, S, parts, dims))
    warm(planner, plains + pipes)
    for base in plains:
        _with_recompute(planner, out, base)
    if exhaustive:
        for base in pipes:
            _every_schedule(planner, out, base, B // base["parallel.replicas"], layers, True)
    else:
        _pipelines(planner, out, pipes, B, layers)
    seen: dict[tuple[Any, ...], Candidate] = {}
    for c in out.candidates:  # each candidate once (a walk may meet one twice)
        seen[tuple(sorted((k, _text(v)) for k, v in c.overrides.items()))] = c
    out.candidates = list(seen.values())
    _every_part(planner, out)
    out.seconds = time.perf_counter() - t0
    return out


#: the best candidates planned again with every spatial part, as a single plan plans them (what the table shows)
SHOWN = 10


def _every_part(planner: _Planner, out: Search) -> None:
    """The :data:`SHOWN` best candidates (by the largest part's plan) planned again part by part: their figures are
    then those ``gems plan`` gives each, and the ranking among them (the best included) is by those. Their cuts'
    parts are traced first on the warm-up's workers (:func:`warm`), each cut's classes shared among them."""
    shown = [c for c in out.ranked if c.fits][:SHOWN]
    warm(planner, [c.overrides for c in shown], parts="every")
    # (and those that run one of their programs under another name: planned alike, so they rank beside it)
    programs = {c.program() for c in shown}
    ids = {id(c) for c in shown}
    shown += [c for c in out.candidates if c.fits and id(c) not in ids and c.program() in programs]
    for c in shown:
        if c.overrides["parallel.spatial"] == 1:
            continue  # (one part: the same plan)
        try:
            with planner.configured(c.overrides) as cfg:
                c.plan = _plan(cfg, planner.layers, "every")
        except (ConfigError, RunError) as e:
            c.plan, c.reason, c.detail = None, "the model refuses the cut", str(e)
            continue
        if not c.plan.fits:
            c.reason, c.detail = NOT_FIT, c.plan.verdict


def warm(planner: _Planner, meshes: list[dict[str, Any]], workers: int | None = None, parts: str = "largest") -> int:
    """Trace every cut of ``meshes`` once, on worker processes (this machine's cores), written to gems's trace
    cache on disk (gems.plan.store), where the search's own plans then find them: a cut's ``largest`` part (the
    search's plans), or its ``every`` part (the candidates shown), each at the two batches the plan reads
    (gems.plan.memory.Planner.profile); a cut's parts are shared among the workers, its classes dealt in turn. The
    traces are what a first search spends its time on (a part of a 3D U-Net on fake tensors: about a second each);
    nothing where the cache is off (``GEMS_CACHE_DIR=``), on one core, or where there is less than one worker's
    share of work. Returns the cuts traced so."""
    from gems.paths import cache_root

    cuts_of: dict[tuple[str, str], dict[str, Any]] = {}
    for base in meshes:
        if base["parallel.spatial"] != 1:
            key = (_text(base["parallel.spatial"]), _text(base["parallel.spatial_dims"]))
            cuts_of.setdefault(key, {**base, "parallel.replicas": 1, "parallel.pipeline": 1, "parallel.schedule": "lp",
                                     "parallel.micro_batches": 1})
    cores = workers or (os.cpu_count() or 1)
    shares = cores if parts == "every" else 1  # a cut's every part: its classes dealt over the workers
    jobs = [(base, parts, k, shares) for base in cuts_of.values() for k in range(shares)]
    n = min(cores, len(jobs))
    if cache_root() is None or n < 2:
        return 0
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from gems.plan.store import source_digest
    from gems.pools import start_worker

    source_digest()  # the workers file their traces under this process's digest (a file edited meanwhile: not theirs)
    _WARMING[:] = [planner]
    try:
        with ProcessPoolExecutor(n, mp_context=get_context("fork"), initializer=start_worker) as pool:
            list(pool.map(_warm_one, jobs))
    finally:
        _WARMING.clear()
    return len(cuts_of)


#: the planner whose cuts the warm-up's workers trace (forked: they find it here)
_WARMING: list[_Planner] = []


def _warm_one(job: tuple[dict[str, Any], str, int, int]) -> None:
    """One worker's share of a cut (:func:`warm`): its largest part planned as the search plans it, or the ``k``-th
    of every ``n`` of its spatial classes traced at the two batches a plan reads."""
    base, parts, k, n = job
    planner = _WARMING[0]
    try:
        with planner.configured(base) as c:
            if parts == "largest":
                _plan(c, planner.layers)
                return
            from gems.plan.memory import Planner, setup

            pl = Planner(setup(c), parts="every")
            for members in pl.classes()[k::n]:
                for batch in (1, 2):
                    pl.traced(members[0], batch)
    except (ConfigError, RunError):  # (a cut the model refuses: the search says so when it plans it)
        pass


def _best(out: Search) -> float:
    """The throughput a candidate must be able to reach to be planned: the best found, less the noise within which
    a slower one ties with it (:data:`TIE`: a simpler one tied with the best is chosen)."""
    return max((c.throughput for c in out.candidates if c.fits), default=0.0) * (1.0 - TIE)


def _pipelines(planner: _Planner, out: Search, pipes: list[dict[str, Any]], B: int, layers: int) -> None:
    """The pipeline meshes, pruned by their bounds (:func:`search`)."""
    bounded = sorted(((bound(planner, b, B), k, b) for k, b in enumerate(pipes)), key=lambda t: (-t[0], t[1]))
    reps: list[tuple[Candidate, dict[str, Any], float]] = []
    for bnd, _, base in bounded:
        if bnd < _best(out):
            out.pruned += 1
            continue
        rep = _representative(planner, out, base, B // base["parallel.replicas"])
        if rep is not None and (rep.fits or rep.overrides.get("parallel.schedule") != "lp"):
            reps.append((rep, base, bnd))  # (an lp representative that does not fit: no schedule of the mesh does)
    reps.sort(key=lambda r: -(r[0].throughput if r[0].fits else -1.0))
    for k, (rep, base, bnd) in enumerate(reps):
        if (k < REFINED or not rep.fits) and bnd >= _best(out):
            _every_schedule(planner, out, base, B // base["parallel.replicas"], layers, False)
        else:
            out.pruned += 1


def _every_schedule(planner: _Planner, out: Search, base: dict[str, Any], line: int, layers: int,
                    exhaustive: bool) -> None:
    """Every registered schedule of a pipeline mesh: its micro-batch counts walked with its first option set, its
    other option sets at the best count (all at every count where ``exhaustive``)."""
    from gems.pipeline.schedules import registered

    D = base["parallel.pipeline"]
    for name, kind in registered().items():
        if D < kind.min_ranks:
            continue
        options = schedule_options(name, kind, D, line, layers)
        if not options:
            continue
        if exhaustive:
            for o in options:
                _walk(planner, out, {**base, **o}, line, True)
            continue
        first = _walk(planner, out, {**base, **options[0]}, line, False)
        m = first.overrides["parallel.micro_batches"] if first is not None else None
        for o in options[1:]:
            if "parallel.gems_replicas" in o or m is None:  # other passes: another line a pass, walked afresh
                _walk(planner, out, {**base, **o}, line, False)
            else:
                _with_recompute(planner, out, {**base, **o, "parallel.micro_batches": m})


def _representative(planner: _Planner, out: Search, base: dict[str, Any], line: int) -> Candidate | None:
    """A pipeline mesh's one candidate of the first pass: where even its lightest candidate (layer parallelism:
    one micro-batch in flight, at the most micro-batches, recomputing) does not fit, that one (no schedule of the
    mesh fits); else 1F1B at the micro-batch count where its step stops falling."""
    light = planner.plan({**base, "parallel.micro_batches": line, "parallel.checkpoint": True})
    if light.plan is None or not light.fits:
        out.candidates.append(light)
        return light if light.plan is not None else None
    return _walk(planner, out, {**base, "parallel.schedule": "1f1b"}, line, False)


def _mesh(R: int, D: int, S: int, parts: list[int], dims: list[int]) -> dict[str, Any]:
    return {"parallel.replicas": R, "parallel.pipeline": D,
            "parallel.spatial": parts[0] if len(parts) == 1 else list(parts),
            "parallel.spatial_dims": list(dims) if S > 1 else None, "parallel.schedule": "lp",
            "parallel.micro_batches": 1}


def _with_recompute(planner: _Planner, out: Search, o: dict[str, Any]) -> Candidate:
    """Plan ``o``; where it does not fit, its recomputing variant too (both kept); the better of the two."""
    cand = planner.plan(o)
    out.candidates.append(cand)
    if cand.plan is not None and not cand.fits:
        again = planner.plan({**o, "parallel.checkpoint": True})
        out.candidates.append(again)
        return again if again.fits else cand
    return cand


def _walk(planner: _Planner, out: Search, o: dict[str, Any], line: int, exhaustive: bool) -> Candidate | None:
    """A schedule's micro-batch counts in increasing order (divisors of a pass's samples), up to where its step
    stops falling after the first that fits (module docstring); all of them where ``exhaustive``. The best
    candidate met (one that fits, else the last planned), None where no count was planned."""
    from gems.pipeline.schedules import registered

    kind = registered()[o["parallel.schedule"]]  # (its passes: what its registration says it takes)
    passes = int(o.get("parallel.gems_replicas") or (2 if kind.passes == "two" else 1))
    if line % passes:
        return None
    best: Candidate | None = None
    last: Candidate | None = None
    for m in divisors(line // passes):
        cand = _with_recompute(planner, out, {**o, "parallel.micro_batches": m})
        last = cand if cand.plan is not None else last
        if cand.fits:
            if best is not None and cand.throughput <= best.throughput and not exhaustive:
                break
            if best is None or cand.throughput > best.throughput:
                best = cand
    return best if best is not None else last


# ---------------------------------------------------------------------------- what it says
#: the breakdown's terms, as a record's (gems.plan.timing)
TERMS = ("compute", "halo", "pipeline_comm", "allreduce", "bubble_or_wait", "data")


def command(given: list[str] | None, cand: Candidate) -> str:
    """The one command line that runs ``cand``: the user's overrides but ``parallel=auto`` and ``parallel.world``,
    then the candidate's."""
    kept = [o for o in (given or []) if o != "parallel=auto" and not o.startswith("parallel.world=")]
    return " ".join(["gems run", *kept, *cand.args()])


def hardware_of(cfg: Any, cand: Candidate) -> dict[str, Any] | None:
    """The predicted step's distance to the device of one candidate (computed for those shown only)."""
    if cand.plan is None or cand.plan.prediction is None:
        return None
    if cand.plan.hardware is None:
        from gems.plan.make import predicted_hardware

        with _Planner(cfg, 0).configured(cand.overrides) as c:
            cand.plan.hardware = predicted_hardware(c, cand.plan)
    return cand.plan.hardware


def as_json(cfg: Any, s: Search, given: list[str] | None = None) -> dict[str, Any]:
    """Every candidate, best first (schema ``gems.search/1``): ``overrides`` (``key=value`` strings that, added to
    the user's command, run it), ``mesh``, ``options``, ``samples_per_s``, ``step_s``, ``breakdown``,
    ``peak_bytes``, ``fits``, ``reason``, ``tied_with`` (the rank of the first of its tie within :data:`TIE`, the
    simplest: :func:`tied`); and ``world``, ``tried``, ``rejected`` (by reason), ``seconds``, ``command`` (the
    best's), ``best`` (its index: 0, or null where nothing fits), ``tie`` (:data:`TIE`)."""
    ranked = s.ranked
    same, ties = s.same(), s.ties()
    out = []
    for i, c in enumerate(ranked):
        pr = c.plan.prediction if c.plan is not None else None
        item = {"rank": i + 1, "same_as": same[i] + 1 if i in same else None,
                "tied_with": ties[i] + 1 if i in ties else None, "overrides": c.args(), "mesh": c.mesh(),
                "options": c.options(),
                "samples_per_s": c.throughput if pr is not None else None,
                "step_s": pr.step_s if pr is not None else None,
                "breakdown": {k: float(pr.breakdown.get(k, 0.0)) for k in TERMS} if pr is not None else None,
                "peak_bytes": c.peak, "fits": c.fits, "reason": c.reason, "detail": c.detail if c.reason else ""}
        if i < 10:
            item["hardware"] = hardware_of(cfg, c)
        out.append(item)
    best = s.best
    return {"schema": "gems.search/1", "world": s.world, "tried": len(s.candidates), "rejected": s.rejected(),
            "pruned": s.pruned, "seconds": round(s.seconds, 2), "best": 0 if best is not None else None, "tie": TIE,
            "command": command(given, best) if best is not None else None, "candidates": out,
            "rates": best.plan.prediction.assumptions[0] if best is not None and best.plan.prediction else None}


def render(cfg: Any, s: Search, given: list[str] | None = None, top: int = 10) -> str:
    """The ranked table of the best ``top``, then what was tried, what was rejected and why, and the command."""
    import io

    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"gems plan parallel=auto: {s.world} ranks, global batch {int(cfg.train.batch_size)}, "
                    f"{cfg.train.precision}", show_header=True, header_style="bold")
    for col in ("#", "tie", "mesh", "schedule", "samples/s", "step s", *TERMS, "peak GiB", "fits", "TFLOP/s frac"):
        t.add_column(col, justify="right" if col not in ("mesh", "schedule") else "left")
    same, ties = s.same(), s.ties()
    for i, c in enumerate([c for i, c in enumerate(s.ranked) if i not in same][:top]):
        pr = c.plan.prediction if c.plan is not None else None
        hw = hardware_of(cfg, c) or {}
        frac = hw.get("flops_fraction")
        t.add_row(str(i + 1), f"= {ties[i] + 1}" if i in ties else "", c.mesh(), c.options(),
                  f"{c.throughput:.3g}" if pr is not None else "-",
                  f"{pr.step_s:.3g}" if pr is not None else "-",
                  *((f"{pr.breakdown.get(k, 0.0):.3g}" if pr is not None else "-") for k in TERMS),
                  f"{c.peak / 2**30:.2f}" if c.peak is not None else "-", "yes" if c.fits else "no",
                  f"{frac:.3g}" if isinstance(frac, (int, float)) else "-")
    buf = io.StringIO()
    Console(file=buf, width=200, force_terminal=False).print(t)
    rej = "; ".join(f"{why}: {n}" for why, n in s.rejected().items()) or "none"
    buf.write(f"{len(s.candidates)} candidate(s) tried in {s.seconds:.1f} s; rejected: {rej}; {s.pruned} pipeline "
              "mesh(es) pruned (their bound under the best found)"
              + (f"; {len(same)} that fit run the action lists of one above under another name (not shown; "
                 "plan.format=json: same_as)" if same else "") + "\n")
    best = s.best
    if best is not None:
        tie = sorted(i for i, first in ties.items() if first == 0)
        if tie:
            buf.write(f"#1 and #{', #'.join(str(i + 1) for i in tie)} are a tie (predicted within {100 * TIE:g}% of "
                      "each other, the prediction's own noise): the simplest mesh is first (the fewest ranks each "
                      "rank talks to, then the fewest options)\n")
        if best.plan.prediction is not None:
            buf.write(f"rates: {best.plan.prediction.assumptions[0]}\n")
        buf.write(f"best: {command(given, best)}\n")
    return buf.getvalue()


def closest_refusal(cfg: Any, s: Search) -> ConfigError:
    """Nothing fits: bad input naming the closest candidate (the least memory a rank) and what it lacks, or, where
    no mesh could even be planned, the batches that would split."""
    planned = [c for c in s.candidates if c.plan is not None]
    if planned:
        c = min(planned, key=lambda c: c.peak or 0)
        dev = c.plan.device
        need, have = c.peak or 0, int(dev.get("usable_bytes") or dev.get("memory_bytes") or 0)
        capped = f" under cluster.rank_memory_gb={float(cfg.cluster.rank_memory_gb):g}" if dev.get("capped") else ""
        return ConfigError("parallel.world", s.world, f"a world where a mesh fits; the closest, {c.mesh()} "
                           f"{c.options()} ({' '.join(c.args())}), needs {gib(need)} a rank, the device holds "
                           f"{gib(have)}{capped} (more ranks, train.precision=bf16, or a smaller batch"
                           + (", or a larger cap)" if capped else ")"))
    B = int(cfg.train.batch_size)
    if any(c.reason == "the batch does not divide" for c in s.candidates):
        works = sorted({k * s.world for k in range(1, 4)} | {k * r for r in divisors(s.world) if r > 1
                                                             for k in range(1, 3) if k * r > B})[:6]
        return ConfigError("train.batch_size", B, f"a batch that the {s.world} ranks' meshes split, such as "
                           f"{', '.join(map(str, works))} (a multiple of the replicas R: {s.world} is one replica a "
                           "rank)")
    why = "; ".join(f"{k}: {n}" for k, n in s.rejected().items())
    return ConfigError("parallel.world", s.world, f"a world this model's meshes can take ({why})")


def search_main(cfg: Any, given: list[str] | None = None) -> int:
    """``gems plan parallel=auto``: the ranked table (or ``plan.format=json``), then exit 0; where nothing fits,
    the table, then bad input naming the closest candidate."""
    import json

    s = search(cfg)
    if str(cfg.plan.format) == "json":
        print(json.dumps(as_json(cfg, s, given)))
    else:
        print(render(cfg, s, given), end="")
    if s.best is None:
        raise closest_refusal(cfg, s)
    return 0


def apply_choice(cfg: Any) -> dict[str, Any]:
    """``parallel=auto`` made concrete on ``cfg``: the best candidate's mesh set, its ranks placed on nodes as any
    run of its size, the choice kept (``parallel.chosen``, which the record keeps); returns the choice. Bad input
    where nothing fits."""
    from omegaconf import OmegaConf, open_dict

    from gems.config import place
    from gems.mesh import mesh_from_config

    overrides, chosen = choose(cfg)
    with open_dict(cfg):
        for k, v in overrides.items():
            OmegaConf.update(cfg, k, v, merge=False)
        cfg.parallel.auto, cfg.parallel.chosen = False, chosen
        if cfg.cluster.launcher == "slurm" or cfg.cluster.name != "local":
            size = mesh_from_config(cfg).size
            cfg.cluster.nodes, cfg.cluster.tasks_per_node = place(cfg.cluster, size)
            cfg.cluster.ntasks = size
    return chosen


def said(chosen: dict[str, Any]) -> str:
    """The choice in one line (what ``gems run parallel=auto`` and ``gems plan`` of a study print)."""
    runner = chosen["runner_up"]
    keys = " ".join(chosen["overrides"]) or "the defaults"
    return (f"parallel=auto chose {chosen['mesh']} ({chosen['options']}; {keys}): "
            f"{chosen['predicted_samples_per_s']:.3g} samples/s predicted"
            + (f", the runner-up {runner['mesh']} ({runner['options']}) {runner['predicted_samples_per_s']:.3g}"
               if runner else "") + f" ({chosen['candidates']} candidates in {chosen['seconds']:.1f} s)")


def choose(cfg: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """What ``gems run parallel=auto`` runs: (the best candidate's overrides, what the record keeps of the choice:
    by which search, of how many candidates, the chosen's and the runner-up's predictions); bad input where
    nothing fits."""
    s = search(cfg)
    best = s.best
    if best is None:
        raise closest_refusal(cfg, s)
    ranked = [c for c in s.ranked if c.fits]
    runner = ranked[1] if len(ranked) > 1 else None
    chosen = {"by": "gems plan's search (parallel=auto: gems/plan/search.py)", "world": s.world,
              "candidates": len(s.candidates), "seconds": round(s.seconds, 2), "mesh": best.mesh(),
              "options": best.options(), "overrides": best.args(), "predicted_samples_per_s": best.throughput,
              "tied": [c.mesh() + " " + c.options() for i, c in enumerate(s.ranked) if s.ties().get(i) == 0],
              "runner_up": None if runner is None else {"mesh": runner.mesh(), "options": runner.options(),
                                                        "overrides": runner.args(),
                                                        "predicted_samples_per_s": runner.throughput}}
    return dict(best.overrides), chosen
