"""CUDA graphs on GPU ranks (``train.cuda_graphs``): the plain path's forward and backward replayed from graphs.

A small step on a GPU is launches: CosmoFlow's MLPerf model at one sample is about 130 kernels forward and
backward, each paid 10-25 µs of Python, dispatcher and driver time (gems plan's 25 µs an op). A CUDA graph replays
them as one launch. gems graphs the model with ``torch.cuda.make_graphed_callables``, not a capture of the whole
step: the model's forward and its backward become two graphs inside one autograd function, and everything around
them stays as it is, eager and one order on every rank by construction: the loss (a few ops), fp16's scaling and
its skipped steps, the gradient sums (gems.replication: every bucket started after the backward, in bucket order;
their overlap with the backward needs hooks inside the model, which a replay does not run), the optimizer, the
watchdog's marks and the step's timing. torch.compile's ``reduce-overhead`` was the other candidate: it would
compile the model's kernels anew (other kernels than eager's, so not bit-equal to the eager step) and needs a
compile per shape; a graph of the eager kernels keeps the step exact.

What a replay must see, and how it is kept:

* **inputs** go through the graph's one static input, copied on the step's stream from the batch the reader's
  side stream made (one device copy a step; the reader's batches stay its own, ``data.prefetch`` deep);
* **dropout** (gems.layers.SampleDropout): its masks are functions of (seed, step, sample), which a replay cannot
  draw; each dropout layer reads a static mask, drawn before every replay with the eager layer's generators;
* **state the capture touches**: make_graphed_callables runs the model a few times before it captures (warm-up),
  which moves BatchNorm's running statistics; every buffer and the device's generator are put back afterwards,
  so the first graphed step starts from the state the eager step would;
* **shapes**: one graph a batch shape; a step whose input has another shape runs eager.

Where a graph is not taken, the run says why in its notes and runs eager: CPU ranks (no CUDA graphs), a pipeline
(its stages exchange messages between their pieces), spatial parts (halos inside the layers), recomputation
(``parallel.checkpoint``: the forward runs again inside the backward), hooks on the model (a fault injection's:
a replay would skip them), or a capture that failed (its error is in the note). The reader ahead pauses while the
model is captured (:data:`CUDA_WORK`). What CPU tests check (tests/test_graphs.py): the decision, and the
whole protocol around the capture, with a stand-in for make_graphed_callables that runs the same warm-up and
returns the eager module (``GEMS_CPU_GRAPH_STAND_IN=1``): a graphed run equals the eager one bit for bit, dropout,
BatchNorm and R = 2 included. What only a GPU shows: the capture itself, the replay's speed, and its results equal
to eager's (scripts/gpu_check.sh runs the same comparison).
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, Sequence

import torch
from torch import nn

from gems.layers import SampleDropout, batch_context

#: on a CPU rank, graph with a stand-in for make_graphed_callables (its warm-up, no graph): the protocol's test hook
STAND_IN_ENV = "GEMS_CPU_GRAPH_STAND_IN"
WARMUP_ITERS = 3
#: held by a thread that issues CUDA work beside the step (the reader ahead: gems.rank.data.Prefetcher, which pins,
#: allocates, copies and draws on its side stream) and by a capture: torch captures in CUDA's global mode, where
#: another thread's allocation or event query while a stream captures fails the capture (or that thread's call)
CUDA_WORK = threading.RLock()


def decide(cfg: Any, settings: Any, mesh: Any, device: torch.device) -> tuple[bool, str | None]:
    """(whether this rank's step replays graphs, a note saying why not where it would have). ``train.cuda_graphs``:
    auto (GPU ranks on the plain path: no pipeline, no spatial parts, no recomputation) or false."""
    if not bool(cfg.train.cuda_graphs):
        return False, None
    stand_in = device.type == "cpu" and os.environ.get(STAND_IN_ENV) == "1"
    if device.type != "cuda" and not stand_in:
        return False, None  # CPU ranks have no CUDA graphs (gems plan and the docs say so; nothing to note a run)
    why = None
    if settings.pipelined:
        why = "a pipeline's stages exchange messages between their pieces (graphs of the pieces are not built yet)"
    elif mesh.spatial > 1:
        why = "spatial parts exchange halos inside their layers"
    elif bool(cfg.parallel.checkpoint):
        why = "recomputation (parallel.checkpoint) runs the forward again inside the backward"
    return (True, None) if why is None else (False, f"train.cuda_graphs: the step runs eager: {why}")


def stand_in_graphed(module: nn.Module, sample_args: tuple[torch.Tensor, ...],
                     num_warmup_iters: int = WARMUP_ITERS) -> nn.Module:
    """make_graphed_callables on a CPU, for the protocol's tests: the same checks (no hooks on the module, no buffer
    that requires a gradient, every parameter used), the same warm-up (forwards and ``torch.autograd.grad`` over
    the parameters, which moves BatchNorm's statistics as the real one does), and the eager module back."""
    if module._backward_hooks or module._forward_hooks or module._forward_pre_hooks:
        raise AssertionError("Modules must not have hooks registered at the time they are passed.")
    if any(b.requires_grad for b in module.buffers()):
        raise AssertionError("only parameters may be trainable. All buffers must have requires_grad=False.")
    params = [p for p in module.parameters() if p.requires_grad]
    for _ in range(num_warmup_iters):
        out = module(*sample_args)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if o.requires_grad]
        torch.autograd.grad(outs, params, [torch.ones_like(o) for o in outs], allow_unused=False)
    return module


