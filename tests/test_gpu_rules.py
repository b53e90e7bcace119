"""Device rules a CPU machine can check for GPU ranks (docs/design.md, "Rules of the GPU path").

Every rank of a job on one kind of device, never two ranks on one GPU: agreed through the rendezvous store
before any process group starts (gems.bootstrap.check_devices), here over a real TCPStore with one thread
per rank, each claiming the device a GPU node would give it. What cannot be checked without GPUs: that
``torch.cuda.get_device_properties(...).uuid`` tells GPUs apart (CUDA documents it as unique per device).
"""
from __future__ import annotations

import datetime
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gems.bootstrap import check_devices
from gems.errors import ConfigError
from gems.launch.world import free_port


def _agree(devices: list[tuple[str, str]]) -> list[Any]:
    """Run check_devices on one thread per rank over a real TCPStore; each rank's outcome (None or error)."""
    size, port = len(devices), free_port()
    master = dist.TCPStore("127.0.0.1", port, size, True, timeout=datetime.timedelta(seconds=20),
                           wait_for_workers=False)
    out: list[Any] = [None] * size

    def rank(r: int) -> None:
        store = master if r == 0 else dist.TCPStore("127.0.0.1", port, size, False,
                                                    timeout=datetime.timedelta(seconds=20))
        kind, gpu = devices[r]
        try:
            check_devices(store, r, size, torch.device(kind), gpu)
        except ConfigError as e:
            out[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_one_gpu_each_passes() -> None:
    assert _agree([("cuda", "n1/GPU-a"), ("cuda", "n1/GPU-b"), ("cuda", "n2/GPU-a")]) == [None] * 3
    assert _agree([("cpu", ""), ("cpu", "")]) == [None, None]


def test_ranks_without_a_gpu_among_gpu_ranks_stop_every_rank() -> None:
    out = _agree([("cuda", "n1/GPU-a"), ("cpu", ""), ("cuda", "n1/GPU-b")])
    assert all(isinstance(e, ConfigError) and e.key == "train.device" and "2 of its 3 ranks" in str(e) for e in out), out


def test_two_ranks_on_one_gpu_are_named() -> None:
    out = _agree([("cuda", "n1/GPU-a"), ("cuda", "n1/GPU-a"), ("cuda", "n1/GPU-c")])
    assert isinstance(out[0], ConfigError) and isinstance(out[1], ConfigError) and out[2] is None, out
    assert out[0].key == "cluster.tasks_per_node" and "GPU-a on n1" in str(out[0])


def test_the_local_launcher_refuses_more_ranks_than_this_machines_gpus(monkeypatch) -> None:
    """A machine with one GPU (a stand-in for torch.cuda: this one has none) and a 2-rank job: refused before
    launch, exit 2 naming the ranks (NCCL would fail with "Duplicate GPU detected" on the two ranks of one GPU);
    one rank passes and runs on the GPU."""
    from gems.bootstrap import check_launch
    from gems.config import compose

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"^parallel='2 ranks': expected at most 1 ranks per node, one per GPU"):
        check_launch(compose(["parallel.replicas=2"]), 2)
    assert check_launch(compose([]), 1) == "cuda"
    with pytest.raises(ConfigError, match=r"^comm.backend=gloo"):  # gloo has no CUDA point-to-point messages
        check_launch(compose(["comm=gloo"]), 1)


def test_a_pipeline_rank_without_parameters_receives_on_its_device() -> None:
    """A partition of pooling layers holds no parameters: its receive buffers go on the rank's device, not
    on the CPU (the runtime took the device from the first parameter)."""
    from gems.pipeline.runtime import PipelineRunner
    from gems.pipeline.schedules import make_schedule

    sched = make_schedule("lp", 2)
    runner = PipelineRunner({1: nn.Sequential(nn.AvgPool2d(2))}, sched, 1, [0, 1], {(0, 1): None, (1, 0): None},
                            batch_size=2, loss_fn=lambda y, t, n: y.sum(), device=torch.device("meta"))
    assert runner.device == torch.device("meta") and not runner.parameters()


