"""CUDA graphs on GPU ranks (gems/rank/graphs.py), checked where a CPU can: which steps graph and what the others
say, and the whole protocol with a stand-in for the capture (GEMS_CPU_GRAPH_STAND_IN=1: its capture runs the step's
body once under a check that refuses a host read, then puts back what it changed; each replay runs the body again).
A graphed step must train exactly as the eager one (dropout, BatchNorm and its averages over replicas, fp16's
skipped steps, the gradient sums at their points), launch at most a few device ops around its replay, read nothing
from the device in its path but the step before's figures, and a capture that fails must stop the run naming its
cause. The capture and the replay themselves need a GPU (scripts/gpu_check.sh)."""
from __future__ import annotations

import contextlib
import gc
import io
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _cli import gems, records
from torch import nn

from gems.layers import SampleDropout, batch_context, keep_masks, sample_keys
from gems.rank import graphs

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it here


def _cfg(graphs_on: bool = True, checkpoint: bool = False, backend: str = "auto") -> Any:
    return SimpleNamespace(train=SimpleNamespace(cuda_graphs=graphs_on), parallel=SimpleNamespace(checkpoint=checkpoint),
                           comm=SimpleNamespace(backend=backend))


def _mesh(spatial: int = 1) -> Any:
    return SimpleNamespace(spatial=spatial)


def test_gpu_ranks_graph_the_plain_path_and_say_why_the_others_stay_eager(monkeypatch) -> None:
    plain, piped = SimpleNamespace(pipelined=False), SimpleNamespace(pipelined=True)
    assert graphs.decide(_cfg(), plain, _mesh(), CUDA) == (True, None)
    assert graphs.decide(_cfg(False), plain, _mesh(), CUDA) == (False, None)
    for cfg, settings, mesh, why in [(_cfg(), piped, _mesh(), "pipeline"), (_cfg(), plain, _mesh(2), "halos"),
                                     (_cfg(checkpoint=True), plain, _mesh(), "recomputation"),
                                     (_cfg(backend="mpi"), plain, _mesh(), "MPI")]:
        ok, note = graphs.decide(cfg, settings, mesh, CUDA)
        assert not ok and note is not None and note.startswith("train.cuda_graphs: the step runs eager") and why in note
    monkeypatch.delenv(graphs.STAND_IN_ENV, raising=False)
    assert graphs.decide(_cfg(), plain, _mesh(), torch.device("cpu")) == (False, None)  # CPU ranks: eager, quietly
    monkeypatch.setenv(graphs.STAND_IN_ENV, "1")
    assert graphs.decide(_cfg(), plain, _mesh(), torch.device("cpu")) == (True, None)


def test_dropout_masks_are_one_batched_hash_of_seed_step_and_sample() -> None:
    """SampleDropout's masks: a sample's are the same whatever batch it is in (every mesh), they change with the
    step, keep 1 - p of the values, and the keys handed in on the device (a graph's static input) give the same
    masks as those made from the samples' ids."""
    d = SampleDropout(0.3)
    x = torch.ones(4, 5, 40)
    with batch_context(1, 2, [9, 2, 5, 7]):
        whole = d(x)
    with batch_context(1, 2, [5, 7]):
        assert torch.equal(d(x[:2]), whole[2:])
    keys = torch.tensor(sample_keys(1, 2, [9, 2, 5, 7]), dtype=torch.int64)
    with batch_context(1, 0, range(4), keys=keys):  # the ids and step are the keys' now
        assert torch.equal(d(x), whole)
    with batch_context(1, 3, [9, 2, 5, 7]):
        assert not torch.equal(d(x), whole)
    kept = keep_masks(torch.tensor(sample_keys(0, 0, range(16))), 4096, 0.3).float().mean().item()
    assert kept == pytest.approx(0.7, abs=0.01)


# ---- whole runs: graphed against eager, in this process (R = 1) and in a gloo world of two (R = 2) -----------------
BN_DROPOUT = ["model=cosmoflow", "model.size=32", "model.width=0.25", "model.norm=batch", "model.dropout=0.5",
              "train.batch_size=4", "train.steps=5", "train.warmup_steps=1", "train.check_fit=false"]