class GraphedModel:
    """The plain path's model replayed from CUDA graphs (module docstring); :meth:`forward` in place of the
    model's call in the step."""

    def __init__(self, seq: nn.Sequential, amp: Callable[..., Any], notes: list[str],
                 make: Callable[..., nn.Module] | None = None) -> None:
        self.seq, self.amp, self.notes = seq, amp, notes
        self.make = make or _make_graphed
        self.shape: tuple[int, ...] | None = None  # the batch shape the graph was captured at
        self.failed = False
        self.dropouts = [m for m in seq.modules() if isinstance(m, SampleDropout) and m.p > 0]

    @property
    def replayed(self) -> bool:
        """Whether the steps replay a captured graph (one was captured, and none failed)."""
        return self.shape is not None and not self.failed

    def forward(self, x: torch.Tensor, seed: int, step: int, ids: Sequence[int]) -> torch.Tensor:
        """The model's output for ``x`` (inside the step's batch_context and autocast, as the eager call)."""
        if self.failed or (self.shape is not None and tuple(x.shape) != self.shape):
            return self._eager(x)
        if self.shape is None and not self._capture(x, seed, step, ids):
            return self._eager(x)
        for d in self.dropouts:
            d.fill(seed, step, ids)
        return self.seq(x)

    def _eager(self, x: torch.Tensor) -> torch.Tensor:
        saved = [d.static_mask for d in self.dropouts]
        for d in self.dropouts:  # the eager layers draw their own masks
            d.static_mask = None
        try:
            # where the capture replaced the module's forward, its own (the graph is not this shape's); elsewhere
            # the module's call, hooks included (a fault injection's)
            return _original_forward(self.seq)(x) if "forward" in vars(self.seq) else self.seq(x)
        finally:
            for d, m in zip(self.dropouts, saved):
                d.static_mask = m

    def _capture(self, x: torch.Tensor, seed: int, step: int, ids: Sequence[int]) -> bool:
        """Graph the model at ``x``'s shape, leaving its state as it was; False (and a note) where it fails."""
        hooked = [m for m in self.seq.modules() if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks]
        if hooked:  # a replay runs no hook: the model's own (a fault injection) must run, eager
            self.failed = True
            self.notes.append(f"train.cuda_graphs: the step runs eager: hooks on the model ({type(hooked[0]).__name__}"
                              "; a replay would skip them)")
            return False
        state = _snapshot(self.seq, x.device)
        try:
            with CUDA_WORK, _cache_off(self.amp):
                self._masks(x, seed, step, ids)
                static = x.detach().clone()
                self.make(self.seq, (static,), num_warmup_iters=WARMUP_ITERS)
            self.shape = tuple(x.shape)
            return True
        except Exception as e:  # noqa: BLE001 - the run goes on eager, and says why
            self.failed = True
            for d in self.dropouts:
                d.static_mask = None
            self.notes.append(f"train.cuda_graphs: the model could not be captured ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200]}); the step runs eager")
            return False
        finally:
            _restore(self.seq, state)
            if x.device.type == "cuda":  # the warm-up's blocks, cached for its side stream, back to the device
                torch.cuda.empty_cache()

    def _masks(self, x: torch.Tensor, seed: int, step: int, ids: Sequence[int]) -> None:
        """A static mask for each dropout layer, shaped as its input at ``x`` (one forward without gradients)."""
        if not self.dropouts:
            return
        shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        hooks = [d.register_forward_pre_hook(lambda m, a: shapes.__setitem__(id(m), (tuple(a[0].shape),
                                                                                     a[0].dtype)))
                 for d in self.dropouts]
        try:
            with torch.no_grad(), batch_context(seed, step, ids):
                self.seq(x)
        finally:
            for h in hooks:
                h.remove()
        for d in self.dropouts:
            shape, dtype = shapes[id(d)]
            d.static_mask = torch.empty(shape, dtype=dtype, device=x.device)
            d.fill(seed, step, ids)


def _make_graphed(module: nn.Module, sample_args: tuple[torch.Tensor, ...], num_warmup_iters: int) -> nn.Module:
    if next(module.parameters()).device.type == "cpu":
        return stand_in_graphed(module, sample_args, num_warmup_iters)
    graphed = torch.cuda.make_graphed_callables(module, sample_args, num_warmup_iters=num_warmup_iters)
    assert isinstance(graphed, nn.Module)  # a module comes back with its forward replaced
    return graphed


def _original_forward(seq: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The module's own forward (make_graphed_callables replaces ``seq.forward`` with one that replays)."""
    return lambda x: type(seq).forward(seq, x)


@contextlib.contextmanager
def _cache_off(amp: Callable[..., Any]) -> Any:
    """The step's autocast with its cache off (make_graphed_callables refuses autocast's weight cache)."""
    with amp():
        if torch.is_autocast_enabled():
            device = "cuda" if torch.is_autocast_enabled("cuda") else "cpu"
            dtype = torch.get_autocast_dtype(device)
            with torch.autocast(device, dtype=dtype, cache_enabled=False):
                yield
        else:
            yield


def _snapshot(seq: nn.Module, device: torch.device) -> dict[str, Any]:
    """Every buffer of ``seq`` and the generators' states (the host's, the rank's GPU's), before the capture's
    warm-up."""
    out: dict[str, Any] = {"buffers": [(b, b.detach().clone()) for b in seq.buffers()],
                           "cpu_rng": torch.get_rng_state(), "device": device}
    if device.type == "cuda":
        out["cuda_rng"] = torch.cuda.get_rng_state(device)
    return out


def _restore(seq: nn.Module, state: dict[str, Any]) -> None:
    if "cuda_rng" in state:
        torch.cuda.synchronize(state["device"])  # the warm-up ran on a side stream
    with torch.no_grad():
        for b, saved in state["buffers"]:
            b.copy_(saved)
    torch.set_rng_state(state["cpu_rng"])
    if "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"], state["device"])
