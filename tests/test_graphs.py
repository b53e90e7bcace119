"""CUDA graphs on GPU ranks (gems/rank/graphs.py), checked where a CPU can: which steps graph and what the others
say, and the whole protocol around the capture with a stand-in for make_graphed_callables that runs its warm-up and
returns the eager module. A graphed step must train exactly as the eager one: dropout's masks, BatchNorm's
statistics (which the warm-up moves), fp16's skipped steps and the gradient sums of replicas (which then start after
the backward). The capture and the replay themselves need a GPU (scripts/gpu_check.sh)."""
from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _cli import gems, records
from torch import nn

from gems.layers import SampleDropout, batch_context
from gems.rank import graphs

CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it here


def _cfg(graphs_on: bool = True, checkpoint: bool = False) -> Any:
    return SimpleNamespace(train=SimpleNamespace(cuda_graphs=graphs_on), parallel=SimpleNamespace(checkpoint=checkpoint))


def _mesh(spatial: int = 1) -> Any:
    return SimpleNamespace(spatial=spatial)


def test_gpu_ranks_graph_the_plain_path_and_say_why_the_others_stay_eager(monkeypatch) -> None:
    plain, piped = SimpleNamespace(pipelined=False), SimpleNamespace(pipelined=True)
    assert graphs.decide(_cfg(), plain, _mesh(), CUDA) == (True, None)
    assert graphs.decide(_cfg(False), plain, _mesh(), CUDA) == (False, None)
    for cfg, settings, mesh, why in [(_cfg(), piped, _mesh(), "pipeline"), (_cfg(), plain, _mesh(2), "halos"),
                                     (_cfg(checkpoint=True), plain, _mesh(), "recomputation")]:
        ok, note = graphs.decide(cfg, settings, mesh, CUDA)
        assert not ok and note is not None and note.startswith("train.cuda_graphs: the step runs eager") and why in note
    monkeypatch.delenv(graphs.STAND_IN_ENV, raising=False)
    assert graphs.decide(_cfg(), plain, _mesh(), torch.device("cpu")) == (False, None)  # CPU ranks: eager, quietly
    monkeypatch.setenv(graphs.STAND_IN_ENV, "1")
    assert graphs.decide(_cfg(), plain, _mesh(), torch.device("cpu")) == (True, None)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(), nn.Flatten(),
                         SampleDropout(0.5), nn.Linear(4 * 6 ** 3, 3))