MAX_OPS = 8  # issue 63: device ops outside the replay a step, at most


def _train(rank: int, size: int, args: list[str], stand_in: str | None, folder: str) -> dict[str, Any]:
    """One rank's training (gems.rank.loop.train) in this process; its record (complete on rank 0)."""
    import os

    from omegaconf import open_dict

    from gems.bootstrap import World
    from gems.config import compose
    from gems.rank.loop import train

    if stand_in is None:
        os.environ.pop(graphs.STAND_IN_ENV, None)
    else:
        os.environ[graphs.STAND_IN_ENV] = stand_in
    cfg = compose([*args, f"results.dir={folder}"] + ([] if stand_in else ["train.cuda_graphs=false"]))
    with open_dict(cfg):
        cfg.run_id = f"graphs-{stand_in or 'eager'}"
    world = World(rank, size, rank, "127.0.0.1", 0, "single", torch.device("cpu"), "gloo", "torch", None, "localhost")
    with contextlib.redirect_stdout(io.StringIO()):
        return dict(train(cfg, world))


def _both(rank: int, size: int, args: list[str], folder: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The graphed run (the stand-in) and the eager run (train.cuda_graphs=false) of ``args``, on this rank."""
    try:
        return _train(rank, size, args, "1", f"{folder}/on"), _train(rank, size, args, None, f"{folder}/off")
    finally:
        import os

        os.environ.pop(graphs.STAND_IN_ENV, None)


@pytest.mark.parametrize("size,extra", [
    (1, ["train.optimizer=sgd"]), (1, ["train.precision=bf16"]),
    (2, ["parallel.replicas=2", "train.optimizer=sgd"]), (2, ["parallel.replicas=2", "train.precision=bf16"]),
], ids=["R1-fp32-sgd", "R1-bf16-adam", "R2-fp32-sgd", "R2-bf16-adam"])
def test_a_graphed_run_equals_the_eager_one_and_launches_few_ops_around_its_replay(tmp_path, size, extra) -> None:
    """CosmoFlow with BatchNorm and dropout: the graphed run's losses are the eager run's bit for bit, and its record
    counts at most 8 device ops outside the replay in its first measured step (the copies of the batch, the target
    and the host values in, the fused optimizer, the figures out), beside the eager step's count (its record's)."""
    args = [*BN_DROPOUT, *extra]
    if size == 1:
        on, off = _both(0, 1, args, str(tmp_path))
    else:
        from gems.launch.world import run_world

        (on, off), _ = run_world(_both, 2, args, str(tmp_path), timeout=300)
    assert on["loss"] == off["loss"] and len(on["loss"]) == 5
    assert on["cuda_graphs"] is True and off["cuda_graphs"] is False
    graphed, eager = on["device_ops"], off["device_ops"]
    print(f"device ops a step ({'R2' if size == 2 else 'R1'}, {extra[-1]}): graphed {graphed['per_step']} "
          f"{graphed['ops']}, eager {eager['per_step']}")
    assert graphed["step"] == eager["step"] == 2
    assert graphed["per_step"] <= MAX_OPS < eager["per_step"]
    from gems.rank.loop import graphed_note

    assert any(n.startswith("train.cuda_graphs: the step (forward, loss, backward") for n in on["notes"])
    assert not any("cuda_graphs" in n for n in off.get("notes", []))
    assert graphed_note  # (the note's one source)


@pytest.mark.parametrize("extra", [
    ["model=unet3d", "model.size=16", "model.width=0.125", "train.batch_size=2"],  # BatchNorm, skips
    ["model=cosmoflow", "model.width=0.25", "train.batch_size=2", "train.precision=fp16",
     "train.loss_scale_init=1e38"],  # fp16: skipped steps
    ["model=cosmoflow", "model.width=0.25", "train.batch_size=2", "train.graph_optimizer=true"],  # the whole step
], ids=["unet-bn", "fp16-skips", "whole-step"])
def test_more_models_train_graphed_as_eager(tmp_path, extra) -> None:
    """The U-Net (BatchNorm, skips), fp16's skipped steps, and the whole step in the graph (train.graph_optimizer:
    Adam's update inside it, its rate a tensor the loop fills; eager with the same optimizer)."""
    args = ["model.size=32", "train.steps=4", "train.warmup_steps=1", "train.check_fit=false", *extra]
    on, off = _both(0, 1, args, str(tmp_path))
    assert on["loss"] == off["loss"] and on["cuda_graphs"] is True
    if "train.graph_optimizer=true" in extra:  # no optimizer outside the replay: the copies in and out, the rate
        assert "_fused_adam_" not in on["device_ops"]["ops"] and on["device_ops"]["per_step"] <= MAX_OPS
    if "train.precision=fp16" in extra:
        assert on["loss_scale"]["skipped_steps"] == off["loss_scale"]["skipped_steps"] and on["loss_scale"]["skipped_steps"]


