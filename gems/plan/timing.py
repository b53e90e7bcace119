"""How fast a job will run: the predicted step time of an R x D x S job, broken down as a record's
``time_breakdown_s`` is (compute, halo, pipeline_comm, allreduce, bubble_or_wait, data), and its throughput.

The model, term by term:

* **compute**: every op of every layer (counted on the planner's fake trace, :mod:`gems.trace.ops`) at its
  roofline on the rank's device (:mod:`gems.plan.devices`): a named GPU's data-sheet rates times an
  efficiency per op class, or this machine's CPU measured on the spot; a backward costs twice its forward
  (input and weight gradients); the optimizer's update is memory-bound over the rank's parameters.
* **halo**: the spatial messages the real exchange plan sends at each layer (sizes logged by the stand-in
  context), forward and backward, each ``latency + bytes / bandwidth`` on the link it crosses; with
  ``parallel.overlap`` (GPU) a layer's exchange hides behind its interior compute. The global BatchNorm
  all-reduces and the gather before the head are counted here too. The parts of a sample meet at every
  layer's exchange, so each layer takes its slowest part's time (for uneven cuts the others wait, which
  counts as halo), and each rendezvous costs the wait for the slowest part's noise (below). Not
  modelled: gloo's delay in sending a message whose receive is posted late (``gems bench plan`` measures it).
* **waits where ranks meet**: a rank's compute time varies from rank to rank by ``cluster.jitter *
  sqrt(seconds)`` (standard deviation; independent noise adds up as a random walk), so where ``p`` ranks
  meet after ``T`` seconds of compute each, each waits on average for the slowest:
  ``E[max of p standard normals] * jitter * sqrt(T)`` (:func:`rendezvous_wait`). The parts of a sample meet
  at every exchange (counted as halo), a pipeline transfer's receiver meets its sender (pipeline_comm),
  replicas meet at the gradient all-reduce once a step (allreduce): the last grows with the number of
  replicas, as weak scaling loses efficiency at scale. Unset (the GPU presets), no waits.
* **pipeline_comm and bubble_or_wait**: the rank's real action list (:func:`gems.pipeline.make_schedule`)
  is simulated with these action times (:func:`gems.pipeline.schedules.simulate`): without transfers the
  idle time is the bubble; what transfers add to the step is pipeline_comm.
* **allreduce**: an all-reduce of the rank's gradients over its gradient group (replicas, spatial parts
  and mirrored holders), in ``comm.bucket_mb`` buckets, over the slowest link the group crosses: the
  faster of a ring (``2 (p-1)/p * bytes / bandwidth + 2 (p-1) * latency`` per bucket) and a tree
  (``2 bytes / bandwidth + 2 ceil(log2 p) * latency`` per bucket), as NCCL chooses; buckets start during
  the last backward, so only what outlasts it is exposed, where communication has resources of its own
  (GPUs; CPU nodes with cores no rank computes on): where every core computes, gloo's copies and sums take
  their time from the compute and the whole all-reduce counts.
* **data**: each rank makes its data at the start of a step, before its first action (inputs where it runs
  a first stage, targets where it runs a last one, for its spatial part): synthetic samples as long as the
  real generator takes here (:func:`gems.plan.cpu.synthetic_seconds`; GPU ranks generate on the host
  too), files (``data=files``) read from the page cache and copied (:func:`copied`). The simulated
  schedule starts each rank once its data is made, so a first stage's data delays the ranks after it.

Every term is a pure function of the trace, the schedule and the rate tables, so it is tested against
hand-computed values; ``gems bench plan`` holds it against measured steps.
"""
from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from gems.plan.devices import Link, Rates
from gems.trace.ops import LayerOps, scaled

__all__ = ["TERMS", "Prediction", "message", "ring_allreduce", "tree_allreduce", "allreduce", "all_gather",
           "expected_max", "rendezvous_wait", "spatial_comm", "layer_time", "pipeline_times", "copied", "predict"]

TERMS = ("compute", "halo", "pipeline_comm", "allreduce", "bubble_or_wait", "data")


#: data above this share of a predicted step is warned about: the study would measure the data path
DATA_WARN = 0.2


