"""What code inside a CUDA graph's capture keeps to, and what a rank that made graphs does before NCCL's teardown.

Three rules (docs/gpu.md, "Graphs and NCCL"): 1. every NCCL launch inside a graph is chained after the one before it
(:func:`launch`); 2. no stream is recorded on a tensor inside a capture, which is held until its streams join instead
(:func:`keep`, :func:`join`); 3. every graph is registered the moment it exists, reset on any failure of its capture
and before the process groups end (:func:`made`, :func:`guarded`, :func:`release`; :func:`alive` names any still
alive where the teardown waits). They live here, below the strategies and the step that launch such work, so that all
keep them alike. On a CPU rank's stand-in (GEMS_CPU_GRAPH_STAND_IN) the launches are marked chained and the resets
logged in order with the messages (gems.commlog, :class:`StandInGraph`).
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

#: what gems.commlog logs when a graph is reset and when the process groups are destroyed (tests read the order)
LOG_HOOKS: list[Callable[[dict[str, Any]], None]] = []


class _Region:
    """One graph's capture (or the stand-in's run of it): its chain stream, the tensors it holds (each with the streams
    it was made on and is used on: :func:`keep`), the graph it captures (None: a stand-in's replay)."""

    def __init__(self, number: int, device: torch.device, api: Any, graph: Any) -> None:
        self.number, self.device, self.api, self.graph = number, device, api, graph
        self.chain: Any = None  # the chain stream (CUDA), made at the region's first launch
        self.held: list[tuple[torch.Tensor, Any, Any]] = []
        self.launches = 0


_numbers = itertools.count()
#: the region under way (one capture at a time in a process: the capture holds gems.rank.graphs.CUDA_WORK); a
#: process-wide value, not a thread's: a GPU's backward runs in autograd's device thread, whose NCCL launches (the
#: gradient sums at their points) belong to the capture as much as the forward's
_REGION: list[_Region] = []
#: whether a launch is being issued through :func:`launch` (gems.commlog marks its posts chained)
_LAUNCHING: list[bool] = [False]


@contextlib.contextmanager
def region(device: torch.device, api: Any = None, graph: Any = None) -> Iterator[None]:
    """A graph's capture (``api``: ``torch.cuda``, or a mock of it) or the stand-in's run of one (``api`` None):
    NCCL launches inside it are chained (:func:`launch`; ``graph``: the graph captured, which is told the
    communicators of its launches), tensors kept (:func:`keep`). At its end the current stream joins the chain, then
    the held tensors go (every stream forked in a capture must join it)."""
    r = _Region(next(_numbers), device, api, graph)
    _REGION.append(r)
    try:
        yield
        if r.chain is not None:  # (after a failure the capture is lost anyway: nothing more is asked of CUDA)
            r.api.current_stream(r.device).wait_stream(r.chain)
    finally:
        _REGION.remove(r)
        r.held.clear()


def in_graph() -> bool:
    """Whether a graph's capture (or the stand-in's run of one) is under way."""
    return bool(_REGION)


def linked() -> dict[str, Any] | None:
    """For gems.commlog's post of a launch: None outside a graph, else the graph's number and whether the launch
    came through :func:`launch` (ordered after the one before it)."""
    if not _REGION:
        return None
    return {"graph": _REGION[-1].number, "chained": _LAUNCHING[0]}


def _works(out: Any) -> list[Any]:
    if out is None:
        return []
    if isinstance(out, (list, tuple)):
        return [w for w in out if w is not None]
    return [out]


def launch(issue: Callable[[], Any], group: Any) -> Any:
    """``issue()`` (a call to torch.distributed that launches NCCL work on ``group``, None for the world; its works or
    None), in one order with every other launch of the rank inside a graph (rule 1 of the module docstring); outside a
    graph it is just called."""
    if not _REGION:
        return issue()
    r = _REGION[-1]
    r.launches += 1
    if r.graph is not None:  # what the graph holds NCCL work of (named where a teardown waits for it: alive)
        comms = _about(r.graph).comms
        name = communicator(group)
        if name not in comms:
            comms.append(name)
    _LAUNCHING[0] = True
    try:
        if r.api is None:  # the stand-in: the launch is marked, gloo runs it as eagerly
            return issue()
        api = r.api
        current = api.current_stream(r.device)
        if r.chain is None:
            r.chain = api.Stream(device=r.device)
        r.chain.wait_stream(current)  # the launch's inputs, ready on the issuing stream
        with api.stream(r.chain):
            out = issue()
            works = _works(out)
            for w in works:  # the chain waits for this launch's completion: the next launch depends on it
                w.wait()
        if not works:  # a blocking call: its result is the issuing stream's at once
            current.wait_stream(r.chain)
        return out
    finally:
        _LAUNCHING[0] = False


def communicator(group: Any) -> str:
    """A process group in words: its ranks (None: the world)."""
    if group is None:
        return "the world"
    import torch.distributed as dist

    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, KeyError):  # (a group this rank is not in, a test's stand-in object)
        return str(getattr(group, "group_name", group))
    return "the group of ranks " + ", ".join(str(r) for r in ranks)