@pytest.mark.parametrize("cut", [2, 3])
def test_avg_pool_correction_lives_on_the_output_device(cut: int) -> None:
    """A padded average pool cut in parts rescales its edge outputs by a correction made once on the output's
    device (it was a host tensor multiplied into a device tensor in every forward)."""
    from gems.spatial.context import SpatialContext
    from gems.spatial.layers.pool import SpatialAvgPool

    sctx = SpatialContext(None, list(range(cut)), (cut,), (0,), (0,))
    layer = SpatialAvgPool(nn.AvgPool2d(3, 2, 1, count_include_pad=False), sctx, "pool", 2)
    y = torch.ones(1, 2, 4, 8, device="meta")
    fix = layer._fix(((0, 5), (0, 8)), (9, 16), y)
    assert fix is not None and fix.device == y.device
    assert layer._fix(((0, 5), (0, 8)), (9, 16), y) is fix  # made once


def test_upsample_indices_and_weights_live_on_the_output_device_made_once() -> None:
    """A cut linear upsample gathers its sources by index: indices and weights are placed on the output's
    device once (a device the host cannot compute on, meta, stands for a GPU: a host tensor meeting it fails)."""
    from gems.spatial import apply_spatial
    from gems.spatial.context import SpatialContext

    sctx = SpatialContext(None, [0], (1,), (0,), (0,))
    (layer,) = apply_spatial(nn.Sequential(nn.Upsample(scale_factor=2, mode="linear")), sctx, None)
    x = torch.ones(1, 2, 8, device="meta")
    assert layer(x).shape == (1, 2, 16)
    placed = layer.__dict__["_placed"]
    assert list(placed) == [((8,), torch.device("meta"), torch.float32)]
    assert all(t.device.type == "meta" for entry in placed.values() for trio in entry for t in trio)
    first = placed[((8,), torch.device("meta"), torch.float32)]
    layer(x)
    assert layer.__dict__["_placed"][((8,), torch.device("meta"), torch.float32)] is first  # not in every forward


def test_a_pipeline_step_reads_nothing_on_the_host(monkeypatch) -> None:
    """The micro-batch losses are summed on the device and the step returns that sum unread (a host read per
    micro-batch stalled a GPU's queue once per micro-batch; the loop reads the step's loss once, at its end)."""
    import gems.pipeline.runtime as rt
    from gems.pipeline.schedules import make_schedule

    torch.manual_seed(0)
    sched = make_schedule("gpipe", 1, micro_batches=4)
    part = nn.Sequential(nn.Linear(3, 2))
    runner = rt.PipelineRunner({0: part}, sched, 0, [0], None, batch_size=8,
                               loss_fn=lambda y, t, n: ((y - t) ** 2).sum() / 8)
    x, y = torch.randn(8, 3), torch.randn(8, 2)
    with _HostReads() as reads:
        loss = runner.step(x, y, list(range(8)), seed=0, step=0)
    assert reads.count == 0 and isinstance(loss, torch.Tensor) and loss.dim() == 0
    with torch.no_grad():
        expected = float(((part(x) - y) ** 2).sum() / 8)
    assert abs(float(loss) - expected) < 1e-5


