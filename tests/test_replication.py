"""Data-parallel replication trains exactly like one process on the same global batch.

Real processes: the `gems` CLI launches the ranks (gloo, or mpiexec with
mpich for comm.backend=mpi); the per-step losses in the records are compared
with the single-process run.
"""
import pytest
import torch
from _cli import gems_here, records

from gems.launch.world import run_world

SMALL = ["model.size=32", "model.width=0.5", "train.batch_size=4", "train.steps=4", "train.warmup_steps=1"]


def _run(tmp, *extra):
    out = gems_here("run", f"results.dir={tmp}", *SMALL, *extra)
    assert out.returncode == 0, out.stderr + out.stdout
    (r,) = records(str(tmp))
    assert r["status"] == "ok"
    return r


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("serial"))


@pytest.mark.parametrize("replicas", [2, 4])
def test_gloo_replicas_give_the_serial_losses(tmp_path, serial, replicas):
    r = _run(tmp_path, f"parallel.replicas={replicas}")
    assert r["world_size"] == replicas and r["mesh"]["replicas"] == replicas
    torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(serial["loss"]), rtol=1e-5, atol=1e-7)
    assert r["global_batch"] == 4 and len(r["peak_memory_bytes"]["per_rank"]) == replicas
    assert r["time_breakdown_s"]["allreduce"] > 0.0


@pytest.mark.mpi
def test_mpi_replicas_give_the_serial_losses(tmp_path, serial):
    r = _run(tmp_path, "parallel.replicas=2", "comm=mpi")
    assert r["env"]["backend"] == "gloo+mpi" and r["env"]["launcher"] == "mpi"
    torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(serial["loss"]), rtol=1e-5, atol=1e-7)


def test_losses_actually_change_between_steps(serial):
    # a guard on the guard: the comparison above is meaningful only if training moves the loss
    assert len(set(round(x, 6) for x in serial["loss"])) == len(serial["loss"])


def _net(hidden):
    from torch import nn

    return nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 4))


def _reducer_world(rank, world, bucket_mb, hidden, overlap=True):
    import torch.distributed as dist

    from gems.replication import IN_PLACE_BYTES, GradientReducer

    torch.manual_seed(0)
    net = _net(hidden)
    red = GradientReducer(net, dist.group.WORLD, bucket_mb=bucket_mb, overlap=overlap)
    assert red.overlap == overlap
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    red.start_step(expected=2)  # two backward passes accumulate before the sum
    net(x[:3]).pow(2).sum().backward()
    assert not any(b.launched for b in red.buckets), "no bucket may launch before its last accumulation"
    net(x[3:]).pow(2).sum().backward()
    red.flush()  # the caller's backward ended: the first layer's bucket (its input has no gradient) launches here
    if not overlap:  # no points: nothing has started, every sum starts in finish()
        assert not any(b.launched for b in red.buckets)
        red.finish()
        return [p.grad.clone() for p in net.parameters()], None  # finish() launched and cleared every bucket
    # every bucket has launched; a large gradient is summed in place, the small ones through one copy
    for b in red.buckets:
        for t, ps, copied, *_ in b.parts:
            large = [p.grad.numel() * 4 >= IN_PLACE_BYTES for p in ps]
            if copied:
                assert not any(large) and t.data_ptr() not in {p.grad.data_ptr() for p in ps}
            else:
                assert ps == [ps[0]] and large[0] and t.data_ptr() == ps[0].grad.data_ptr()
    in_place = sum(1 for b in red.buckets for *_, copied, _, _ in b.parts if not copied)
    red.finish()
    return [p.grad.clone() for p in net.parameters()], in_place


@pytest.mark.parametrize("bucket_mb,hidden,overlap", [(25.0, 16, True), (0.0001, 16, True), (4.0, 40000, True),
                                                      (0.0001, 16, False)])
def test_reducer_sums_over_ranks_after_the_last_accumulation(bucket_mb, hidden, overlap):
    out = run_world(_reducer_world, 3, bucket_mb, hidden, overlap)
    grads = [g for g, _ in out]
    # Linear(8, 40000) holds a 1.2 MiB weight: summed in place; the 0.6 MiB one and the biases are copied
    if overlap:
        assert all(n == (1 if hidden == 40000 else 0) for _, n in out)
    torch.manual_seed(0)
    net = _net(hidden)
    for rank in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
        net(x).pow(2).sum().backward()
    for rank in range(3):
        for g, p in zip(grads[rank], net.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-5)  # summation order differs


