"""Gradients summed over every rank that holds a copy of a parameter: replicas, spatial parts, GEMS's mirrored partitions.

Each copy computes a weighted share of the global loss, so the exact gradient is the plain sum over the copies
(docs/design.md, "Global batch and the loss"). The sums are bucketed and overlapped with the backward, launched at
points every member reaches in one order (docs/design.md, "Rules of the GPU path": gradient sums), over
torch.distributed or, with ``comm.backend=mpi``, mpi4py. BatchNorm's buffers are averaged over the same copies.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Mapping

import torch
from torch import nn

from gems import capture, timers
from gems.layout import dense, row_major
from gems.progress import waiting


class MPIGroup:
    """A sub-communicator of COMM_WORLD over ``ranks`` (collective: every rank calls it). PyTorch's wheels carry no
    MPI backend, so the sums over MPI (``comm.backend=mpi``) are gems's own, through mpi4py."""

    def __init__(self, world_comm: Any, ranks: list[int]) -> None:
        me = world_comm.Get_rank()
        color = min(ranks) if me in ranks else -1
        self.comm = world_comm.Split(color if color >= 0 else 0x7FFFFFF, key=me)
        self.cuda_aware = os.environ.get("GEMS_MPI_CUDA_AWARE", "0") == "1"


def mpi_group(world_comm: Any, mesh: Any, rank: int) -> MPIGroup:
    """Build the MPI gradient communicator matching ``mesh.ranks('grad')``.

    Every rank calls this once with its own grad ranks; ranks sharing a group
    share its smallest rank as colour.
    """
    return MPIGroup(world_comm, mesh.ranks("grad") or [rank])


def _grad(p: nn.Parameter) -> torch.Tensor:
    assert p.grad is not None, "a launched bucket gives every parameter a gradient"
    return p.grad


#: a parameter at least this large is summed in place in its own ``.grad`` instead of through a copy
IN_PLACE_BYTES = 1 << 20


def summed_in_place(nbytes: int) -> bool:
    """Whether a gradient of ``nbytes`` is summed in place in its ``.grad`` (one collective, no copy; dense in any
    memory format) or through its bucket's flattened copy, so the reducer holds extra memory only for the small
    gradients: the one rule the reducer and the planner's memory (gems.plan.memory) keep."""
    return nbytes >= IN_PLACE_BYTES


class _Bucket:
    def __init__(self, params: list[nn.Parameter], at: Mapping[nn.Parameter, tuple[int, int]]) -> None:
        self.params = params
        # the sequence of its last parameter (the backward that completes it) and the first layer it holds there
        # (where its point is); and every sequence it holds parameters of, in its order
        self.key, self.first = at[params[-1]]
        self.keys = tuple(dict.fromkeys(at[p][0] for p in params))
        self.ready = 0
        self.launched = False
        # (tensor to sum, the parameters whose gradients it holds, copied back after the sum?, handle, host copy)
        self.parts: list[tuple[torch.Tensor, list[nn.Parameter], bool, Any, Any]] = []
        #: the flattened buffer whose views are the small gradients' static tensors (GradientReducer.static_grads)
        self.flat: torch.Tensor | None = None