class _HostReads:
    """Counts what would make the host wait for a GPU, on any device: scalar reads of a tensor (``item``,
    ``float``, ``bool``: aten's ``_local_scalar_dense``, seen by a dispatch mode), ``tolist``, ``cpu``,
    ``numpy``, and the loop's device synchronisation (``gems.rank.profiling.device_sync``: ``torch.cuda.synchronize``)."""

    def __init__(self, host: set[int] | None = None) -> None:
        self.count = 0
        self.where: list[str] = []
        self._undo: list[Any] = []
        self.host = host or set()  # ids of tensors that live on the host on a GPU rank too (Adam's step counts)

    _active: list["_HostReads"] = []  # counters inside counters: only the innermost counts (an evaluation in a step)

    def _hit(self, what: str) -> None:
        import traceback

        if self._active and self._active[-1] is not self:
            return
        self.count += 1
        frames = [f for f in traceback.extract_stack()[:-2] if "/gems/" in f.filename]
        self.where.append(f"{what} at {frames[-1].filename.split('/gems/')[-1]}:{frames[-1].lineno}" if frames else what)

    def __enter__(self) -> "_HostReads":
        from torch.utils._python_dispatch import TorchDispatchMode

        import gems.rank.profiling as profiling

        outer = self

        class Reads(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func is torch.ops.aten._local_scalar_dense.default and id(args[0]) not in outer.host:
                    outer._hit("a scalar read")
                return func(*args, **(kwargs or {}))

        for name in ("tolist", "cpu", "numpy"):
            real = getattr(torch.Tensor, name)

            def wrap(t, *a, _real=real, _name=name, **k):  # type: ignore[no-untyped-def]
                outer._hit(_name)
                return _real(t, *a, **k)

            self._undo.append((torch.Tensor, name, real))
            setattr(torch.Tensor, name, wrap)
        real_sync = profiling.device_sync
        self._undo.append((profiling, "device_sync", real_sync))
        profiling.device_sync = lambda device: (outer._hit("a device synchronisation"), real_sync(device))[1]  # type: ignore
        self._mode = Reads()
        self._mode.__enter__()
        self._active.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._active.remove(self)
        self._mode.__exit__(*exc)
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)


def _count_reads(rank: int, size: int, extra: list[str]) -> dict[str, dict[int, list[str]]]:
    """One rank of a training run of the loop in this process (``size`` ranks: a run_world's gloo world), every
    host read of its measured steps and of its evaluations counted by :class:`_HostReads`: {"step": {step: where},
    "evaluate": {step: where}}."""
    import contextlib
    import io

    from omegaconf import open_dict

    import gems.rank.loop as loop
    from gems.bootstrap import World
    from gems.config import compose

    cfg = compose(["model.size=32", "model.width=0.25", "train.batch_size=4", "train.steps=5",
                   "train.warmup_steps=2", "train.check_fit=false", *extra])
    with open_dict(cfg):
        cfg.run_id = "sync-count"
        cfg.results.dir = f"/tmp/gems-test-sync-count-{size}"
    world = World(rank, size, rank, "127.0.0.1", 0, "single", torch.device("cpu"), "gloo", "torch", None, "localhost")
    seen: dict[str, dict[int, list[str]]] = {"step": {}, "evaluate": {}}
    from gems.rank.hooks import Evaluation

    real_step, real_eval = loop.Loop.one_step, Evaluation.after_step

    def counted(self, step):  # type: ignore[no-untyped-def]
        if step < self.state.plan.measure_from:  # CPU ranks profile their first steps' tensor memory: not a GPU's
            return real_step(self, step)
        # torch's Adam keeps each parameter's step count on the host, on GPU ranks too: reading it waits for nothing
        host = {id(st["step"]) for st in self.state.opt.state.values() if isinstance(st.get("step"), torch.Tensor)}
        with _HostReads(host) as reads:
            out = real_step(self, step)
        seen["step"][step] = reads.where
        return out

    def evaluated(self, result):  # type: ignore[no-untyped-def]
        if not self.state.plan.evaluates(result.step):
            return real_eval(self, result)
        with _HostReads() as reads:
            out = real_eval(self, result)
        seen["evaluate"][result.step] = reads.where
        return out

    loop.Loop.one_step, Evaluation.after_step = counted, evaluated  # type: ignore[method-assign]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            loop.train(cfg, world)
    finally:
        loop.Loop.one_step, Evaluation.after_step = real_step, real_eval  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("extra", [[], ["parallel.schedule=gpipe", "parallel.micro_batches=2"],
                                   ["train.precision=bf16"]], ids=["whole", "pipeline", "bf16"])