class _FakeComm:
    """Stands in for an mpi4py communicator: records what the reducer hands to Iallreduce, in order."""

    def __init__(self) -> None:
        self.launched: list[int] = []

    def Iallreduce(self, send, buf, op=None):  # noqa: N802 (mpi4py's name)
        self.launched.append(int(buf.size))

        class _Handle:
            def Wait(self):  # noqa: N802
                return None
        return _Handle()


def _mpi_backward(comm):  # type: ignore[no-untyped-def]
    """A stand-in MPI group over ``comm`` and a reducer over a three-layer net in buckets of >= 104 bytes, armed,
    after one backward: (group, reducer)."""
    from gems import replication

    group = replication.MPIGroup.__new__(replication.MPIGroup)
    group.comm, group.cuda_aware = comm, True
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                              torch.nn.Linear(16, 4))
    red = replication.GradientReducer(net, group, bucket_mb=0.0001)
    red.start_step()
    net(torch.randn(3, 8)).pow(2).sum().backward()
    red.flush()  # the caller's end of the backward (where the first layer's bucket launches)
    return group, red


class _Event:
    """A CUDA event stand-in: complete only once the test says so (the GPU has not run the kernels yet)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_mpi_sums_wait_for_their_data_and_launch_in_bucket_order(monkeypatch):
    """The MPI path hands a bucket over only once the kernels that make its gradient have run (an event; here
    a stand-in, as no GPU is at hand), never blocks the backward to wait for one, launches in bucket order
    on every rank, and waits for the rest at the end of the step. What only a GPU shows: that the event is
    recorded on the stream that made the gradient and the side stream's host copy (gems.replication._Staged)."""
    from mpi4py import MPI  # noqa: F401  (the reducer imports it for MPI.IN_PLACE)

    from gems import replication

    events: list[_Event] = []
    real_init = replication._Staged.__init__

    def staged(self, bucket, index, t, cuda_aware):
        real_init(self, bucket, index, t, cuda_aware)
        self.event = _Event()
        events.append(self.event)

    monkeypatch.setattr(replication._Staged, "__init__", staged)
    # buckets of >= 104 bytes, last layer first: (bias, weight) of each Linear, flattened: 68, 272, 144 values
    group, red = _mpi_backward(_FakeComm())
    assert len(events) == 3 and group.comm.launched == [], "nothing goes to MPI before its data exists"
    events[1].done = True  # the second bucket's kernels ran first: it still waits for the first
    red._launch_staged(block=False)
    assert group.comm.launched == []
    events[0].done = True
    red._launch_staged(block=False)
    assert group.comm.launched == [68, 272]  # in bucket order
    red.finish()  # the end of the step waits for the rest, in order
    assert group.comm.launched == [68, 272, 144] and all(e.done for e in events)


def test_mpi_sums_launched_during_the_backward_are_driven_by_the_hooks_that_follow() -> None:
    """Without MPI's asynchronous progress (Cray MPICH's default) a non-blocking all-reduce advances only inside MPI
    calls: the reducer tests its sums in flight from every gradient hook, so they move during the backward, not
    only in finish() (before, nothing tested them until finish's Wait)."""
    from mpi4py import MPI  # noqa: F401  (the reducer imports it for MPI.IN_PLACE)


    tested: list[int] = []

    class _Handle:
        def __init__(self, n: int) -> None:
            self.n, self.calls = n, 0

        def Test(self) -> bool:  # noqa: N802 (mpi4py's name)
            self.calls += 1
            tested.append(self.n)
            return self.calls >= 2  # complete at its second test

        def Wait(self) -> None:  # noqa: N802
            return None

    class _Comm:
        launched = 0

        def Iallreduce(self, send, buf, op=None):  # noqa: N802
            self.launched += 1
            return _Handle(self.launched)

    group, red = _mpi_backward(_Comm())
    assert group.comm.launched == 3 and 1 in tested and 2 in tested, tested  # tested while the backward ran
    assert len(red._mpi_pending) <= 1  # the earlier ones completed under the later hooks' tests
    red.finish()


