"""One runtime that executes any :class:`~gems.pipeline.schedules.Schedule` over torch.distributed point-to-point:
:class:`PipelineRunner` runs each action's forward or backward of its partition on its chunk of the batch, and the
messages in the rounds of the schedule's exchange plan (gems.pipeline.exchange), waiting only where an action needs
what a round received. Around every forward and backward the chunk's ``batch_context`` is set, so ``SampleDropout``
draws the serial masks; ``checkpoint=True`` runs a partition's forward again in its backward.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from gems import commlog, timers
from gems.fault import all_finite
from gems.layers import Recompute, batch_context, evaluation_mode
from gems.layout import format_for, row_major
from gems.pipeline.deferred import WeightGrads, deferring, make_deferrable
from gems.pipeline.exchange import (
    Bucket,
    ExchangePlan,
    Message,
    Round,
    adoptable,
    at_points,
    microseconds,
    pairs,
    plan_exchanges,
    program,
    receive_lead,
    sum_points,
    wanted,
)
from gems.pipeline.schedules import ACT as _ACT
from gems.pipeline.schedules import GRAD as _GRAD
from gems.pipeline.schedules import Action, Kind, Schedule, backward_kinds
from gems.progress import mark, waiting
from gems.shapes import GSHAPE

__all__ = ["PipelineRunner", "LossFn", "Stats"]

LossFn = Callable[[torch.Tensor, Any, int], torch.Tensor]
#: the tag kind of a cut's shape header. Its fields: ndim, dtype code, the dims; the number of global spatial dims,
#: then those (a spatial cut's); the number of pieces packed with the activation (gems.models.skips.Carried), then
#: each one's ndim, dtype code and dims. Sent after its length (PipelineRunner._headers): a cut carries any number
#: of skips
_HEADER = 2
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]
_CONNECT_TAG = 1 << 20  # the messages that make a pair's first exchanges (PipelineRunner.connect)


@dataclass
class _Live:
    """What one (pass, micro-batch, stage) keeps between its forward and its backward."""

    x: torch.Tensor
    y: torch.Tensor | None = None  # None when checkpointing or on the last stage
    loss: torch.Tensor | None = None
    recompute: Recompute | None = None  # when checkpointing: what the backward's forward replays


@dataclass
class Transfers:
    """When this rank sent each message and waited for each it received (the host's wall clock, ``time.time()``:
    one clock for every process of a node, NTP's across nodes), keyed by ``(step, kind, pass, micro-batch,
    receiving stage)``. Set against each other by :func:`split_waits`."""

    sent: dict[tuple[int, ...], float] = field(default_factory=dict)
    received: dict[tuple[int, ...], tuple[float, float]] = field(default_factory=dict)


def split_waits(received: dict[tuple[int, ...], tuple[float, float]], sent: dict[tuple[int, ...], float]
                ) -> tuple[float, float]:
    """(transfer, bubble) seconds of a rank's waits for messages, as the planner splits them: a wait runs from
    when the rank asks for the message to when it has it; the part before the sender sent it is the bubble
    (the sender was not done), the rest is the transfer (``pipeline_comm``). A message whose send time is
    unknown counts as bubble."""
    transfer = bubble = 0.0
    for key, (start, end) in received.items():
        t_sent = sent.get(key)
        moving = max(0.0, end - max(start, t_sent)) if t_sent is not None else 0.0
        transfer += moving
        bubble += max(0.0, end - start - moving)
    return transfer, bubble


class ActionClock:
    """How long each of this rank's actions ran, by (kind, stage): the host's clock on CPU ranks (an action's
    compute is done when its call returns), CUDA events on the compute stream on GPU ranks (read once, after one
    synchronisation, when the times are agreed: :meth:`PipelineRunner.place_rounds_by_time`)."""

    def __init__(self, device: torch.device, limit: int) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[tuple[Kind, int], Any, Any]] = []
        self.limit = limit  # the most spans kept (a few steps' worth: a runner never asked to place keeps few)

    def start(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, key: tuple[Kind, int], begun: Any) -> None:
        if len(self.spans) >= self.limit:
            return
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.spans.append((key, begun, e))
        else:
            self.spans.append((key, begun, time.perf_counter()))

    def least(self) -> dict[tuple[Kind, int], float]:
        """The shortest time each (kind, stage) took, in seconds (the first of each pays its set-up)."""
        if self.cuda and self.spans:
            torch.cuda.synchronize()
        out: dict[tuple[Kind, int], float] = {}
        for key, a, b in self.spans:
            s = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[key] = min(out.get(key, s), s)
        return out


@dataclass
class Stats:
    """Seconds spent since the last reset: computing forwards, backwards, and waiting for messages."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    wait_s: float = 0.0


