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
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _cli import gems, records
from torch import nn

from gems.layers import SampleDropout, batch_context, keep_masks, sample_keys
from gems.rank import graphs

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it here


def _cfg(graphs_on: bool = True, checkpoint: bool = False, backend: str = "auto", spatial: bool = False,
         collectives: bool = True) -> Any:
    return SimpleNamespace(train=SimpleNamespace(cuda_graphs=graphs_on, graph_spatial=spatial,
                                                 graph_collectives=collectives),
                           parallel=SimpleNamespace(checkpoint=checkpoint), comm=SimpleNamespace(backend=backend))


def _mesh(spatial: int = 1, size: int = 1) -> Any:
    return SimpleNamespace(spatial=spatial, size=max(size, spatial))


def test_gpu_ranks_graph_the_plain_path_and_say_why_the_others_stay_eager(monkeypatch) -> None:
    plain, piped = SimpleNamespace(pipelined=False), SimpleNamespace(pipelined=True)
    assert graphs.decide(_cfg(), plain, _mesh(), CUDA) == (True, None)
    assert graphs.decide(_cfg(False), plain, _mesh(), CUDA) == (False, None)
    for cfg, settings, mesh, why in [(_cfg(), piped, _mesh(), "pipeline"), (_cfg(), plain, _mesh(2), "halos"),
                                     (_cfg(checkpoint=True), plain, _mesh(), "recomputation"),
                                     (_cfg(backend="mpi"), plain, _mesh(), "MPI")]:
        ok, note = graphs.decide(cfg, settings, mesh, CUDA)
        assert not ok and note is not None and note.startswith("train.cuda_graphs: the step runs eager") and why in note
    assert graphs.decide(_cfg(spatial=True), plain, _mesh(2), CUDA) == (True, None)  # halos captured with the step
    ok, note = graphs.decide(_cfg(checkpoint=True, spatial=True), plain, _mesh(2), CUDA)
    assert not ok and note is not None and "recomputation" in note
    pieces = SimpleNamespace(train=SimpleNamespace(cuda_graphs=True, graph_spatial=True, graph_pieces=True),
                             parallel=SimpleNamespace(checkpoint=False), comm=SimpleNamespace(backend="auto"))
    ok, note = graphs.decide(pieces, piped, _mesh(2), CUDA)  # a spatial pipeline's pieces: not built yet
    assert not ok and note is not None and "a pipeline's spatial parts" in note
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

    # the variables stay set for the rest of this process: a rank's process ends with its run, and a test's own
    # process has them put back after the test (tests/conftest.py's _gems_environment_kept)
    if stand_in is None:  # the eager run: in the stand-in's layout (a GPU's), so that both compute the same bits
        os.environ.pop(graphs.STAND_IN_ENV, None)
        os.environ[graphs.LAYOUT_ENV] = "1"
    else:
        os.environ[graphs.STAND_IN_ENV] = stand_in
        os.environ.pop(graphs.LAYOUT_ENV, None)
    # (a multi-rank graph holds NCCL work: graphed only with train.graph_collectives, which the stand-in runs here)
    cfg = compose([*args, f"results.dir={folder}", "train.graph_collectives=true"]
                  + ([] if stand_in else ["train.cuda_graphs=false"]))
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
        os.environ.pop(graphs.LAYOUT_ENV, None)


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
    # counted on the last step before the timed ones (a dispatch mode counts them, slowly): a replay when graphed
    assert graphed["step"] == on["step_time_s"]["measured_from"] - 1 == 2
    assert eager["step"] == off["step_time_s"]["measured_from"] - 1 == 1
    assert graphed["per_step"] <= MAX_OPS < eager["per_step"]
    assert any(n.startswith("train.cuda_graphs: the step (forward, loss, backward") for n in on["notes"])
    assert not any("cuda_graphs" in n for n in off.get("notes", []))


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