def data_share(prediction: Any) -> float:
    """The share of a predicted step that making or reading the samples takes."""
    return float(prediction.breakdown.get("data", 0.0)) / prediction.step_s if prediction.step_s > 0 else 0.0


def data_warning(cfg: Any, share: float) -> str:
    """What to say when data is more than :data:`DATA_WARN` of a predicted step, and what to change."""
    kind = cfg.data.name if cfg is not None else "synthetic"
    ahead = "a reader ahead of the step (data.prefetch=2, the default)"
    fix = (f"{ahead}, GPU ranks (synthetic samples are drawn on the GPU), or staged files (data=files data.path=...)"
           if kind == "synthetic" else f"{ahead}, files staged to node-local storage (data.stage=node), or faster "
           "storage")
    return (f"data is {100 * share:.0f}% of the predicted step (more than {100 * DATA_WARN:.0f}%): the run would "
            f"measure the data path, not the model; try {fix}")


# ---- the formulas ----------------------------------------------------------------------------------------------
def message(nbytes: float, link: Link) -> float:
    """One message: latency plus bytes over bandwidth."""
    return link.latency + nbytes / link.bandwidth


def ring_allreduce(nbytes: float, p: int, link: Link, buckets: int = 1) -> float:
    """A ring all-reduce of ``nbytes`` over ``p`` ranks in ``buckets`` pieces: each rank sends and receives
    ``2 (p-1)/p`` of the data, in ``2 (p-1)`` steps per piece."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (p - 1) / p * nbytes / link.bandwidth + 2 * (p - 1) * link.latency * max(1, buckets)


def tree_allreduce(nbytes: float, p: int, link: Link, buckets: int = 1) -> float:
    """A (double binary) tree all-reduce: the data reduced up a tree and broadcast down it, pipelined, so
    each rank moves about ``2 bytes`` whatever ``p``, in ``2 ceil(log2 p)`` steps per piece."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    return 2 * nbytes / link.bandwidth + 2 * math.ceil(math.log2(p)) * link.latency * max(1, buckets)


def allreduce(nbytes: float, p: int, link: Link, buckets: int = 1) -> float:
    """The faster of a ring and a tree all-reduce, as NCCL picks between them by size and rank count
    (the ring's latency grows with ``p``, the tree's with ``log2 p``; gloo and MPI have both kinds too)."""
    return min(ring_allreduce(nbytes, p, link, buckets), tree_allreduce(nbytes, p, link, buckets))


def all_gather(full_bytes: float, p: int, link: Link) -> float:
    """A ring all-gather of a tensor of ``full_bytes`` in ``p`` equal parts."""
    if p <= 1:
        return 0.0
    return (p - 1) / p * full_bytes / link.bandwidth + (p - 1) * link.latency


@functools.lru_cache(maxsize=None)
def expected_max(p: int) -> float:
    """The expected largest of ``p`` independent standard normal draws (0 for one, 0.564 for two, 1.03 for
    four, 3.24 for 1024), by quadrature of ``x p phi(x) Phi(x)^(p-1)``."""
    if p <= 1:
        return 0.0
    nd = statistics.NormalDist()
    n, lo, hi = 4000, -9.0, 9.0
    h = (hi - lo) / n
    return sum((lo + i * h) * p * nd.pdf(lo + i * h) * nd.cdf(lo + i * h) ** (p - 1) for i in range(n + 1)) * h


def rendezvous_wait(p: int, seconds: float, jitter: float) -> float:
    """What a rank waits, on average, where ``p`` ranks meet after ``seconds`` of compute each, when each
    rank's time varies independently by ``jitter * sqrt(seconds)`` (standard deviation; ``cluster.jitter``):
    the expected slowest of the ``p`` minus the mean."""
    return expected_max(p) * jitter * math.sqrt(max(0.0, seconds))


def spatial_comm(entries: Sequence[tuple[str, float, int]], parts: int, link: Link) -> float:
    """The seconds of one layer's spatial messages in one direction: ``(kind, bytes, messages)`` as the
    stand-in context logs them (halo: the bytes this part sends to its neighbours, concurrently, sharing
    the rank's link; allreduce: a small all-reduce over the parts; gather: the whole tensor)."""
    t = 0.0
    for kind, nbytes, msgs in entries:
        if kind == "halo":
            t += (link.latency if msgs else 0.0) + nbytes / link.bandwidth
        elif kind == "allreduce":
            t += allreduce(nbytes, parts, link)
        else:
            t += all_gather(nbytes, parts, link)
    return t


