"""The plain step replayed from one CUDA graph (gems.rank.graphs): the forward, the loss, the backward into the
graph's own gradients, the sums at the reducer's points, BatchNorm's averages over the copies, the step's sync and
(``train.graph_optimizer``) the update."""
from __future__ import annotations

import zlib
from typing import Any, Callable

import torch

from gems import progress
from gems.fault import all_finite
from gems.layers import batch_context
from gems.rank import graphs
from gems.rank.steppers.plain import PlainStepper
from gems.rank.sync import all_reduce_sum, step_sync, with_flags
from gems.replication import average_buffers, averaged_buffers, flat_buffers


class GraphedStepper(PlainStepper):
    """The plain step as one function of static tensors, replayed from a graph. A batch of another shape, or a model
    with hooks a replay would skip (a fault injection's), runs the eager step with the same sums, averages and sync,
    in the same order. Its figures hold whether this rank's input and output were finite."""

    averages_buffers = True

    def __init__(self, plain: PlainStepper, mesh: Any, graph_optimizer: bool) -> None:
        super().__init__(plain.parts, plain.reducer, plain.samples_per_step, plain.forward)
        p, reducer = self.parts, self.reducer
        self.grads = reducer.static_grads()  # the graph's own gradients: they never alias a buffer unsafely
        self.zeroed = [b.flat for b in reducer.buckets if b.flat is not None] + \
            [g for _, g in self.grads if g._base is None]
        self.group = mesh.group("grad")
        self.buffers = averaged_buffers([p.seq], self.group)
        self.flat = flat_buffers([p.seq], self.buffers)  # one sum in place over the copies
        self.copies = len(mesh.ranks("grad"))
        self.optimizer_in_step = graph_optimizer and not p.scaler.enabled  # fp16 decides its skip on the host
        if graph_optimizer and p.scaler.enabled:
            self.notes.append("train.graph_optimizer: fp16's skipped steps are decided on the host: the optimizer "
                              "stays outside the graph")
        self.optimizer: Any = None  # made after the composition (adopt)
        self.graph = graphs.StepGraph(self.body, p.world.device, p.world.rank, self.touched, grads=self.grads,
                                      static=self.static)
        self.own_hooks = reducer.hook_ids()

    def adopt(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def flag(self, ok: torch.Tensor | bool) -> torch.Tensor:
        """A finiteness flag as float64 (a fill, not a copy from the host: capturable)."""
        return ok.to(torch.float64).reshape(1) if isinstance(ok, torch.Tensor) else \
            torch.full((1,), float(ok), dtype=torch.float64, device=self.world.device)

    def body(self, s: graphs.Static) -> None:
        """The step the graph holds, on its static tensors."""
        p, reducer = self.parts, self.reducer
        reducer.start_step()
        for q, g in self.grads:  # attached again each step: zero_grad in either form leaves them as they were made
            q.grad = g
        torch._foreach_zero_(self.zeroed)
        ok_in = all_finite(s.x)
        progress.mark("forward")
        with batch_context(p.seed, 0, range(s.x.shape[0]), keys=s.keys):
            with graphs.uncached(p.amp):
                out = p.seq(s.x)
            ok_out = all_finite(out)
            loss = p.loss_fn(out, s.y)
            progress.mark("backward")
            p.scaler.scale_on_device(loss).backward()
        reducer.finish(timed=False)  # (no event may be timed inside a capture)
        if self.buffers:
            average_buffers(self.buffers, self.group, self.copies, self.flat)
        pair = torch.stack([loss.detach().reshape(()).to(torch.float64), s.stop.to(torch.float64)])
        all_reduce_sum(pair, self.world)  # the step's sync (gems.rank.sync.step_sync's collective)
        s.figures.copy_(with_flags(pair, self.flag(ok_in), self.flag(ok_out)))
        if self.optimizer_in_step:
            self.optimizer.step()

    def eager(self, x: torch.Tensor, y: torch.Tensor, ids: list[int], step: int, stop: int) -> torch.Tensor:
        """The same step eager: the plain step, then the averages, the sync and the update, in the body's order."""
        local = self.forward_backward(x, y, ids, step)
        if self.buffers:
            average_buffers(self.buffers, self.group, self.copies, self.flat)
        pair = step_sync(local, stop, self.world)
        if self.optimizer_in_step:
            self.optimizer.step()
        return with_flags(pair, self.flag(self.finite[0]), self.flag(self.finite[1]))

    def static(self) -> list[torch.Tensor]:
        """What the body reads that outlives it, besides what it changes: the parameters, the sums' buffers, the
        optimizer's rate where it is a tensor (the stand-in holds each replay to these: gems.rank.graphs.Trace)."""
        out = [q.detach() for q in self.params] + [b.flat for b in self.reducer.buckets if b.flat is not None]
        out += [self.flat] if self.flat is not None else []
        if self.optimizer is not None:
            out += [g["lr"] for g in self.optimizer.param_groups if isinstance(g.get("lr"), torch.Tensor)]
        return out

    def touched(self) -> list[torch.Tensor]:
        """What a step changes beyond its outputs (the stand-in's capture puts it back)."""
        out = list(self.parts.seq.buffers())
        if self.optimizer_in_step:
            out += [q.detach() for q in self.params]
            out += [v for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    def step(self, x: torch.Tensor | None, y: torch.Tensor | None, ids: list[int], step: int,
             stop: Callable[[], int], quiesce: bool = False) -> torch.Tensor:
        """The step with its sync: [global loss, stop, input finite, output finite] on the device."""
        assert x is not None and y is not None
        request = stop()
        with progress.waiting("step sync"):
            return self.synced(x, y, ids, step, request)

    def synced(self, x: torch.Tensor, y: torch.Tensor, ids: list[int], step: int, stop: int) -> torch.Tensor:
        graph = self.graph
        if graph.ran == 0 and not graph.refused:
            foreign = graphs.hooked([self.parts.seq], self.own_hooks)
            hooks, shapes = self.agree(foreign is not None, x, y)
            if hooks or shapes:  # every rank's step eager
                graph.refused = True
                why = (f"hooks on the model ({foreign}; a replay would skip them)" if foreign else
                       "hooks on another rank's model (a replay would skip them there)" if hooks else
                       "the ranks' batches differ in shape")
                every = ("; every rank runs it eager (NCCL asks that a collective be captured on every rank or on "
                         "none)") if self.world.size > 1 else ""
                self.notes.append(f"train.cuda_graphs: the step runs eager: {why}{every}")
        if graph.refused or not graph.fits(x, y):
            return self.eager(x, y, ids, step, stop)
        return graph.run(x, y, self.parts.seed, step, ids, stop)

    def agree(self, hooked: bool, x: torch.Tensor, y: torch.Tensor) -> tuple[bool, bool]:
        """Before the first step, alike on every rank: (whether some rank's model has hooks a replay would skip,
        whether the ranks' batches differ in shape). Whether a collective is captured must be the same on every
        rank that takes part in it (NCCL's rule; the body's sums and sync span the world), so one rank's reason to
        run eager is every rank's: one all-reduce over the world, at the first step (not timed). A later batch of
        another shape is another shape on every rank (every rank trains whole batches in equal shares of one data
        set), so a rank runs that step eager where all do."""
        world = self.world
        if world.size == 1:
            return hooked, False
        import torch.distributed as dist

        shape = zlib.crc32(repr((tuple(x.shape), x.dtype, tuple(y.shape), y.dtype)).encode())
        t = torch.tensor([int(hooked), shape, -shape], dtype=torch.int64, device=world.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        got = t.tolist()
        return got[0] > 0, got[1] != -got[2]

    def replay_note(self) -> str | None:
        if not self.graph.replayed:
            return None
        spatial = self.parts.ctx is not None
        return graphs.GRAPHED_NOTE.format(
            eager=graphs.EAGER_STEPS, halos=" with its halo exchanges (train.graph_spatial)" if spatial else "",
            optimizer="" if self.optimizer_in_step else "the optimizer's update (one fused kernel), ")