@pytest.mark.parametrize("size,extra", [
    (2, [*BN_DROPOUT, "parallel.spatial=2", "train.optimizer=sgd"]),
    (4, [*BN_DROPOUT, "parallel.replicas=2", "parallel.spatial=2", "train.precision=bf16"]),
    (2, ["model=unet3d", "model.size=16", "model.width=0.125", "train.batch_size=2", "train.steps=4",
         "train.warmup_steps=1", "train.check_fit=false", "parallel.spatial=2"]),
], ids=["S2-fp32-sgd", "R2xS2-bf16-adam", "unet-S2"])
def test_spatial_parts_graphed_with_their_halos_train_as_eager(tmp_path, size, extra) -> None:
    """train.graph_spatial: a spatial part's whole step replayed from one graph, its halo exchanges (and BatchNorm's
    global statistics) captured in it as the gradient sums are: CosmoFlow with BatchNorm and dropout cut in depth,
    alone and under two replicas in bf16, and the U-Net (its skips across the cut) train as the eager parts bit for
    bit, with at most 8 device ops outside the replay (the eager step's hundreds), and the record says the halos
    were replayed."""
    from gems.launch.world import run_world

    results = run_world(_both, size, [*extra, "train.graph_spatial=true"], str(tmp_path), timeout=300)
    on, off = results[0]
    assert on["loss"] == off["loss"] and on["cuda_graphs"] is True and off["cuda_graphs"] is False
    assert on["device_ops"]["per_step"] <= MAX_OPS < off["device_ops"]["per_step"], (on["device_ops"],
                                                                                      off["device_ops"])
    assert any("with its halo exchanges (train.graph_spatial)" in n for n in on["notes"]), on["notes"]


def test_no_event_is_timed_inside_a_capture(monkeypatch) -> None:
    """A halo's or a stage's wait is timed by CUDA events on a GPU rank (gems.timers), which no capture may hold:
    inside one the span is not started (the graph's replay is timed whole by the loop), and nothing is added."""
    from gems import timers

    made: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: made.append(1))
    into: dict[str, float] = {}
    t0 = timers.now(CUDA)
    timers.add_since(into, "halo", t0)
    assert t0 is None and not made and into == {} and not timers.pending()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: SimpleNamespace(record=lambda: made.append(1)))
    timers.add_since(into, "halo", timers.now(CUDA))
    assert len(made) == 2 and timers.pending()
    timers._PENDING.clear()


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


def test_a_pieces_replays_are_held_to_the_first(monkeypatch) -> None:
    """A piece's graphs would freeze what the host gave its partition at the capture: the stand-in holds each
    replay of a slot's forward and backward to its first, so a partition that reads a host value each step (a
    factor here) fails the replay where the value changed."""
    from gems.rank import pieces as pc

    factor = [2.0]

    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * factor[0]

    part = nn.Sequential(nn.Linear(5, 3), Scale())
    act = SimpleNamespace(stage=0, replica=0, micro_batch=0)
    p = pc.Pieces(torch.device("cpu"), 0, contextlib.nullcontext, lambda: [])
    for step in range(4):
        if step == 3:
            factor[0] = 3.0
        p.begin_step(step)
        with batch_context(7, step, [4, 9]):
            try:
                p(act, part, torch.randn(2, 5, requires_grad=True)).sum().backward()
            except RuntimeError as e:
                assert step == 3 and "the replay dispatched other work than the capture recorded at op 2: " \
                    "aten.mul.Tensor(float32[2, 3] (made in the body), 3.0)" in str(e), e
                return
    raise AssertionError("the changed factor replayed")


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


SMALL = [*BN_DROPOUT[:5], "train.batch_size=2", "train.steps=3", "train.warmup_steps=1", "train.check_fit=false"]