PIPE = ["model=cosmoflow", "model.size=32", "model.width=0.25", "model.norm=batch", "model.dropout=0.5",
        "train.steps=4", "train.warmup_steps=1", "train.check_fit=false", "train.graph_pieces=true",
        "parallel.micro_batches=2"]


@pytest.mark.parametrize("size,extra", [
    (2, ["parallel.pipeline=2", "parallel.schedule=gpipe", "train.batch_size=4"]),
    (2, ["parallel.pipeline=2", "parallel.schedule=mast", "train.batch_size=4", "parallel.micro_batches=1"]),
    (4, ["parallel.replicas=2", "parallel.pipeline=2", "parallel.schedule=1f1b", "train.batch_size=8"]),
], ids=["D2-gpipe", "D2-mast", "R2xD2-1f1b"])
def test_a_pipelines_graphed_pieces_train_as_its_eager_stages(tmp_path, size, extra) -> None:
    """train.graph_pieces: each partition's forward and backward of a micro-batch replayed (gems.rank.pieces) between
    the schedule's messages, with BatchNorm and dropout: GPipe (every forward before the backwards: a slot a
    micro-batch), GEMS-MAST (two partitions a rank, the mirrored copies' sums between the rounds) and 1F1B under two
    replicas train as the eager run bit for bit, and the record says what was replayed."""
    from gems.launch.world import run_world

    results = run_world(_both, size, [*PIPE, *extra], str(tmp_path), timeout=300)
    on, off = results[0]
    assert on["loss"] == off["loss"] and len(on["loss"]) == 4
    assert on["cuda_graphs"] is True and off["cuda_graphs"] is False
    assert any("(train.graph_pieces)" in n for n in on["notes"])


def test_a_piece_gives_the_partitions_gradients_never_its_own_buffers_and_a_failed_capture_names_it(monkeypatch) -> None:
    """A slot's replay inside autograd (gems.rank.pieces): the output, the input's gradient and the parameters'
    equal the partition's own; the parameters' .grad are copies (a zero_() on them leaves the next replay alone);
    a capture failing at its end stops the run naming the stage and train.graph_pieces=false."""
    from gems.rank import pieces as pc

    torch.manual_seed(0)
    part = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), SampleDropout(0.3), nn.Linear(4, 3))
    twin = __import__("copy").deepcopy(part)
    act = SimpleNamespace(stage=1, replica=0, micro_batch=0)
    p = pc.Pieces(torch.device("cpu"), 0, contextlib.nullcontext, lambda: list(part.buffers()))
    for step in range(3):
        x = torch.randn(2, 5, generator=torch.Generator().manual_seed(step)).requires_grad_(True)
        xt = x.detach().clone().requires_grad_(True)
        p.begin_step(step)
        with batch_context(7, step, [4, 9]):
            y, yt = p(act, part, x), twin(xt)
        (y * torch.arange(3.0)).sum().backward()
        (yt * torch.arange(3.0)).sum().backward()
        assert torch.equal(y, yt) and torch.equal(x.grad, xt.grad)
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(part.parameters(), twin.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(part.buffers(), twin.buffers()))
        if step == 2:
            slot = p.slots[(1, 0, 0)]
            assert p.replays == 2 and not any(g is not None and g.data_ptr() == q.grad.data_ptr()
                                              for g, q in zip(slot.grads[1:], part.parameters()))
        for q in [*part.parameters(), *twin.parameters()]:
            q.grad = None
    monkeypatch.setenv(graphs.STAND_IN_ENV, "fail_at_end")
    failing = pc.Pieces(torch.device("cpu"), 5, contextlib.nullcontext, lambda: [])
    with batch_context(7, 0, [4, 9]):
        failing(act, part, torch.randn(2, 5, requires_grad=True))
    failing.begin_step(0)
    with pytest.raises(graphs.CaptureFailed, match="capturing the piece of stage 1 failed on rank 5 at step 1: .*"
                                                    "train.graph_pieces=false"):
        failing.begin_step(1)


