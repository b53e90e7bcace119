"""What code inside a CUDA graph's capture keeps to, and what a rank that made graphs does before NCCL's teardown.

Three rules (docs/gpu.md, "Graphs and NCCL"): 1. every NCCL launch inside a graph is chained after the one before it
(:func:`launch`); 2. no stream is recorded on a tensor inside a capture (:func:`keep`); 3. every graph is reset before
the process groups are destroyed (:func:`made`, :func:`release`). They live here, below the strategies and the step
that launch such work, so that all keep them alike. On a CPU rank's stand-in (GEMS_CPU_GRAPH_STAND_IN) the launches
are marked chained and the resets logged in order with the messages (gems.commlog, :class:`StandInGraph`).
"""
from __future__ import annotations

import contextlib
import gc
import itertools
import os
from typing import Any, Callable, Iterator

import torch

#: what gems.commlog logs when a graph is reset and when the process groups are destroyed (tests read the order)
LOG_HOOKS: list[Callable[[dict[str, Any]], None]] = []


class _Region:
    """One graph's capture (or the stand-in's run of it): its chain stream, the tensors held to its end."""

    def __init__(self, number: int, device: torch.device, api: Any) -> None:
        self.number, self.device, self.api = number, device, api
        self.chain: Any = None  # the chain stream (CUDA), made at the region's first launch
        self.held: list[torch.Tensor] = []
        self.launches = 0


_numbers = itertools.count()
#: the region under way (one capture at a time in a process: the capture holds gems.rank.graphs.CUDA_WORK); a
#: process-wide value, not a thread's: a GPU's backward runs in autograd's device thread, whose NCCL launches (the
#: gradient sums at their points) belong to the capture as much as the forward's
_REGION: list[_Region] = []
#: whether a launch is being issued through :func:`launch` (gems.commlog marks its posts chained)
_LAUNCHING: list[bool] = [False]


@contextlib.contextmanager
def region(device: torch.device, api: Any = None) -> Iterator[None]:
    """A graph's capture (``api``: ``torch.cuda``, or a mock of it) or the stand-in's run of one (``api`` None):
    NCCL launches inside it are chained (:func:`launch`), tensors kept (:func:`keep`). At its end the current
    stream joins the chain, then the held tensors go (every stream forked in a capture must join it)."""
    r = _Region(next(_numbers), device, api)
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


def launch(issue: Callable[[], Any]) -> Any:
    """``issue()`` (a call to torch.distributed that launches NCCL work; its works or None), in one order with every
    other launch of the rank inside a graph (rule 1 of the module docstring); outside a graph it is just called."""
    if not _REGION:
        return issue()
    r = _REGION[-1]
    r.launches += 1
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


def keep(t: torch.Tensor, stream: Any) -> None:
    """``t`` is used on ``stream`` as well as where it was made: eagerly ``record_stream``; inside a graph the
    region holds it to its end instead (rule 2 of the module docstring)."""
    if _REGION:
        _REGION[-1].held.append(t)
    else:
        t.record_stream(stream)


def avoid_record_streams() -> None:
    """Before a GPU rank's process groups are made, where its step may be graphed: ProcessGroupNCCL keeps a
    collective's tensors in its work instead of recording its stream on them (rule 2). A value the user set stays."""
    os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")


# ---------------------------------------------------------------------------- graphs released before teardown
#: every graph this process made and has not released (CUDA graphs, the stand-in's)
GRAPHS: list[Any] = []


def made(graph: Any) -> Any:
    """Register a graph the rank made (before its capture begins: a capture that fails still leaves one to reset)."""
    GRAPHS.append(graph)
    return graph


def reset(graph: Any) -> None:
    """Reset one graph now (a capture that failed after it began) and forget it."""
    try:
        graph.reset()
    finally:
        GRAPHS[:] = [g for g in GRAPHS if g is not graph]


def release(device: torch.device | None, api: Any = None, waiting: Callable[[], Any] | None = None) -> int:
    """Before a rank destroys its process groups (rule 3): its device's queue finished (``waiting()``: the watchdog's
    phase for it), every graph it made reset and forgotten, and the garbage collected (a cycle or a traceback may
    hold a graph object: reset, it holds nothing of NCCL's). Returns how many graphs were reset."""
    if not GRAPHS:
        return 0
    api = api if api is not None else (torch.cuda if device is not None and device.type == "cuda" else None)
    if api is not None:
        with waiting() if waiting is not None else contextlib.nullcontext():
            api.synchronize(device)
    graphs, GRAPHS[:] = list(GRAPHS), []
    for g in graphs:
        g.reset()
    n = len(graphs)
    del graphs
    gc.collect()
    return n


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