def test_graphed_gradients_have_their_parameters_strides_as_a_gpus_fused_optimizer_requires(tmp_path,
                                                                                            monkeypatch) -> None:
    """A GPU rank's model is channels-last, and torch's fused SGD and Adam CUDA kernels refuse a gradient whose
    strides are not its parameter's (a CPU kernel takes it). The stand-in computes in that layout and checks the
    fused optimizer before every step as CUDA does (gems.rank.graphs.check_fused): after every replay each gradient
    has its parameter's strides, the small ones too (views of their bucket's buffer, each laid out as its
    parameter over its span); row-major views of channels-last weights are refused; and the eager sum's flattened
    copy lies in memory order as the views do (the same positions in the summed buffer: the same sums at R >= 3,
    where a ring's chunks sum in an order that depends on the position)."""
    from gems import replication
    from gems.layout import row_major

    monkeypatch.setenv(graphs.STAND_IN_ENV, "1")  # (restored after the test)
    seen: list[tuple[Any, ...]] = []
    real = graphs.StepGraph.run

    def run(self, *a, **k):  # type: ignore[no-untyped-def]
        out = real(self, *a, **k)
        if self.replays:
            seen.extend((p.grad.stride(), p.stride(), p.is_contiguous()) for p, _ in self.grads)
        return out

    monkeypatch.setattr(graphs.StepGraph, "run", run)
    args = [*SMALL, "train.optimizer=sgd"]
    assert _train(0, 1, args, "1", str(tmp_path / "views"))["cuda_graphs"] is True
    assert seen and all(g == p for g, p, _ in seen) and any(not c for *_, c in seen)  # channels-last weights too
    monkeypatch.setattr(replication, "_segment", lambda flat, off, p: flat[off:off + p.numel()].view(p.shape))
    with pytest.raises(RuntimeError, match=r"the fused SGD of a GPU refuses this step: a parameter of shape "
                                           r"\(4, 4, 3, 3, 3\) and strides \(108, 1, 36, 12, 4\) has a gradient of "
                                           r"strides \(108, 27, 9, 3, 1\)"):
        with warnings.catch_warnings():  # (autograd warns of the layout these views break)
            warnings.simplefilter("ignore")
            _train(0, 1, args, "1", str(tmp_path / "row-major"))
    monkeypatch.undo()
    weights = [torch.empty(3, 4, 2, 2, 2).to(memory_format=torch.channels_last_3d), torch.empty(5)]
    flat = torch.zeros(sum(w.numel() for w in weights))
    views = [replication._segment(flat, 0, weights[0]), replication._segment(flat, weights[0].numel(), weights[1])]
    grads = [torch.randn_like(w) for w in weights]
    for v, g in zip(views, grads):
        v.copy_(g)
    assert [v.stride() for v in views] == [w.stride() for w in weights] and replication._views_of(flat, views)
    assert torch.equal(flat, torch.cat([row_major(g).reshape(-1) for g in grads]))  # the eager copy's order