def test_gradients_cannot_double_whatever_zero_grad_does(tmp_path, monkeypatch) -> None:
    """The graph owns its gradients and writes each step's afresh (issue 63, finding 5: make_graphed_callables's
    aliased a static buffer, and a zero_grad that zeroes instead of freeing doubled them): with zero_grad zeroing,
    and with gradients left in .grad, the graphed run still equals the eager one."""
    real = torch.optim.Optimizer.zero_grad
    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", lambda self, set_to_none=True: real(self, False))
    on, off = _both(0, 1, [*BN_DROPOUT, "train.optimizer=sgd"], str(tmp_path / "zeroed"))
    assert on["loss"] == off["loss"]
    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", lambda self, set_to_none=True: None)
    on, _ = _both(0, 1, [*BN_DROPOUT, "train.optimizer=sgd"], str(tmp_path / "kept"))
    assert on["loss"] == off["loss"]


def test_a_nan_in_a_step_read_late_is_placed_by_that_steps_own_flags(tmp_path) -> None:
    """A graphed step's figures carry its finiteness flags: a NaN input at step 3, whose figures the loop reads
    during step 4 (step 4's flags are finite then), is still placed in step 3's input, and the run stops there."""
    from gems.rank.loop import NonFiniteLoss

    with pytest.raises(NonFiniteLoss, match="the loss of step 3 is nan .* the input of rank 0"):
        _train(0, 1, [*BN_DROPOUT, "train.steps=6", "fault.nan_rank=0", "fault.at_step=3"], "1", str(tmp_path))
    (r,) = records(str(tmp_path))
    assert r["failure"]["where"] == "input" and r["failure"]["step"] == 3 and len(r["loss"]) == 4


# ---- no host read in the step's path ------------------------------------------------------------------------------
class _Syncs:
    """Counts what would make a GPU rank's host wait for its device: a device value read on the host (item, tolist,
    a tensor's truth or number, nonzero: every ``_local_scalar_dense``), a copy to the host (``cpu``), a device
    synchronisation (torch.cuda's, the loop's)."""

    def __init__(self) -> None:
        self.where: list[str] = []

    def __enter__(self) -> "_Syncs":
        from torch.utils._python_dispatch import TorchDispatchMode

        import gems.rank.loop as loop

        outer = self

        class Reads(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero"):
                    outer.where.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self._undo: list[tuple[Any, str, Any]] = []
        for owner, name in [(torch.Tensor, "tolist"), (torch.Tensor, "cpu"), (torch.Tensor, "item"),
                            (torch.cuda, "synchronize"), (loop, "_sync")]:
            real = getattr(owner, name)
            self._undo.append((owner, name, real))
            setattr(owner, name, lambda *a, _real=real, _name=name, **k: (outer.where.append(_name), _real(*a, **k))[1])
        self._mode = Reads()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)