def keep(t: torch.Tensor, stream: Any, made_on: Any) -> None:
    """``t``, made on ``made_on``, is used on ``stream`` too: eagerly ``record_stream``; inside a graph the region
    holds it until ``made_on`` joins ``stream`` (:func:`join`), or to its end (rule 2 of the module docstring)."""
    if _REGION:
        _REGION[-1].held.append((t, made_on, stream))
    else:
        t.record_stream(stream)


def join(waiter: Any, waited: Any) -> None:
    """``waiter.wait_stream(waited)``; inside a graph the tensors made on ``waiter`` and held for their use on
    ``waited`` go: their memory's next use on ``waiter`` follows that use (rule 2), so the pool takes it back inside
    the capture as the eager step's allocator does."""
    waiter.wait_stream(waited)
    if _REGION:
        r = _REGION[-1]
        r.held = [h for h in r.held if not (h[1] == waiter and h[2] == waited)]


def avoid_record_streams() -> None:
    """Before a GPU rank's process groups are made, where its step may be graphed: ProcessGroupNCCL keeps a
    collective's tensors in its work instead of recording its stream on them (rule 2). A value the user set stays."""
    os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")


# ---------------------------------------------------------------------------- graphs released before teardown
#: every graph this process made and has not released (CUDA graphs, the stand-in's): what :func:`release` resets
GRAPHS: list[Any] = []


@dataclass
class _About:
    """What a graph is, the communicators whose NCCL work its capture launched, and whether it was reset."""

    what: str
    comms: list[str] = field(default_factory=list)
    reset: bool = False


#: every graph made or captured here that is still an object (the registry aside: one held back from it, or kept by
#: a traceback, is found here too)
_ABOUT: weakref.WeakKeyDictionary[Any, _About] = weakref.WeakKeyDictionary()


def _about(graph: Any) -> _About:
    try:
        return _ABOUT.setdefault(graph, _About(str(getattr(graph, "what", type(graph).__name__))))
    except TypeError:  # an object without weak references (a test's mock): nothing to remember it by
        return _About(type(graph).__name__)


def made(graph: Any, what: str = "a graph") -> Any:
    """Register a graph the moment it exists (before its capture begins: a capture that fails still leaves one to
    reset); ``what`` names it where a teardown waits for it (:func:`alive`)."""
    GRAPHS.append(graph)
    _about(graph).what = what
    return graph


def reset(graph: Any) -> bool:
    """Reset one graph now and forget it. False where its reset raised: it stays registered, and :func:`alive`
    names it (the error that led here is the one worth raising)."""
    try:
        graph.reset()
    except Exception:
        return False
    _about(graph).reset = True
    GRAPHS[:] = [g for g in GRAPHS if g is not graph]
    return True


