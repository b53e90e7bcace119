"""What a rank hands to torch.distributed, logged in issue order, and replayed as NCCL would run it.

Every test runs over gloo, which completes orders NCCL can hang on: a gloo receive is a passive buffer that any later
send with its tag fills, while NCCL runs each message as a kernel on its communicator's stream in issue order and
matches a pair's messages by order. :class:`Recorder` logs a rank's calls (``GEMS_COMM_LOG=DIR`` for a whole run);
:func:`replay` runs every rank's log together under NCCL's rules and names what would hang.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from gems import capture

__all__ = ["Recorder", "replay", "OrderError", "load", "install_from_env", "recording", "COLLECTIVES"]

#: the collectives the recorder logs (object collectives log the tensor collectives they are made of)
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "reduce", "gather", "scatter", "barrier", "all_reduce_coalesced")
_P2P = ("isend", "irecv", "send", "recv")


class OrderError(AssertionError):
    """The logged orders would hang or mismatch under NCCL's rules (the message says where)."""


# ---- recording ------------------------------------------------------------------------------------------------
_ACTIVE: list["Recorder"] = []  # the recorders installed in this process


def recording() -> bool:
    """Whether this process's communication is being logged for :func:`replay`: the order it issues then stands
    for an NCCL run's (gems.pipeline.exchange.receive_lead)."""
    return bool(_ACTIVE)


def _comm_of(group: Any) -> tuple[str, tuple[int, ...]]:
    """(name, global ranks) of a process group (None: the default group)."""
    g = group if group is not None else c10d._get_default_group()
    ranks = tuple(dist.get_process_group_ranks(g))
    return str(getattr(g, "group_name", ranks)), ranks


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