class _Tap(torch.autograd.Function):
    """A layer's parameters, handed to its forward through an identity that also reads the layer's input
    (``anchor``): backward, their gradients are accumulated into ``.grad`` here, before the node that made the
    input runs, so before the point on that input (docs/design.md, "Rules of the GPU path": gradient sums)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, params: list[nn.Parameter]) -> tuple[torch.Tensor, ...]:
        ctx.params = params
        # a view nothing used (a deferrable layer reads its weight detached: gems.pipeline.deferred) gets None, not
        # zeros: no accumulation is counted for it here, its own (the W's) is
        ctx.set_materialize_grads(False)
        return tuple(p.detach() for p in params)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        pairs = [(p, g) for p, g in zip(ctx.params, grads) if g is not None]
        if pairs:  # autograd's own accumulator (gradient layout, hooks), run now rather than when it pleases
            torch.autograd.backward([p for p, _ in pairs], [g for _, g in pairs])
        return None, None


class _Staged:
    """One MPI sum on its way to MPI. A CPU tensor is ready at once. A GPU tensor is made by kernels the host
    has only queued: with CUDA-aware MPI an event recorded on the producing stream must complete before MPI
    reads the device buffer (handing it over at once raced the backward); without, the copy to pinned host
    memory runs on a side stream (not inside the hook, which would drain the GPU) and its event says when
    the host buffer holds the gradient. ``ready(block=False)`` only polls the event; the gradient hooks poll and
    launch the staged sums in bucket order, so the backward is never drained for them."""

    def __init__(self, bucket: "_Bucket", index: int, t: torch.Tensor, cuda_aware: bool) -> None:
        # MPI takes row-major buffers only: a channels-last gradient as its own memory seen row-major (a view)
        t = row_major(t)
        self.bucket, self.index, self.t, self.host, self.event = bucket, index, t, None, None
        if not t.is_cuda:
            return
        producer = torch.cuda.current_stream(t.device)
        if cuda_aware:
            self.event = torch.cuda.Event()
            self.event.record(producer)
            return
        side = _side_stream(t.device)
        side.wait_stream(producer)
        with torch.cuda.stream(side):
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(side)
        t.record_stream(side)

    def ready(self, block: bool) -> bool:
        if self.event is None:
            return True
        if block:
            self.event.synchronize()
            return True
        return bool(self.event.query())

    def buffer(self) -> Any:
        """What MPI sums in place: the host copy, the CPU tensor's memory, or the device tensor (CUDA-aware)."""
        if self.host is not None:
            return self.host.numpy()
        return self.t if self.t.is_cuda else self.t.numpy()


_SIDE: dict[Any, Any] = {}


def attach(reducer: "GradientReducer", runner: Any) -> None:
    """The gradient sum of a pipeline runner's partitions: launched after every backward action (``flush``), and,
    for GEMS's mirrored copies (a gradient group holding ranks of the rank's own pipeline line, which reach a
    bucket at another point of their exchange rounds), by the runner: each bucket between two rounds every holder
    shares (gems.pipeline.exchange.sum_points), at the points inside its action where nothing comes between
    (gems.pipeline.exchange.at_points, :meth:`GradientReducer.at_points`)."""
    runner.after_backward = reducer.flush
    if reducer.enabled and runner.schedule.holds_copies:
        reducer.at_points(())
        runner.sum_mirrors([b.keys for b in reducer.buckets], reducer.launch_bucket, reducer.at_points)


def _side_stream(device: torch.device) -> Any:
    """The stream that copies gradients to the host for MPI, one per device."""
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device=device)
    return _SIDE[device]


Layers = Mapping[int, nn.Sequential]


def _sequences(model: Any) -> Layers | None:
    """The layer sequences a reducer is given: one ``nn.Sequential`` (key 0), a mapping of them (a pipeline's
    partitions by index), or None for a bare iterable of parameters."""
    if isinstance(model, nn.Sequential):
        return {0: model}
    if isinstance(model, Mapping):
        return dict(model)
    return None


