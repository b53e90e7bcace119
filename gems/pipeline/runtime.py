"""One runtime that executes any :class:`~gems.pipeline.schedules.Schedule` over torch.distributed p2p.

The schedule says what this pipeline rank does, in order; this module does it:
runs the forward or backward of its partition on the right chunk of the batch,
sends activations down and gradients up right after the action that makes
them, and posts the matching receives a few actions ahead, so transfers
overlap compute. Since sends never block and every order came out of a valid
execution (:func:`~gems.pipeline.schedules.simulate` checks it), no rank can
deadlock.

The message order is one NCCL completes (docs/design.md, "Rules of the GPU
path"; :mod:`gems.commlog` replays it). NCCL runs the operations of a
communicator in issue order on one stream, a receive holding the stream until
its send arrives, and matches the messages of a pair by order, not by tag. So
each directed link (sending rank -> receiving rank,
:meth:`~gems.pipeline.schedules.Schedule.links`) has a two-rank process group
of its own (``mesh.groups.links``), every message goes out as a batch of one on
its link's group (``batch_isend_irecv``: the group's own communicator, not a
pair communicator torch would make on the side), and a rank posts the receives
of each link in the order the sender sends them. A receive posted early then
holds only later receives of the same link, never a send, and the prefetch is
safe under NCCL as it is under gloo. The links are connected once, in one
global order, before the first step (:meth:`PipelineRunner.connect`): NCCL
starts a communicator when both ranks first use it, and a first use from
inside a step could wait on a rank that waits on something else.

Batch split (deterministic, the same on every rank and for the serial
reference): a line's share of ``n`` samples is cut into ``eta x m`` contiguous
chunks of ``n / (eta m)``; chunk ``p * m + i`` is micro-batch ``i`` of replica
pass ``p``. So ``mast`` gives the first half to replica A and the second to B;
``master`` gives eta equal chunks alternating A, B, A, ...; ``lp``/``gpipe``/
``1f1b`` have one pass cut into ``m`` micro-batches.

Messages also carry a tag (step parity, activation | gradient | shape header,
pass, micro-batch, stage), which gloo and MPI check. The activation shape crossing each cut is
known in advance when the partitions could be traced on fake tensors
(:func:`~gems.pipeline.partition.boundary_shapes`); otherwise the first
activation a sender sends into a stage is preceded by a small shape header
and the receiver waits for it once (first step only).

Around every forward, and every backward (recomputation included),
``gems.layers.batch_context(seed, step, chunk's sample ids)`` is set,
so ``SampleDropout`` draws the serial masks. With ``checkpoint=True`` a
partition keeps only its input between forward and backward and runs the
forward again in the backward; BatchNorm buffers are restored after the
recomputation so running statistics are updated once.

Why one file of this length: one executor for every schedule, with the bookkeeping of its messages (batches per
link) and their timing; split, one state machine would be read in pieces.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from gems import timers
from gems.fake import scalar
from gems.fault import all_finite
from gems.fault.progress import mark, waiting
from gems.layers import batch_context, evaluation_mode
from gems.pipeline.deferred import WeightGrads, deferring, make_deferrable
from gems.pipeline.schedules import ACT as _ACT
from gems.pipeline.schedules import GRAD as _GRAD
from gems.pipeline.schedules import Action, Kind, Schedule, receives, sends

__all__ = ["PipelineRunner", "LossFn", "Stats"]

LossFn = Callable[[torch.Tensor, Any, int], torch.Tensor]
_HEADER = 2
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8, torch.bool]
_HEADER_LEN = 10  # ndim, dtype code, up to 8 dims
_CONNECT_TAG = 1 << 20  # the one message each way that starts a link (PipelineRunner.connect)


@dataclass
class _Live:
    """What one (pass, micro-batch, stage) keeps between its forward and its backward."""

    x: torch.Tensor
    y: torch.Tensor | None = None  # None when checkpointing or on the last stage
    loss: torch.Tensor | None = None


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
    their gradients identically.
    """

    def __init__(self, partitions: dict[int, nn.Sequential], schedule: Schedule, position: int, peers: Sequence[int],
                 links: dict[tuple[int, int], Any] | None, batch_size: int, loss_fn: LossFn, checkpoint: bool = False,
                 shapes: Sequence[tuple[tuple[int, ...], torch.dtype]] | None = None, lookahead: int = 2,
                 balance: Sequence[int] | None = None, device: torch.device | None = None) -> None:
        self.schedule = schedule
        self.position = position
        self.peers = list(peers)
        self.links = dict(links or {})  # (sending, receiving) position -> the link's process group
        missing = [ln for ln in schedule.links() if position in ln and ln not in self.links]
        if missing and links is not None:  # (None: a runner asked only about its roles, which sends nothing)
            raise RuntimeError(f"PipelineRunner: no process group for the links {missing} of {schedule.name}: "
                               f"build them with mesh.build_groups(rank, links=schedule.links())")
        self.batch_size = batch_size
        self.loss_fn = loss_fn
        self.checkpoint = checkpoint
        self.lookahead = lookahead
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
        self._finite: list[tuple[int, torch.Tensor | bool]] = []  # (position, all finite?) of the last step
        self._sends: list[tuple[Any, torch.Tensor]] = []  # isends of the step in flight, with their buffers
        self._weights = WeightGrads()  # what the I actions of a split schedule leave for their W
        if schedule.split:
            for part in self.partitions.values():
                make_deferrable(part)
        self._step_parity = 0
        # what each peer sends this rank, in the order it sends it: receives are posted in that order,
        # as NCCL matches point-to-point messages by issue order (gloo and MPI would also match by tag)
        self._inbox, self._src_index = self._inboxes(schedule.actions)
        self._next: dict[int, int] = {}
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

    def _inboxes(self, actions: Sequence[Sequence[Action]]) -> tuple[dict[int, list[tuple[int, int, int, int]]],
                                                                   dict[tuple[int, int, int, int], tuple[int, int]]]:
        """What each peer sends this rank under ``actions``, in the order it sends it (receives are posted in that
        order, as NCCL matches point-to-point messages by issue order), and where each message stands there."""
        inbox: dict[int, list[tuple[int, int, int, int]]] = {}
        index: dict[tuple[int, int, int, int], tuple[int, int]] = {}
        for src, order in enumerate(actions):
            for a in order:
                msg = self._message(a)
                if msg is not None and msg[0] == self.position:
                    queue = inbox.setdefault(src, [])
                    index[msg[1]] = (src, len(queue))
                    queue.append(msg[1])
        return inbox, index

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

    def chunk_slice(self, replica: int, micro_batch: int) -> slice:
        """Which samples of the line's share a (pass, micro-batch) carries."""
        c = replica * self.schedule.micro_batches + micro_batch
        return slice(c * self.chunk, (c + 1) * self.chunk)

    # ---- p2p ---------------------------------------------------------------------------------------------
    def _tag(self, kind: int, replica: int, micro_batch: int, stage: int) -> int:
        s = self.schedule
        parity = 0 if kind == _HEADER else self._step_parity
        return (((parity * 3 + kind) * s.replicas + replica) * s.micro_batches + micro_batch) * s.stages + stage

    def _link(self, src: int, dst: int) -> Any:
        """The process group of the directed link from pipeline position ``src`` to ``dst``."""
        return self.links[(src, dst)]

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        """Send ``t`` to pipeline position ``dst`` on its link, as a batch of one (the link group's communicator)."""
        op = dist.P2POp(dist.isend, t, self.peers[dst], group=self._link(self.position, dst), tag=tag)
        self._sends.append((dist.batch_isend_irecv([op])[0], t))

    def _irecv(self, buf: torch.Tensor, src: int, tag: int) -> Any:
        op = dist.P2POp(dist.irecv, buf, self.peers[src], group=self._link(src, self.position), tag=tag)
        return dist.batch_isend_irecv([op])[0]

    def connect(self) -> None:
        """Start every link of this rank before the first step: one small message each way, the links taken in
        one order on every rank (by their lower, then higher position, then direction), each waited for.
        Pairwise meetings in one global order cannot deadlock; NCCL's lazy start of a communicator inside a
        step could (it blocks both ranks until both use it)."""
        mine = [ln for ln in self.schedule.links() if self.position in ln]
        for src, dst in sorted(mine, key=lambda ln: (min(ln), max(ln), ln[0] > ln[1])):
            t = torch.zeros(1, device=self.device)
            if src == self.position:
                op = dist.P2POp(dist.isend, t, self.peers[dst], group=self._link(src, dst), tag=_CONNECT_TAG)
            else:
                op = dist.P2POp(dist.irecv, t, self.peers[src], group=self._link(src, dst), tag=_CONNECT_TAG)
            for w in dist.batch_isend_irecv([op]):
                w.wait()

    def _send_activation(self, a: Action, y: torch.Tensor) -> None:
        direction = self.schedule.direction(a.replica)
        key = (direction, a.stage + 1)
        y = y.detach().contiguous()
        dst = self.schedule.rank_of(a.replica, a.stage + 1)
        if key not in self._shape:  # the receiver cannot know it either: tell it once
            fields = [y.dim(), _DTYPES.index(y.dtype), *y.shape]
            head = torch.tensor(fields + [0] * (_HEADER_LEN - len(fields)), dtype=torch.int64, device=y.device)
            self._isend(head, dst, self._tag(_HEADER, direction, 0, a.stage + 1))
            self._shape[key] = (tuple(y.shape), y.dtype)  # also the shape of the gradient coming back
        shape, dtype = self._shape[key]
        if tuple(y.shape) != shape:
            raise RuntimeError(f"stage {a.stage} produced an activation of shape {tuple(y.shape)}, "
                               f"the receiver expects {shape}")
        if y.dtype != dtype:  # e.g. bf16 under autocast where the cut was traced in fp32: send what is expected
            y = y.to(dtype)
        self._note_sent((_ACT, a.replica, a.micro_batch, a.stage + 1))
        self._isend(y, self.schedule.rank_of(a.replica, a.stage + 1), self._tag(_ACT, a.replica, a.micro_batch, a.stage + 1))

    def _message(self, a: Action) -> tuple[int, tuple[int, int, int, int]] | None:
        """(destination position, key) of what an action sends, if anything (:func:`schedules.sends`)."""
        out = sends(a, self.schedule.stages)
        if out is None:
            return None
        kind, stage = out
        return self.schedule.rank_of(a.replica, stage), (kind, a.replica, a.micro_batch, stage)

    def _recv_key(self, a: Action) -> tuple[int, int, int, int] | None:
        """The message an action needs, as (kind, pass, micro-batch, stage), or None (:func:`schedules.receives`)."""
        got = receives(a, self.schedule.stages)
        return None if got is None else (got[0], a.replica, a.micro_batch, got[1])

    def _shape_of(self, key: tuple[int, int, int, int]) -> tuple[tuple[int, ...], torch.dtype] | None:
        kind, replica, _, stage = key
        direction = self.schedule.direction(replica)
        return self._shape.get((direction, stage if kind == _ACT else stage + 1))

    def _read_header(self, key: tuple[int, int, int, int], src: int) -> None:
        kind, replica, _, stage = key
        assert kind == _ACT, "a gradient's shape is known from the forward that sent the activation"
        direction = self.schedule.direction(replica)
        head = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
        with waiting("pipeline transfer"):
            self._irecv(head, src, self._tag(_HEADER, direction, 0, stage)).wait()
        head = head.cpu()  # the first step only, and only for partitions that could not be traced
        ndim = int(head[0])
        self._shape[(direction, stage)] = (tuple(int(v) for v in head[2:2 + ndim]), _DTYPES[int(head[1])])

    def _post(self, key: tuple[int, int, int, int], block: bool) -> bool:
        """Post the irecvs from ``key``'s sender up to ``key``, in the order it sends them.

        A message whose shape is still unknown (first step, untraced partitions)
        needs its header first: read it when ``block`` (the caller needs this
        message now, so the sender is bound to send the header), else stop.
        True when ``key`` is posted.
        """
        src, index = self._src_index[key]
        queue = self._inbox[src]
        while self._next.get(src, 0) <= index:
            k = queue[self._next.get(src, 0)]
            shape = self._shape_of(k)
            if shape is None:
                if not block:
                    return False
                self._read_header(k, src)
                shape = self._shape_of(k)
                assert shape is not None
            kind, replica, mb, stage = k
            buf = torch.empty(shape[0], dtype=shape[1], device=self.device)
            work = self._irecv(buf, src, self._tag(kind, replica, mb, stage))
            self._recvs[k] = (work, buf)
            self._next[src] = self._next.get(src, 0) + 1
        return True

    def _receive(self, key: tuple[int, int, int, int]) -> torch.Tensor:
        t0 = timers.now(self.device)  # on GPUs the compute stream's stall (gems.timers), not the host's launch
        w0 = time.time()
        with waiting("pipeline transfer"):
            self._post(key, block=True)
            work, buf = self._recvs.pop(key)
            work.wait()
        timers.add_since(self.stats.__dict__, "wait_s", t0)
        if self.device.type == "cpu":  # (on GPUs the host's clock sees launches, not transfers)
            self.transfers.received[(self._step, *key)] = (w0, time.time())
        return buf

    def _note_sent(self, key: tuple[int, int, int, int]) -> None:
        if self.device.type == "cpu":
            self.transfers.sent[(self._step, *key)] = time.time()

    def _prefetch(self, actions: Sequence[Action], index: int) -> None:
        """Post receives for the next ``lookahead`` actions that need one."""
        posted = 0
        for a in actions[index:]:
            key = self._recv_key(a)
            if key is None:
                continue
            if not self._post(key, block=False) or (posted := posted + 1) >= self.lookahead:
                break

    def _reap_sends(self, wait: bool = False) -> None:
        if wait:
            with waiting("pipeline transfer"):
                for work, _ in self._sends:
                    work.wait()
            self._sends = []
            return
        self._sends = [(work, t) for work, t in self._sends if not work.is_completed()]

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
                self._send_activation(a, y)
            return
        if a.stage == 0:
            self._finite.append((0, all_finite(x)))
        with batch_context(self._seed, self._step, self._ids[self.chunk_slice(a.replica, a.micro_batch)]):
            if self.checkpoint:
                with torch.no_grad():
                    y = part(x)
                    live = _Live(x)
                    if last:
                        self._loss_total = self._loss_total + self.loss_fn(y, target, self.chunk).detach()
            else:
                if a.stage > 0 and x.is_floating_point():
                    x.requires_grad_(True)
                y = part(x)
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
            self._send_activation(a, y)

    def _backward(self, a: Action, grad: torch.Tensor | None, target: Any) -> None:
        """A backward (``B``), or the input-gradient half of a split one (``I``: the deferrable layers queue
        their weight gradients for the ``W``, :mod:`gems.pipeline.deferred`)."""
        part = self.partitions[a.stage]
        live = self._live.pop((a.replica, a.micro_batch, a.stage))
        x = live.x
        key = (a.replica, a.micro_batch, a.stage)
        defer = deferring(self._weights, key) if a.kind is Kind.I else contextlib.nullcontext()
        with batch_context(self._seed, self._step, self._ids[self.chunk_slice(a.replica, a.micro_batch)]), defer:
            if self.checkpoint:
                saved = [b.detach().clone() for b in part.buffers()]
                x = x.detach()
                if a.stage > 0 and x.is_floating_point():
                    x.requires_grad_(True)
                y = part(x)
                out = self.scale_loss(self.loss_fn(y, target, self.chunk)) if grad is None else y
            else:
                out = self.scale_loss(live.loss) if grad is None and live.loss is not None else live.y
            assert out is not None
            if out.requires_grad:
                torch.autograd.backward(out, grad)
            if self.checkpoint:  # after the backward: autograd saved these buffers and checks their versions
                with torch.no_grad():
                    for b, v in zip(part.buffers(), saved):
                        b.copy_(v)
        if a.stage > 0:
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            self._note_sent((_GRAD, a.replica, a.micro_batch, a.stage - 1))
            self._isend(g, self.schedule.rank_of(a.replica, a.stage - 1),
                        self._tag(_GRAD, a.replica, a.micro_batch, a.stage - 1))

    def step(self, inputs: torch.Tensor | None, targets: Any, sample_ids: Sequence[int], seed: int, step: int) -> float:
        """Forward and backward of one step's share of this line; returns the weighted losses computed here.

        ``inputs`` and ``targets`` are the line's whole share (``batch_size``
        samples, in global order); ranks that run no first stage may pass None
        for ``inputs``, ranks that run no last stage None for ``targets``.
        Gradients accumulate into ``.grad`` of :meth:`parameters`; summing
        them over the mesh's ``grad`` group gives the serial gradient.
        """
        if len(sample_ids) != self.batch_size:
            raise ValueError(f"step() got {len(sample_ids)} sample ids; this line trains on {self.batch_size} per step")
        self._run(self.actions, inputs, targets, sample_ids, seed, step)
        total = self._loss_total
        return scalar(total) if isinstance(total, torch.Tensor) else float(total)

    def evaluate(self, inputs: torch.Tensor | None, targets: Any, sample_ids: Sequence[int],
                 metric: Callable[[torch.Tensor, Any, Sequence[int]], torch.Tensor],
                 batch_statistics: bool = False) -> torch.Tensor | None:
        """A forward of one batch of the line's share, without gradients, in evaluation mode (with
        ``batch_statistics``, the normalisation layers in training mode: gems.layers.evaluation_mode): the
        schedule's forward actions in their order (a subsequence of a deadlock-free order, the activations on the
        same links); returns the sum of ``metric(output, target, sample ids)`` over the last-stage chunks this rank
        ran (None where it runs no last stage)."""
        fwd = [tuple(a for a in order if a.kind.forward) for order in self.schedule.actions]
        saved = self._inbox, self._src_index
        self._inbox, self._src_index = self._inboxes(fwd)
        self._metric, self._metric_total = metric, None
        try:
            with evaluation_mode([self.modules], batch_statistics), torch.no_grad():
                self._run(fwd[self.position], inputs, targets, sample_ids, 0, -1)
        finally:
            self._inbox, self._src_index = saved
            self._metric = None
        return self._metric_total

    def _run(self, actions: Sequence[Action], inputs: torch.Tensor | None, targets: Any, sample_ids: Sequence[int],
             seed: int, step: int) -> None:
        """Run ``actions`` in order, each with the message it needs received first and what it makes sent after."""
        self._seed, self._step, self._ids = seed, step, list(sample_ids)
        self._loss_total = 0.0
        self._finite = []
        self._live: dict[tuple[int, int, int], _Live] = {}
        self._recvs: dict[tuple[int, int, int, int], tuple[Any, torch.Tensor]] = {}
        self._sends = []
        self._next = {}
        last = self.schedule.stages - 1
        for index, a in enumerate(actions):
            self._prefetch(actions, index)
            key = self._recv_key(a)
            received = self._receive(key) if key is not None else None
            sl = self.chunk_slice(a.replica, a.micro_batch)
            target = targets[sl] if a.stage == last and targets is not None else None
            t0 = time.perf_counter()
            mark("forward" if a.kind.forward else "backward")
            if a.kind is Kind.W:  # the weight gradients an I left behind (a split schedule)
                self._weights.run((a.replica, a.micro_batch, a.stage))
                self.stats.backward_s += time.perf_counter() - t0
            elif a.kind.forward:
                if a.stage == 0:
                    if inputs is None:
                        raise ValueError("this rank runs a first stage: step() needs the inputs")
                    x = inputs[sl]
                else:
                    assert received is not None
                    x = received
                self._forward(a, x, target)
                self.stats.forward_s += time.perf_counter() - t0
            else:
                self._backward(a, received, target)
                self.stats.backward_s += time.perf_counter() - t0
            self._reap_sends()
        self._reap_sends(wait=True)
        assert not self._recvs and not self._live and not self._weights.pending, \
            "schedule left messages, activations or weight gradients behind"
        self._step_parity ^= 1