def _taps_world(rank, world):
    """(a) a split backward's I and W on a layer that holds a deferrable Linear beside a norm: the tap of the
    Linear's weight, unused by the I (the layer reads it detached), counts no accumulation, so the bucket waits for
    the W; (b) a module run at two places of the sequence: its sums start in finish(), once its two uses are in."""
    import copy

    import torch.distributed as dist
    from torch import nn

    from gems.pipeline.deferred import WeightGrads, deferring, make_deferrable
    from gems.replication import GradientReducer

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = nn.LayerNorm(6), nn.Linear(6, 3)

        def forward(self, x):
            return self.lin(self.norm(x))

    torch.manual_seed(0)
    out = {}
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    net = nn.Sequential(nn.Linear(5, 6), Block())
    ref = copy.deepcopy(net)
    make_deferrable(net)
    red = GradientReducer(net, dist.group.WORLD, bucket_mb=1e-6)
    red.start_step()
    store = WeightGrads()
    with deferring(store, (0, 0, 0)):
        net(x).pow(2).sum().backward()
    red.flush()  # the I's end: nothing of the deferred Linear may launch yet
    store.run((0, 0, 0))
    red.flush()
    red.finish()
    ref(x).pow(2).sum().backward()
    out["split"] = [(g, p.grad) for g, p in zip([q.grad for q in net.parameters()], ref.parameters())]
    b = nn.Linear(4, 4)
    twice = nn.Sequential(nn.Linear(5, 4), b, nn.Tanh(), b)
    plain = copy.deepcopy(twice)
    red2 = GradientReducer(twice, dist.group.WORLD, bucket_mb=1e-6)
    out["overlap"] = red2.overlap
    red2.start_step()
    twice(x).pow(2).sum().backward()
    red2.finish()
    plain(x).pow(2).sum().backward()
    out["twice"] = [(p.grad, q.grad) for p, q in zip(twice.parameters(), plain.parameters())]
    return out


def test_taps_count_what_the_backward_gives_and_shared_modules_sum_at_the_end():
    out = run_world(_taps_world, 2)
    for o in out:
        assert o["overlap"] is False
    for key in ("split", "twice"):
        for k in range(len(out[0][key])):
            summed = sum(o[key][k][1] for o in out)  # each rank's own plain gradient, summed by hand
            torch.testing.assert_close(out[0][key][k][0], summed, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key} {k}: {m}")