class PipelineRunner:
    """Runs one pipeline line's forward and backward of a step under a schedule.

    Made by :func:`gems.pipeline.apply_pipeline`. ``modules`` holds this rank's
    partitions (ascending partition index), ``parameters()`` their parameters
    in that order, so the two mirrored holders of a partition pair flatten
    their gradients identically. ``group``: the pipeline line's process group
    (``mesh.groups.pipeline``), the one communicator every message goes on; ``up_group``
    (``mesh.groups.pipeline_up``, gloo only), where given, carries the messages to a lower position instead, and a
    round's operations are issued one by one (no ``batch_isend_irecv``: its operations must share one group).
    """

    def __init__(self, partitions: dict[int, nn.Sequential], schedule: Schedule, position: int, peers: Sequence[int],
                 group: Any, batch_size: int, loss_fn: LossFn, checkpoint: bool = False,
                 shapes: Sequence[tuple[tuple[int, ...], torch.dtype]] | None = None,
                 balance: Sequence[int] | None = None, device: torch.device | None = None,
                 up_group: Any = None) -> None:
        self.schedule = schedule
        self.position = position
        self.peers = list(peers)
        self.group = group
        self.up_group = up_group
        #: how many actions ahead of its round a round's receives go out (gems.pipeline.exchange.receive_lead): over
        #: gloo, whose line carries each direction on a group of its own (up_group); none on one communicator (NCCL)
        self.lead = receive_lead(dist.get_backend(group)) if up_group is not None else 0
        self.batch_size = batch_size
        self.loss_fn = loss_fn
        self.checkpoint = checkpoint
        self.partitions = partitions
        self.balance = list(balance) if balance is not None else []  # layers per partition, all D
        self.modules = nn.ModuleList([partitions[i] for i in sorted(partitions)])
        self.actions: tuple[Action, ...] = schedule.actions[position]
        self.chunk = batch_size // schedule.chunks
        S = schedule.stages
        # activation (shape, dtype) entering stage s, per direction; filled by tracing or by headers
        self._shape: dict[tuple[int, int], tuple[tuple[int, ...], torch.dtype]] = {}
        if shapes is not None:
            for s in range(1, S):
                for direction in range(len(schedule.placement)):
                    self._shape[(direction, s)] = (tuple(shapes[s - 1][0]), shapes[s - 1][1])
        self.stats = Stats()  # the caller may read and reset it (time breakdown of records)
        self.transfers = Transfers()  # when each message was sent and waited for (the caller takes them)
        #: whether every pair this rank exchanges with has met at every message size before the first step
        #: (:meth:`connect`); False where the shapes are learnt from headers in the first step
        self.connected = False
        self._finite: list[tuple[int, torch.Tensor | bool]] = []  # (position, all finite?) of the last step
        #: works of the step's rounds, with the buffers they send and their messages' keys
        self._sends: list[tuple[Any, torch.Tensor, tuple[int, int, int, int]]] = []
        #: per message this rank receives, the sends its arrival shows delivered (of the plan it was made for)
        self._delivered: dict[tuple[int, int, int, int], tuple[tuple[int, int, int, int], ...]] = {}
        self._delivered_of: dict[int, tuple[ExchangePlan, dict[Any, Any]]] = {}
        self._weights = WeightGrads()  # what the I actions of a split schedule leave for their W
        if schedule.split:
            for part in self.partitions.values():
                make_deferrable(part)
        self._step_parity = 0
        self._plans = {False: plan_exchanges(schedule)}  # and, at the first evaluation, its forwards' (True)
        #: evaluation (forward only): the metric summed over the last stage's chunks, else None (training)
        self._metric: Callable[[torch.Tensor, Any, Sequence[int]], torch.Tensor] | None = None
        self._metric_total: torch.Tensor | None = None
        # every buffer this rank receives into lives on its device, parameters or not (a partition of pooling
        # layers holds none): NCCL takes device tensors only
        params = [p for m in self.modules for p in m.parameters()]
        self.device = device if device is not None else (params[0].device if params else torch.device("cpu"))
        self._loss_total: torch.Tensor | float = 0.0
        #: the loss the backward starts from (fp16's loss scaling multiplies it: gems.precision)
        self.scale_loss: Callable[[torch.Tensor], torch.Tensor] = lambda loss: loss
        self._memory_format = torch.contiguous_format
        self._gshape: dict[tuple[int, int], tuple[int, ...]] = {}  # (direction, stage) -> a spatial cut's global shape
        #: a training forward of a partition: ``call_part(action, partition, x)`` (a graphed piece's replay:
        #: gems.rank.pieces), else the partition's own call
        self.call_part: Callable[[Action, nn.Module, torch.Tensor], torch.Tensor] = lambda a, part, x: part(x)
        #: called after every backward action (B, I, W), at the same place of the step on every rank running the
        #: same actions: the gradient sum launches what the action completed (GradientReducer.flush)
        self.after_backward: Callable[[], None] = lambda: None
        #: GEMS's mirrored copies: each bucket's partitions and what launches its sum (sum_mirrors), and where
        self._sum_buckets: list[Bucket] = []
        self._sum_launch: Callable[[int], None] = lambda b: None
        self._sum_at_points: Callable[[tuple[int, ...]], None] = lambda bs: None
        # (id(plan), lead) -> its issue order, and the sums each action may start inside it
        self._programs: dict[tuple[int, int], tuple[list[tuple[str, Any]], dict[int, tuple[int, ...]]]] = {}
        #: the training actions' times, from :meth:`time_actions` until the rounds are placed by them
        self.clock: ActionClock | None = None

    def time_actions(self) -> None:
        """Time the training steps' actions from now on, for :meth:`place_rounds_by_time` (parallel.rounds_by=time)."""
        self.clock = ActionClock(self.device, limit=4 * len(self.actions))

    def place_rounds_by_time(self, group: Any = None) -> str | None:
        """From now on, place the exchange rounds by the actions' measured times instead of the unit clock
        (``parallel.rounds_by=time``; :mod:`gems.pipeline.exchange`: any clock keeps the rounds' proof, as long as
        every rank derives the same plan): each (kind, stage)'s shortest time on this rank since the start, the
        largest over the ranks of ``group`` (one all-reduce, in whole microseconds: every rank of the job calls
        this at the same point and gets the same integers, so every line, mirror and spatial part plans alike).
        A step's (an evaluation's) plan is adopted only where it differs and no position then holds more received
        buffers at once than under the unit clock (:func:`~gems.pipeline.exchange.adoptable`). It may hold them at
        another point of the step, which gems plan's memory does not follow (it plans the unit clock's rounds: a
        looped BFS run here held 4% more tensor memory at its peak with timed rounds): that is why
        ``parallel.rounds_by=time`` is asked for, not the default. Collective. Returns what the record says, or None
        where no plan changed."""
        sched = self.schedule
        kinds = (Kind.F, *backward_kinds(sched.split))
        keys = [(k, s) for k in kinds for s in range(sched.stages)]
        least = self.clock.least() if self.clock is not None else {}
        self.clock = None
        t = torch.tensor([microseconds(least[k]) if k in least else 0 for k in keys], dtype=torch.int64,
                         device=self.device)
        with waiting("pipeline transfer"):
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        got = [int(v) for v in t.tolist()]
        if min(got) < 1:  # a (kind, stage) no rank ran: keep the unit clock
            return None
        costs = dict(zip(keys, got))
        adopted = []
        for forward_only in (False, True):
            unit, timed = plan_exchanges(sched, forward_only), plan_exchanges(sched, forward_only, costs)
            # with the lead the run posts at (none under NCCL, nor where the log stands for an NCCL run's order)
            if adoptable(unit, timed, self._lead(unit)):
                self._plans[forward_only] = timed
                adopted.append("an evaluation's" if forward_only else "a step's")
        self._programs.clear()
        if not adopted:
            return None
        us = "; ".join(f"{k} " + "/".join(f"{costs[(k, s)] / 1e3:.3g}" for s in range(sched.stages)) for k in kinds)
        return (f"the pipeline's exchange rounds of {' and '.join(adopted)} actions placed by their measured times "
                f"(ms per stage: {us}; parallel.rounds_by=time)")

    def plan(self, forward_only: bool = False) -> ExchangePlan:
        """The exchange rounds of a step (``forward_only``: of an evaluation), made once."""
        if forward_only not in self._plans:
            self._plans[forward_only] = plan_exchanges(self.schedule, forward_only)
        return self._plans[forward_only]

    # ---- what the caller needs to know -------------------------------------------------------------------
    @property
    def samples_per_step(self) -> int:
        """Samples this pipeline line trains on per step (all replica passes together)."""
        return self.batch_size

    @property
    def needs_inputs(self) -> bool:
        """Whether this rank runs a first stage (and so reads input samples)."""
        return any(a.stage == 0 for a in self.actions)

    @property
    def needs_targets(self) -> bool:
        """Whether this rank runs a last stage (and so computes a loss)."""
        return any(a.stage == self.schedule.stages - 1 for a in self.actions)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, ordered by partition index."""
        return [p for m in self.modules for p in m.parameters()]

    def buffers(self) -> list[torch.Tensor]:
        """This rank's buffers (e.g. BatchNorm statistics), ordered by partition index."""
        return [b for m in self.modules for b in m.buffers()]

    def first_nonfinite(self) -> int | None:
        """Where this rank first saw a non-finite value in the last step: 0 its input, 1 + s the output of
        partition s; None when all was finite (reading the flags may synchronise a GPU)."""
        return min((pos for pos, ok in self._finite if not bool(ok)), default=None)

    @property
    def memory_format(self) -> torch.memory_format:
        """The memory format the partitions compute in (channels-last for convolutions on GPUs: gems.rank.compose):
        activations and their gradients cross the cuts in it, so no message is converted on either side (a
        partition that packs skips with its activation, gems.models.skips.Carried, flattens them in it)."""
        return self._memory_format

    @memory_format.setter
    def memory_format(self, fmt: torch.memory_format) -> None:
        self._memory_format = fmt
        for part in self.partitions.values():
            if hasattr(part, "memory_format"):  # a partition that packs skips (gems.models.skips.Carried)
                setattr(part, "memory_format", fmt)

    def chunk_slice(self, replica: int, micro_batch: int) -> slice:
        """Which samples of the line's share a (pass, micro-batch) carries: the share of ``n`` samples cut into
        ``eta x m`` contiguous chunks of ``n / (eta m)``, chunk ``p * m + i`` micro-batch ``i`` of pass ``p``, the same
        on every rank and for the serial reference. So ``mast`` gives the first half to replica A and the second to
        B, ``master`` eta equal chunks alternating A, B, A, ...; ``lp``, ``gpipe`` and ``1f1b`` cut one pass into
        ``m`` micro-batches."""
        c = replica * self.schedule.micro_batches + micro_batch
        return slice(c * self.chunk, (c + 1) * self.chunk)

    # ---- p2p ---------------------------------------------------------------------------------------------
    def _tag(self, kind: int, replica: int, micro_batch: int, stage: int) -> int:
        """A message's tag, which gloo checks: step parity, activation | gradient | shape header, pass, micro-batch,
        stage."""
        s = self.schedule
        parity = 0 if kind == _HEADER else self._step_parity
        return (((parity * 3 + kind) * s.replicas + replica) * s.micro_batches + micro_batch) * s.stages + stage

    def _op(self, m: Message, t: torch.Tensor, tag: int) -> Any:
        """The send or the receive of ``m`` on this rank, on the line's communicator (up the line on ``up_group``
        where there is one)."""
        group = self.up_group if self.up_group is not None and m.src > m.dst else self.group
        if m.src == self.position:
            return dist.P2POp(dist.isend, t, self.peers[m.dst], group=group, tag=tag)
        return dist.P2POp(dist.irecv, t, self.peers[m.src], group=group, tag=tag)

    def _batch(self, ops: list[Any], keys: list[Any]) -> dict[Any, Any]:
        """One ``batch_isend_irecv`` (one NCCL group), or with ``up_group`` (gloo) the operations one by one in their
        order, as gloo runs a batch; the work that covers each key's operation (NCCL gives the whole group one
        work, gloo one per operation)."""
        if self.up_group is not None:
            works = [op.op(op.tensor, op.peer, group=op.group, tag=op.tag) for op in ops]
            return dict(zip(keys, works))
        works = dist.batch_isend_irecv(ops)
        return {k: (works[i] if len(works) == len(ops) else works[-1]) for i, k in enumerate(keys)}

    def connect(self) -> None:
        """Make every pair's first exchanges before the first step, at every message size of a step: for each
        pair of positions that exchange messages, in one global order (:func:`gems.pipeline.exchange.pairs`), one
        batch with one message of every (shape, dtype) each way, waited for. Pairwise meetings in one global
        order cannot deadlock; NCCL makes a pair's connections at its first exchange (both ranks must meet), and
        may open more at a larger size. Needs every cut's shape (traced partitions); without them the first step
        makes these exchanges and :attr:`connected` stays False."""
        plan = self.plan()
        sizes: dict[tuple[int, int], set[tuple[tuple[int, ...], str]]] = {}
        for r in plan.rounds:
            for m in r.messages:
                shape = self._shape_of(m.key)
                if shape is None:
                    return
                sizes.setdefault((m.src, m.dst), set()).add((shape[0], str(shape[1]).replace("torch.", "")))
        for a, b in pairs(plan):
            if self.position not in (a, b):
                continue
            ops = []
            for src, dst in ((a, b), (b, a)):
                for dims, dtype in sorted(sizes.get((src, dst), ())):
                    t = torch.zeros(dims, dtype=getattr(torch, dtype), device=self.device)
                    ops.append(self._op(Message(_ACT, 0, 0, 0, src, dst), t, _CONNECT_TAG))
            with waiting("pipeline transfer"):
                for w in set(self._batch(ops, list(range(len(ops)))).values()):
                    w.wait()
        self.connected = True

    def _shape_of(self, key: tuple[int, int, int, int]) -> tuple[tuple[int, ...], torch.dtype] | None:
        kind, replica, _, stage = key
        direction = self.schedule.direction(replica)
        return self._shape.get((direction, stage if kind == _ACT else stage + 1))

    def _headers(self, messages: Sequence[Message]) -> None:
        """The shapes of the round's activations into stages whose shape this rank and its peers do not know
        yet (the first step of partitions that could not be traced on fake tensors,
        :func:`~gems.pipeline.partition.boundary_shapes`): two batches, each read at once: every header's length,
        then the headers (of any length: a cut carries as many skips as the model has). Both ends of every header
        issue the two batches in the round's order. A header also carries a spatial part's global shape and, for a
        partition that packs skips with its activation (:class:`gems.models.skips.Carried`), the packed pieces'
        layout. That first step makes the pair's first exchanges at those sizes, so the run leaves it out of its
        timing (:attr:`PipelineRunner.connected`)."""
        order: list[tuple[Message, tuple[int, int]]] = []
        bodies: dict[tuple[int, int], list[int]] = {}  # what this rank sends
        for m in messages:
            key = (self.schedule.direction(m.replica), m.stage)
            if m.kind != _ACT or key in self._shape or any(k == key for _, k in order):
                continue
            if m.src == self.position:
                y = self._outbox[m.key]
                g = getattr(y, GSHAPE, None) or ()
                fields = [y.dim(), _DTYPES.index(y.dtype), *y.shape, len(g), *g]
                # a partition that packs skips with its activation (gems.models.skips.Carried): the pieces' layout
                layout = getattr(self.partitions[m.stage - 1], "outgoing", None) or []
                fields += [len(layout)] + [v for shape, dt in layout for v in (len(shape), _DTYPES.index(dt), *shape)]
                bodies[key] = fields
                self._shape[key] = (tuple(y.shape), y.dtype)  # also the gradient's coming back
            order.append((m, key))
        if not order:
            return
        lengths = [torch.tensor([len(bodies.get(key, ()))], dtype=torch.int64, device=self.device) for _, key in order]
        self._meet([(m, key, t) for (m, key), t in zip(order, lengths)])
        heads = [torch.tensor(bodies[key], dtype=torch.int64, device=self.device) if key in bodies
                 else torch.zeros(int(n.item()), dtype=torch.int64, device=self.device)
                 for (_, key), n in zip(order, lengths)]
        self._meet([(m, key, t) for (m, key), t in zip(order, heads)])
        for (_, key), head in zip(order, heads):
            if key in bodies:
                continue
            h = [int(v) for v in head.tolist()]  # the first step only, and only for partitions that could not be traced
            nd = h[0]
            self._shape[key] = (tuple(h[2:2 + nd]), _DTYPES[h[1]])
            ng = h[2 + nd]
            if ng:  # a spatial part's global shape: every later activation into the stage is tagged with it
                self._gshape[key] = tuple(h[3 + nd:3 + nd + ng])
            at = 3 + nd + ng
            layout = []
            for _ in range(h[at]):  # the packed pieces' layout, for the receiving partition to unpack
                n = h[at + 1]
                layout.append((tuple(h[at + 3:at + 3 + n]), _DTYPES[h[at + 2]]))
                at += 2 + n
            if layout:
                setattr(self.partitions[key[1]], "incoming", layout)

    def _meet(self, messages: Sequence[tuple[Message, tuple[int, int], torch.Tensor]]) -> None:
        """One batch of header messages, waited for: each is the only message of its tag in flight (the header
        tag of its cut), so the length and the header that follows it cannot be mistaken for each other."""
        ops = [self._op(m, t, self._tag(_HEADER, key[0], 0, key[1])) for m, key, t in messages]
        works = self._batch(ops, list(range(len(ops))))
        with waiting("pipeline transfer"):
            for w in set(works.values()):
                w.wait()

    def _exchange(self, rnd: Round, receives_only: bool = False) -> None:
        """This rank's batch of one round: what its actions made for the round's receivers, and buffers for what
        it receives (kept with their work until the action that needs them: :meth:`_receive`). ``receives_only``:
        the round's receives alone, posted ahead of it (over gloo: :func:`gems.pipeline.exchange.receive_lead`); the
        round then carries the rest."""
        mine = [m for m in rnd.of(self.position)
                if m.key not in self._inbox and (m.dst == self.position or not receives_only)]
        if not mine:
            return
        self._headers(mine)
        ops, tensors = [], []
        for m in mine:
            if m.src == self.position:
                t = self._outbox.pop(m.key)
                self._note_sent(m.key)
            else:
                shape = self._shape_of(m.key)
                assert shape is not None, f"no shape for {m.key}: its header comes in its round"
                t = self._buffer(shape[0], shape[1])
            ops.append(self._op(m, row_major(t), self._tag(m.kind, m.replica, m.micro_batch, m.stage)))
            tensors.append(t)
        works = self._batch(ops, list(mine))
        for m, t in zip(mine, tensors):
            if m.dst == self.position:
                self._inbox[m.key] = (works[m], t)
            else:
                self._sends.append((works[m], t, m.key))

    def _lead(self, plan: ExchangePlan) -> int:
        """How many actions ahead of its round this rank posts a round's receives (exchange.receive_lead): none
        while one of its messages' shapes is still to come in a header (the first step of untraced partitions), and
        none while the run's communication is logged for NCCL's replay (gems.commlog: the log stands for an NCCL
        run's order). Ranks may differ here: over gloo each pair's receiver posts in round order either way."""
        if not self.lead or commlog.recording() or any(self._shape_of(m.key) is None
                                                          for m in plan.messages(self.position)):
            return 0
        return self.lead

    def _receive(self, key: tuple[int, int, int, int]) -> torch.Tensor:
        """What an action needs, received in an earlier round: its work waited for (on a GPU the compute stream
        waits for the communication stream; the host goes on). An activation of a spatial cut is tagged with its
        global shape (learnt from the first step's header), so the stage's first spatial layer does not sum it
        over the parts and read it on the host."""
        t0 = timers.now(self.device)  # on GPUs the compute stream's stall (gems.timers), not the host's launch
        w0 = time.time()
        work, buf = self._inbox.pop(key)
        g = self._gshape.get((self.schedule.direction(key[1]), key[3])) if key[0] == _ACT else None
        if g is not None:
            setattr(buf, GSHAPE, g)
        with waiting("pipeline transfer"):
            work.wait()
        timers.add_since(self.stats.__dict__, "wait_s", t0)
        if self.device.type == "cpu":  # (on GPUs the host's clock sees launches, not transfers)
            self.transfers.received[(self._step, *key)] = (w0, time.time())
        proven = self._delivered.get(key, ())
        if proven:
            self._free_sends(proven)
        return buf

    def _free_sends(self, keys: Sequence[tuple[int, int, int, int]]) -> None:
        """Free the buffers of sends known delivered (:meth:`gems.pipeline.exchange.ExchangePlan.delivered`): their
        works waited for, which never stalls. Over gloo a send's work says it completed only once waited for, so
        without this a rank held every buffer it sent until the end of the step (an activation's under
        recomputation, where nothing else keeps it; every input gradient a stage sent)."""
        done = set(keys)
        with waiting("pipeline transfer"):  # never waits (a wrong proof would, and the watchdog would name it)
            for work, _, key in self._sends:
                if key in done:
                    work.wait()
        self._sends = [s for s in self._sends if s[2] not in done]

    def _note_sent(self, key: tuple[int, int, int, int]) -> None:
        if self.device.type == "cpu":
            self.transfers.sent[(self._step, *key)] = time.time()

    def _reap_sends(self, wait: bool = False) -> None:
        if wait:
            with waiting("pipeline transfer"):
                for work, _, _ in self._sends:
                    work.wait()
            self._sends = []
            return
        self._sends = [s for s in self._sends if not s[0].is_completed()]

    def _put(self, a: Action, kind: int, stage: int, t: torch.Tensor) -> None:
        """Leave what ``a`` made for another stage to the round after it (an activation as the receiver expects
        it: e.g. bf16 under autocast where the cut was traced in fp32)."""
        t = _tagged(t.detach().contiguous(memory_format=self._format(t.dim())), t)
        shape = self._shape_of((kind, a.replica, a.micro_batch, stage))
        if shape is not None:
            if tuple(t.shape) != shape[0]:
                raise RuntimeError(f"stage {a.stage} produced a tensor of shape {tuple(t.shape)} for stage {stage}, "
                                   f"the receiver expects {shape[0]}")
            if t.dtype != shape[1]:
                t = _tagged(t.to(shape[1]), t)
        self._outbox[(kind, a.replica, a.micro_batch, stage)] = t

    def _format(self, ndim: int) -> torch.memory_format:
        """The memory format a message of ``ndim`` dims crosses in: the partitions' own where it applies."""
        return format_for(self.memory_format, ndim)

    def _buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A receive buffer of ``shape`` in the format the partitions compute in (channels-last: allocated as the
        channels-last tensor's memory, a row-major (N, *spatial, C) block, and viewed as (N, C, *spatial))."""
        if self._format(len(shape)) is torch.contiguous_format:
            return torch.empty(shape, dtype=dtype, device=self.device)
        last = torch.empty((shape[0], *shape[2:], shape[1]), dtype=dtype, device=self.device)
        return last.movedim(-1, 1)

    # ---- compute -----------------------------------------------------------------------------------------
    def _forward(self, a: Action, x: torch.Tensor, target: Any) -> None:
        part = self.partitions[a.stage]
        last = a.stage == self.schedule.stages - 1
        if self._metric is not None:  # evaluation: forward only, nothing kept for a backward
            y = part(x)
            if last:
                m = self._metric(y, target, self._ids[self.chunk_slice(a.replica, a.micro_batch)])
                self._metric_total = m if self._metric_total is None else self._metric_total + m
            else:
                self._put(a, _ACT, a.stage + 1, y)
            return
        if a.stage == 0:
            self._finite.append((0, all_finite(x)))
        with batch_context(self._seed, self._step, self._ids[self.chunk_slice(a.replica, a.micro_batch)]):
            if self.checkpoint:
                live = _Live(x, recompute=Recompute(self.device, list(part.buffers())))
                with torch.no_grad():
                    y = part(x)
                    if last:
                        self._loss_total = self._loss_total + self.loss_fn(y, target, self.chunk).detach()
            else:
                if a.stage > 0 and x.is_floating_point():
                    x.requires_grad_(True)
                y = self.call_part(a, part, x)
                live = _Live(x)
                if last:
                    live.loss = self.loss_fn(y, target, self.chunk)
                    # summed on the device: one host read at the end of the step, not one per micro-batch
                    self._loss_total = self._loss_total + live.loss.detach()
                else:
                    live.y = y
        self._finite.append((1 + a.stage, all_finite(y)))
        self._live[(a.replica, a.micro_batch, a.stage)] = live
        if not last:
            self._put(a, _ACT, a.stage + 1, y)

    def _backward(self, a: Action, grad: torch.Tensor | None, target: Any) -> None:
        """A backward (``B``), or the input-gradient half of a split one (``I``: the deferrable layers queue
        their weight gradients for the ``W``, :mod:`gems.pipeline.deferred`)."""
        part = self.partitions[a.stage]
        live = self._live.pop((a.replica, a.micro_batch, a.stage))
        x = live.x
        key = (a.replica, a.micro_batch, a.stage)
        defer = deferring(self._weights, key) if a.kind is Kind.I else contextlib.nullcontext()
        with batch_context(self._seed, self._step, self._ids[self.chunk_slice(a.replica, a.micro_batch)]), defer:
            if live.recompute is not None:
                x = _tagged(x.detach(), x)
                if a.stage > 0 and x.is_floating_point():
                    x.requires_grad_(True)
                with live.recompute.replay():
                    y = part(x)
                    out = self.scale_loss(self.loss_fn(y, target, self.chunk)) if grad is None else y
            else:
                out = self.scale_loss(live.loss) if grad is None and live.loss is not None else live.y
            assert out is not None
            if out.requires_grad:
                torch.autograd.backward(out, grad)
            if live.recompute is not None:
                live.recompute.restore()
        if a.stage > 0:
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            self._put(a, _GRAD, a.stage - 1, g)

    def step(self, inputs: torch.Tensor | None, targets: Any, sample_ids: Sequence[int], seed: int,
             step: int) -> torch.Tensor:
        """Forward and backward of one step's share of this line; returns the weighted losses computed here, summed
        on the device (0 where this rank runs no last stage): nothing of the step is read on the host.

        ``inputs`` and ``targets`` are the line's whole share (``batch_size``
        samples, in global order); ranks that run no first stage may pass None
        for ``inputs``, ranks that run no last stage None for ``targets``.
        Gradients accumulate into ``.grad`` of :meth:`parameters`; summing
        them over the mesh's ``grad`` group gives the serial gradient.
        """
        if len(sample_ids) != self.batch_size:
            raise ValueError(f"step() got {len(sample_ids)} sample ids; this line trains on {self.batch_size} per step")
        self._run(self.plan(), inputs, targets, sample_ids, seed, step)
        total = self._loss_total
        return total.detach() if isinstance(total, torch.Tensor) else torch.zeros((), device=self.device)

    def evaluate(self, inputs: torch.Tensor | None, targets: Any, sample_ids: Sequence[int],
                 metric: Callable[[torch.Tensor, Any, Sequence[int]], torch.Tensor],
                 batch_statistics: bool = False) -> torch.Tensor | None:
        """A forward of one batch of the line's share, without gradients, in evaluation mode (with
        ``batch_statistics``, the normalisation layers in training mode: gems.layers.evaluation_mode): the
        schedule's forward actions in their order, in the rounds of their own exchange plan; returns the sum of
        ``metric(output, target, sample ids)`` over the last-stage chunks this rank ran (None where it runs no last
        stage)."""
        self._metric, self._metric_total = metric, None
        try:
            with evaluation_mode([self.modules], batch_statistics), torch.no_grad():
                self._run(self.plan(forward_only=True), inputs, targets, sample_ids, 0, -1)
        finally:
            self._metric = None
        return self._metric_total

    def sum_mirrors(self, buckets: Sequence[Bucket], launch: Callable[[int], None],
                    inside: Callable[[tuple[int, ...]], None] = lambda bs: None) -> None:
        """Launch the gradient sums of GEMS's mirrored copies during the step, each where every holder issues it in
        the same order with the rounds (:func:`gems.pipeline.exchange.sum_points`): ``buckets``, the partition (or
        partitions) of each bucket in the order the sum launches them; ``launch(b)`` starts bucket ``b``'s;
        ``inside(bs)`` names, before each action, the buckets it may start at its own points
        (:func:`gems.pipeline.exchange.at_points`), and ``()`` after it."""
        self._sum_buckets, self._sum_launch, self._sum_at_points = list(buckets), launch, inside
        self._programs.clear()

    def _program(self, plan: ExchangePlan) -> tuple[list[tuple[str, Any]], dict[int, tuple[int, ...]]]:
        """This rank's issue order of ``plan`` (gems.pipeline.exchange.program) and the sums each action may start
        inside it (:func:`~gems.pipeline.exchange.at_points`), made once: a step's with the mirrored copies' sums,
        an evaluation's without."""
        lead = self._lead(plan)
        key = (id(plan), lead)
        if key not in self._programs:
            sums = sum_points(plan, self._sum_buckets)[self.position] if self._sum_buckets and self._metric is None \
                else []
            prog = program(plan, self.position, sums, lead)
            self._programs[key] = (prog, at_points(prog))
        return self._programs[key]

    def _act(self, a: Action, inputs: torch.Tensor | None, targets: Any) -> None:
        """One action: what it needs taken from its round's buffer, its forward, backward or weight gradients."""
        last = self.schedule.stages - 1
        key = wanted(a, self.schedule.stages)
        received = self._receive(key) if key is not None else None
        sl = self.chunk_slice(a.replica, a.micro_batch)
        target = targets[sl] if a.stage == last and targets is not None else None
        t0 = time.perf_counter()
        clock = self.clock if self._metric is None else None  # a training step's action, while timed
        begun = clock.start() if clock is not None else None
        mark("forward" if a.kind.forward else "backward")
        if a.kind is Kind.W:  # the weight gradients an I left behind (a split schedule)
            self._weights.run((a.replica, a.micro_batch, a.stage))
            self.after_backward()
            self.stats.backward_s += time.perf_counter() - t0
        elif a.kind.forward:
            if a.stage == 0:
                if inputs is None:
                    raise ValueError("this rank runs a first stage: step() needs the inputs")
                x = _tagged(inputs[sl], inputs)
            else:
                assert received is not None
                x = received
            self._forward(a, x, target)
            self.stats.forward_s += time.perf_counter() - t0
        else:
            self._backward(a, received, target)
            self.after_backward()
            self.stats.backward_s += time.perf_counter() - t0
        if clock is not None:
            clock.stop((a.kind, a.stage), begun)
        self._reap_sends()

    def _run(self, plan: ExchangePlan, inputs: torch.Tensor | None, targets: Any, sample_ids: Sequence[int],
             seed: int, step: int) -> None:
        """Run this rank's actions of ``plan`` in order, each after the rounds due before it (what it needs
        received first), what it makes left for the round after it."""
        self._seed, self._step, self._ids = seed, step, list(sample_ids)
        self._loss_total = 0.0
        self._finite = []
        self._live: dict[tuple[int, int, int], _Live] = {}
        self._inbox: dict[tuple[int, int, int, int], tuple[Any, torch.Tensor]] = {}
        self._outbox: dict[tuple[int, int, int, int], torch.Tensor] = {}
        self._sends = []
        if id(plan) not in self._delivered_of:  # per plan (training's, evaluation's, a timed one), kept with it
            self._delivered_of[id(plan)] = (plan, plan.delivered(self.position))
        self._delivered = self._delivered_of[id(plan)][1]
        actions = plan.orders[self.position]
        prog, inside = self._program(plan)
        for kind, item in prog:
            if kind == "round":
                self._exchange(item)
            elif kind == "receive":
                self._exchange(item, receives_only=True)
            elif kind == "sum":
                self._sum_launch(item)  # (nothing where the action started it already)
            elif item in inside:
                self._sum_at_points(inside[item])
                self._act(actions[item], inputs, targets)
                self._sum_at_points(())
            else:
                self._act(actions[item], inputs, targets)
        self._reap_sends(wait=True)
        assert not self._inbox and not self._outbox and not self._live and not self._weights.pending, \
            "schedule left messages, activations or weight gradients behind"
        self._step_parity ^= 1


def _tagged(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` carrying ``like``'s global spatial shape (gems.shapes.GSHAPE), where it has one: a slice, a
    copy or a detached alias of a spatial part is that part still."""
    g = getattr(like, GSHAPE, None)
    if g is not None and t is not like:
        setattr(t, GSHAPE, g)
    return t