@contextlib.contextmanager
def guarded(*graphs: Any) -> Iterator[None]:
    """The capture of ``graphs`` (each registered by :func:`made`): the garbage collector off meanwhile, and on any
    exception every one of them reset before the error leaves. In torch a graph exists once ``cudaStreamEndCapture``
    succeeds, before ``instantiate()`` (which may still fail inside ``capture_end``), and a traceback would keep it
    alive; its ``reset()`` frees only what it holds, whatever state the capture left (a failed ``capture_end``
    included: no allocator call then), so it is always called."""
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    except BaseException:
        for g in graphs:
            reset(g)
        raise
    finally:
        if collecting:
            gc.enable()


@contextlib.contextmanager
def captured(graph: Any, device: torch.device, api: Any, **begin: Any) -> Iterator[None]:
    """One graph's capture on the current stream (CUDA's thread-local mode; ``begin``: more of ``capture_begin``'s
    arguments, a pool): its NCCL launches chained (:func:`region`), and ``capture_end`` always called (it ends the
    stream's capture after a failure inside it too). Inside :func:`guarded`."""
    graph.capture_begin(capture_error_mode="thread_local", **begin)
    try:
        with region(device, api, graph):
            yield
    finally:
        graph.capture_end()


#: the device errors :func:`release` met (the rank then ends its process groups by abort: gems.worker.end_rank)
DEVICE_ERRORS: list[str] = []


def release(device: torch.device | None, api: Any = None, waiting: Callable[[], Any] | None = None) -> int:
    """Before a rank ends its process groups (rule 3): its device's queue finished (``waiting()``: the watchdog's
    phase for it), every graph it made reset and forgotten, even where the device reports an error (NCCL's abort
    waits for live graphs too), and the garbage collected (a cycle or a traceback may hold a graph object: reset, it
    holds nothing of NCCL's). The device's error is raised after the resets (and kept: :data:`DEVICE_ERRORS`).
    Returns how many graphs were reset."""
    if not GRAPHS:
        return 0
    api = api if api is not None else (torch.cuda if device is not None and device.type == "cuda" else None)
    failed: Exception | None = None
    if api is not None:
        try:
            with waiting() if waiting is not None else contextlib.nullcontext():
                api.synchronize(device)
        except Exception as e:  # a device in error cannot finish its queue: its graphs are reset all the same
            failed = e
            DEVICE_ERRORS.append(f"{type(e).__name__}: {str(e).strip()[:200]}")
    n = sum(reset(g) for g in list(GRAPHS))
    gc.collect()
    if failed is not None:
        raise failed
    return n


def alive() -> list[str]:
    """Every graph made or captured here that is still an object and was not reset, in words: what it is, the
    communicators it holds NCCL work of, and whether the registry has lost it (what a teardown that waits names)."""
    out = []
    for graph, about in list(_ABOUT.items()):
        if about.reset or not getattr(graph, "live", True):
            continue
        comms = f" holding NCCL work of {'; '.join(about.comms)}" if about.comms else " (no NCCL work captured)"
        lost = "" if any(g is graph for g in GRAPHS) else ", not in the registry"
        out.append(f"{about.what}{comms}{lost}")
    return out


def holding() -> bool:
    """Whether a graph holding NCCL work is alive (:func:`alive`): what NCCL's teardown waits for (the stand-in's
    teardown waits on it as NCCL's does: gems.worker)."""
    return any(a.comms and not a.reset and getattr(g, "live", True) for g, a in list(_ABOUT.items()))


class StandInGraph:
    """The stand-in's graph object (a CPU rank): what a CUDA graph is to the teardown, its reset logged."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.live = True

    def reset(self) -> None:
        if self.live:
            self.live = False
            for hook in LOG_HOOKS:
                hook({"e": "graph_reset", "what": self.what})