class _Work:
    """A work handle that logs the host's ``wait()`` on it (everything else passes through)."""

    def __init__(self, work: Any, ids: list[int], rec: "Recorder") -> None:
        self._work, self._ids, self._rec = work, ids, rec

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._rec._event({"e": "wait", "ids": self._ids})
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@dataclass
class Recorder:
    """Log this process's torch.distributed point-to-point and collective calls in issue order; a context manager.

    Each call's kind, peer, communicator, bytes, dtype and device, the batch it was issued in, and every ``wait()``
    the host makes on its work. A run logs each rank to ``DIR/rank<N>.jsonl`` when ``GEMS_COMM_LOG=DIR`` is set
    (:func:`install_from_env`, called by the worker); a test holds a recorder around the code it checks.
    ``device``: the rank's device; a tensor on another device is a violation (``violations``), raised at
    once with ``strict_device=True``. ``sink``: a file to append each event to as JSON (a hung run still
    leaves its log), else the events stay in ``events``. NCCL takes device tensors only; on CPU ranks every tensor
    is on the CPU, so the device check bites on GPU ranks and fake-GPU dry runs (tests/test_comm_rules.py's static
    check covers the CPU machines).
    """

    device: torch.device | None = None
    strict_device: bool = False
    sink: Path | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    _ids: Iterator[int] = field(default_factory=itertools.count)
    _batches: Iterator[int] = field(default_factory=itertools.count)
    _batch: int | None = None
    _batch_ids: list[int] = field(default_factory=list)
    _saved: list[tuple[Any, str, Any]] = field(default_factory=list)
    _file: Any = None

    # -- install and remove ------------------------------------------------------------------------------------
    def __enter__(self) -> "Recorder":
        if self.sink is not None:
            self.sink.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.sink, "a", buffering=1)
            self._event({"e": "rank", "rank": dist.get_rank() if dist.is_initialized() else 0,
                         "device": None if self.device is None else str(self.device)})
        wrappers: dict[str, Callable[..., Any]] = {"batch_isend_irecv": self._batch_isend_irecv}
        for name in _P2P:
            wrappers[name] = self._p2p(name, getattr(c10d, name))
        for name in COLLECTIVES:
            if hasattr(c10d, name):
                wrappers[name] = self._collective(name, getattr(c10d, name))
        wrappers["destroy_process_group"] = self._destroy(c10d.destroy_process_group)
        for name, fn in wrappers.items():
            for mod in (c10d, dist):
                if hasattr(mod, name):
                    self._saved.append((mod, name, getattr(mod, name)))
                    setattr(mod, name, fn)
        _ACTIVE.append(self)
        capture.LOG_HOOKS.append(self._event)  # a graph's reset, in order with the messages (gems.capture)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE[:] = [r for r in _ACTIVE if r is not self]
        capture.LOG_HOOKS[:] = [h for h in capture.LOG_HOOKS if h != self._event]
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)
        self._saved.clear()
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- events ------------------------------------------------------------------------------------------------
    def _event(self, ev: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(ev) + "\n")
        else:
            self.events.append(ev)

    def _check(self, fn: str, tensors: list[torch.Tensor]) -> str:
        devs = sorted({str(t.device) for t in tensors})
        if self.device is not None:
            bad = [d for d in devs if torch.device(d) != self.device and not d.startswith("meta")]
            if bad:
                msg = f"{fn} got a tensor on {bad[0]}; this rank's device is {self.device}"
                self.violations.append(msg)
                if self.strict_device:
                    raise OrderError(msg)
        return ",".join(devs)

    def _post(self, kind: str, fn: str, group: Any, tensors: list[torch.Tensor], peer: int | None) -> int:
        name, ranks = _comm_of(group)
        me = dist.get_rank()
        if kind == "coll" or self._batch is not None:
            comm = f"g:{name}"  # the group's communicator (collectives and batched point-to-point)
        else:
            assert peer is not None
            comm = f"p:{name}:{min(me, peer)}-{max(me, peer)}"  # the pair's own communicator
            ranks = (min(me, peer), max(me, peer))
        i = next(self._ids)
        if self._batch is not None:
            self._batch_ids.append(i)
        ev = {"e": "post", "id": i, "kind": kind, "fn": fn, "comm": comm, "ranks": list(ranks), "peer": peer,
              "batch": self._batch, "bytes": sum(t.numel() * t.element_size() for t in tensors),
              "dtype": ",".join(sorted({str(t.dtype).replace("torch.", "") for t in tensors})),
              "device": self._check(fn, tensors)}
        link = capture.linked()  # inside a graph: which one, and whether ordered after the launch before it
        if link is not None:
            ev.update(link)
        self._event(ev)
        return i

    def _destroy(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            self._event({"e": "destroy", "graphs_alive": len(capture.GRAPHS)})
            return orig(*args, **kwargs)

        return destroy_process_group

    def _p2p(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        send = name in ("isend", "send")

        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            peer = kwargs.get("dst" if send else "src", args[0] if args else None)
            local = kwargs.get("group_dst" if send else "group_src")
            if peer is None and local is not None:
                peer = dist.get_global_rank(group if group is not None else c10d._get_default_group(), local)
            i = self._post("send" if send else "recv", name, group, [tensor], None if peer is None else int(peer))
            out = orig(tensor, *args, **kwargs)
            if name in ("send", "recv"):  # blocking
                self._event({"e": "wait", "ids": [i]})
                return out
            return out if self._batch is not None else _Work(out, [i], self)

        wrapper.__name__ = name
        return wrapper

    def _batch_isend_irecv(self, ops: list[Any]) -> list[Any]:
        """One batch: its operations start together and, under NCCL, one work covers them all, so a wait on
        any of them waits for the whole batch."""
        orig = next(fn for mod, name, fn in self._saved if mod is c10d and name == "batch_isend_irecv")
        self._batch, self._batch_ids = next(self._batches), []
        try:
            works = orig(ops)
            ids = list(self._batch_ids)
        finally:
            self._batch = None
        return [_Work(w, ids, self) for w in works]

    def _collective(self, name: str, orig: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if group is None:
                group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            i = self._post("coll", name, group, _tensors(list(args) + list(kwargs.values())), None)
            out = orig(*args, **kwargs)
            if out is None or not kwargs.get("async_op", False):
                self._event({"e": "wait", "ids": [i]})
                return out
            return _Work(out, [i], self)

        wrapper.__name__ = name
        return wrapper


def install_from_env(rank: int, device: torch.device | None) -> contextlib.AbstractContextManager[Any]:
    """The recorder of ``GEMS_COMM_LOG=DIR`` for this rank (``DIR/rank<N>.jsonl``), or a no-op without it."""
    where = os.environ.get("GEMS_COMM_LOG")
    if not where:
        return contextlib.nullcontext()
    return Recorder(device=device, sink=Path(where) / f"rank{rank}.jsonl")


def load(folder: str | Path) -> dict[int, list[dict[str, Any]]]:
    """The logs a run wrote with ``GEMS_COMM_LOG=folder``, by rank."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(Path(folder).glob("rank*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rank = next((e["rank"] for e in events if e.get("e") == "rank"), int(path.stem[4:]))
        out[int(rank)] = events
    return out


# ---- replaying ------------------------------------------------------------------------------------------------
@dataclass
class _Op:
    rank: int
    id: int
    kind: str  # send | recv | coll
    fn: str
    comm: str
    ranks: tuple[int, ...]
    peer: int | None
    nbytes: int
    dtype: str
    seq: int = 0  # the k of "k-th message of this pair on this communicator", or of this collective
    started: bool = False
    done: bool = False

    def __str__(self) -> str:
        what = f"{self.fn} {'to' if self.kind == 'send' else 'from'} rank {self.peer}" if self.kind != "coll" \
            else f"{self.fn} #{self.seq} over ranks {list(self.ranks)}"
        return f"{what} ({self.nbytes} bytes, {self.comm})"


@dataclass(eq=False)
class _Entry:
    """What a rank's streams run as one: an operation, or every operation of one batch; it waits to be at the
    head of each stream it is on (its communicator's and the pair stream of every peer it involves)."""

    ops: list[_Op]
    streams: list[tuple[int, str]] = field(default_factory=list)
    #: what must be done before it starts beside its streams' order: a graph's last chained launch, for the eager
    #: work issued after that graph (its capture's end joined the chain: rule 8 of :func:`replay`)
    after: list["_Entry"] = field(default_factory=list)

    def __str__(self) -> str:
        return str(self.ops[0]) + (f" and {len(self.ops) - 1} more in its batch" if len(self.ops) > 1 else "")


class _Replay:
    """The state of one replay: every rank's host position in its log, each stream's queue of entries (one per
    rank and communicator, one per pair of ranks: see :func:`replay`), and the operations matched by order."""

    def __init__(self, logs: dict[int, list[dict[str, Any]]], strict_sends: bool) -> None:
        self.logs, self.strict = logs, strict_sends
        self.ops: dict[tuple[int, int], _Op] = {}
        self.host = {r: 0 for r in logs}
        self.streams: dict[tuple[int, str], deque[_Entry]] = {}
        self.open_batch: dict[int, tuple[Any, _Entry]] = {}  # rank -> (batch id, its entry): the batch it issues
        self.counters: dict[tuple[Any, ...], int] = {}
        self.sends: dict[tuple[str, int, int, int], _Op] = {}
        self.recvs: dict[tuple[str, int, int, int], _Op] = {}
        self.colls: dict[tuple[str, int, int], _Op] = {}
        self.first_use: dict[tuple[str, int], _Op] = {}
        self.chained: dict[int, _Entry] = {}  # rank -> its last launch inside a graph (rule 8 of replay)

    # ---- issuing ----------------------------------------------------------------------------------------------
    def post(self, r: int, ev: dict[str, Any]) -> None:
        """Rank ``r``'s host issues an operation: it joins the streams of its communicator and of its peers (with
        the rest of its batch) and gets its place in the order its pair (or its communicator's collectives)
        match by."""
        op = _Op(r, int(ev["id"]), ev["kind"], ev["fn"], ev["comm"], tuple(ev["ranks"]), ev.get("peer"),
                 int(ev["bytes"]), str(ev.get("dtype", "")))
        if op.kind == "coll":
            key: tuple[Any, ...] = ("c", op.comm, r)
        else:
            assert op.peer is not None, f"rank {r}: {op.fn} from any source cannot be replayed"
            src, dst = (r, op.peer) if op.kind == "send" else (op.peer, r)
            key = (op.kind, op.comm, src, dst)
        op.seq = self.counters.get(key, 0)
        self.counters[key] = op.seq + 1
        if op.kind == "coll":
            self.colls[(op.comm, r, op.seq)] = op
        elif op.kind == "send":
            self.sends[(op.comm, r, op.peer, op.seq)] = op  # type: ignore[index]
        else:
            self.recvs[(op.comm, op.peer, r, op.seq)] = op  # type: ignore[index]
        self.first_use.setdefault((op.comm, r), op)
        self.ops[(r, op.id)] = op
        b = ev.get("batch")
        opened = self.open_batch.get(r)
        if b is not None and opened is not None and opened[0] == b:
            entry = opened[1]
            entry.ops.append(op)
        else:
            entry = _Entry([op])
            if b is not None:
                self.open_batch[r] = (b, entry)
            else:
                self.open_batch.pop(r, None)
        for stream in self.streams_of(r, op, ev, entry):
            if stream not in entry.streams:  # a batch's ops are issued together: it is the tail of each stream
                entry.streams.append(stream)
                self.streams.setdefault(stream, deque()).append(entry)

    def streams_of(self, r: int, op: _Op, ev: dict[str, Any], entry: _Entry) -> list[tuple[int, str]]:
        """The streams rank ``r``'s operation runs on: its communicator's and a pair stream a peer (rules 1-2), and
        inside a graph the rank's one chain (rule 8), which the eager work issued after the graph follows."""
        peers = [m for m in op.ranks if m != r] if op.kind == "coll" else [int(op.peer or 0)]
        out = [(r, f"comm {op.comm}")] + [(r, f"pair {min(r, p)}-{max(r, p)}") for p in peers]
        if ev.get("graph") is not None and ev.get("chained"):
            self.chained[r] = entry
            out.append((r, "graph chain"))
        elif ev.get("graph") is None and r in self.chained and self.chained[r] not in entry.after:
            entry.after.append(self.chained[r])
        return out

    def advance_hosts(self) -> bool:
        """Every host issues what it can: up to its next wait for an operation not done yet."""
        moved = False
        for r, events in self.logs.items():
            while self.host[r] < len(events):
                ev = events[self.host[r]]
                if ev["e"] == "post":
                    self.post(r, ev)
                elif ev["e"] == "wait" and not all(self.ops[(r, int(i))].done for i in ev["ids"]
                                                   if (r, int(i)) in self.ops):
                    break
                self.host[r] += 1
                moved = True
        return moved

    # ---- running ----------------------------------------------------------------------------------------------
    def started(self, op: _Op) -> bool:
        """Lazy initialisation: an operation starts once every member has issued something on its communicator."""
        return all((op.comm, m) in self.first_use for m in op.ranks)

    def match_of(self, op: _Op) -> _Op | None:
        if op.kind == "send":
            return self.recvs.get((op.comm, op.rank, op.peer, op.seq))  # type: ignore[arg-type]
        return self.sends.get((op.comm, op.peer, op.rank, op.seq))  # type: ignore[arg-type]

    def complete_collective(self, op: _Op) -> bool:
        peers = [self.colls.get((op.comm, m, op.seq)) for m in op.ranks]
        if not all(p is not None and p.started for p in peers):
            return False
        fns = {p.fn for p in peers if p is not None}
        if len(fns) > 1:
            raise OrderError(f"collective #{op.seq} on {op.comm}: ranks issued different collectives "
                             f"({', '.join(sorted(fns))})")
        for p in peers:
            assert p is not None
            p.done = True
        return True

    def complete_message(self, op: _Op) -> bool:
        other = self.match_of(op)
        if other is None or not other.started:
            if op.kind == "send" and not self.strict:  # a lenient send completes once it starts
                op.done = True
                return True
            return False
        if (other.nbytes, other.dtype) != (op.nbytes, op.dtype):
            s, rv = (op, other) if op.kind == "send" else (other, op)
            raise OrderError(f"message #{s.seq} from rank {s.rank} to rank {rv.rank} on {s.comm}: sent {s.nbytes} "
                             f"bytes of {s.dtype}, received into {rv.nbytes} bytes of {rv.dtype} (NCCL matches "
                             "messages by order, not by tag)")
        op.done = True
        if self.strict or other.kind == "send":
            other.done = True
        return True

    def advance_streams(self) -> bool:
        """Every entry at the head of all its streams runs: its operations start, and complete as their peers
        allow; a finished entry leaves its streams."""
        moved = False
        heads = {id(q[0]): q[0] for q in self.streams.values() if q}
        for entry in heads.values():
            if not all(self.streams[s][0] is entry for s in entry.streams) or \
                    not all(op.done for e in entry.after for op in e.ops):
                continue
            for op in entry.ops:
                if not op.started and self.started(op):
                    op.started = moved = True
            for op in entry.ops:
                if not op.done and op.started:
                    done = self.complete_collective(op) if op.kind == "coll" else self.complete_message(op)
                    moved = moved or done
            if all(op.done for op in entry.ops):
                for s in entry.streams:
                    self.streams[s].popleft()
                moved = True
        return moved

    # ---- the verdict -------------------------------------------------------------------------------------------
    def stuck(self) -> str | None:
        """Where the orders hang, rank by rank, or None when every host and stream ran to the end."""
        waiting = {r: events[self.host[r]] for r, events in self.logs.items() if self.host[r] < len(events)}
        pending = {k: q for k, q in self.streams.items() if q}
        if not waiting and not pending:
            return None
        lines = []
        for r in sorted(self.logs):
            if r in waiting:
                ev = waiting[r]
                ops = [self.ops[(r, int(i))] for i in ev.get("ids", []) if (r, int(i)) in self.ops]
                names = [str(op) for op in ops if not op.done]
                lines.append(f"rank {r} waits (host) for {'; '.join(names[:2]) or ev}")
            for (rr, name), q in sorted(pending.items()):
                if rr == r:
                    lines.append(f"rank {r} {name} stream is held by {q[0]}"
                                 + (f", with {len(q) - 1} behind it" if len(q) > 1 else ""))
        return "under NCCL's rules these orders hang:\n  " + "\n  ".join(lines)


def replay(logs: dict[int, list[dict[str, Any]]], strict_sends: bool = False) -> dict[str, int]:
    """Run the logged orders of all ranks together under NCCL's rules; raise :class:`OrderError` naming the stuck
    ranks and what each waits for, or a mismatch (sizes or dtypes of a pair's k-th message, collectives issued in
    different orders, a message nobody receives), else return counts of what ran (``ops``, ``messages``,
    ``collectives``).

    The rules are the least NCCL promises (a replay more lenient than the hardware passed a runtime that hung on a
    GPU; docs/design.md, "Rules of the GPU path"):

    1. What a rank issues on a communicator runs in issue order. torch's ProcessGroupNCCL runs collectives and
       ``batch_isend_irecv`` on the group's communicator, and a lone ``isend``/``irecv`` on a communicator of its
       own for the pair (per group). Communicators start when every member first uses them (lazily).
    2. CUDA does not promise that two streams progress independently (NVIDIA/nccl issue 783), so what a rank
       issues towards one peer also runs in issue order across all its communicators: an operation waits until it
       is at the head of its communicator's stream and of the pair stream of every peer it involves (a
       collective: every other member). A receive holds everything the rank issued after it towards that peer.
    3. The operations of one ``batch_isend_irecv`` are one group: they start together and end when all have.
       Nothing else is grouped.
    4. The k-th send from rank a to rank b on a communicator meets the k-th receive on b from a there; their
       bytes and dtypes must agree.
    5. A receive holds its streams until the matching send has started; a send completes once it starts, or with
       ``strict_sends`` only once its receive has started too (as NCCL does for messages larger than its
       buffers: the rule gems's runtime is checked under).
    6. A collective completes when every member of the communicator has started it; members must issue the same
       collectives in the same order.
    7. The host blocks where it called ``wait()`` (as gloo does; NCCL's ``wait`` only orders streams, so this
       only adds waits: an order that passes here also passes without them).
    8. Inside a CUDA graph a rank's launches run in one order, each once the one before it is done (the chain of
       gems.capture.launch: a replay issues them as the graph does, not on the eager streams alone), and the eager
       work it issues after the graph waits for the graph's last launch (the capture's end joins the chain). An
       order whose cycle of waits only this serialisation closes hangs here as it would in the graph.
    """
    unordered(logs)
    run = _Replay(logs, strict_sends)
    while run.advance_hosts() | run.advance_streams():
        pass
    hang = run.stuck()
    if hang:
        raise OrderError(hang)
    unmatched = [op for op in run.ops.values() if op.kind == "send" and run.match_of(op) is None]
    if unmatched:
        raise OrderError(f"{len(unmatched)} message(s) nobody receives, the first {unmatched[0]} from rank "
                         f"{unmatched[0].rank}: under NCCL it would be matched with a later receive")
    ops = run.ops.values()
    return {"ops": len(run.ops), "messages": sum(op.kind == "send" for op in ops),
            "collectives": sum(op.kind == "coll" for op in ops)}


def unordered(logs: dict[int, list[dict[str, Any]]]) -> None:
    """Raise :class:`OrderError` where a rank launched NCCL work inside a CUDA graph without ordering it after its
    launch before (gems.capture.launch): in a replay the graph's kernels run in the order of its dependencies
    only, so two such launches on different communicators may run concurrently, or in one order on one rank and
    the other on another, where NCCL promises no progress (NVIDIA/nccl#783). Eagerly the issue order is the
    stream's; inside a graph nothing is assumed that an edge does not make."""
    for r, events in sorted(logs.items()):
        for ev in events:
            if ev.get("e") == "post" and ev.get("graph") is not None and not ev.get("chained"):
                raise OrderError(f"rank {r} launched {ev['fn']} on {ev['comm']} (post {ev['id']}) inside CUDA graph "
                                 f"{ev['graph']} without an order after its launch before (gems.capture.launch): in "
                                 "a replay it may run concurrently with NCCL work on another communicator, or in "
                                 "another order on another rank")


def records(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The post events of a log (what was issued), in order."""
    return [e for e in events if e.get("e") == "post"]