def layer_time(ops: LayerOps, rates: Rates, backward: bool, batch: int, first: bool = False,
               part: str | None = None, deferred: int = 0) -> float:
    """Seconds of one layer's ops at micro-batch ``batch``, forward or backward, or one part of a split backward
    (:meth:`Rates.layer_time`)."""
    return rates.layer_time(ops, backward, batch, first, part, deferred)


def pipeline_times(sched: Any, cost: Callable[[Any], float], transfer: Callable[[Any], float],
                   start: Sequence[float] | None = None) -> tuple[list[float], list[float], list[float]]:
    """Per pipeline rank: (end of its last action, end without any transfer time, its busy seconds), from
    simulating the schedule's real per-rank orders; rank ``r`` starts at ``start[r]`` (its data made)."""
    from gems.pipeline.schedules import simulate

    with_comm = simulate(sched, cost=cost, transfer=transfer, start=start)
    without = simulate(sched, cost=cost, transfer=lambda a: 0.0, start=start)
    R = sched.ranks
    end = [0.0] * R
    end0 = [0.0] * R
    busy = [0.0] * R
    for a, (s, e) in with_comm.items():
        r = sched.rank_of(a.replica, a.stage)
        end[r] = max(end[r], e)
        busy[r] += e - s
    for a, (_, e) in without.items():
        r = sched.rank_of(a.replica, a.stage)
        end0[r] = max(end0[r], e)
    return end, end0, busy


# ---- the prediction ------------------------------------------------------------------------------------------
@dataclass
class Prediction:
    step_s: float
    breakdown: dict[str, float]
    throughput: float  # samples/s
    position: str  # the mesh position that sets the step time
    per_position: list[dict[str, Any]] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    staging_s: float = 0.0  # data.stage=node: the copy to node-local storage, once per job (not a step's)

    def as_json(self) -> dict[str, Any]:
        return {"total": self.step_s, "breakdown": dict(self.breakdown), "position": self.position,
                "per_position": self.per_position, "assumptions": list(self.assumptions),
                "staging_once_s": self.staging_s}


@dataclass
class _StageTime:
    fwd: float  # compute seconds of one forward of one micro-batch
    bwd: float
    comm_fwd: float  # exposed spatial messages
    comm_bwd: float
    layers: list[tuple[float, float, float, float]] = field(default_factory=list)  # (fwd, bwd, comm_fwd, comm_bwd)
    #: of ``bwd`` and ``comm_bwd``, the recomputed layers' forward run again (parallel.checkpoint) and its messages
    replay: float = 0.0
    replay_comm: float = 0.0
    #: a split backward's, per layer: (its I's compute, its W's compute), the I with any recomputed forward
    split: list[tuple[float, float]] = field(default_factory=list)

    def backward(self, kind: Any) -> tuple[float, float]:
        """(compute, exposed messages) of a backward action of ``kind`` (gems.pipeline.schedules.Kind): a B all of
        the stage's backward; a split backward's I its layers' input gradients and whatever they do not defer (the
        normalisations', activations' and spatial layers' whole backward, any recomputed forward, every exchange),
        its W the deferred weight gradients and their bookkeeping (:meth:`gems.plan.devices.Rates.layer_time`)."""
        if float(kind.backward_share) >= 1.0:
            return self.bwd, self.comm_bwd
        if kind.input_gradient:
            return sum(i for i, _ in self.split), self.comm_bwd
        return sum(w for _, w in self.split), 0.0