def _steps(model: nn.Sequential, forward: Any, shapes: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """A few steps: (output, every gradient, every buffer) after each; ``shapes``: each step's batch."""
    out = []
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, batch in enumerate(shapes):
        x = torch.randn(batch, 2, 6, 6, 6, generator=torch.Generator().manual_seed(step))
        ids = list(range(step * 8, step * 8 + batch))
        with batch_context(7, step, ids):
            y = forward(x, step, ids)
        y.square().sum().backward()
        out.append((y.detach().clone(), *[p.grad.clone() for p in model.parameters()],
                    *[b.clone() for b in model.buffers()]))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def test_a_graphed_model_trains_as_the_eager_one_bit_for_bit() -> None:
    """Dropout masks, BatchNorm statistics, gradients and the updated weights, over steps; a batch of another
    shape runs eager (and is equal too)."""
    eager, graphed = _model(), _model()
    notes: list[str] = []
    g = graphs.GraphedModel(graphed, contextlib.nullcontext, notes)
    shapes = [2, 2, 3, 2]
    want = _steps(eager, lambda x, step, ids: eager(x), shapes)
    got = _steps(graphed, lambda x, step, ids: g.forward(x, 7, step, ids), shapes)
    assert g.shape == (2, 2, 6, 6, 6) and not notes
    for a, b in zip(want, got):
        assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_the_captures_warm_up_moves_batchnorm_and_the_graph_puts_it_back() -> None:
    """The stand-in's warm-up moves BatchNorm's running statistics (as make_graphed_callables's does): without the
    snapshot the first graphed step would start from other statistics than the eager one."""
    moved = _model()
    before = moved[1].running_mean.clone()
    with batch_context(7, 0, [0, 1]):
        graphs.stand_in_graphed(moved, (torch.randn(2, 2, 6, 6, 6),))
    assert not torch.equal(moved[1].running_mean, before)
    kept = _model()
    g = graphs.GraphedModel(kept, contextlib.nullcontext, [])
    x = torch.randn(2, 2, 6, 6, 6)
    assert g._capture(x, 7, 0, [0, 1])
    assert torch.equal(kept[1].running_mean, before) and int(kept[1].num_batches_tracked) == 0


def test_a_capture_that_fails_says_why_and_the_step_runs_eager() -> None:
    def refuses(module: nn.Module, args: tuple, num_warmup_iters: int) -> nn.Module:
        module(*args)  # it had run a forward (moving BatchNorm) before it failed
        raise RuntimeError("operation not permitted when stream is capturing")

    eager, failing = _model(), _model()
    notes: list[str] = []
    g = graphs.GraphedModel(failing, contextlib.nullcontext, notes, make=refuses)
    want = _steps(eager, lambda x, step, ids: eager(x), [2, 2])
    got = _steps(failing, lambda x, step, ids: g.forward(x, 7, step, ids), [2, 2])
    assert g.failed and len(notes) == 1 and "could not be captured (RuntimeError: operation not permitted" in notes[0]
    for a, b in zip(want, got):
        assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert all(d.static_mask is None for d in g.dropouts)


def test_a_graphed_models_dropout_reads_the_masks_the_eager_layer_draws() -> None:
    d = SampleDropout(0.3)
    x = torch.randn(3, 5, 4)
    with batch_context(1, 4, [9, 2, 5]):
        eager = d(x)
    d.static_mask = torch.empty(3, 5, 4)
    d.fill(1, 4, [9, 2, 5])
    assert torch.equal(d(x), eager)
    d.fill(1, 5, [9, 2, 5])  # the next step's masks differ
    assert not torch.equal(d(x), eager)


SMALL = ["model=cosmoflow_mlperf", "model.size=32", "train.steps=4", "train.warmup_steps=1"]


@pytest.mark.parametrize("extra", [
    ["train.batch_size=2"],  # dropout 0.5, SGD with momentum
    ["train.batch_size=4", "parallel.replicas=2"],  # the sums after the backward, in bucket order
    ["model=unet3d", "model.size=16", "model.width=0.125", "train.batch_size=2"],  # BatchNorm, skips
    ["model=cosmoflow", "model.width=0.25", "train.batch_size=2", "train.precision=fp16",
     "train.loss_scale_init=1e38"],  # fp16: skipped steps
], ids=["mlperf-dropout", "mlperf-R2", "unet-bn", "fp16-skips"])
def test_a_run_with_the_graph_protocol_trains_as_the_eager_run(tmp_path, monkeypatch, extra) -> None:
    """Real gems runs on CPU ranks with the stand-in (GEMS_CPU_GRAPH_STAND_IN=1) against train.cuda_graphs=false:
    the same losses bit for bit (and the same skipped steps)."""
    given = {a.split("=", 1)[0] for a in extra}
    args = [*(a for a in SMALL if a.split("=", 1)[0] not in given), *extra]
    monkeypatch.setenv(graphs.STAND_IN_ENV, "1")
    on = gems("run", f"results.dir={tmp_path / 'on'}", *args, timeout=400)
    monkeypatch.delenv(graphs.STAND_IN_ENV)
    off = gems("run", f"results.dir={tmp_path / 'off'}", *args, "train.cuda_graphs=false", timeout=400)
    assert on.returncode == 0 and off.returncode == 0, (on.stderr + off.stderr)[-3000:]
    (a,), (b,) = records(str(tmp_path / "on")), records(str(tmp_path / "off"))
    assert a["loss"] == b["loss"]
    assert a["cuda_graphs"] is True and b["cuda_graphs"] is False  # replayed (no capture failed), and eager
    from gems.rank.loop import GRAPHED_NOTE

    assert [n for n in a.get("notes", []) if "cuda_graphs" in n] == [GRAPHED_NOTE]  # what stayed eager, said
    assert not any("cuda_graphs" in n for n in b.get("notes", []))
    if "train.precision=fp16" in extra:
        assert a["loss_scale"]["skipped_steps"] == b["loss_scale"]["skipped_steps"] and a["loss_scale"]["skipped_steps"]


def test_a_graphed_replica_sums_its_gradients_after_the_backward(monkeypatch) -> None:
    """A replayed backward runs no hooks inside the model, so the reducer of a graphed rank places no points."""
    from gems.replication import GradientReducer

    seq = _model()
    assert GradientReducer(seq, object(), overlap=False).overlap is False
    assert GradientReducer(copy.deepcopy(seq), object()).overlap is True


def test_a_model_with_hooks_runs_eager_and_its_hooks_run() -> None:
    """A hook on the model (fault.stall_rank's) would not run in a replay, and make_graphed_callables refuses a
    hooked module: the step runs eager through the module's call, hooks included, and says why."""
    seq = _model()
    calls: list[int] = []
    seq.register_forward_pre_hook(lambda m, a: calls.append(1))
    notes: list[str] = []
    g = graphs.GraphedModel(seq, contextlib.nullcontext, notes)
    with batch_context(7, 0, [0, 1]):
        g.forward(torch.randn(2, 2, 6, 6, 6), 7, 0, [0, 1])
    assert calls == [1] and g.failed and not g.replayed
    assert notes == ["train.cuda_graphs: the step runs eager: hooks on the model (Sequential; a replay would skip "
                     "them)"]


def test_the_stand_in_refuses_what_make_graphed_callables_refuses() -> None:
    seq = _model()
    seq.register_forward_hook(lambda m, a, o: None)
    with pytest.raises(AssertionError, match="hooks"):
        graphs.stand_in_graphed(seq, (torch.randn(2, 2, 6, 6, 6),))
    unused = nn.Sequential(nn.Linear(3, 3))
    unused.spare = nn.Parameter(torch.zeros(1))  # a parameter the forward never uses
    with pytest.raises(RuntimeError):
        graphs.stand_in_graphed(unused, (torch.randn(2, 3),))


def test_the_reader_ahead_pauses_while_the_model_is_captured() -> None:
    """torch captures in CUDA's global mode, where another thread's allocation fails the capture: the capture holds
    the lock the reader's CUDA work takes (gems.rank.data.Prefetcher)."""
    import threading

    held: list[bool] = []

    def make(module: nn.Module, args: tuple, num_warmup_iters: int) -> nn.Module:
        probe = threading.Thread(target=lambda: held.append(not graphs.CUDA_WORK.acquire(blocking=False)))
        probe.start()
        probe.join()
        return graphs.stand_in_graphed(module, args, num_warmup_iters)

    g = graphs.GraphedModel(_model(), contextlib.nullcontext, [], make=make)
    with batch_context(7, 0, [0, 1]):
        g.forward(torch.randn(2, 2, 6, 6, 6), 7, 0, [0, 1])
    assert held == [True] and g.replayed
    import inspect

    from gems.rank.data import Prefetcher

    assert "with CUDA_WORK, torch.cuda.stream(self._side)" in inspect.getsource(Prefetcher._make)