def test_a_training_step_synchronises_with_its_device_once(extra: list[str]) -> None:
    """A GPU waits for its host wherever the host waits for it: measured on an H200, gems's step trailed a plain
    loop by 11-13%. A step of the training loop (one rank, in this process) reads the device at most once: its
    loss and stop flag, after the optimizer's update is queued. Counted on CPU through the same code paths: every
    scalar read, tolist, cpu or numpy, and the loop's device synchronisation, in the measured steps."""
    per_step = _count_reads(0, 1, extra)["step"]
    assert sorted(per_step) == [2, 3, 4]
    for step, where in per_step.items():
        assert len(where) <= 1, (step, where)


VALIDATE = ["data.val_samples=8", "train.eval_every=2"]


@pytest.mark.parametrize("extra", [
    ["parallel.pipeline=2", "parallel.spatial=2", "parallel.schedule=1f1b", "parallel.micro_batches=2", *VALIDATE],
    ["parallel.pipeline=2", "parallel.spatial=2", "parallel.schedule=gpipe", "parallel.micro_batches=2",
     "parallel.checkpoint=true"],
    ["parallel.replicas=2", "parallel.spatial=2", *VALIDATE],
], ids=["D2xS2-1f1b", "D2xS2-recompute", "R2xS2"])
def test_every_mesh_reads_its_device_once_a_step(extra: list[str]) -> None:
    """The same count on every rank of 4-rank meshes: spatial parts behind a pipeline cut (its activations carry
    their global shape from the first step's header: the stage's first spatial layer summed it over the parts and
    read it on the host once a micro-batch, again in the recomputation and in every evaluation batch), with
    recomputation, and R x S; an evaluation reads its figures once, whatever the batches."""
    from gems.launch.world import run_world

    for rank, seen in enumerate(run_world(_count_reads, 4, extra, timeout=300)):
        assert sorted(seen["step"]) == [2, 3, 4], rank
        for step, where in seen["step"].items():
            assert len(where) <= 1, (rank, step, where)
        if "train.eval_every=2" in extra:
            assert sorted(seen["evaluate"]) == [1, 3, 4], rank
            for step, where in seen["evaluate"].items():
                assert len(where) <= 1, (rank, step, where)


# ---- the memory format, coalesced halo batches, the reader thread's device (issue 42, items 4-7) ------------------
def _channels_last_world(rank: int, world: int) -> dict[str, Any]:
    """A model in channels-last (as gems places convolutions on GPUs), its gradients summed over 2 ranks by the
    reducer, and a 2-stage pipeline of it whose cuts cross in channels-last; what each saw."""
    import copy

    from gems.mesh import Mesh
    from gems.pipeline import apply_pipeline
    from gems.replication import GradientReducer

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 256, 3, padding=1), nn.ReLU(), nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(256, 2, 1))  # the middle weight: 2.25 MiB, summed in place
    plain = copy.deepcopy(net)
    net = net.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(rank)).to(memory_format=torch.channels_last)
    red = GradientReducer(net, dist.group.WORLD, bucket_mb=1.0)
    red.start_step()
    net(x).pow(2).sum().backward()
    red.flush()
    parts = [(copied, [tuple(p.shape) for p in ps], t.data_ptr() == ps[0].grad.data_ptr())
             for b in red.buckets for t, ps, copied, _, _ in b.parts]
    red.finish()
    out: dict[str, Any] = {"grads": [p.grad.clone() for p in net.parameters()], "parts": parts,
                           "cl": net[2].weight.grad.is_contiguous(memory_format=torch.channels_last)}
    # the pipeline: stage 0 on rank 0, stage 1 on rank 1; every message a channels-last tensor
    mesh = Mesh(pipeline=2, world_size=world)
    mesh.build_groups(rank)
    seq = copy.deepcopy(plain).to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    runner = apply_pipeline(seq, mesh, rank, loss_fn=lambda y, t, n: y.pow(2).sum(), batch_size=4,
                            schedule="gpipe", micro_batches=2, balance=[3, 2], sample_shape=(3, 6, 6))
    runner.memory_format = torch.channels_last
    sent: list[bool] = []
    real = runner._batch  # what every round hands to torch.distributed (one batch, or over gloo one op at a time)

    def spy(ops, keys):  # type: ignore[no-untyped-def]
        # a channels-last (2, 256, 6, 6) activation or gradient crosses as its own memory: a (2, 6, 6, 256) block
        sent.extend(op.tensor.is_contiguous() and tuple(op.tensor.shape) == (2, 6, 6, 256)
                    for op in ops if op.tensor.dim() == 4)
        return real(ops, keys)

    runner._batch = spy  # type: ignore[method-assign]
    xs = torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(9)).to(memory_format=torch.channels_last)
    runner.step(xs if rank == 0 else None, torch.zeros(4) if rank == 1 else None, list(range(4)), 0, 0)
    out["sent"] = sent
    out["pipe_grads"] = [p.grad.clone() for p in runner.parameters()]
    return out


