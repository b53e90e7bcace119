"""Graphed pieces of a pipeline's partitions (``train.graph_pieces``): each action's partition replayed from CUDA graphs
between the schedule's messages, which stay eager, as do the last stage's loss, fp16's scale, the gradient sums and
the optimizer (:class:`Pieces`; docs/gpu.md, "CUDA graphs": pipelines). Off by default until a GPU has run them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from gems import capture as rules
from gems.layers import batch_context, current_batch, sample_keys
from gems.rank.graphs import CUDA_WORK, CaptureFailed, HostRing, NoHostReads, Trace, cause, replaying, stand_in, uncached

#: forwards and backwards on a slot's static input before its capture (torch's make_graphed_callables runs three)
WARMUP = 3


class _Slot:
    """One (stage, replica pass, micro-batch): its static input, keys, output, output gradient and gradients, and
    its two graphs (or, on a CPU, the stand-in's replay of them)."""

    def __init__(self, part: nn.Module, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
                 needs_grad: bool, samples: int, device: torch.device, amp: Callable[[], Any]) -> None:
        self.part, self.amp, self.device = part, amp, device
        self.params = [p for p in part.parameters() if p.requires_grad]
        # in the input's layout (a channels-last cut on a GPU): another layout would run other kernels than eager's
        self.x = torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_().requires_grad_(needs_grad)
        self.keys = torch.zeros((samples, 2), dtype=torch.int64, device=device)
        self.host = HostRing(2 * samples, device)
        self.inputs: list[torch.Tensor] = ([self.x] if needs_grad else []) + list(self.params)
        self.y: torch.Tensor | None = None
        self.gy: torch.Tensor | None = None
        self.grads: list[torch.Tensor | None] = []
        self.graphs: tuple[Any, Any] | None = None
        self.replayed = False  # whether its graphs replayed once (a failure of the first says what to do)
        self.name = "a piece"  # for the messages (Pieces names it: its stage and rank)
        self._live: torch.Tensor | None = None  # the stand-in's forward, for its backward
        #: the stand-in's first replay of the forward and of the backward, which every later one must dispatch
        #: (gems.rank.graphs.Trace: what a GPU's graphs would freeze)
        self.traces: dict[str, list[Any]] = {}

    def fits(self, x: torch.Tensor) -> bool:
        return (tuple(x.shape) == tuple(self.x.shape) and x.stride() == self.x.stride() and x.dtype == self.x.dtype
                and x.requires_grad == self.x.requires_grad)

    def _forward(self) -> torch.Tensor:
        with batch_context(0, 0, range(self.keys.shape[0]), keys=self.keys), uncached(self.amp), torch.enable_grad():
            return self.part(self.x)

    def _grads(self, y: torch.Tensor, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return torch.autograd.grad(y, self.inputs, gy, allow_unused=True)

    # ---- capture
    def capture_cuda(self, side: Any, api: Any) -> None:
        """The warm-up on the pieces' side stream (``side``, one for every slot, so that what a slot's warm-up
        cached serves the next), its cached blocks released, then the forward's graph and the backward's in one
        pool (the slot's). ``api``: ``torch.cuda`` (a test passes a mock of it)."""
        side.wait_stream(api.current_stream(self.device))
        with CUDA_WORK, api.stream(side):
            for _ in range(WARMUP):
                y = self._forward()
                self._grads(y, torch.ones_like(y))
            del y
        api.synchronize(self.device)
        api.empty_cache()  # as torch.cuda.graph does: during a capture the allocator releases no cached block
        # registered first, both reset on any failure (gems.capture.guarded: none outlives the rank's teardown)
        fwd = rules.made(api.CUDAGraph(), f"the forward's graph of {self.name}")
        bwd = rules.made(api.CUDAGraph(), f"the backward's graph of {self.name}")
        with rules.guarded(fwd, bwd), CUDA_WORK, api.stream(side):
            with rules.captured(fwd, self.device, api):
                y = self._forward()
            self.gy = torch.empty_like(y)
            with rules.captured(bwd, self.device, api, pool=fwd.pool()):
                grads = self._grads(y, self.gy)
        api.current_stream(self.device).wait_stream(side)
        self.y, self.grads, self.graphs = y.detach(), list(grads), (fwd, bwd)

    def capture_stand_in(self) -> None:
        """The stand-in: one forward and backward under the host-read check (what a capture refuses); the buffers
        are put back by the caller."""
        graph = rules.made(rules.StandInGraph("piece"), f"the graphs of {self.name}")
        with rules.guarded(graph), NoHostReads(), rules.region(torch.device("cpu"), graph=graph):
            y = self._forward()
            grads = self._grads(y, torch.ones_like(y))
            if stand_in() == "fail_at_end":
                raise RuntimeError("CUDA error: operation failed due to a previous error during capture (stand-in: "
                                   "injected at the capture's end)")
        self.y, self.gy = torch.zeros_like(y), torch.zeros_like(y)
        self.grads = [g if g is None else torch.zeros_like(g) for g in grads]
        self.graphs = None

    def _first(self, replay: Callable[[], None]) -> None:
        """A replay; the first one's failure stops the run with the capture's named message."""
        try:
            replay()
        except Exception as e:
            if self.replayed:
                raise
            raise CaptureFailed(f"train.graph_pieces: the first replay of {self.name} failed: {cause(e, False)}. The run "
                                "stops. train.graph_pieces=false trains eager") from e
        self.replayed = True

    # ---- replay
    def forward(self, x: torch.Tensor, keys: Sequence[int]) -> torch.Tensor:
        with torch.no_grad():
            self.x.copy_(x)
            self.keys.view(-1).copy_(self.host.fill(keys), non_blocking=True)
        if self.graphs is not None:
            self._first(self.graphs[0].replay)
        else:
            self._first(self._stand_in_forward)
        assert self.y is not None
        return self.y

    def _stand_in_forward(self) -> None:
        if not self.replayed and stand_in() == "fail_at_replay":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (stand-in: injected at the first "
                               "replay)")
        with self._traced("forward"):
            self._live = self._forward()
            assert self.y is not None
            with torch.no_grad():
                self.y.copy_(self._live)

    @contextlib.contextmanager
    def _traced(self, what: str) -> Iterator[None]:
        """The stand-in's replay of ``what``, held to its first (:class:`gems.rank.graphs.Trace`)."""
        trace = Trace(self._static, reference=self.traces.get(what))
        with replaying(), trace, rules.region(torch.device("cpu")):
            yield
        trace.check_complete()
        self.traces.setdefault(what, trace.ops)

    def _static(self) -> list[torch.Tensor]:
        return [t for t in (self.x, self.keys, self.y, self.gy, *self.params, *self.part.buffers(), *self.grads)
                if t is not None]

    def backward(self, gy: torch.Tensor) -> list[torch.Tensor | None]:
        assert self.gy is not None
        with torch.no_grad():
            self.gy.copy_(gy)
        if self.graphs is not None:
            self.graphs[1].replay()
        else:
            assert self._live is not None
            with self._traced("backward"):
                got = self._grads(self._live, self.gy)
                with torch.no_grad():
                    for mine, g in zip(self.grads, got):
                        if mine is not None and g is not None:
                            mine.copy_(g)
            self._live = None
        return self.grads


class _Piece(torch.autograd.Function):
    """A slot's replay inside autograd: the forward's output (the slot's static output), and in the backward the
    input's gradient (the static one: the runtime sends it before the slot replays again) and the parameters'
    (copies: ``.grad`` never aliases the graph's buffers)."""

    @staticmethod
    def forward(ctx: Any, slot: _Slot, keys: list[int], x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.slot = slot
        return slot.forward(x, keys).detach()

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[Any, ...]:
        slot: _Slot = ctx.slot
        grads = slot.backward(gy)
        gx = grads[0] if slot.x.requires_grad else None
        params = grads[1:] if slot.x.requires_grad else grads
        return (None, None, gx, *(g.clone() if g is not None else None for g in params))


class Pieces:
    """A pipeline rank's slots: called in place of a partition (``PipelineRunner.call_part``); :meth:`begin_step`
    before each step captures them once the first step has run them eagerly.

    A slot, a (stage, replica pass, micro-batch) the rank runs, gets a pair of graphs, the partition's forward and its
    backward (as ``torch.cuda.make_graphed_callables`` makes them), in a pool of its own; autograd routes the input's
    gradient to the message the runtime sends back and the parameters' (copied out of the graph: they never alias its
    buffers) to ``.grad`` through autograd's own accumulation, whose hooks the gradient sum counts; the sums start
    at the end of each backward action (points inside a replayed partition would not run). The second step captures
    every slot before its first action, each after a warm-up of three forwards and backwards on its static input
    (BatchNorm's statistics put back after); dropout's keys are a slot's static input too. A slot whose input has
    another shape runs eager. Every slot holds its own gradients and backward workspace (a stage's ``m``
    micro-batches: ``m`` sets), which the planner holds all at once. Not for spatial parts (their halos exchange
    inside the layers), recomputation or a split backward (the weight gradients wait for their W action)."""

    def __init__(self, device: torch.device, rank: int, amp: Callable[[], Any],
                 buffers: Callable[[], list[torch.Tensor]], api: Any = None) -> None:
        self.device, self.rank, self.amp, self.buffers = device, rank, amp, buffers
        #: CUDA's capture where the device is a GPU (``api``: a mock of torch.cuda, in a test), else the stand-in
        self.api = api if api is not None else torch.cuda if device.type == "cuda" else None
        self.slots: dict[tuple[int, int, int], _Slot] = {}
        #: (stage, replica pass, micro-batch) -> (partition, input shape, its strides, dtype, needs grad, samples)
        self.seen: dict[tuple[int, int, int], tuple[nn.Module, tuple[int, ...], tuple[int, ...], torch.dtype, bool,
                                                    int]] = {}
        self.steps = 0
        self.captured = False
        self.replays = 0
        self.refused = False  # hooks on a partition a replay would skip (the caller decides)

    @property
    def replayed(self) -> bool:
        return self.replays > 0

    def begin_step(self, step: int) -> None:
        """Before a step's first action: capture every slot the first step ran (once)."""
        if not self.refused and not self.captured and self.steps >= 1 and self.seen:
            self._capture_all(step)
        self.steps += 1

    def _capture_all(self, step: int) -> None:
        saved = [(b, b.detach().clone()) for b in self.buffers()]  # the warm-up moves BatchNorm's statistics
        key: Any = None
        side = self.api.Stream(device=self.device) if self.api is not None else None
        try:
            for key, (part, shape, stride, dtype, needs_grad, samples) in sorted(self.seen.items()):
                slot = _Slot(part, shape, stride, dtype, needs_grad, samples, self.device, self.amp)
                slot.name = f"the piece of stage {key[0]} (replica pass {key[1]}, micro-batch {key[2]}) on rank {self.rank}"
                if self.api is not None:
                    slot.capture_cuda(side, self.api)
                else:
                    slot.capture_stand_in()
                self.slots[key] = slot
        except Exception as e:
            raise CaptureFailed(f"train.graph_pieces: capturing the piece of stage {key[0] if key else '?'} failed on "
                                f"rank {self.rank} at step {step}: {cause(e)}. The run stops: a failed capture leaves "
                                "CUDA's caching allocator mid-capture. train.graph_pieces=false trains eager") from e
        finally:
            with torch.no_grad():
                for b, v in saved:
                    b.copy_(v)
        self.captured = True

    def __call__(self, action: Any, part: nn.Module, x: torch.Tensor) -> torch.Tensor:
        key = (action.stage, action.replica, action.micro_batch)
        info = current_batch()
        if self.refused or not torch.is_grad_enabled() or info is None:
            return part(x)
        slot = self.slots.get(key)
        if slot is None or not slot.fits(x) or slot.keys.shape[0] != len(info.sample_ids):
            if not self.captured:
                self.seen[key] = (part, tuple(x.shape), x.stride(), x.dtype, x.requires_grad, len(info.sample_ids))
            return part(x)
        keys = [k for pair in sample_keys(info.seed, info.step, info.sample_ids) for k in pair]
        self.replays += 1
        return _Piece.apply(slot, keys, x, *slot.params)