def test_a_graphed_step_reads_nothing_from_the_device_and_its_figures_a_step_late(tmp_path, monkeypatch) -> None:
    """Issue 63, item 2: in the measured steps of a graphed run nothing in the step's path reads the device; the
    loop reads a step's figures (the loss, the stop flag: one asynchronous copy to the host) during the next step,
    after that step's replay is queued, so on a GPU the host's work for the next step overlaps this one; the steps
    something needs at once (the last) are read in their own step."""
    import gems.rank.loop as loop
    from gems.rank.sync import Readout

    order: list[tuple[str, int]] = []
    syncs: dict[int, list[str]] = {}
    real_step, real_finish, real_run = loop.Run.one_step, loop.Run.finish, graphs.StepGraph.run

    def one_step(self, step):  # type: ignore[no-untyped-def]
        if step < self.measure_from:
            return real_step(self, step)
        with _Syncs() as seen:
            out = real_step(self, step)
        syncs[step] = seen.where
        return out

    def finish(self, done):  # type: ignore[no-untyped-def]
        order.append(("read", done.step))
        return real_finish(self, done)

    def run(self, x, y, seed, step, ids, stop):  # type: ignore[no-untyped-def]
        out = real_run(self, x, y, seed, step, ids, stop)
        order.append(("replay" if self.replays else "eager", step))
        return out

    monkeypatch.setattr(loop.Run, "one_step", one_step)
    monkeypatch.setattr(loop.Run, "finish", finish)
    monkeypatch.setattr(graphs.StepGraph, "run", run)
    reads = []
    monkeypatch.setattr(Readout, "read", staticmethod(lambda posted, _r=Readout.read: reads.append(1) or _r(posted)))
    try:
        record = _train(0, 1, [*BN_DROPOUT, "train.optimizer=sgd"], "1", str(tmp_path))
    finally:
        import os

        os.environ.pop(graphs.STAND_IN_ENV, None)
    assert record["cuda_graphs"] is True
    assert sorted(syncs) == [2, 3, 4] and all(not where for where in syncs.values()), syncs
    assert order == [("eager", 0), ("read", 0), ("replay", 1), ("read", 1), ("replay", 2), ("replay", 3),
                     ("read", 2), ("replay", 4), ("read", 3), ("read", 4)]
    assert len(reads) == 5  # one read of each step's figures


# ---- a capture that fails ------------------------------------------------------------------------------------------
class _FakeCuda:
    """torch.cuda as the capture sees it, with a graph whose capture_end fails as CUDA's does after an error inside
    the capture: records every call, and which stream is current."""

    def __init__(self, fail: bool = True) -> None:
        self.fail = fail
        self.calls: list[Any] = []
        self.main = SimpleNamespace(name="main", wait_stream=lambda s: None)
        self.current = self.main

    def Stream(self, device: Any) -> Any:  # noqa: N802 - torch.cuda's name
        return SimpleNamespace(name="side", wait_stream=lambda s: None)

    def current_stream(self, device: Any) -> Any:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: Any) -> Any:
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    def synchronize(self, device: Any) -> None:
        self.calls.append("synchronize")

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def CUDAGraph(self) -> Any:  # noqa: N802
        fake = self

        class Graph:
            def capture_begin(self, capture_error_mode: str = "global") -> None:
                fake.calls.append(("capture_begin", capture_error_mode, fake.current.name))

            def capture_end(self) -> None:
                fake.calls.append(("capture_end", fake.current.name))
                if fake.fail:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

            def replay(self) -> None:
                fake.calls.append("replay")

        return Graph()