def test_channels_last_gradients_are_summed_in_place_and_cuts_cross_in_channels_last() -> None:
    """On GPUs gems computes convolutions in channels-last (gems.rank.compose), so no convolution gradient is
    ``is_contiguous()``: the reducer copied every large one before its sum. Checked on CPU with a channels-last
    model: the 2.25 MiB gradient is summed in its own ``.grad`` (no copy), the sums equal one process's; a pipeline
    of it sends its channels-last activations and gradients as they lie in memory and receives them into
    channels-last buffers (they were converted to NCHW on the way out and back on the way in) and computes the
    serial gradients."""
    import copy

    from gems.launch.world import run_world

    out = run_world(_channels_last_world, 2)
    for o in out:
        assert o["cl"]
        in_place = [shapes for copied, shapes, same in o["parts"] if not copied]
        assert in_place == [[(256, 256, 3, 3)]], o["parts"]
        assert all(same for copied, _, same in o["parts"] if not copied)
        assert o["sent"] and all(o["sent"]), o["sent"]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 256, 3, padding=1), nn.ReLU(), nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(256, 2, 1))
    plain = copy.deepcopy(net)
    for rank in range(2):
        net(torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(rank))).pow(2).sum().backward()
    for g, p in zip(out[0]["grads"], net.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4)
    plain(torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(9))).pow(2).sum().backward()
    pipe = out[0]["pipe_grads"] + out[1]["pipe_grads"]
    for g, p in zip(pipe, plain.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4)


def _coalesced_world(rank: int, world: int) -> list[str]:
    """A cut convolution and pool whose halo batches come back as one work each, as NCCL's coalescing path hands
    them (gloo gives one a message): the layers must not count on a work per message."""
    from _spatial_worlds import model_cases, run_case

    from gems.spatial import SpatialContext

    class _One:  # as NCCL's work: waiting again for a completed one returns at once (a gloo work must not)
        def __init__(self, works: list[Any]) -> None:
            self.works = works

        def wait(self) -> bool:
            for w in self.works:
                w.wait()
            self.works = []
            return True

        def is_completed(self) -> bool:
            return all(w.is_completed() for w in self.works)

    real = dist.batch_isend_irecv
    dist.batch_isend_irecv = lambda ops: [_One(real(ops))]  # type: ignore[assignment]
    try:
        sctx = SpatialContext(None, list(range(world)), (world,), (0,), (rank,), overlap=True)
        build, shape, _, opts = model_cases()["cosmoflow"]
        return run_case(build, shape, sctx, opts)
    finally:
        dist.batch_isend_irecv = real  # type: ignore[assignment]