def _mast_world(rank, world, buckets=None):
    """GEMS-MAST on two gloo ranks, a bucket a parameter (or ``buckets`` of them, as even as the sizes allow): which
    buckets each rank launched, in order, and whether inside an action (at its points or its flush) or between the
    runtime's rounds; and the summed gradients (and with ``buckets``, each bucket's sequences)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from gems.mesh import Mesh
    from gems.models import build_model
    from gems.pipeline import apply_pipeline
    from gems.replication import GradientReducer, attach

    torch.manual_seed(0)
    spec = build_model({"name": "cosmoflow", "size": 32, "width": 0.25})
    mesh = Mesh(1, 2, world_size=world)
    mesh.build_groups(rank, mirrored=True)
    B = 4
    runner = apply_pipeline(spec.module, mesh, rank, loss_fn=lambda o, t, n: F.mse_loss(o, t, reduction="sum") / B,
                            batch_size=B, schedule="mast", sample_shape=tuple(spec.input_shape))
    total = sum(q.numel() * q.element_size() for q in runner.parameters())
    red = GradientReducer(runner.partitions, mesh.group("grad"),
                          bucket_mb=1e-6 if buckets is None else total / buckets / 2**20)
    attach(red, runner)
    in_action = [False]
    act = runner._act

    def timed_act(*a, **k):
        in_action[0] = True
        try:
            return act(*a, **k)
        finally:
            in_action[0] = False

    runner._act = timed_act
    launched = []
    launch = red._launch

    def noted(b):
        launched.append((red.buckets.index(b), b.key, in_action[0]))
        return launch(b)

    red._launch = noted
    count = {id(q): 1 for q in runner.parameters()}
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, *spec.input_shape, generator=g), torch.randn(B, spec.num_outputs, generator=g)
    red.start_step(expected=lambda q: count[id(q)])
    runner.step(x, y, list(range(B)), 0, 0)
    red.finish()
    dist.barrier()
    grads = {k: [p.grad.clone() for p in part.parameters()] for k, part in runner.partitions.items()}
    if buckets is not None:
        return launched, grads, [b.keys for b in red.buckets]
    return launched, grads


def test_mirrored_copies_start_the_last_backwards_sums_inside_it_in_one_order():
    """GEMS-MAST's mirrored copies used to start every bucket of the step's last backward after it ended (no
    overlap). Now the sums that nothing would come before (gems.pipeline.exchange.at_points) start inside the action,
    at the gradient sum's points: partition 0's buckets, there on both ranks. Partition 1's wait for the round that
    carries the gradient its backward sent. Both ranks launch every bucket in one order, and each partition's summed
    gradients are the same on both holders."""
    out = run_world(_mast_world, 2)
    (l0, g0), (l1, g1) = out
    assert [b for b, _, _ in l0] == [b for b, _, _ in l1] == sorted(b for b, _, _ in l0), (l0, l1)
    for launched in (l0, l1):
        inside = {key for _, key, during in launched if during}
        between = {key for _, key, during in launched if not during}
        assert inside == {0} and between == {1}, launched
        assert sum(1 for _, key, during in launched if during) > 2  # several buckets, not the flush's one
    for k in (0, 1):
        for a, b in zip(g0[k], g1[k]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("buckets", [1, 3])
def test_buckets_fill_across_a_mirrored_ranks_partitions_and_sum_in_one_order(buckets):
    """A bucket fills across the partitions a rank holds, as DDP's fill across a model and as the planner counts
    them (before, a rank holding two small partitions ran two collectives a step where one would do). In one bucket
    a step, GEMS-MAST sums everything once, inside its last backward (at its flush), on both ranks. In three, one of
    them holds partition 1's first layers and partition 0's last ones: it starts at its point in partition 0's
    backward, in the same order on both ranks. The summed gradients are the same on both holders."""
    from functools import partial

    out = run_world(partial(_mast_world, buckets=buckets), 2)
    (l0, g0, keys), (l1, g1, keys1) = out
    assert keys == keys1
    assert [b for b, _, _ in l0] == [b for b, _, _ in l1] == list(range(len(keys))), (l0, l1)
    if buckets == 1:
        assert keys == [(1, 0)] and l0 == l1 == [(0, 0, True)], (keys, l0)
    else:
        spanning = [i for i, k in enumerate(keys) if k == (1, 0)]
        assert len(keys) == 3 and len(spanning) == 1, keys
        for launched in (l0, l1):
            assert launched[spanning[0]] == (spanning[0], 0, True), launched  # inside partition 0's backward
    for k in (0, 1):
        for a, b in zip(g0[k], g1[k]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_w_hands_its_weight_gradients_to_the_accumulators_without_a_copy():
    """A split backward's W accumulates through autograd (post-accumulate hooks fire, the gradient sum's buckets
    with them) and the accumulator takes each gradient as made: given from Python it copied each (a 4096^2 dense
    layer's 64 MiB at every W, half of the W's time on this machine); a second W adds to what is there."""
    from torch import nn

    from gems.pipeline.deferred import WeightGrads, _accumulate, deferring, make_deferrable

    w = torch.zeros(4, 4, requires_grad=True)
    made: list = []

    def make():
        g = torch.ones(4, 4)
        made.append(g.data_ptr())
        return [g, torch.ones(2)]

    _accumulate([w, None], make)  # a parameter that is not there: its entry dropped
    assert w.grad.data_ptr() == made[0] and torch.equal(w.grad, torch.ones(4, 4))

    lin, ref = nn.Linear(8, 8), nn.Linear(8, 8)
    ref.load_state_dict(lin.state_dict())
    make_deferrable(lin)
    fired: list = []
    for p in lin.parameters():
        p.register_post_accumulate_grad_hook(lambda q: fired.append(q.shape))
    x = torch.randn(3, 8)
    store = WeightGrads()
    for k in range(2):
        with deferring(store, (0, 0, k)):
            lin(x).pow(2).sum().backward()
        assert len(fired) == 2 * k  # the I leaves the weight gradients to the W
        store.run((0, 0, k))
        ref(x).pow(2).sum().backward()
        assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(lin.bias.grad, ref.bias.grad)
        assert len(fired) == 2 * (k + 1)
    # outside deferring() the same layer computes both gradients in its backward (autograd's grad mode off there)
    lin(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad) and len(fired) == 6