def test_a_capture_that_fails_stops_the_run_naming_its_cause_and_leaves_nothing_held() -> None:
    """On a mock of torch.cuda: a step whose capture fails inside (a host read, as CUDA refuses it) and then at its
    end raises CaptureFailed naming the first error, not capture_end's, and train.cuda_graphs=false; the capture
    ended on its own stream, the current stream is back, the garbage collector is on again, the reader's lock is
    free, and nothing ran after the failure (no empty_cache: the allocator is mid-capture then)."""
    fake = _FakeCuda()

    def body(s: graphs.Static) -> None:
        if any(c[0] == "capture_begin" for c in fake.calls if isinstance(c, tuple)):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        s.figures.fill_(1.0)

    g = graphs.StepGraph(body, torch.device("cpu"), 3, capture=graphs._CudaCapture(torch.device("cpu"), api=fake))
    x, y = torch.zeros(2, 3), torch.zeros(2, 1)
    assert g.run(x, y, 0, 0, [0, 1], False)[0] == 1.0  # the eager step, on the capture's stream
    with pytest.raises(graphs.CaptureFailed) as failed:
        g.run(x, y, 0, 1, [0, 1], False)
    text = str(failed.value)
    assert text.startswith("train.cuda_graphs: capturing the step failed on rank 3 at step 1: RuntimeError: CUDA "
                           "error: operation not permitted when stream is capturing (then RuntimeError: CUDA error: "
                           "operation failed due to a previous error during capture)")
    assert "train.cuda_graphs=false" in text
    assert fake.calls == ["synchronize", ("capture_begin", "thread_local", "side"), ("capture_end", "side")]
    assert "empty_cache" not in fake.calls
    assert fake.current is fake.main and gc.isenabled() and not g.captured and not g.replayed
    assert _free(graphs.CUDA_WORK)


def test_a_capture_runs_its_eager_step_then_captures_once_and_replays_on_the_current_stream() -> None:
    """The order of calls on a mock of torch.cuda: the eager step on the capture's stream, the capture there (CUDA's
    thread-local mode) after a device synchronisation, the eager step's cached blocks released once the capture
    ended, then replays; after every replay the graph's gradients are attached again for the optimizer outside it
    (a replay runs none of the body's Python)."""
    fake = _FakeCuda(fail=False)
    w = nn.Parameter(torch.zeros(2))
    ran: list[str] = []
    static = torch.zeros(2)

    def body(s: graphs.Static) -> None:
        ran.append(fake.current.name)
        w.grad = static

    g = graphs.StepGraph(body, torch.device("cpu"), 0, capture=graphs._CudaCapture(torch.device("cpu"), api=fake),
                         grads=[(w, static)])
    for step in range(4):
        w.grad = None  # the optimizer's zero_grad
        g.run(torch.zeros(1, 1), torch.zeros(1, 1), 0, step, [0], False)
        assert w.grad is static
    assert ran == ["side", "side"]  # the eager step, and the capture (its Python runs once, recording)
    assert fake.calls == ["synchronize", ("capture_begin", "thread_local", "side"), ("capture_end", "side"),
                          "empty_cache", "replay", "replay", "replay"]
    assert g.replays == 3 and fake.current is fake.main


def _free(lock: Any) -> bool:
    """Whether another thread can take ``lock`` now (it gives it back at once)."""
    got: list[bool] = []

    def probe() -> None:
        got.append(lock.acquire(blocking=False))
        if got[-1]:
            lock.release()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got == [True]


def test_the_stand_ins_capture_refuses_a_host_read_and_puts_back_what_it_ran() -> None:
    """The stand-in's capture runs the body under a check a CUDA capture would enforce (a device value read on the
    host fails it), and undoes what that run changed (a capture runs nothing): the failure names the read."""
    buf = torch.zeros(3)

    def body(s: graphs.Static) -> None:
        buf.add_(1.0)
        s.figures.fill_(buf.sum().item())  # a host read: a capture cannot hold it

    g = graphs.StepGraph(body, torch.device("cpu"), 0, touched=lambda: [buf])
    x, y = torch.zeros(1, 2), torch.zeros(1, 1)
    g.run(x, y, 0, 0, [0], False)
    assert buf.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(graphs.CaptureFailed, match="_local_scalar_dense reads a device value on the host"):
        g.run(x, y, 0, 1, [0], False)
    assert buf.tolist() == [1.0, 1.0, 1.0]  # put back