def test_halo_batches_hold_with_one_work_for_the_whole_batch() -> None:
    """Under NCCL torch may return a single work for a whole ``batch_isend_irecv``: the halo code waited for
    receives and sends by their index in a work a message, which that path does not give. CosmoFlow cut in 2
    parts, every batch one work (gems.spatial.context.Posted), equals the serial model."""
    from gems.launch.world import run_world

    assert run_world(_coalesced_world, 2) == [[], []]


def test_a_halo_batch_holds_one_message_per_peer_and_its_buffers() -> None:
    """A pair's messages match by the order of its batches (NCCL has no tags): a batch holds at most one message
    each way per peer, and keeps every buffer it moves."""
    from gems.spatial.context import Posted, SpatialContext

    one = object()
    p = Posted([one], 2, 1, [torch.zeros(1)] * 3)
    assert p.receives == [one] and p.sends == [one] and len(p.buffers) == 3
    p = Posted(["r1", "r2", "s"], 2, 1, [])
    assert p.receives == ["r1", "r2"] and p.sends == ["s"]
    sctx = SpatialContext(None, [0, 1, 2], (3,), (0,), (1,))
    with pytest.raises(ValueError, match="one halo message per peer"):
        sctx.exchange([(0, torch.zeros(1)), (0, torch.zeros(1))], [])


def test_the_reader_thread_sets_its_device_first(monkeypatch) -> None:
    """CUDA keeps a current device per thread, GPU 0 unless set: the reader thread pinned memory and ran its side
    stream without setting the rank's GPU, which can make a context on GPU 0 for every local rank. Stand-ins for
    torch.cuda (this machine has no GPU) record the device each thread set before it fetched a batch. What only
    a GPU shows: each rank's process holding memory on its own GPU alone (the rig: scripts/gpu_check.sh)."""
    import threading

    from gems.rank.data import Prefetcher

    current: dict[str, Any] = {}
    seen: list[tuple[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.__setitem__(threading.current_thread().name, d))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: object())

    class _Ctx:
        def __init__(self, *a: Any) -> None:
            pass

        def __enter__(self) -> None:
            return None

        def __exit__(self, *a: Any) -> None:
            return None

    class _Event:
        def record(self, stream: Any) -> None:
            return None

    monkeypatch.setattr(torch.cuda, "stream", _Ctx)
    monkeypatch.setattr(torch.cuda, "Event", _Event)

    def fetch(step: int) -> tuple[list[int], Any, Any]:
        name = threading.current_thread().name
        seen.append((name, current.get(name)))
        return [step], None, None

    pf = Prefetcher(fetch, [0, 1], depth=1, device=torch.device("cuda", 3))
    try:
        pf._thread.join(5)  # type: ignore[union-attr]
    finally:
        pf.close()
    assert seen == [("gems-prefetch", torch.device("cuda", 3))] * 2, seen


def test_read_counts_are_copied_then_finished_on_the_side_stream(monkeypatch) -> None:
    """A GPU rank's reader copies a read batch's counts (int16, half a float's bytes) to its GPU and turns them into
    the network's input there, on its side stream, before the event the step waits for. Stand-ins for torch.cuda
    and for a host tensor record the order; what only a GPU shows (the copy's overlap, the transform's kernels) the
    rig's science run uses (scripts/gpu_lease.py)."""
    from gems.rank.data import Prefetcher

    order: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: "side")

    class _Ctx:
        def __init__(self, stream: Any) -> None:
            self.stream = stream

        def __enter__(self) -> None:
            order.append(f"enter {self.stream}")

        def __exit__(self, *a: Any) -> None:
            order.append("exit")

    class _Event:
        def record(self, stream: Any) -> None:
            order.append(f"event on {stream}")

    class _Host:
        is_cuda = False

        def pin_memory(self) -> "_Host":
            order.append("pin")
            return self

        def to(self, device: Any, non_blocking: bool = False) -> str:
            order.append(f"copy to {device}")
            return "counts on the GPU"

    monkeypatch.setattr(torch.cuda, "stream", _Ctx)
    monkeypatch.setattr(torch.cuda, "Event", _Event)

    def finish(x: Any) -> str:
        order.append(f"finish {x}")
        return "input"

    pf = Prefetcher(lambda step: ([step], _Host(), None), [0], depth=0, device=torch.device("cuda", 1), finish=finish)
    pf._side = "side"  # depth 0 makes no thread; the side stream's path is the same one the thread takes
    (ids, x, _), event = pf._make(0)
    assert x == "input" and ids == [0] and event is not None
    assert order == ["enter side", "pin", "copy to cuda:1", "finish counts on the GPU", "event on side", "exit"], order