def _meet(parts: Sequence[_StageTime]) -> _StageTime:
    """One stage's time when its spatial parts (position classes) meet at every layer's exchange: each layer
    takes as long as its slowest part there (a part that is faster waits for its neighbours, which a
    record counts as halo time), so the stage is the sum over layers of the slowest, not the slowest sum
    (they differ for uneven cuts, where parts are largest at different layers)."""
    if len(parts) == 1:
        return parts[0]
    fwd = bwd = cf = cb = 0.0
    for layer in zip(*(p.layers for p in parts)):
        f = max(x[0] for x in layer)
        b = max(x[1] for x in layer)
        fwd, bwd = fwd + f, bwd + b
        cf += max(x[0] + x[2] for x in layer) - f
        cb += max(x[1] + x[3] for x in layer) - b
    split = [(max(x[0] for x in layer), max(x[1] for x in layer)) for layer in zip(*(p.split for p in parts))]
    return _StageTime(fwd, bwd, cf, cb, replay=max(p.replay for p in parts),
                      replay_comm=max(p.replay_comm for p in parts), split=split)


def _stage_times(ops1: dict[int, LayerOps], ops2: dict[int, LayerOps], b1: int, b2: int, chunk: int,
                 comm1: list[tuple[int, str, int, int]], comm2: list[tuple[int, str, int, int]],
                 a: int, e: int, last: bool, n_layers: int, rates: Rates, parts: int, link: Link | None,
                 overlap: bool, jitter: float = 0.0, again: frozenset[int] = frozenset(),
                 deferred: Sequence[int] | None = None) -> _StageTime:
    """A stage's times, layer by layer (its loss with the last stage); ``again``: the layers recomputed in the
    backward (parallel.checkpoint, :meth:`gems.plan.memory.Planner.recomputed`), whose forward and its exchanges
    the backward runs once more; ``deferred``: under a split backward, each layer's deferrable modules
    (gems.pipeline.deferred), by which its I and W are timed apart."""
    per: list[tuple[float, float, float, float]] = []
    split: list[tuple[float, float]] = []
    meets: list[bool] = []
    replay = replay_comm = 0.0
    layers = list(range(a, e)) + ([n_layers] if last else [])  # the loss with the last stage
    for j in layers:
        ops = scaled(ops1.get(j, {}), ops2.get(j, {}), b1, b2, chunk)
        tf, tb = layer_time(ops, rates, False, chunk), layer_time(ops, rates, True, chunk, first=j == 0)
        cf = cb = 0.0
        met = False  # whether the parts meet at the layer's exchange
        if link is not None:
            e1 = [(k, nb, m) for i, k, nb, m in comm1 if i == j]
            met = bool(e1)
            e2 = [(k, nb, m) for i, k, nb, m in comm2 if i == j]
            ents = [(k, _at(n1, n2, b1, b2, chunk), m) for (k, n1, m), (_, n2, _) in zip(e1, e2)]
            halo = spatial_comm([x for x in ents if x[0] == "halo"], parts, link)
            rest = spatial_comm([x for x in ents if x[0] != "halo"], parts, link)
            if overlap:  # the exchange runs while the interior is computed
                cf, cb = max(0.0, halo - tf) + rest, max(0.0, halo - tb) + rest
            else:
                cf, cb = halo + rest, halo + rest
        if deferred is not None:
            n = deferred[j] if j < len(deferred) else 0
            split.append((layer_time(ops, rates, True, chunk, j == 0, "input", n) + (tf if j in again else 0.0),
                          layer_time(ops, rates, True, chunk, j == 0, "weight", n)))
        if j in again:  # its forward runs again before its backward (the same exchanges, in the same order)
            tb, cb = tb + tf, cb + cf
            replay, replay_comm = replay + tf, replay_comm + cf
        per.append((tf, tb, cf, cb))
        meets.append(met)
    if jitter > 0 and any(meets):  # each exchange waits for the slowest part's noise since the last one
        per = _with_waits(per, meets, parts, jitter)
    return _StageTime(sum(x[0] for x in per), sum(x[1] for x in per), sum(x[2] for x in per),
                      sum(x[3] for x in per), per, replay, replay_comm, split)


def _with_waits(per: list[tuple[float, float, float, float]], meets: list[bool], parts: int,
                jitter: float) -> list[tuple[float, float, float, float]]:
    """Each layer's (fwd, bwd, comm_fwd, comm_bwd) with the rendezvous waits of its exchanges added: the
    parts meet at every layer that exchanges, after the compute since their last meeting (the layers
    before it, this one included, forward in order and backward in reverse)."""
    out = [list(x) for x in per]
    since = 0.0
    for k, x in enumerate(per):
        since += x[0]
        if meets[k]:
            out[k][2] += rendezvous_wait(parts, since, jitter)
            since = 0.0
    since = 0.0
    for k in reversed(range(len(per))):
        since += per[k][1]
        if meets[k]:
            out[k][3] += rendezvous_wait(parts, since, jitter)
            since = 0.0
    return [(x[0], x[1], x[2], x[3]) for x in out]