def test_a_run_whose_capture_fails_exits_1_naming_the_cause(tmp_path, monkeypatch) -> None:
    """A real `gems run` whose capture fails at its end (the stand-in's injection, as CUDA's capture_end answers a
    capture something invalidated): exit 1, and the failed record names the rank, the cause and the way on."""
    monkeypatch.setenv(graphs.STAND_IN_ENV, "fail_at_end")
    r = gems("run", *BN_DROPOUT[:3], "train.steps=3", "train.warmup_steps=1", "train.check_fit=false",
             f"results.dir={tmp_path}", timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    (rec,) = records(str(tmp_path))
    assert rec["status"] == "failed"
    text = rec["error"]
    assert "capturing the step failed on rank 0 at step 1" in text and "train.cuda_graphs=false" in text, text
    assert "operation failed due to a previous error during capture" in text


def test_a_model_with_hooks_runs_eager_and_its_hooks_run(tmp_path, monkeypatch) -> None:
    """A hook on the model (fault.stall_rank's) would not run in a replay: the step runs eager through the model's
    call, hooks included, says why, and trains as the eager run; the gradient sum's own hooks (its points) are the
    step's, recorded where they act by a capture."""
    import gems.rank.loop as loop

    calls: list[int] = []

    def arm(fault: Any, rank: int, modules: list[nn.Module]) -> None:
        modules[0][0].register_forward_pre_hook(lambda m, a: calls.append(1))

    monkeypatch.setattr(loop.inject, "arm", arm)
    on, off = _both(0, 1, [*BN_DROPOUT, "train.optimizer=sgd"], str(tmp_path))
    assert on["loss"] == off["loss"] and on["cuda_graphs"] is False
    assert calls == [1] * 10  # every step of both runs
    assert "train.cuda_graphs: the step runs eager: hooks on the model (BatchNorm3d; a replay would skip them)" in on["notes"]


def test_the_reader_ahead_pauses_while_the_step_is_captured() -> None:
    """Of the rank's threads only the reader ahead issues CUDA work: the capture holds the lock its work takes
    (gems.rank.data.Prefetcher)."""
    held: list[bool] = []

    class Probe(graphs._StandInCapture):
        def capture(self, body: Any) -> None:
            with graphs.CUDA_WORK:  # as _CudaCapture holds it
                held.append(not _free(graphs.CUDA_WORK))
                super().capture(body)

    g = graphs.StepGraph(lambda s: None, torch.device("cpu"), 0, capture=Probe(lambda: []))
    for step in range(2):
        g.run(torch.zeros(1, 1), torch.zeros(1, 1), 0, step, [0], False)
    assert held == [True] and g.replayed
    import inspect

    from gems.rank.data import Prefetcher

    assert "with CUDA_WORK, torch.cuda.stream(self._side)" in inspect.getsource(Prefetcher._make)
    assert "with CUDA_WORK, self.api.stream(self.stream)" in inspect.getsource(graphs._CudaCapture.capture)


def test_the_optimizer_a_capture_steps_is_capturable() -> None:
    """gems bench step's control captures a plain loop's whole step, optimizer included: the configured optimizer
    (Adam, the default) is made capturable there (it raised "capturable is False" inside the capture); with
    train.graph_optimizer a run's optimizer is capturable with its rate on the device, in eager runs too. Built on
    fake GPU tensors: a CPU has no capturable Adam."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gems.config import compose
    from gems.rank.optim import make_optimizer

    with FakeTensorMode():
        params = [nn.Parameter(torch.empty(3, device="cuda"))]
        control = make_optimizer(compose([]), params, capturable=True)
        plain = make_optimizer(compose([]), params)
    assert type(control).__name__ == "Adam" and control.param_groups[0]["capturable"] is True
    assert plain.param_groups[0]["capturable"] is False and plain.param_groups[0]["fused"] is True
    whole = make_optimizer(compose(["train.graph_optimizer=true"]), [nn.Parameter(torch.zeros(3))])
    assert isinstance(whole.param_groups[0]["lr"], torch.Tensor)  # (capturable on a GPU only: a CPU has none)
    import inspect

    from gems.bench.step import _plain

    assert "make_optimizer(cfg, list(model.parameters()), capturable=graphed)" in inspect.getsource(_plain)