def test_three_replicas_sum_the_graphs_gradient_views_as_the_eager_copy(tmp_path) -> None:
    """At R = 3 a ring's chunks sum in an order that depends on an element's position in the summed buffer, so the
    graph's views of a bucket (each gradient laid out as its parameter, channels-last weights too) and the eager
    step's flattened copy must put every element at the same position (memory order, both): the graphed run equals
    the eager one bit for bit (with the copy in logical order it did not: its third step differed)."""
    from gems.launch.world import run_world

    args = [*SMALL[:5], "train.batch_size=3", "train.steps=4", "train.warmup_steps=1", "train.check_fit=false",
            "train.optimizer=sgd", "parallel.replicas=3", "comm.bucket_mb=0.5"]
    on, off = run_world(_both, 3, args, str(tmp_path), timeout=300)[0]
    assert on["cuda_graphs"] is True and on["loss"] == off["loss"]


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

        import gems.rank.profiling as profiling

        outer = self

        class Reads(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func.overloadpacket.__name__ in ("_local_scalar_dense", "nonzero"):
                    outer.where.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        self._undo: list[tuple[Any, str, Any]] = []
        for owner, name in [(torch.Tensor, "tolist"), (torch.Tensor, "cpu"), (torch.Tensor, "item"),
                            (torch.cuda, "synchronize"), (profiling, "device_sync")]:
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


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_graphed_step_reads_nothing_from_the_device_and_its_figures_a_step_late(tmp_path, monkeypatch,
                                                                                  precision) -> None:
    """Issue 63, item 2: in the measured steps of a graphed run nothing in the step's path reads the device; the
    loop reads a step's figures (the loss, the stop flag: one asynchronous copy to the host) during the next step,
    after that step's replay is queued, so on a GPU the host's work for the next step overlaps this one; the steps
    something needs at once (the last) are read in their own step. fp16's overflow verdict too: decided on the
    device (its fused optimizer handed it) and read with the figures."""
    import gems.rank.loop as loop
    from gems.rank.sync import Readout

    order: list[tuple[str, int]] = []
    syncs: dict[int, list[str]] = {}
    real_step, real_after, real_run = loop.Loop.one_step, loop.Loop.after, graphs.StepGraph.run

    def one_step(self, step):  # type: ignore[no-untyped-def]
        if step < self.state.plan.measure_from:
            return real_step(self, step)
        with _Syncs() as seen:
            out = real_step(self, step)
        syncs[step] = seen.where
        return out

    def after(self, queued):  # type: ignore[no-untyped-def]
        order.append(("read", queued.step))
        return real_after(self, queued)

    def run(self, x, y, seed, step, ids, stop):  # type: ignore[no-untyped-def]
        out = real_run(self, x, y, seed, step, ids, stop)
        order.append(("replay" if self.replays else "eager", step))
        return out

    monkeypatch.setattr(loop.Loop, "one_step", one_step)
    monkeypatch.setattr(loop.Loop, "after", after)
    monkeypatch.setattr(graphs.StepGraph, "run", run)
    reads = []
    monkeypatch.setattr(Readout, "read", staticmethod(lambda posted, _r=Readout.read: reads.append(1) or _r(posted)))
    try:
        record = _train(0, 1, [*BN_DROPOUT, "train.optimizer=sgd", "train.steps=6", f"train.precision={precision}",
                               "train.loss_scale_init=1024"], "1", str(tmp_path))
    finally:
        import os

        os.environ.pop(graphs.STAND_IN_ENV, None)
    assert record["cuda_graphs"] is True
    assert sorted(syncs) == [3, 4, 5] and all(not where for where in syncs.values()), syncs
    assert order == [("eager", 0), ("read", 0), ("replay", 1), ("read", 1), ("replay", 2), ("read", 2),
                     ("replay", 3), ("replay", 4), ("read", 3), ("replay", 5), ("read", 4), ("read", 5)]
    assert len(reads) == 6  # one read of each step's figures
    if precision == "fp16":
        assert record["loss_scale"] == {"final_scale": 1024.0, "skipped_steps": []}


def test_the_watchdog_allows_a_step_read_late_what_the_device_took() -> None:
    """The stall allowance grows with the slowest step: a graphed step read a step late gives it the device's span
    of the step (its events), not the host's millisecond of launches; a step read at once, its wall time."""
    from gems.rank.sync import Queued, took

    late = Queued(4, begun=10.0, t0=10.0, data_s=0.0, posted=None, verdict=False,  # type: ignore[arg-type]
                  host_s=0.001, deferred=True)
    assert took(late, 0.5, now=99.0) == 0.5 and took(late, 0.0001, now=99.0) == 0.001
    at_once = Queued(4, begun=10.0, t0=10.0, data_s=0.0, posted=None, verdict=False)  # type: ignore[arg-type]
    assert took(at_once, 0.5, now=12.0) == 2.0


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
        self.calls.append("Stream")
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
            def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
                fake.calls.append(("capture_begin", capture_error_mode, fake.current.name))

            def pool(self) -> Any:
                return id(self)

            def capture_end(self) -> None:
                fake.calls.append(("capture_end", fake.current.name))
                if fake.fail:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

            def replay(self) -> None:
                fake.calls.append("replay")

            def reset(self) -> None:
                fake.calls.append("reset")

        return Graph()


def test_a_capture_that_fails_stops_the_run_naming_its_cause_and_leaves_nothing_held() -> None:
    """On a mock of torch.cuda: a step whose capture fails inside (a host read, as CUDA refuses it) and then at its
    end raises CaptureFailed naming the first error, not capture_end's, and train.cuda_graphs=false; the capture
    ended on its own stream, the graph was reset (safe in any state: torch's reset frees only what the graph holds),
    the current stream is back, the garbage collector is on again, the reader's lock is free, and nothing else ran
    after the failure (no empty_cache: the allocator is mid-capture then)."""
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
    assert fake.calls == ["Stream", "synchronize", "empty_cache", ("capture_begin", "thread_local", "side"),
                          ("capture_end", "side"), "reset"]  # nothing else after the failure (empty_cache asserts)
    assert fake.current is fake.main and gc.isenabled() and not g.captured and not g.replayed
    assert _free(graphs.CUDA_WORK)


def test_a_capture_runs_its_eager_step_then_captures_once_and_replays_on_the_current_stream() -> None:
    """The order of calls on a mock of torch.cuda: the eager step on the capture's stream, the capture there (CUDA's
    thread-local mode) after a device synchronisation and the eager step's cached blocks released (before the
    capture, as torch.cuda.graph does: during a capture the allocator releases no cached block, and the graph's
    pool would be allocated beside them), then replays; after every replay the graph's gradients are attached again
    for the optimizer outside it (a replay runs none of the body's Python)."""
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
    assert fake.calls == ["Stream", "synchronize", "empty_cache", ("capture_begin", "thread_local", "side"),
                          ("capture_end", "side"), "replay", "replay", "replay"]
    assert g.replays == 3 and fake.current is fake.main


def test_a_pipelines_pieces_are_captured_from_one_side_stream_each_after_the_cache_is_released() -> None:
    """On a mock of torch.cuda: every slot of a pipeline's pieces warms up on one side stream (a stream a slot would
    keep each warm-up's cached blocks apart, none reused by the next) and is captured after the cached blocks are
    released (during a capture the allocator releases none): one Stream, then for each slot a synchronisation, the
    cache emptied, the forward's capture and the backward's."""
    from gems.rank import pieces as pc

    fake = _FakeCuda(fail=False)
    part = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    p = pc.Pieces(torch.device("cpu"), 0, contextlib.nullcontext, lambda: [], api=fake)
    with batch_context(7, 0, [4, 9]):
        for mb in range(3):
            p(SimpleNamespace(stage=0, replica=0, micro_batch=mb), part, torch.randn(2, 5, requires_grad=True))
    p.begin_step(0)
    p.begin_step(1)
    slot = ["synchronize", "empty_cache", ("capture_begin", "thread_local", "side"), ("capture_end", "side"),
            ("capture_begin", "thread_local", "side"), ("capture_end", "side")]
    assert fake.calls == ["Stream", *slot, *slot, *slot] and p.captured and len(p.slots) == 3


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


@pytest.mark.parametrize("body,why", [
    (lambda s: s.figures.add_(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)),
     "lift_fresh: a tensor made from Python data"),
    (lambda s: s.figures[:1].add_(torch.bincount(s.scalars[:1])), "bincount reads a device value on the host"),
    (lambda s: s.figures.copy_(torch.repeat_interleave(s.figures, torch.ones(4, dtype=torch.int64))),
     "repeat_interleave reads a device value on the host"),
    (lambda s: s.figures.masked_fill_(s.figures > 0, s.figures[0]), "masked_fill_ with a tensor value reads it"),
], ids=["torch.tensor", "bincount", "repeat_interleave", "masked_fill"])
def test_the_stand_ins_capture_refuses_what_a_cuda_capture_refuses_where_a_cpu_kernel_hides_it(body, why) -> None:
    """A CUDA capture refuses a copy from pageable host memory (a tensor made from Python data in the body) and a
    kernel that reads a device value on the host (an output's size: bincount, repeat_interleave without its size; a
    tensor value: masked_fill). A CPU kernel does these below the dispatcher, where no check sees them: the
    stand-in's capture refuses the ops themselves, and the run stops naming them."""
    g = graphs.StepGraph(body, torch.device("cpu"), 0)
    x, y = torch.zeros(1, 2), torch.zeros(1, 1)
    g.run(x, y, 0, 0, [0], False)  # the eager step runs them
    with pytest.raises(graphs.CaptureFailed, match=f"{why}.*stand-in capture"):
        g.run(x, y, 0, 1, [0], False)


