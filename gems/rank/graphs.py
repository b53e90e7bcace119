"""CUDA graphs on GPU ranks (``train.cuda_graphs``): the plain path's step replayed from one graph.

The step is one function of static tensors (the body, built by gems.rank.compose), run eagerly for its first
:data:`EAGER_STEPS` step(s), then captured once and replayed (:class:`StepGraph`); a step that cannot replay runs the
eager step with the same collectives. On CPU ranks a stand-in for the capture (``GEMS_CPU_GRAPH_STAND_IN``) checks
what a capture cannot hold. What the graph holds, what stays around it and why: docs/gpu.md, "CUDA graphs".
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gems import capture as rules
from gems.errors import RunError
from gems.layers import sample_keys

#: on a CPU rank, graph with a stand-in for the capture (the body run, checked and undone; each replay runs it
#: again): ``1``; ``fail_at_end``: the stand-in's capture fails at its end, as CUDA's does when something during it
#: invalidated the capture; ``fail_after_body``: an error of the body's own after its NCCL work, the capture ending
#: well (its graph made, to be reset before the error leaves); ``fail_at_replay``: the first replay fails;
#: ``hold_back``: the step's graph is held back from the registry (gems.capture.GRAPHS), so the rank's release
#: leaves it alive and the teardown, which waits for it as NCCL's does, runs into its time limit (the failures' tests)
STAND_IN_ENV = "GEMS_CPU_GRAPH_STAND_IN"
STAND_IN_MODES = ("1", "fail_at_end", "fail_after_body", "fail_at_replay", "hold_back")
#: on a CPU rank, compute in a GPU rank's layout without the stand-in (:func:`gpu_layout`)
LAYOUT_ENV = "GEMS_CPU_GPU_LAYOUT"
#: steps of the body run eagerly, on the capture's stream, before the capture: torch's warm-up (libraries
#: initialised, NCCL's communicators made, the optimizer's state created); real steps, so nothing is put back
EAGER_STEPS = 1
#: held by a thread that issues CUDA work beside the step (the reader ahead: gems.rank.data.Prefetcher, which pins,
#: allocates, copies and draws on its side stream) and by a capture: a capture must not see another thread's work
CUDA_WORK = threading.RLock()
#: what the record says of a graphed run (gems.rank.loop)
GRAPHED_NOTE = ("train.cuda_graphs: the step (forward{halos}, loss, backward, gradient sums, BatchNorm's averages and the "
                "step's sync) was replayed from a CUDA graph after {eager} eager step(s) and the capture; around it "
                "ran the copies of the batch and of the host values in, {optimizer}and one copy of the step's "
                "figures out, read a step late")

#: what the record says of a pipeline whose pieces were replayed (gems.rank.pieces)
PIECES_NOTE = ("train.cuda_graphs: each partition's forward and backward of a micro-batch was replayed from CUDA graphs "
               "(train.graph_pieces) after an eager step and the capture; the schedule's messages, the loss, the "
               "gradient sums (after each backward action) and the optimizer ran eager around them")


class CaptureFailed(RunError):
    """A capture of the step failed: the run stops (docs/gpu.md, "CUDA graphs": why not eager)."""


def decide(cfg: Any, settings: Any, mesh: Any, device: torch.device) -> tuple[bool, str | None]:
    """(whether this rank's step replays graphs, a note saying why not where it would have). ``train.cuda_graphs``:
    auto (GPU ranks on the plain path: no pipeline, no recomputation, sums not over MPI, no spatial parts unless
    ``train.graph_spatial`` captures their halos; a pipeline's partitions too with ``train.graph_pieces``, but for a
    split backward: gems.rank.pieces) or false. A step whose graph would hold NCCL work (more than one rank on the
    plain path) graphs only with ``train.graph_collectives``: no lent GPU has run such a graph to its end yet
    (issue 74: the default captures no NCCL work until a lease's records turn it on)."""
    if not bool(cfg.train.cuda_graphs):
        return False, None
    if device.type != "cuda" and not (device.type == "cpu" and stand_in() is not None):
        return False, None  # CPU ranks have no CUDA graphs (gems plan and the docs say so; nothing to note a run)
    why = None
    if settings.pipelined and not bool(getattr(cfg.train, "graph_pieces", False)):
        why = ("a pipeline's stages exchange messages between their pieces (train.graph_pieces=true replays each "
               "partition's pieces from graphs between them: gems.rank.pieces, off until a GPU has run them)")
    elif settings.pipelined and mesh.spatial > 1:
        why = ("a pipeline's spatial parts exchange halos inside their pieces (train.graph_pieces replays the pieces "
               "of a pipeline without spatial parts; train.graph_spatial the step of spatial parts without a pipeline)")
    elif mesh.spatial > 1 and not bool(getattr(cfg.train, "graph_spatial", False)):
        why = ("spatial parts exchange halos inside their layers (train.graph_spatial=true captures the messages in "
               "the step's graph: off until a GPU has run it)")
    elif bool(cfg.parallel.checkpoint):
        why = "recomputation (parallel.checkpoint) runs the forward again inside the backward"
    elif str(getattr(getattr(cfg, "comm", None), "backend", "")) == "mpi":
        why = "MPI's gradient sums (comm.backend=mpi) run from the host"
    elif settings.pipelined and settings.schedule.split:
        why = "a split backward's weight gradients wait for their W action (gems.pipeline.deferred)"
    elif not settings.pipelined and mesh.size > 1 and not bool(getattr(cfg.train, "graph_collectives", False)):
        why = ("its graph would hold NCCL work (the gradient sums and the step's sync"
               + (", the halo messages" if mesh.spatial > 1 else "") + ") and no lent GPU has yet run such a graph "
               "to its end (train.graph_collectives=true captures it: gems.capture)")
    return (True, None) if why is None else (False, f"train.cuda_graphs: the step runs eager: {why}")


def stand_in() -> str | None:
    """The stand-in's mode on a CPU rank (``GEMS_CPU_GRAPH_STAND_IN``): None (off), ``1`` or ``fail_at_end``."""
    mode = os.environ.get(STAND_IN_ENV)
    return mode if mode in STAND_IN_MODES else None


def gpu_layout(device: torch.device) -> bool:
    """Whether a CPU rank computes in a GPU rank's layout (gems.rank.compose: channels-last convolutions) and checks
    its fused optimizer as a GPU's kernel does (:func:`check_fused`): under the stand-in, and with
    ``GEMS_CPU_GPU_LAYOUT=1`` (the eager run a test compares a stand-in's with: the same layout, the same bits)."""
    return device.type == "cpu" and (stand_in() is not None or os.environ.get(LAYOUT_ENV) == "1")


# ---------------------------------------------------------------------------- the static tensors
@dataclass
class Static:
    """What the body reads and writes; the same tensors at every step."""

    x: torch.Tensor
    y: torch.Tensor
    #: host values of the step, int64: the stop flag, then each sample's two dropout keys (gems.layers.sample_keys)
    scalars: torch.Tensor
    #: the step's figures, float64: the global loss and the stop flag (summed over the ranks), then whether this
    #: rank's input and output were finite (1.0 or 0.0)
    figures: torch.Tensor

    @property
    def keys(self) -> torch.Tensor:
        return self.scalars[1:].view(-1, 2)

    @property
    def stop(self) -> torch.Tensor:
        return self.scalars[0]


class HostRing:
    """Host buffers the step's host values go through (pinned on a GPU rank), written through numpy (no device op)
    and copied in with one non-blocking copy. Two, used in turn: the copy from one is done by the time the step two
    later writes it again, since the loop reads every step's figures (after its copies) within one step."""

    def __init__(self, n: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.buffers = [torch.zeros(n, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self.turn = 0

    def fill(self, values: Sequence[int]) -> torch.Tensor:
        buf = self.buffers[self.turn]
        self.turn ^= 1
        buf.numpy()[:] = values
        return buf


# ---------------------------------------------------------------------------- counting the step's device ops
_REPLAYING = threading.local()
#: ops that launch nothing on the device: allocator and autograd bookkeeping
_NO_KERNEL = {"detach", "lift_fresh", "alias", "record_stream", "empty", "empty_like", "empty_strided",
              "new_empty", "new_empty_strided", "_has_compatible_shallow_copy_type", "set_"}


@contextlib.contextmanager
def replaying() -> Iterator[None]:
    """Around a replay: what runs inside is the graph's (the stand-in runs the body there), not counted."""
    before = getattr(_REPLAYING, "on", False)
    _REPLAYING.on = True
    try:
        yield
    finally:
        _REPLAYING.on = before


class DeviceOps(TorchDispatchMode):
    """Counts the ops a step dispatches that launch work on the rank's device, outside a replay: an op with a tensor
    of the device among its arguments or results, views, allocations and bookkeeping left out (they launch no
    kernel). On a GPU rank these are the step's launches around the graph; the stand-in's replay is not counted."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device_type = device.type
        self.count = 0
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(_REPLAYING, "on", False):
            return out
        name = func.overloadpacket.__name__
        if name in _NO_KERNEL or getattr(func, "is_view", False):
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type == self.device_type for t in tensors):
            self.count += 1
            self.names[name] = self.names.get(name, 0) + 1
        return out


class NoHostReads(TorchDispatchMode):
    """The stand-in's capture: refuses what a CUDA capture cannot hold: a device value read on the host, by the op
    itself or inside its CUDA kernel (a CPU kernel reads it below the dispatcher, where no mode sees it: those ops
    are named here), and a tensor made from Python data (``torch.tensor``: on a GPU, a copy from pageable host
    memory, which a capture refuses). A copy of another host tensor to the device cannot show here: the stand-in's
    host is its device."""

    READS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "unique_dim", "_unique2",
             # CUDA kernels that read a device value on the host (an output's size, a checked value)
             "_unique", "unique_consecutive", "unique_dim_consecutive", "bincount", "histc",
             "embedding_dense_backward", "_linalg_check_errors"}
    #: ops that read a 0-dim tensor argument on the host in their CUDA kernel (``value.item()``)
    TENSOR_VALUE = {"masked_fill", "masked_fill_", "index_fill", "index_fill_"}
    FROM_HOST = {"lift_fresh", "lift_fresh_copy"}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        why = None
        if name in self.READS or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                  and isinstance(args[0], torch.Tensor)):
            why = f"{name} reads a device value on the host"
        elif name in self.TENSOR_VALUE and len(args) > 2 and isinstance(args[-1], torch.Tensor):
            why = f"{name} with a tensor value reads it on the host"
        elif name in self.FROM_HOST:
            why = f"{name}: a tensor made from Python data (torch.tensor) is copied from pageable host memory"
        if why is not None:
            raise RuntimeError(f"CUDA error: operation not permitted when stream is capturing ({why}; stand-in "
                               "capture)")
        return func(*args, **kwargs)


def _value(v: Any) -> Any:
    """A non-tensor argument as a replay compares it: its value where it is one (a number, a dtype, a device), else
    its type (a process group, an op's handle: objects a replay may make anew)."""
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return repr(v)
    return type(v).__name__


class Trace(TorchDispatchMode):
    """The stand-in's record of a body's work, to hold every replay to its capture: a GPU's replay runs the kernels
    the capture recorded, with the values the host gave them then, on the tensors they read then; the stand-in's
    replay runs the body's Python again. So the capture records each op it dispatches with its non-tensor arguments
    and the tensors of ``static`` it reads (by storage and view: the graph's own tensors, alive throughout), and each
    replay must dispatch the same: a host value read in the body (a float the host computes each step, a branch on
    a counter), frozen into a GPU's graph, fails it, as does a static tensor replaced by another."""

    def __init__(self, static: Callable[[], list[torch.Tensor]], reference: list[Any] | None = None) -> None:
        super().__init__()
        self.static = {t.untyped_storage().data_ptr() for t in static() if t.numel()}
        self.reference = reference
        self.ops: list[Any] = []

    def _tensor(self, t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr() if t.numel() else None
        where = (ptr, t.storage_offset(), tuple(t.stride())) if ptr in self.static else "made in the body"
        return (str(t.dtype), tuple(t.shape), where)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        entry = (str(func), tuple(self._tensor(a) if isinstance(a, torch.Tensor) else _value(a) for a in flat))
        if self.reference is not None:
            i = len(self.ops)
            if i >= len(self.reference) or self.reference[i] != entry:
                was = _show(self.reference[i]) if i < len(self.reference) else "nothing (the capture ended there)"
                raise RuntimeError(f"stand-in: the replay dispatched other work than the capture recorded at op {i}: "
                                   f"{_show(entry)}, where the capture had {was}. A GPU's replay runs what was "
                                   "captured: a value the host gives the body each step must be in a tensor of the "
                                   "graph's, and the body must read the same tensors each step")
        self.ops.append(entry)
        return func(*args, **kwargs)

    def check_complete(self) -> None:
        if self.reference is not None and len(self.ops) != len(self.reference):
            raise RuntimeError(f"stand-in: the replay dispatched {len(self.ops)} ops where the capture recorded "
                               f"{len(self.reference)} (the first missing: {_show(self.reference[len(self.ops)])})")


def _show(entry: Any) -> str:
    """An op of a :class:`Trace` as a message shows it: its name, and its arguments (a tensor by its dtype, shape
    and whether it is one of the graph's, at which address)."""
    name, args = entry

    def arg(a: Any) -> str:
        if not isinstance(a, tuple):
            return str(a)
        dtype, shape, where = a
        at = "made in the body" if isinstance(where, str) else f"the graph's at {where[0]:#x}+{where[1]}"
        return f"{dtype.replace('torch.', '')}{list(shape)} ({at})"

    return f"{name}({', '.join(arg(a) for a in args)})"


#: the per-parameter state torch's fused SGD and Adam kernels read beside the parameters and their gradients
_FUSED_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _shares_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch's ``_check_tensors_share_sizes_and_strides``: the same sizes, and the same strides but where a size
    is 1."""
    return a.shape == b.shape and all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride(), b.stride()))


def check_fused(optimizer: Any) -> None:
    """What torch's fused SGD and Adam CUDA kernels check before they run (``check_fast_path_restrictions``): each
    parameter, its gradient and its state (momentum, moments) on one device, of one dtype, dense, and of the same
    sizes and strides; and Adam's step count a float32 tensor on the parameter's device (a host one would be read
    by the kernel on the device). CPU kernels take what these refuse (a row-major gradient of a channels-last
    weight), so a CPU rank in a GPU's layout (:func:`gpu_layout`) runs this check before every step."""
    from gems.layout import dense

    for group in optimizer.param_groups:
        if not group.get("fused"):
            continue
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state.get(p, {})
            tensors = [("gradient", p.grad)] + [(k, state[k]) for k in _FUSED_STATE if isinstance(state.get(k),
                                                                                                 torch.Tensor)]
            for what, t in tensors:
                if not (_shares_layout(p, t) and dense(t) and dense(p) and t.device == p.device
                        and (t.dtype == p.dtype or what != "gradient")):
                    raise RuntimeError(
                        f"the fused {type(optimizer).__name__} of a GPU refuses this step: a parameter of shape "
                        f"{tuple(p.shape)} and strides {p.stride()} has a {what} of strides {t.stride()} "
                        f"({t.dtype}, {t.device}; torch's CUDA kernel checks that parameters, gradients and state "
                        "share dtype, device, sizes and strides; stand-in check)")
            step = state.get("step")
            if isinstance(step, torch.Tensor) and (step.device != p.device or step.dtype != torch.float32):
                raise RuntimeError(f"the fused {type(optimizer).__name__} of a GPU reads its step count on the "
                                   f"device: it is {step.dtype} on {step.device}, the parameter on {p.device} "
                                   "(stand-in check)")


# ---------------------------------------------------------------------------- captures
class _CudaCapture:
    """The body captured on a side stream of the rank's GPU and replayed on the current stream.
    ``api`` is ``torch.cuda`` (a test passes a mock of it)."""

    def __init__(self, device: torch.device, api: Any = None) -> None:
        self.api = api if api is not None else torch.cuda
        self.device = device
        self.stream = self.api.Stream(device=device)
        self.graph: Any = None

    def eager(self, body: Callable[[], None]) -> None:
        """The body as a step, on the capture's stream (torch's warm-up place), ordered with the current stream."""
        current = self.api.current_stream(self.device)
        self.stream.wait_stream(current)
        with CUDA_WORK, self.api.stream(self.stream):
            body()
        current.wait_stream(self.stream)

    def capture(self, body: Callable[[], None]) -> None:
        """Capture the body (nothing runs). The stream's capture always ends, and the current stream is always
        restored, whatever failed; nothing else is called after a failure (no ``empty_cache``: the allocator is
        mid-capture then, and asserts). The eager step's cached blocks are released before the capture begins,
        as ``torch.cuda.graph`` does: during a capture the allocator releases none of them (its private pool
        would be allocated beside them: twice the step's memory)."""
        current = self.api.current_stream(self.device)
        self.stream.wait_stream(current)
        self.api.synchronize(self.device)  # nothing of the eager steps still queued while the capture begins
        self.api.empty_cache()  # the eager step's blocks, cached for the capture's stream, back to the device
        graph = rules.made(self.api.CUDAGraph(), "the step's graph")  # registered first: the rank resets it
        # reset on any failure (gems.capture.guarded); NCCL launched in one order (gems.capture.captured)
        with rules.guarded(graph), CUDA_WORK, self.api.stream(self.stream), rules.captured(graph, self.device,
                                                                                              self.api):
            body()
        current.wait_stream(self.stream)
        self.graph = graph

    def replay(self) -> None:
        self.graph.replay()


class _StandInCapture:
    """The capture on a CPU rank: its capture runs the body once under :class:`NoHostReads`, records its ops
    (:class:`Trace`) and puts back every tensor of the graph's that run changed (a capture runs nothing); each
    replay runs the body again (not counted as the step's own ops: :func:`replaying`), held to the recorded ops.
    ``fail_at_end``: the capture fails at its end as CUDA's would after something invalidated it."""

    def __init__(self, touched: Callable[[], list[torch.Tensor]], mode: str = "1",
                 grads: Sequence[tuple[torch.nn.Parameter, torch.Tensor]] = (),
                 static: Callable[[], list[torch.Tensor]] = lambda: []) -> None:
        self.touched, self.mode, self.grads, self.static = touched, mode, list(grads), static
        self.body: Callable[[], None] | None = None
        self.graph: Any = None
        self.recorded: list[Any] = []  # the capture's ops (:class:`Trace`), which every replay must dispatch

    def _static(self) -> list[torch.Tensor]:
        return [*self.static(), *self.touched(), *(g for _, g in self.grads)]

    def eager(self, body: Callable[[], None]) -> None:
        body()

    def capture(self, body: Callable[[], None]) -> None:
        saved = [(t, t.detach().clone()) for t in {id(t): t for t in self._static()}.values()]
        trace = Trace(self._static)
        graph = rules.made(rules.StandInGraph("step"), "the step's graph")
        if self.mode == "hold_back":  # lost by the registry on purpose: nothing resets it (gems.worker's test)
            rules.GRAPHS.remove(graph)
        with rules.guarded(graph):  # reset on any failure, as the CUDA capture's graph is
            failed = True
            try:
                with NoHostReads(), trace, rules.region(torch.device("cpu"), graph=graph):
                    body()
                if self.mode == "fail_after_body":  # the body's own error after its NCCL work; the capture ends well
                    raise RuntimeError("stand-in: an error of the step's own after its NCCL work was captured")
                failed = False
            finally:
                with torch.no_grad():
                    for t, v in saved:
                        t.copy_(v)
                if self.mode == "fail_at_end" or (failed and self.mode != "fail_after_body"):
                    # as cudaStreamEndCapture answers a capture something invalidated
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture"
                                       + (" (stand-in: injected at the capture's end)" if self.mode == "fail_at_end"
                                          else ""))
        self.body, self.recorded, self.graph = body, trace.ops, graph

    def replay(self) -> None:
        """The body again, held to the capture's ops (:class:`Trace`); then what a GPU's replay leaves of the host's
        side of it: nothing, so the gradients it attached are taken off again (the step attaches them after a
        replay: :meth:`StepGraph.run`)."""
        assert self.body is not None
        if self.mode == "fail_at_replay":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (stand-in: injected at the first "
                               "replay)")
        trace = Trace(self._static, reference=self.recorded)
        with replaying(), trace, rules.region(torch.device("cpu")):
            self.body()
        trace.check_complete()
        for p, _ in self.grads:
            p.grad = None


def cause(e: BaseException, in_capture: bool = True) -> str:
    """The first error of a failed capture, and what followed it: CUDA's ``capture_end`` answers any failure with
    a generic error, raised while the first one (the illegal call) is handled, so the first is the chain's root."""
    chain = [e]
    while chain[-1].__context__ is not None and len(chain) < 8:
        chain.append(chain[-1].__context__)
    root = chain[-1]

    def line(x: BaseException) -> str:
        text = str(x).strip().splitlines()
        return f"{type(x).__name__}: {text[0][:300] if text else ''}"

    if root is e:
        return (f"{line(e)} (no error came before it: something outside the step's own calls invalidated the "
                "capture; the reader and CUDA's global mode were kept out of its way)") if in_capture else line(e)
    return f"{line(root)} (then {line(e)})"


# ---------------------------------------------------------------------------- the graphed step
class StepGraph:
    """A graphed rank's step: :meth:`run` copies the step's batch and host values into the static
    tensors and runs the body: eagerly for the first :data:`EAGER_STEPS` step(s), then captured once and replayed.
    ``body(static)`` is the step; ``touched()`` lists what it changes beyond its static outputs (the stand-in's
    capture puts them back); ``capture`` makes the capture (default: CUDA's on a GPU, the stand-in on a CPU).

    The gradients (``grads``) are static tensors the graph owns (gems.replication.GradientReducer.static_grads: the
    small ones views of their bucket's flattened buffer, each of its parameter's strides); the body zeroes them and
    attaches them before its backward, so no ``zero_grad``, nor anything left in ``.grad``, can double one.
    Dropout's keys are host values copied in with the stop flag, its masks drawn inside the graph. One graph a batch
    shape: a step of another shape runs the body eagerly, with the same sums and sync in the same order on every
    rank."""

    def __init__(self, body: Callable[[Static], None], device: torch.device, rank: int,
                 touched: Callable[[], list[torch.Tensor]] = lambda: [], capture: Any = None,
                 eager_steps: int = EAGER_STEPS, grads: Sequence[tuple[torch.nn.Parameter, torch.Tensor]] = (),
                 static: Callable[[], list[torch.Tensor]] = lambda: []) -> None:
        self.body, self.device, self.rank, self.touched = body, device, rank, touched
        #: tensors the body reads that outlive it (the parameters, the sums' buffers): a replay reads the same ones
        self.more_static = static
        #: (parameter, its static gradient): attached after each replay, for the optimizer (a replay writes the
        #: static tensors and runs none of the body's Python)
        self.grads = list(grads)
        self.eager_steps = int(eager_steps)
        self._capture = capture
        self.static: Static | None = None
        self.host: HostRing | None = None
        self.ran = 0  # steps of the body (eager, then replays)
        self.captured = False
        self.replays = 0
        self.refused = False  # the steps run eager (hooks on the model a replay would skip: the caller decides)

    @property
    def replayed(self) -> bool:
        """Whether the steps replayed a captured graph."""
        return self.replays > 0

    @property
    def shape(self) -> tuple[int, ...] | None:
        return tuple(self.static.x.shape) if self.static is not None else None

    def fits(self, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether the body takes this batch (the first one sets the shapes: one graph a shape)."""
        s = self.static
        return s is None or (s.x.shape == x.shape and s.x.dtype == x.dtype and s.y.shape == y.shape
                             and s.y.dtype == y.dtype)

    def run(self, x: torch.Tensor, y: torch.Tensor, seed: int, step: int, ids: Sequence[int],
            stop: int) -> torch.Tensor:
        """The step's figures (:attr:`Static.figures`, on the device; not read): the batch and host values copied
        in, then the body run, captured or replayed."""
        if self.static is None:
            self.static = Static(torch.empty_like(x), torch.empty_like(y),
                                 torch.zeros(1 + 2 * len(ids), dtype=torch.int64, device=self.device),
                                 torch.zeros(4, dtype=torch.float64, device=self.device))
            self.host = HostRing(1 + 2 * len(ids), self.device)
        s, host = self.static, self.host
        assert host is not None
        s.x.copy_(x)
        s.y.copy_(y)
        values = [int(stop)] + [k for pair in sample_keys(seed, step, ids) for k in pair]
        s.scalars.copy_(host.fill(values), non_blocking=True)
        cap = self._capturer()
        if self.ran < self.eager_steps:
            cap.eager(lambda: self.body(s))
        else:
            if not self.captured:
                try:
                    cap.capture(lambda: self.body(s))
                except Exception as e:
                    raise CaptureFailed(
                        f"train.cuda_graphs: capturing the step failed on rank {self.rank} at step {step}: {cause(e)}. "
                        "The run stops: a failed capture leaves CUDA's caching allocator mid-capture. "
                        "train.cuda_graphs=false trains eager") from e
                self.captured = True
            try:
                cap.replay()
            except Exception as e:
                if self.replays:
                    raise
                raise CaptureFailed(
                    f"train.cuda_graphs: the first replay of the step failed on rank {self.rank} at step {step}: "
                    f"{cause(e, in_capture=False)}. The run stops. train.cuda_graphs=false trains eager") from e
            self.replays += 1
            for p, g in self.grads:
                p.grad = g
        self.ran += 1
        return s.figures

    def _statics(self) -> list[torch.Tensor]:
        s = self.static
        return self.more_static() + ([] if s is None else [s.x, s.y, s.scalars, s.figures])

    def _capturer(self) -> Any:
        if self._capture is None:
            mode = stand_in()
            self._capture = (_CudaCapture(self.device) if self.device.type == "cuda" else
                             _StandInCapture(self.touched, mode=mode or "1", grads=self.grads, static=self._statics))
        return self._capture


@contextlib.contextmanager
def uncached(amp: Callable[[], Any]) -> Iterator[None]:
    """The step's autocast (``amp()``) with its weight cache off: a capture must not keep casts in a cache that
    outlives it (torch refuses autocast's cache in make_graphed_callables for this); the casts are the same."""
    with amp():
        if torch.is_autocast_enabled():
            device = "cuda" if torch.is_autocast_enabled("cuda") else "cpu"
            with torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False):
                yield
        else:
            yield


def hooked(modules: Sequence[torch.nn.Module], own: set[int] = frozenset()) -> str | None:  # type: ignore[assignment]
    """The first module under ``modules`` with hooks a replay would not run (a fault injection's), by type name;
    ``own``: the ids of hooks the step itself placed (the gradient sum's points and taps, whose work the capture
    records where they place it)."""
    for root in modules:
        for m in root.modules():
            for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks):
                if any(k not in own for k in hooks):
                    return type(m).__name__
    return None