def _at(v1: float, v2: float, b1: int, b2: int, b: int) -> float:
    if b1 == b2:
        return v1 * b / b1
    return max(0.0, v1 + (v2 - v1) * (b - b1) / (b2 - b1))


#: ``data(part, samples, input, target)``: seconds for a rank to make ``samples`` samples of its data at step start,
#: the input of its spatial part of extents ``part`` = (C, *spatial) and/or the targets
DataTime = Callable[[Sequence[int], int, bool, bool], float]


def copied(rates: Rates) -> DataTime:
    """Data copied once in memory at the rank's memory bandwidth, each float read and written (the default of a
    caller that names no data time; read files are timed by gems.plan.predict.read_files); targets are small."""
    return lambda part, samples, inp, tgt: 2 * 4 * math.prod(part) * samples / rates.bandwidth if inp else 0.0


def predict(pl: Any, prof: Any, batch: int, rates: Rates, cluster: Any, nodes: int, tasks_per_node: int,
            data: DataTime | None = None, prefetch: int = 0, data_on_device: bool = False,
            graphed: bool = False) -> Prediction:
    """The step time of the planned job (``pl``: the memory planner with its traces; ``prof``: its balance
    and per-class stages at this batch; ``data``: how long a rank takes to make its data, :func:`copied`
    by default; ``prefetch``: the steps a reader makes ahead (``data.prefetch``): where communication and
    compute leave room (``rates.spare``), only what outlasts the step before is exposed. Data made on the
    rank's own device (``data_on_device``: synthetic samples drawn on a GPU) takes that device's time whatever
    the reader: it is never hidden). ``graphed``: the step replayed from a CUDA graph (gems.rank.graphs): its ops
    pay a replay's cost, not a launch (``GRAPH_OP_OVERHEAD_S``); the gradient sums start at their points in the
    captured backward, as eager."""
    from dataclasses import replace

    from gems.plan.devices import GRAPH_OP_OVERHEAD_S, links

    st = pl.st
    mesh = st.mesh
    world = mesh.size
    intra, inter = links(cluster, nodes) if world > 1 else (None, None)
    tpn = max(1, tasks_per_node)

    def link_of(ranks: Sequence[int]) -> Link | None:
        if intra is None:
            return None
        return intra if len({r // tpn for r in ranks}) <= 1 else (inter or intra)

    bal, classes = prof
    chunk = pl.chunk_of(batch)
    D = mesh.pipeline
    S = mesh.spatial
    overlap = bool(st.overlap if st.overlap is not None else st.gpu)
    sched = pl.sched() if pl.pipelined else None
    n_stages = len(bal)
    spatial_link = link_of(mesh.spatial_ranks(0, 0)) if S > 1 else None
    jitter = float(cluster.jitter or 0.0) if world > 1 else 0.0
    model_rates = replace(rates, op_overhead_s=GRAPH_OP_OVERHEAD_S) if graphed else rates
    per_stage = _stage_list(pl, classes, bal, chunk, model_rates, S, spatial_link, overlap, jitter,
                            bool(sched is not None and sched.split))
    stage_out = [classes[0][2][p].out.at(chunk) for p in range(n_stages)]
    stage_in = [classes[0][2][p].inp.at(chunk) for p in range(n_stages)]

    # the data: made at the start of the step by every rank that runs a first stage (inputs) or a last stage
    # (targets), before its first action: the B / R samples of its replica line, for its spatial part
    data = data or copied(rates)
    n_ranks = sched.ranks if sched is not None else 1
    samples = chunk * pl.chunks
    data_s = []
    for d in range(n_ranks):
        held = sched.partitions_of(d) if sched is not None else [0]
        inp, tgt = 0 in held, n_stages - 1 in held
        data_s.append(max(data(cls[1], samples, inp, tgt) for cls in classes))

    # the schedule
    booked = model_rates.share * model_rates.action_overhead_s  # each action's bookkeeping on the host
    summed = _accumulations(sched, [classes[0][2][p].params for p in range(n_stages)], model_rates)
    if sched is not None:

        def cost(act: Any) -> float:
            t = per_stage[act.stage]
            if act.kind.forward:
                return t.fwd + t.comm_fwd + booked
            # B all of it, or a split's I or W (Rates.layer_time); the weight gradients added to the step's so far
            return sum(t.backward(act.kind)) + booked + (summed.get((sched.rank_of(act.replica, act.stage), act.stage),
                                                                    0.0) if act.kind.finishes_gradients else 0.0)

        def transfer(act: Any) -> float:
            nxt = act.stage + 1 if act.kind.forward else act.stage - 1
            r0, r1 = sched.rank_of(act.replica, act.stage), sched.rank_of(act.replica, nxt)
            lk = link_of([mesh.rank_of(0, r0, 0), mesh.rank_of(0, r1, 0)])
            if lk is None:
                return 0.0
            # the receiver meets the sender: it waits for the noise of the sender's action too
            return message(stage_out[act.stage] if act.kind.forward else stage_in[act.stage], lk) + \
                rendezvous_wait(2, cost(act), jitter)

        if prefetch > 0 and rates.spare and not data_on_device:
            data_s = _exposed(data_s, max(pipeline_times(sched, cost, transfer, None)[0]))
        end, end0, _busy = pipeline_times(sched, cost, transfer, data_s)
        actions = sched.actions
        ranks = range(sched.ranks)
    else:
        t = per_stage[0]
        work = t.fwd + t.bwd + t.comm_fwd + t.comm_bwd
        data_s = _exposed(data_s, work) if prefetch > 0 and rates.spare and not data_on_device else data_s
        end = end0 = [data_s[0] + work]
        actions = None
        ranks = range(1)
    step_end = max(end)  # every rank waits for the slowest at the step's sync

    per_position = []
    worst: dict[str, float] | None = None
    worst_label = ""
    for d in ranks:
        held = sched.partitions_of(d) if sched is not None else [0]
        if actions is not None:
            comp = sum((per_stage[a.stage].fwd if a.kind.forward else per_stage[a.stage].backward(a.kind)[0])
                       for a in actions[d]) + booked * len(actions[d]) + \
                sum(summed.get((d, a.stage), 0.0) for a in actions[d] if a.kind.finishes_gradients)
            spat = sum((per_stage[a.stage].comm_fwd if a.kind.forward else per_stage[a.stage].backward(a.kind)[1])
                       for a in actions[d])
            last_b = [a for a in actions[d] if a.kind.frees]
            window = sum(cost(a) for a in last_b[-len(held):]) if last_b else 0.0
        else:
            comp, spat = per_stage[0].fwd + per_stage[0].bwd, per_stage[0].comm_fwd + per_stage[0].comm_bwd
            # a capture records the sums where the eager backward starts them; in a graph of spatial parts every
            # NCCL launch follows the one before it (gems.capture's chain), so each backward halo, and the compute
            # that needs it, waits for every sum launched before: priced as not hidden behind the backward
            window = 0.0 if graphed and S > 1 else per_stage[0].bwd
        # gradients: a ring over the replicas, spatial parts and mirrored holders of these partitions
        params = sum(classes[0][2][p].params for p in held)
        holders = next((g for g in sched.holder_groups() if d in g), (d,)) if sched is not None else (0,)
        group = [mesh.rank_of(r, h, s) for r in range(mesh.replicas) for h in holders for s in range(S)]
        ar_s = _gradient_sum(params, len(group), link_of(group), st.bucket_mb, window, rates.spare, mesh.replicas,
                             comp, jitter)
        # the optimizer's update: memory-bound over parameters, gradients and state (Rates.update)
        opt_s = rates.update(params, st.optimizer_factor) + 10 * len(held) * rates.op_overhead_s
        bubble = max(0.0, end0[d] - data_s[d] - comp - spat) + (step_end - end[d])
        bubble = bubble if bubble > 1e-9 * step_end else 0.0  # the subtractions' rounding is no wait
        pcomm = max(0.0, end[d] - end0[d])
        terms = {"compute": comp + opt_s + rates.host_step_s, "halo": spat, "pipeline_comm": pcomm, "allreduce": ar_s,
                 "bubble_or_wait": bubble, "data": data_s[d]}
        total = sum(terms.values())
        label = f"pipeline {d}" if D > 1 else "every rank"
        per_position.append({"pipeline": d, "total": total, "breakdown": terms})
        if worst is None or total > sum(worst.values()):
            worst, worst_label = terms, label
    assert worst is not None
    step = sum(worst.values())
    said = _assumptions(rates, intra, inter, overlap, world, jitter, prefetch, data_on_device)
    if graphed:
        said.insert(2, f"the model's forward and backward replayed from CUDA graphs (train.cuda_graphs): "
                       f"{GRAPH_OP_OVERHEAD_S * 1e6:.3g} us a kernel (planned: no lease has timed a replay yet), the "
                       "loss, the gradient sums and the step's sync inside the replay; the optimizer launches its own"
                       + ("; the sums chained with the halos, so not hidden behind the backward (docs/gpu.md)" if S > 1
                          else ""))
    elif rates.kind == "gpu":  # the cost a launch was fit to rows that no longer measure the code (issue 74)
        said.insert(2, STALE_LAUNCH_FIT)
    return Prediction(step, worst, batch / step if step > 0 else math.inf, worst_label, per_position, said)


def _accumulations(sched: Any, params: Sequence[float], rates: Rates) -> dict[tuple[int, int], float]:
    """Per (pipeline rank, stage), what each of the stage's backward actions that finish weight gradients (B, W)
    adds on average for adding them to those of the step so far: a memory-bound pass over the stage's ``params``
    bytes (the gradient read, the sum read and written), for every such action of the step but the first (its
    gradients are taken as they are); none where each stage runs one such action a step (or no pipeline)."""
    if sched is None:
        return {}
    out: dict[tuple[int, int], float] = {}
    for d in range(sched.ranks):
        runs: dict[int, int] = {}
        for a in sched.actions[d]:
            if a.kind.finishes_gradients:
                runs[a.stage] = runs.get(a.stage, 0) + 1
        for stage, n in runs.items():
            if n > 1 and params[stage] > 0:
                once = rates.time("memory", ("memory", "elementwise"), 0.0, 3.0 * params[stage], False)
                out[(d, stage)] = once * (n - 1) / n
    return out


def _stage_list(pl: Any, classes: Any, bal: Sequence[int], chunk: int, rates: Rates, S: int,
                spatial_link: Link | None, overlap: bool, jitter: float, split: bool = False) -> list[_StageTime]:
    """Each stage's times: its layers (``bal``: layers per stage) at micro-batch ``chunk`` on every spatial
    class, the classes meeting at every layer's exchange (:func:`_meet`); ``split``: a split backward's I and W
    timed apart too."""
    out: list[_StageTime] = []
    start = 0
    for p, n in enumerate(bal):
        a, e = start, start + n
        start = e
        parts = []
        for members, _local, _stages, _tb in classes:
            t1, t2 = pl.traced(members[0], 1), pl.traced(members[0], 2)
            n_layers = len(t1.out_bytes) - 1
            parts.append(_stage_times(t1.ops, t2.ops, t1.batch, t2.batch, chunk, t1.comm, t2.comm, a, e,
                                      p == len(bal) - 1, n_layers, rates, S, spatial_link, overlap, jitter,
                                      pl.recomputed(n_layers), pl.deferred(members[0]) if split else None))
        out.append(_meet(parts))
    return out


def staging(nbytes: float, tasks_per_node: int, link: Link | None, files: int) -> tuple[float, str]:
    """``data.stage=node``: every node copies all ``nbytes`` of the data set once, its ranks sharing the files,
    at most as fast as the node's ranks can take from the network together (``link``: the between-node figure of
    one rank; a shared filesystem may be slower). Seconds once per job, and what that assumes."""
    if link is None or nbytes <= 0:
        return 0.0, "data.stage=node: the copy's time is not predicted (no between-node link figures, or no files)"
    rate = link.bandwidth * max(1, tasks_per_node)
    seconds = nbytes / rate + files * link.latency
    return seconds, (f"data.stage=node: {files} files, {nbytes / 2**30:.3g} GiB copied to every node once at job "
                     f"start at {rate / 1e9:g} GB/s a node (its ranks' network; a slower filesystem makes it "
                     f"longer): {seconds:.3g} s once per job, not per step")


def _exposed(data_s: list[float], step: float) -> list[float]:
    """What a reader that makes each step's data during the step before leaves the step to wait for."""
    return [max(0.0, v - step) for v in data_s]


def _gradient_sum(params: float, p: int, link: Link | None, bucket_mb: float, window: float, spare: bool,
                  replicas: int, compute: float, jitter: float) -> float:
    """Seconds of a rank's gradient sum over its ``p`` holders: buckets of ``bucket_mb`` over ``link``, hidden
    behind the last backward's ``window`` where communication has resources of its own (``spare``), plus the
    wait for the slowest replica (the replicas meet here after a step's compute each; within a replica its
    ranks met at every exchange and transfer)."""
    if link is None or p <= 1:
        return 0.0
    nb = max(1, math.ceil(params / max(1.0, bucket_mb * 2**20)))
    full = allreduce(params, p, link, nb)
    return (max(full - window, full / nb) if spare else full) + rendezvous_wait(replicas, compute, jitter)


#: what an eager GPU plan says of its cost a launch until a lease measures today's code (issue 74, item 7)
STALE_LAUNCH_FIT = ("the cost a launch (kernels: above) was fit to GPU rows measured by a gems whose dropout drew its "
                    "masks a sample at a time (27 launches more a step at a batch of 4); today's code launches fewer "
                    "and no lent GPU has measured it since: a small eager step, made mostly of launches, may be "
                    "planned short of what it takes (planned, not measured)")


def _assumptions(rates: Rates, intra: Link | None, inter: Link | None, overlap: bool, world: int,
                 jitter: float, prefetch: int, data_on_device: bool = False) -> list[str]:
    """What a prediction assumes, in words (its rates, links, halo overlap, jitter and the reader ahead)."""
    out = [rates.about]
    if rates.kind == "gpu":
        out.append(f"kernels: {rates.op_overhead_s * 1e6:.3g} us of launch and framework time an op (a backward op "
                   f"twice), and gems's own host time {rates.host_step_s * 1e3:.3g} ms a step")
    if rates.large_seen and rates.large_sample is not None:
        convs = ", ".join(f"{cin} -> {cout}" for _, cin, cout in sorted(rates.large_seen))
        fwd, bwd = rates.large_sample
        out.append(f"a sample past 2^31 elements in convolution(s) {convs}: past a 32-bit index PyTorch leaves "
                   f"cuDNN's usual kernels, timed at {fwd / 1e12:.2g} TFLOP/s forward and {bwd / 1e12:.2g} backward "
                   "(an H100's, results/gpu/h100-2026-11-27.md); parallel.spatial cuts the sample below it")
    if intra is not None:
        out.append(f"links: {intra.bandwidth / 1e9:g} GB/s and {intra.latency * 1e6:g} us within a node"
                   + (f", {inter.bandwidth / 1e9:g} GB/s and {inter.latency * 1e6:g} us between nodes"
                      if inter is not None else ""))
    out.append("halo exchanges overlap interior compute" if overlap else "halo exchanges do not overlap compute")
    if world > 1:
        out.append(f"ranks' compute varies by {jitter * 1e3:.3g} ms (standard deviation) over a second of "
                   "it (cluster.jitter), so where ranks meet they wait for the slowest" if jitter else
                   "no rank-to-rank jitter (cluster.jitter unset): ranks meet without waiting for each "
                   "other's noise")
    if data_on_device:
        out.append("data made on the rank's device: what the step waits for is the device's own time of it")
    elif prefetch > 0:
        out.append(f"data read {prefetch} step(s) ahead (data.prefetch): " + (
            "only what outlasts the step before waits" if rates.spare else "every core computes, so the reader's "
            "time is the step's"))
    else:
        out.append("data read in the step (data.prefetch=0)")
    return out