def test_the_stand_in_holds_every_replay_to_what_its_capture_recorded() -> None:
    """A GPU's replay runs the kernels its capture recorded, with the values the host gave them then, on the tensors
    they read then; the stand-in's replay runs the body's Python again. So it records the capture's ops (their
    non-tensor arguments, the graph's tensors they read) and holds every replay to them: a rate the host gives the
    body as a number each step, frozen into a GPU's graph, fails the replay that differs, as does a tensor of the
    graph replaced by another; the same rate read from a tensor the host fills replays."""
    x, y = torch.zeros(1, 2), torch.zeros(1, 1)
    rate = [0.5]
    g = graphs.StepGraph(lambda s: s.figures.add_(1.0).mul_(rate[0]), torch.device("cpu"), 0)
    for step in range(3):
        g.run(x, y, 0, step, [0], False)
    rate[0] = 0.25
    with pytest.raises(RuntimeError, match=r"the replay dispatched other work than the capture recorded at op 1: "
                                           r"aten.mul_.Tensor\(float64\[4\] \(the graph's at 0x[0-9a-f]+\+0\), 0.25\), "
                                           r"where the capture had aten.mul_.Tensor\(.*, 0.5\)"):
        g.run(x, y, 0, 3, [0], False)
    held = [torch.zeros(4, dtype=torch.float64)]
    g = graphs.StepGraph(lambda s: s.figures.add_(held[0]), torch.device("cpu"), 0, static=lambda: held)
    for step in range(3):
        g.run(x, y, 0, step, [0], False)
    old, held[0] = held[0], torch.ones(4, dtype=torch.float64)  # (the old one kept: its memory not reused)
    with pytest.raises(RuntimeError, match="the replay dispatched other work than the capture recorded at op 0"):
        g.run(x, y, 0, 3, [0], False)
    device_rate = torch.tensor(0.5, dtype=torch.float64)
    g = graphs.StepGraph(lambda s: s.figures.add_(1.0).mul_(device_rate), torch.device("cpu"), 0,
                         static=lambda: [device_rate])
    for step in range(4):
        device_rate.fill_(0.5 ** step)
        figures = g.run(x, y, 0, step, [0], False)
    assert figures.tolist() == [((((0 + 1) * 1 + 1) * 0.5 + 1) * 0.25 + 1) * 0.125] * 4  # each step's rate
    assert g.replays == 3 and old is not None


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