class GradientReducer:
    """Sum the gradients of a model over a group, overlapped with the backward in one order on every member.

    ``model``: an ``nn.Sequential`` of layers, or ``{partition index: nn.Sequential}`` (the partitions this rank
    runs), the same on every rank of the group; or an iterable of parameters, listed in the same order on every
    rank, whose sums then all start in :meth:`finish` (no points without the layers). ``group`` is a
    torch.distributed group, or an ``MPIGroup`` from :func:`mpi_group`, or None for a group of one (then nothing
    happens). ``overlap=False`` places no points: every sum starts in :meth:`finish` (or where :meth:`launch_bucket` is
    called). Where the group holds ranks the step exchanges messages with (GEMS's mirrored copies, in the same
    pipeline line), each reaches a bucket at another point of its exchange rounds: :func:`attach` puts the reducer
    in the pipeline runtime's hands, which launches each bucket between two rounds every holder shares
    (:meth:`launch_bucket`, gems.pipeline.exchange.sum_points) or names the buckets the running action may start at
    its points (:meth:`at_points`); what is left starts in :meth:`finish`.
    """

    def __init__(self, model: Any, group: Any, bucket_mb: float = 25.0, overlap: bool = True) -> None:
        layers = _sequences(model)
        if layers is not None:
            at: dict[nn.Parameter, tuple[int, int]] = {}  # parameter -> (sequence, first layer that holds it)
            for key in sorted(layers):
                for j, layer in enumerate(layers[key]):
                    for p in layer.parameters():
                        at.setdefault(p, (key, j))
            self.params = [p for p in at if p.requires_grad]
        else:
            self.params = [p for p in model if p.requires_grad]
            at = {p: (0, 0) for p in self.params}
        self.group = group
        self.enabled = group is not None
        self.overlap = overlap and layers is not None and self.enabled
        self.is_mpi = isinstance(group, MPIGroup)
        cap = max(1, int(bucket_mb * 2**20))
        # buckets in reverse order (the order gradients arrive), filled across sequences (a pipeline rank's
        # partitions, last first: their backwards end in that order), so a rank whose partitions are small sums
        # them in one collective, not one a partition
        self.buckets: list[_Bucket] = []
        cur: list[nn.Parameter] = []
        size = 0
        for p in reversed(self.params):
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self.buckets.append(_Bucket(cur, at))
                cur, size = [], 0
        if cur:
            self.buckets.append(_Bucket(cur, at))
        self._where = {id(p): i for i, b in enumerate(self.buckets) for p in b.params}
        self._expected: dict[int, int] = {}
        self._count: dict[int, int] = {}
        self._staged: list[_Staged] = []  # MPI sums waiting for their data, in launch order
        self._mpi_pending: list[Any] = []  # MPI sums launched and not yet seen complete (driven by _progress_mpi)
        self._armed = False
        #: GEMS's mirrored copies (:meth:`at_points`): the buckets the running action may start at its points, in
        #: order; None: every complete bucket at its own point (replicas and spatial parts)
        self._due: tuple[int, ...] | None = None
        self.wait_s = 0.0
        self._hooks: list[Any] = []
        if self.enabled:
            for p in self.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if self.overlap and layers is not None:
            self._instrument(layers, at)

    # ---- points and taps (docs/design.md, gradient sums) -------------------------------------------------------
    def _instrument(self, layers: Layers, at: dict[nn.Parameter, tuple[int, int]]) -> None:
        """A point on the input of each layer where a bucket starts, and taps on the layers whose parameters such a
        bucket holds. Not for a bucket that starts at its sequence's first layer (a whole small partition's): its
        point would be reached where the backward ends, so it starts at flush(), and its layers run untapped (a tap
        costs a small layer's forward and backward a few percent). A module run at two places, or a parameter two
        layers share (tied weights), would take two taps' worth of accumulations a backward, or one tapped and one
        not: its sums start in finish() instead (no overlap)."""
        seen_modules: set[int] = set()
        seen_params: set[int] = set()
        for seq in layers.values():
            for layer in seq:
                mods = {id(m) for m in layer.modules()}
                params = {id(p) for p in layer.parameters()}
                if mods & seen_modules or params & seen_params:
                    self.overlap = False
                    return
                seen_modules |= mods
                seen_params |= params
        points = {(b.key, b.first) for b in self.buckets if b.first > 0}
        # only a bucket's parameters in its point's sequence take taps: at a point, those of its other sequences
        # were completed (or not) by earlier actions, which every member has run alike (an action runs one
        # sequence; a rank's partitions' backwards end last partition first, so at its point they usually are)
        tapped = {id(p) for b in self.buckets if b.first > 0 for p in b.params if at[p][0] == b.key}
        for key, seq in layers.items():
            for j, layer in enumerate(seq):
                taps = [(m, name, p) for m in layer.modules() for name, p in m._parameters.items()
                        if p is not None and p.requires_grad and at.get(p) == (key, j) and id(p) in tapped]
                if not taps and (key, j) not in points:
                    continue
                swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
                self._hooks.append(layer.register_forward_pre_hook(
                    functools.partial(self._enter, key, j, (key, j) in points, taps, swapped)))
                self._hooks.append(layer.register_forward_hook(
                    functools.partial(_restore, swapped), always_call=True))

    def _enter(self, key: int, j: int, point: bool, taps: list[tuple[nn.Module, str, nn.Parameter]],
               swapped: list[tuple[nn.Module, str, nn.Parameter]], layer: nn.Module, args: tuple[Any, ...]) -> None:
        if not self._armed or not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
            return
        x = args[0]
        if not x.requires_grad:  # a model's first layer: its parameters' buckets launch at flush()
            return
        if point:
            x.register_hook(functools.partial(self._reached, key, j))
        if taps:
            views = _Tap.apply(x, [p for _, _, p in taps])
            for (m, name, p), v in zip(taps, views):
                m._parameters[name] = v  # type: ignore[assignment]  # for this forward only (_restore)
                swapped.append((m, name, p))

    def _reached(self, key: int, j: int, grad: torch.Tensor) -> None:
        """The point on the input of layer ``j`` of sequence ``key``: launch its complete buckets (for mirrored
        copies also those holding nothing of this sequence, completed in an earlier action: complete on every part;
        a bucket holding this sequence's first layers and another's last, of this one's, waits for flush(): its
        parameters here are complete only once the backward has left the sequence)."""
        if self._due is None:
            self._launch_where(lambda b: b.key == key and b.first >= j)
        else:
            self._launch_due(lambda b: (b.key == key and b.first >= j) or key not in b.keys)

    def flush(self) -> None:
        """The caller's backward has ended (on every member at the same place of its step): launch every complete
        bucket not launched yet, in bucket order (for mirrored copies: of the action's, :meth:`at_points`)."""
        if self._armed and self.overlap:
            if self._due is None:
                self._launch_where(lambda b: True)
            else:
                self._launch_due(lambda b: True)

    def at_points(self, buckets: tuple[int, ...]) -> None:
        """GEMS's mirrored copies: the pipeline runtime names the buckets the action it is about to run may start
        inside it, at its points and at :meth:`flush` (gems.pipeline.exchange.at_points: those it would launch
        right after the action), and ``()`` after it. They start in their order, each once it is complete at a
        point that reads it complete on every part, and none before the one ahead of it: so every holder issues
        them in one order, whatever its autograd's. Called once with ``()`` by :func:`attach`, which puts the
        reducer in this mode."""
        self._due = tuple(buckets)

    def _launch_due(self, here: Callable[[_Bucket], bool]) -> None:
        assert self._due is not None
        for i in self._due:
            b = self.buckets[i]
            if b.launched:
                continue
            if not (b.ready == len(b.params) and here(b)):
                return
            self._launch(b)

    def launch_bucket(self, i: int) -> None:
        """Start bucket ``i``'s sum now: where the pipeline runtime places the sums of GEMS's mirrored copies
        (gems.pipeline.exchange.sum_points: after the action that completes it, between the same two rounds on every
        holder). A bucket not complete then (parameters that took no gradient this step) is left to finish(), on
        every holder alike."""
        b = self.buckets[i]
        if self._armed and self.enabled and not b.launched and b.ready == len(b.params):
            self._launch(b)

    def _launch_where(self, due: Callable[[_Bucket], bool]) -> None:
        for b in self.buckets:
            if not b.launched and due(b) and b.ready == len(b.params):
                self._launch(b)

    # ---- step protocol ----------------------------------------------------------
    def start_step(self, expected: int | Callable[[nn.Parameter], int] = 1) -> None:
        """Arm the hooks: a parameter is ready after ``expected`` gradient accumulations this step."""
        for b in self.buckets:
            b.ready, b.parts, b.launched = 0, [], False
        self._count = {id(p): 0 for p in self.params}
        self._expected = {id(p): (expected(p) if callable(expected) else expected) for p in self.params}
        self._staged = []
        self._mpi_pending = []
        if self._due is not None:
            self._due = ()  # mirrored copies: none until the runtime names an action's
        self._armed = True
        self.wait_s = 0.0

    def _on_grad(self, p: nn.Parameter) -> None:
        """Counts a parameter's accumulations (it launches nothing: points do)."""
        if not self._armed:
            return
        if self._mpi_pending:
            self._progress_mpi()
        if self._staged:
            self._launch_staged(block=False)  # sums whose data the GPU has made since
        k = id(p)
        self._count[k] += 1
        if self._count[k] == self._expected[k]:
            self.buckets[self._where[k]].ready += 1

    def _launch(self, b: _Bucket) -> None:
        """Start the sums of bucket ``b``: large dense gradients in place (no copy: the hook fired after their
        last accumulation, so autograd no longer writes them), the small ones flattened into one tensor (none to
        make where they are the views of the bucket's flattened buffer: :meth:`static_grads`)."""
        b.launched = True
        small: list[nn.Parameter] = []
        tensors: list[tuple[torch.Tensor, list[nn.Parameter], bool]] = []
        for p in b.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if summed_in_place(p.grad.numel() * p.grad.element_size()) and dense(p.grad):
                tensors.append((p.grad, [p], False))
            else:
                small.append(p)
        if small and b.flat is not None and _views_of(b.flat, [_grad(p) for p in small]):
            tensors.append((b.flat, small, False))  # the same layout as the copy below: the same sums, bit for bit
        elif small:  # each gradient's memory in its order (a channels-last one as it lies), as the static views
            grads = [row_major(_grad(p)).reshape(-1) for p in small]
            flat = torch.cat(grads) if len(grads) > 1 else grads[0].clone()
            tensors.append((flat, small, True))
        if self.is_mpi:
            # MPI reads the buffer from the host's side: staged (gems.replication._Staged) and launched in
            # bucket order once the GPU has produced it, without blocking the backward
            b.parts = [(t, ps, copy, None, None) for t, ps, copy in tensors]
            self._staged += [_Staged(b, i, t, self.group.cuda_aware) for i, (t, _, _) in enumerate(tensors)]
            self._launch_staged(block=False)
            return
        b.parts = [(t, ps, copy, *self._start(t)) for t, ps, copy in tensors]

    def _launch_staged(self, block: bool) -> None:
        """Hand the staged MPI sums whose data is ready to MPI, in staging order (every rank launches the
        same sums in the same order); ``block``: wait for each in turn (the end of the step)."""
        from mpi4py import MPI

        while self._staged:
            st = self._staged[0]
            if not st.ready(block):
                return
            self._staged.pop(0)
            _, ps, copy, _, _ = st.bucket.parts[st.index]
            handle = self.group.comm.Iallreduce(MPI.IN_PLACE, st.buffer(), op=MPI.SUM)
            st.bucket.parts[st.index] = (st.t, ps, copy, handle, st.host)  # the row-major view of the sum
            self._mpi_pending.append(handle)

    def _progress_mpi(self) -> None:
        """Let MPI move the sums in flight (``Test`` on each): without an asynchronous progress thread, which Cray
        MPICH and MPICH leave off by default, a non-blocking collective advances only inside MPI calls, so the
        sums launched during the backward would mostly run in :meth:`finish`. Called from every gradient hook."""
        self._mpi_pending = [h for h in self._mpi_pending if not h.Test()]

    def _start(self, t: torch.Tensor) -> tuple[Any, Any]:
        """Start the sum of ``t`` in place over the torch.distributed group: (handle, None)."""
        import torch.distributed as dist

        return capture.launch(lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True),
                              self.group), None

    def finish(self, timed: bool = True) -> float:
        """Launch what the hooks did not, wait for every bucket, write sums back. Returns seconds waited (0 with
        ``timed=False``: inside a CUDA graph's capture, where no event may be timed)."""
        if not self.enabled:
            self._armed = False
            return 0.0
        device = self.params[0].device if self.params else None
        t0 = timers.now(device) if timed else None  # on GPUs the compute stream's stall, read at the step's end
        with waiting("gradient sum"):
            self._wait_all()
        self._armed = False
        self.wait_s = 0.0
        if t0 is not None:
            timers.add_since(self.__dict__, "wait_s", t0)
        return self.wait_s

    def static_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Gradient tensors for a CUDA graph to own (gems.rank.graphs), one a parameter, in bucket order: a
        gradient that :func:`summed_in_place` is its own tensor in the parameter's memory format; the small ones
        of a bucket are views of one flattened buffer in the order :meth:`_launch` flattens them, which the sum
        then reads in place (no copy in, none back). Every one has its parameter's strides (a channels-last
        weight's view is laid out channels-last over its span of the buffer: :func:`_segment`), as autograd's
        gradients have and torch's fused optimizers require on a GPU (their CUDA kernels check that parameters,
        gradients and state share sizes and strides). Allocated once; the graph zeroes and attaches them before
        each backward."""
        out: list[tuple[nn.Parameter, torch.Tensor]] = []
        for b in self.buckets:
            small = [p for p in b.params if not summed_in_place(p.numel() * p.element_size())]
            b.flat = torch.zeros(sum(p.numel() for p in small), dtype=small[0].dtype, device=small[0].device) \
                if small else None
            off = 0
            for p in b.params:
                if summed_in_place(p.numel() * p.element_size()):
                    out.append((p, torch.zeros_like(p)))
                else:
                    assert b.flat is not None
                    out.append((p, _segment(b.flat, off, p)))
                    off += p.numel()
        return out

    def _wait_all(self) -> None:
        for b in self.buckets:  # the rest, in bucket order: parameters that got no (or fewer) gradients this step
            if not b.launched:
                self._launch(b)
        if self.is_mpi:
            self._launch_staged(block=True)
        for b in self.buckets:
            for t, ps, copy, handle, host in b.parts:
                handle.Wait() if self.is_mpi else handle.wait()
                if host is not None:
                    t.copy_(host, non_blocking=True)  # pinned host -> device, ordered on the current stream
                if copy:
                    off = 0
                    for p in ps:
                        n = p.numel()
                        g = row_major(_grad(p))  # (a view: written in the order it was flattened)
                        g.copy_(t[off:off + n].view(g.shape))
                        off += n
            b.parts = []

    def hook_ids(self) -> set[int]:
        """The ids of the hooks this reducer placed on the layers (its points and taps)."""
        return {h.id for h in self._hooks}

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _segment(flat: torch.Tensor, off: int, p: torch.Tensor) -> torch.Tensor:
    """``flat[off:off + p.numel()]`` as a tensor of ``p``'s shape and strides (``p`` dense in some order of its
    dims: its memory is that span in that order); row-major where ``p`` is not dense (autograd's layout then)."""
    span = flat[off:off + p.numel()]
    return span.as_strided(p.shape, p.stride()) if dense(p) else span.view(p.shape)


def _views_of(flat: torch.Tensor, grads: list[torch.Tensor]) -> bool:
    """Whether ``grads`` are, in order, consecutive dense views that make up ``flat``, each covering its span in
    its own order (:func:`_segment`: the order :meth:`GradientReducer._launch` flattens a copy in)."""
    base, off, item = flat.data_ptr(), 0, flat.element_size()
    for g in grads:
        if g.data_ptr() != base + off * item or not dense(g) or g.dtype != flat.dtype:
            return False
        off += g.numel()
    return off == flat.numel()


def averaged_buffers(modules: list[nn.Module], group: Any) -> list[torch.Tensor]:
    """The buffers :func:`average_buffers` averages over the copies of ``modules``: every floating one (BatchNorm's
    running statistics), where the gradient group holds more than this rank (``group`` not None)."""
    return [b for m in modules for b in m.buffers() if b.is_floating_point()] if group is not None else []


def average_buffers(buffers: list[torch.Tensor], group: Any, size: int, flat: torch.Tensor | None = None) -> None:
    """Average floating buffers over ``group`` (``size`` ranks), so every copy keeps the same running statistics
    (replicas and mirrored GEMS partitions see different samples): summed in one flattened fp32 tensor, divided,
    copied back; where ``flat`` is given, the buffers are its views (:func:`flat_buffers`) and it is summed in
    place (the same values: no copy in, none back)."""
    import torch.distributed as dist

    if flat is not None:
        capture.launch(lambda: dist.all_reduce(flat, group=group), group)
        flat /= size
        return
    flat = torch.cat([b.reshape(-1).float() for b in buffers])
    capture.launch(lambda: dist.all_reduce(flat, group=group), group)
    flat /= size
    off = 0
    for b in buffers:
        b.copy_(flat[off:off + b.numel()].view_as(b))
        off += b.numel()


def flat_buffers(modules: list[nn.Module], buffers: list[torch.Tensor]) -> torch.Tensor | None:
    """Make ``buffers`` (of ``modules``) the views of one flattened fp32 tensor, in order, values kept, so that
    :func:`average_buffers` sums them in place (a graphed step); returns that tensor, or None where a buffer is not
    fp32 (then the average copies, with the same result)."""
    if not buffers or any(b.dtype != torch.float32 for b in buffers):
        return None
    flat = torch.cat([b.detach().reshape(-1) for b in buffers])
    views, off, where = [], 0, {id(b): i for i, b in enumerate(buffers)}
    for b in buffers:
        views.append(flat[off:off + b.numel()].view(b.shape))
        off += b.numel()
    for root in modules:
        for m in root.modules():
            for name, t in list(m._buffers.items()):
                if t is not None and id(t) in where:
                    m._buffers[name] = views[where[id(t)]]
    buffers[:] = views
    return flat


def _restore(swapped: list[tuple[nn.Module, str, nn.Parameter]], layer: nn.Module, args: Any, out: Any) -> None:
    """After a tapped layer's forward (or its failure): the parameters back in their modules."""
    for m, name, p in swapped:
        m._parameters[name] = p
    swapped.clear()