def test_cosmoflows_pools_take_a_deterministic_backward_where_torch_has_none() -> None:
    """train.deterministic on a GPU: torch's CUDA average-pool backward adds with atomics and has no deterministic
    version, so CosmoFlow's pools (gems.layers.AvgPool3d) take one of gems's where torch's deterministic algorithms are
    on: torch's forward, and the gradient as one elementwise add a kernel offset. Here, on CPU: the same output, the
    gradient torch's up to the order of its sums (fp64), with padding, several strides and an uneven kernel; a
    pool it does not take (no padding counted) stays torch's. The GPU's bits are the lease's deterministic pair."""
    import torch.nn.functional as F

    from gems.config import compose, section
    from gems.layers import AvgPool3d, _AvgPoolDeterministic
    from gems.models import build_model

    torch.manual_seed(0)
    for shape, k, s, p in [((2, 3, 9, 8, 7), (3, 3, 3), (2, 2, 2), (1, 1, 1)), ((1, 1, 5, 6, 7), (3, 2, 3), (1, 2, 3),
                                                                             (1, 0, 1))]:
        x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        y, ref = _AvgPoolDeterministic.apply(x, k, s, p), F.avg_pool3d(x, k, s, p)
        g = torch.randn_like(ref)
        assert torch.equal(y, ref)
        assert torch.allclose(torch.autograd.grad(y, x, g)[0], torch.autograd.grad(ref, x, g)[0], rtol=0, atol=1e-15)
    pools = [m for m in build_model(section(compose(["model.size=32"]), "model")).module.modules()
             if isinstance(m, nn.AvgPool3d)]
    assert pools and all(type(m) is AvgPool3d for m in pools)
    x = torch.randn(1, 2, 6, 6, 6, requires_grad=True)
    assert torch.equal(AvgPool3d(3, 2, 1, count_include_pad=False)(x), F.avg_pool3d(x, 3, 2, 1, count_include_pad=False))


def test_train_deterministic_names_the_ops_that_ran_without_a_deterministic_kernel(tmp_path: Any) -> None:
    """Issue 83, item 5: "the same bits" under train.deterministic holds where every op has a deterministic kernel; an
    op torch ran without one (its warn_only warning) is named in the record's notes, once however many steps ran it."""
    args = ["model=custom", "model._target_=_custom_models.alerting_tiny", "model.input_shape=[4,8,8,8]",
            "model.num_outputs=4", "train.batch_size=2", "train.steps=3", "train.check_fit=false"]
    from _cli import gems_here, records

    on = gems_here("run", *args, "train.deterministic=true", f"results.dir={tmp_path / 'on'}")
    assert on.returncode == 0, on.stderr[-2000:]
    ((r,),) = [records(str(tmp_path / "on"))]
    (said,) = [n for n in r["notes"] if n.startswith("train.deterministic:")]
    assert said.endswith("two runs may differ in their last bits: scatter_add_cuda_kernel"), said
    off = gems_here("run", *args, f"results.dir={tmp_path / 'off'}")
    assert off.returncode == 0 and not any("train.deterministic" in n for n in records(str(tmp_path / "off"))[0]["notes"])