def _stand_in_run(rank: int, size: int, args: list[str], folder: str) -> dict[str, Any]:
    try:
        return _train(rank, size, args, "1", folder)
    finally:
        import os

        os.environ.pop(graphs.STAND_IN_ENV, None)


def test_a_hook_on_one_rank_makes_every_rank_run_eager(tmp_path) -> None:
    """fault.stall_rank's hook sits on one rank's model, and a replay would skip it there; NCCL asks that a
    collective be captured on every rank or on none (the body's sums and sync): so the ranks agree before their
    first step (one all-reduce), and every rank runs eager, each saying why."""
    from gems.launch.world import run_world

    args = [*SMALL, "train.optimizer=sgd", "parallel.replicas=2", "train.batch_size=4", "fault.stall_rank=1",
            "fault.at_step=99"]
    ranks = run_world(_stand_in_run, 2, args, str(tmp_path), timeout=300)
    assert [r["cuda_graphs"] for r in ranks] == [False, False]
    assert any(n.startswith("train.cuda_graphs: the step runs eager: hooks on another rank's model") and
               "every rank runs it eager" for n in ranks[0]["notes"])


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


def test_the_reader_and_the_capture_issue_their_cuda_work_under_one_lock(monkeypatch) -> None:
    """The lock's two holders, run on mocks of torch.cuda: the reader ahead holds it while it reads, copies and
    draws on its side stream and records its event (gems.rank.data.Prefetcher), and CUDA's capture holds it from
    before the capture begins until it ends (gems.rank.graphs._CudaCapture), each probed from another thread."""
    from gems.rank.data import Prefetcher

    held: list[tuple[str, bool]] = []

    def probe(what: str) -> None:
        held.append((what, not _free(graphs.CUDA_WORK)))

    @contextlib.contextmanager
    def stream(s: Any) -> Any:
        probe("stream")
        yield

    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda: SimpleNamespace(record=lambda s: probe("event")))
    reader = Prefetcher(lambda step: (probe("read"), ([step], None, None))[1], [], 0, torch.device("cpu"))
    reader._side = "side"  # (a GPU rank's reader ahead has its side stream)
    (ids, x, y), event = reader._make(3)
    assert ids == [3] and held == [("stream", True), ("read", True), ("event", True)] and _free(graphs.CUDA_WORK)
    held.clear()
    fake = _FakeCuda(fail=False)
    real_graph = fake.CUDAGraph

    def graph() -> Any:
        g = real_graph()
        begin, end = g.capture_begin, g.capture_end
        g.capture_begin = lambda **k: (probe("capture_begin"), begin(**k))[1]
        g.capture_end = lambda: (probe("capture_end"), end())[1]
        return g

    fake.CUDAGraph = graph  # type: ignore[method-assign]
    cap = graphs._CudaCapture(torch.device("cpu"), api=fake)
    cap.capture(lambda: probe("body"))
    assert held == [("capture_begin", True), ("body", True), ("capture_end", True)] and _free(graphs.CUDA_WORK)


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


def test_a_capturable_optimizer_stepped_outside_a_capture_does_not_warn(monkeypatch) -> None:
    """gems makes Adam capturable where it chose to (train.graph_optimizer, the bench's control) and steps it
    eagerly too (the warm-up, a graphed run's eager steps): torch's check before every step, run as on a GPU that
    is not capturing, warns of nothing (torch sets its warned-once flag when it makes the optimizer), and refuses
    a non-capturable one inside a capture."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gems.config import compose
    from gems.rank.optim import make_optimizer

    with FakeTensorMode():
        control = make_optimizer(compose([]), [nn.Parameter(torch.empty(3, device="cuda"))], capturable=True)
        plain = make_optimizer(compose([]), [nn.Parameter(torch.empty(3, device="cuda"))])
    capturing = [False]
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: CUDA)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda *a: SimpleNamespace(
        is_capturing=lambda: capturing[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        control._accelerator_graph_capture_health_check()
    capturing[0] = True
    control._accelerator_graph_capture_health_check()
    with pytest.raises(RuntimeError, match="capturable is False"):
        plain._accelerator_graph_capture_health_check()


def test_the_bench_control_steps_a_capturable_optimizer_inside_its_capture(monkeypatch) -> None:
    """gems bench step's control (the plain loop's whole step captured) run on a mock of torch.cuda: the optimizer
    it steps inside the capture was made capturable (Adam's step raised "capturable is False" there), and the
    steps after replay the graph."""
    from gems.bench import step as bench
    from gems.rank import optim

    made: list[dict[str, Any]] = []
    capturing = [False]
    stepped: list[bool] = []
    real = optim.make_optimizer

    def make(cfg: Any, params: Any, capturable: bool = False) -> Any:
        opt = real(cfg, params, capturable=capturable)
        made.append({"capturable": capturable, "optimizer": cfg.train.optimizer})
        opt.register_step_post_hook(lambda o, a, k: stepped.append(capturing[0]))
        return opt

    @contextlib.contextmanager
    def graph(g: Any) -> Any:
        capturing[0] = True
        try:
            yield
        finally:
            capturing[0] = False

    replays: list[int] = []
    side = SimpleNamespace(wait_stream=lambda s: None)
    for name, value in [("Stream", lambda *a, **k: side), ("current_stream", lambda *a, **k: side),
                        ("stream", lambda s: contextlib.nullcontext()), ("graph", graph),
                        ("CUDAGraph", lambda: SimpleNamespace(replay=lambda: replays.append(1)))]:
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(optim, "make_optimizer", make)
    bench._plain(["model=cosmoflow", "model.size=32", "model.width=0.125", "model.dropout=0", "train.batch_size=1"],
                 torch.device("cpu"), 2, 1, True)
    assert made == [{"capturable": True, "optimizer": "adam"}]
    assert stepped == [False, False, False, True] and len(replays) == 2  # three warm-ups, the capture, two replays


def test_a_loaded_fused_or_capturable_adam_keeps_its_step_count_on_its_parameters_device(tmp_path) -> None:
    """Every Adam of a run is fused (and capturable with train.graph_optimizer on a GPU), and their kernels read the
    step count on the parameters' device: a checkpoint's step count goes there as float32, as torch's own
    load_state_dict puts it (a host one beside a GPU's parameters would be read by the kernel as a device address);
    a plain Adam's stays on the host. Loaded onto parameters on the meta device (a GPU's stand-in here)."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    from gems import checkpoint as ckpt

    m = nn.Linear(2, 3)
    opt = torch.optim.Adam(m.parameters(), fused=True)
    m(torch.randn(4, 2)).sum().backward()
    opt.step()
    for p in m.parameters():
        opt.state[p]["step"] = opt.state[p]["step"].double()  # (saved as another dtype: loaded as the kernel's)
    hold = ckpt.Holding({"weight": (m, "weight"), "bias": (m, "bias")}, list(m.parameters()), opt)
    with warnings.catch_warnings():  # (DCP warns that it saves in one process)
        warnings.simplefilter("ignore")
        dcp.save(hold.state(), checkpoint_id=str(tmp_path), no_dist=True)
    for kind, device, dtype in [({"fused": True}, "meta", torch.float32),
                                ({"capturable": True, "foreach": False}, "meta", torch.float32),
                                ({"foreach": False}, "cpu", torch.float64)]:
        meta = nn.Linear(2, 3, device="meta")
        loaded = torch.optim.Adam(meta.parameters(), **kind)  # type: ignore[arg-type]
        ckpt.load(Path(tmp_path), ckpt.Holding({"weight": (meta, "weight"), "bias": (meta, "bias")},
                                               list(meta.parameters()), loaded), what=("model", "optim"))
        for p in meta.parameters():
            step = loaded.state[p]["step"]
            assert (step.device.type, step.dtype, step.dim()) == (device, dtype, 0), kind
            assert loaded.state[p]["exp_avg"].device.type == "meta"


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_fp16s_skip_decided_on_the_device_equals_the_hosts(optimizer) -> None:
    """fp16's overflow verdict need not be read on the host each step: after the step that makes the optimizer's
    state, the world's verdict goes to torch's fused kernel as found_inf (which then leaves parameters and state
    alone) and the scale moves on the device by GradScaler's rule (gems.precision.LossScaler.step_late); the
    host's record follows when the figures are read (settle). Against the verdict read at once (step): the same
    parameters, optimizer state, scales and skipped steps, bit for bit, with overflows at the first step (decided
    on the host: a skipped first step of fused SGD would leave its momentum unwritten), and later."""
    from gems.precision import LossScaler

    def run(late: bool) -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=True) if optimizer == "sgd" else
               torch.optim.Adam(model.parameters(), lr=0.01, fused=True))
        scaler = LossScaler(torch.device("cpu"), True, init_scale=2.0 ** 8, growth_interval=2)
        decided = []
        for step in range(8):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            if step in (0, 3, 4):
                x[0, 0] = float("inf")  # its gradients overflow
            scaler.scale(model(x).square().mean()).backward()
            if late:
                verdict = scaler.step_late(opt, step)
                decided.append(verdict is not None)
                if verdict is not None:
                    scaler.settle(step, bool(verdict.item() > 0))  # (the loop reads it with the step's figures)
            else:
                scaler.step(opt, step)
            opt.zero_grad(set_to_none=True)
        state = [v.clone() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        return ([p.detach().clone() for p in model.parameters()], state, scaler.state_dict(),
                float(scaler._scaler._scale), int(scaler._scaler._growth_tracker), decided)

    host, device = run(False), run(True)
    assert device[5] == [False, False] + [True] * 6  # on the host until a step made the state, then on the device
    assert all(torch.equal(a, b) for a, b in zip(host[0], device[0])) and len(host[1]) == len(device[1])
    assert all(torch.equal(a, b) for a, b in zip(host[1], device[1]))
    assert host[2] == device[2] and host[2]["skipped"] == [0, 3, 4] and host[3:5] == device[3:5]
