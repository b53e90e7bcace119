"""What a CUDA graph's capture asks of the code inside it and of the rank that made it (gems/capture.py), checked
where a CPU can: the NCCL launches inside a graph chained in issue order on one stream (on a mock of torch.cuda:
the stream waits as a GPU would be given them), no stream recorded on a tensor inside a capture, the graphs reset
before the process groups are destroyed on every way a graphed run ends (real runs over gloo, the stand-in for the
capture, every rank's calls logged), the failures named, and the default that captures no NCCL work until a lent
GPU has run such graphs to their end. What only a GPU shows: that NCCL's teardown no longer waits (the rig's graphed
points, gems.gpucheck.graphed_points) and the pool a graphed spatial step takes."""
from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from _cli import gems_here, records

from gems import capture
from gems.commlog import OrderError, load, replay
from gems.rank import graphs


class _Api:
    """torch.cuda as gems.capture sees it: streams that record what waits on what, in one list of calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.main = self._stream("main")
        self.current = self.main
        self.made = 0

    def _stream(self, name: str) -> Any:
        api = self

        class S:
            def __init__(self) -> None:
                self.name = name

            def wait_stream(self, other: Any) -> None:
                api.calls.append(("wait_stream", self.name, other.name))

        return S()

    def Stream(self, device: Any = None) -> Any:  # noqa: N802 - torch.cuda's name
        self.made += 1
        return self._stream(f"chain{self.made}")

    def current_stream(self, device: Any = None) -> Any:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: Any) -> Any:
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    def synchronize(self, device: Any = None) -> None:
        self.calls.append(("synchronize",))

    def work(self, name: str) -> Any:
        api = self
        return SimpleNamespace(wait=lambda: api.calls.append(("wait", name, api.current.name)))


def test_nccl_launches_inside_a_graph_are_chained_in_issue_order_and_the_capture_joins_the_chain() -> None:
    """Inside a capture each launch is issued from the region's one chain stream, which first waits for the issuing
    stream (the launch's inputs) and then for the launch's works: the next launch, whatever its communicator,
    depends on it. The issuing stream waits on the chain only for a blocking call; an asynchronous one (a gradient
    sum) leaves it free (the overlap), its own code waiting on the work later. At the region's end the capturing
    stream joins the chain. Outside a graph a launch is the call alone."""
    api = _Api()
    issued: list[str] = []

    def issue(name: str, asynchronous: bool) -> Any:
        def go() -> Any:
            issued.append(f"{name} on {api.current.name}")
            return [api.work(name)] if asynchronous else None
        return go

    assert capture.launch(issue("eager", True), None) is not None and api.calls == []  # outside: just the call
    before = capture.alive()  # (another test's graphs, not yet collected)
    graph = capture.StandInGraph("step")
    with capture.region(torch.device("cpu"), api, graph):
        assert capture.in_graph()
        capture.launch(issue("sum", True), "grad")  # a bucket's all-reduce (async_op=True)
        with api.stream(api._stream("halo")):  # a halo posted from its side stream
            capture.launch(issue("halo", True), "spatial")
        capture.launch(issue("sync", False), None)  # the step's sync (blocking)
    assert not capture.in_graph()
    assert issued == ["eager on main", "sum on chain1", "halo on chain1", "sync on chain1"]
    assert api.calls == [("wait_stream", "chain1", "main"), ("wait", "sum", "chain1"),
                         ("wait_stream", "chain1", "halo"), ("wait", "halo", "chain1"),
                         ("wait_stream", "chain1", "main"), ("wait_stream", "main", "chain1"),  # blocking: at once
                         ("wait_stream", "main", "chain1")]  # the capture's end joins the chain
    assert api.made == 1  # one chain a graph
    # the graph knows the communicators it holds NCCL work of (what a teardown that waits for it names)
    assert capture.alive() == [*before, "step holding NCCL work of grad; spatial; the world, not in the registry"]
    graph.reset()
    assert capture.alive() == before


def test_no_stream_is_recorded_on_a_tensor_inside_a_capture_and_each_is_held_until_its_streams_join() -> None:
    """Eagerly a tensor used on a second stream gets ``record_stream``; inside a graph the region holds it instead (a
    block with stream uses freed in a capture is never reused in it: the pool would grow past the plan), until the
    stream it was made on waits for the one that uses it: from then on its memory's next use there follows that use,
    so the pool may take it back inside the capture (the halo's input when the compute stream joins the side stream,
    the received buffers at the next post's join), as the eager step's allocator does."""
    recorded: list[Any] = []
    api = _Api()
    main, side = api.main, api._stream("side")

    class T:
        def __init__(self, name: str) -> None:
            self.name = name

        def record_stream(self, s: Any) -> None:
            recorded.append((self.name, s.name))

        def __repr__(self) -> str:
            return self.name

    capture.keep(T("eager"), side, main)  # type: ignore[arg-type]
    x, buf, last = T("x"), T("buf"), T("last")
    with capture.region(torch.device("cpu")):
        held = lambda: [h[0] for h in capture._REGION[-1].held]  # noqa: E731
        capture.keep(x, side, main)  # type: ignore[arg-type]  # the layer's input, packed on the side stream
        capture.join(side, main)  # another layer's post: x stays (its use on side is not joined back yet)
        assert held() == [x]
        capture.join(main, side)  # the halo's wait: main follows the sends that read x
        capture.keep(buf, main, side)  # type: ignore[arg-type]  # received on side, read on main
        assert held() == [buf]
        capture.join(side, main)  # the next post: side follows main's reads of buf
        capture.keep(last, main, side)  # type: ignore[arg-type]
        assert held() == [last]  # the last layer's buffers: to the region's end
    assert recorded == [("eager", "side")]
    assert api.calls == [("wait_stream", "side", "main"), ("wait_stream", "main", "side"),
                         ("wait_stream", "side", "main")]


def test_a_graph_launched_outside_the_chain_is_refused_by_the_replay() -> None:
    """The strict NCCL replay (gems.commlog) refuses a launch inside a graph that was not chained after the one
    before it: in a replay only the graph's edges order kernels, and NCCL promises no progress for concurrent work on
    two communicators. The same logs chained replay."""
    def post(i: int, comm: str, ranks: list[int], chained: bool) -> dict[str, Any]:
        return {"e": "post", "id": i, "kind": "coll", "fn": "all_reduce", "comm": comm, "ranks": ranks, "peer": None,
                "batch": None, "bytes": 4, "dtype": "float32", "device": "cpu", "graph": 0, "chained": chained}

    logs = {r: [post(0, "g:grad", [0, 1], True), post(1, "g:world", [0, 1], r == 0)] for r in (0, 1)}
    with pytest.raises(OrderError, match="rank 1 launched all_reduce on g:world .post 1. inside CUDA graph 0 without an "
                                         "order after its launch before"):
        replay(logs)
    logs[1][1]["chained"] = True
    assert replay(logs)["collectives"] == 4


def test_release_finishes_the_queue_in_the_watchdogs_gpu_phase_then_resets_every_graph() -> None:
    """gems.capture.release: the device's queue finished in the ``gpu queue`` phase (where a hung peer ends the
    rank by the watchdog's path, not NCCL's), then every graph the rank made reset and forgotten; nothing to do
    where it made none."""
    from gems import progress

    api, phases = _Api(), []
    resets: list[str] = []

    class G:
        def __init__(self, name: str) -> None:
            self.name = name

        def reset(self) -> None:
            resets.append(self.name)

    @contextlib.contextmanager
    def waiting() -> Any:
        with progress.waiting("gpu queue"):
            phases.append(progress.PROGRESS.phase)
            yield

    assert capture.release(torch.device("cpu"), api=api) == 0 and api.calls == []
    capture.made(G("step"))
    capture.made(G("piece"))
    assert capture.release(torch.device("cpu"), api=api, waiting=waiting) == 2
    assert api.calls == [("synchronize",)] and phases == ["gpu queue"] and resets == ["step", "piece"]
    assert capture.GRAPHS == [] and capture.DEVICE_ERRORS == []


def test_a_device_in_error_still_has_every_graph_reset_then_its_error_raised(monkeypatch) -> None:
    """Where the device reports an error as its queue is finished (a failed first replay on a GPU), every graph is
    reset all the same (NCCL's abort waits for live graphs too), and the error then leaves, kept for the worker, which
    ends the process groups by abort. A graph whose reset fails stays registered and is named alive."""
    monkeypatch.setattr(capture, "DEVICE_ERRORS", [])
    api = _Api()
    resets: list[str] = []

    def broken(device: Any = None) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    api.synchronize = broken  # type: ignore[method-assign]

    class G:
        def __init__(self, name: str, fails: bool = False) -> None:
            self.name, self.fails = name, fails

        def reset(self) -> None:
            if self.fails:
                raise RuntimeError("the driver refused")
            resets.append(self.name)

    before = capture.alive()
    kept = [capture.made(G("step"), "the step's graph"), capture.made(G("stuck", fails=True), "a stuck graph")]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        capture.release(torch.device("cuda", 0), api=api)
    assert resets == ["step"] and capture.GRAPHS == [kept[1]]
    assert capture.DEVICE_ERRORS == ["RuntimeError: CUDA error: an illegal memory access was encountered"]
    assert capture.alive() == [*before, "a stuck graph (no NCCL work captured)"]
    kept[1].fails = False
    assert capture.reset(kept[1]) and capture.GRAPHS == [] and capture.alive() == before


@pytest.mark.parametrize("fails", ["body", "instantiate"])
def test_a_graph_is_reset_on_every_failure_of_its_capture_before_the_error_leaves(fails: str) -> None:
    """On a mock of torch.cuda: the body raises its own error (after NCCL work, say) while ``capture_end`` succeeds,
    or ``capture_end`` raises after ``cudaStreamEndCapture`` made the graph (``instantiate()`` failing inside it):
    either way the graph is reset before the error leaves (a traceback holding it would hang NCCL's teardown; torch's
    ``reset()`` frees only what the graph holds, in every state), and the error is the capture's named one."""
    calls: list[str] = []
    api = _Api()

    class Graph:
        def capture_begin(self, **kw: Any) -> None:
            calls.append("capture_begin")

        def capture_end(self) -> None:
            calls.append("capture_end")
            if fails == "instantiate":
                raise RuntimeError("CUDA error: out of memory (cudaGraphInstantiateWithFlags)")

        def reset(self) -> None:
            calls.append("reset")

    api.CUDAGraph = Graph  # type: ignore[attr-defined]
    api.empty_cache = lambda: None  # type: ignore[attr-defined]

    def body(s: graphs.Static) -> None:
        if "capture_begin" in calls and fails == "body":
            raise ValueError("the step's own error")
        s.figures.fill_(1.0)

    g = graphs.StepGraph(body, torch.device("cpu"), 1, capture=graphs._CudaCapture(torch.device("cpu"), api=api))
    x, y = torch.zeros(2, 3), torch.zeros(2, 1)
    g.run(x, y, 0, 0, [0, 1], False)
    named = "ValueError: the step's own error" if fails == "body" else "RuntimeError: CUDA error: out of memory"
    with pytest.raises(graphs.CaptureFailed, match=f"capturing the step failed on rank 1 at step 1: {named}"):
        g.run(x, y, 0, 1, [0, 1], False)
    assert calls == ["capture_begin", "capture_end", "reset"] and capture.GRAPHS == []


# ---- whole runs: every way a graphed run ends, its graphs reset before its process groups go -------------------------
SMALL = ["model=cosmoflow_small", "model.size=32", "model.width=0.25", "train.batch_size=4", "train.steps=5",
         "train.warmup_steps=1", "train.check_fit=false", "train.graph_collectives=true"]


def _ended(events: list[dict[str, Any]]) -> list[list[str]]:
    """Each attempt's teardown (a resumed job appends to the rank's log): its graph resets and destroy, in order."""
    out: list[list[str]] = []
    for e in events:
        if e.get("e") == "rank":
            out.append([])
        elif e.get("e") in ("graph_reset", "destroy"):
            out[-1].append(e["e"] if e["e"] == "graph_reset" else f"destroy({e['graphs_alive']} alive)")
    return out


@pytest.mark.parametrize("path,mesh,stand_in,extra,status", [
    ("failed", ["parallel.spatial=2", "train.graph_spatial=true"], "1", ["fault.nan_rank=1", "fault.at_step=3"], 1),
    ("capture-failed", ["parallel.spatial=2", "train.graph_spatial=true"], "fail_at_end", [], 1),
    ("body-failed", ["parallel.replicas=2"], "fail_after_body", [], 1),
    ("first-replay-failed", ["parallel.replicas=2"], "fail_at_replay", [], 1),
    ("preempted", ["parallel.replicas=2"], "1", ["fault.preempt_at_step=3"], 0),
    ("pieces-first-replay-failed", ["parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=2",
                                    "train.graph_pieces=true"], "fail_at_replay", [], 1),
])
def test_every_way_a_graphed_run_ends_resets_its_graphs_before_its_process_groups_go(tmp_path: Path, monkeypatch,
                                                                                      path, mesh, stand_in, extra,
                                                                                      status) -> None:
    """A graphed run (the stand-in) that fails on a non-finite loss, whose capture fails at its end, whose body fails
    after its NCCL work with the capture ended, whose first replay fails, or that is preempted and resumed: on every
    rank, in every attempt, each graph it made is reset before its process groups are destroyed (none alive then),
    or before the process ends where it ends without destroying them (a preemption). The failures of a capture and
    of a first replay are named, with the key that trains eager."""
    monkeypatch.setenv(graphs.STAND_IN_ENV, stand_in)
    monkeypatch.setenv("GEMS_COMM_LOG", str(tmp_path / "comm"))
    r = gems_here("run", *SMALL, *mesh, *extra, f"results.dir={tmp_path}")
    assert r.returncode == status, r.stderr[-2000:]
    logs = load(tmp_path / "comm")
    assert sorted(logs) == [0, 1]
    for rank, events in logs.items():
        attempts = _ended(events)
        assert attempts and all(a and a[0] == "graph_reset" for a in attempts), (rank, attempts)
        for a in attempts:
            assert a.count("graph_reset") == len(a) - a.count("destroy(0 alive)"), (rank, a)
        if path == "preempted":  # ended by os._exit for the launcher to resume: released, nothing destroyed; then done
            assert len(attempts) == 2 and attempts[0] == ["graph_reset"] and attempts[1][-1] == "destroy(0 alive)"
        else:  # one graph for the step; one a slot for a pipeline's pieces (two micro-batches here)
            resets = 2 if "pieces" in path else 1
            assert attempts == [["graph_reset"] * resets + ["destroy(0 alive)"]], (rank, attempts)
    (rec,) = records(str(tmp_path))
    if path == "preempted":
        assert rec["status"] == "ok" and rec["cuda_graphs"] is True and len(rec["loss"]) == 5
        return
    error = str(rec.get("error") or "")
    named = {"failed": "non-finite", "capture-failed": "capturing the step failed",
             "body-failed": "capturing the step failed", "first-replay-failed": "the first replay of the step failed",
             "pieces-first-replay-failed": "train.graph_pieces: the first replay of the piece of stage"}
    assert named[path] in error.lower() if path == "failed" else named[path] in error, error[:500]
    if path != "failed":
        assert ("train.graph_pieces=false" if "pieces" in path else "train.cuda_graphs=false") + " trains eager" in error


def test_a_graph_the_registry_lost_ends_its_ranks_teardown_within_the_limit_naming_it(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """A graph held back from the registry on purpose (the stand-in's ``hold_back``: nothing resets it) is alive at the
    rank's end, and the stand-in's teardown waits for it as NCCL's does. Each rank ends within its limit (the stall
    allowance, fault.stall_timeout_s) all the same: its failure report, a teardown's and never a step timeout's,
    names the graph, that the registry lost it and the communicators it holds NCCL work of; its log says it exits
    with the teardown's status; the run's record, written before, stands."""
    import json

    from gems.worker import TEARDOWN_EXIT

    monkeypatch.setenv(graphs.STAND_IN_ENV, "hold_back")
    limit = 4.0
    r = gems_here("run", *SMALL, "parallel.replicas=2", f"fault.stall_timeout_s={limit:g}", f"results.dir={tmp_path}")
    (rec,) = records(str(tmp_path))
    assert rec["status"] == "ok" and rec["cuda_graphs"] is True, (r.stderr[-2000:], rec.get("error"))
    written = Path(rec["_path"]).stat().st_mtime
    for rank in (0, 1):
        (report_path,) = tmp_path.glob(f".jobs/*/failures/rank{rank}.json")
        report = json.loads(report_path.read_text())
        assert report["kind"] == "teardown" and not report["echo"], report
        assert report["graphs_alive"] == ["the step's graph holding NCCL work of the group of ranks 0, 1; the world, "
                                          "not in the registry"], report
        assert f"were not destroyed within {limit:g} s (fault.stall_timeout_s)" in report["error"]
        assert "timeout" not in report["kind"] and "step " not in report["error"].split("(")[0]
        # at the teardown's limit (rank 0's began after it wrote the record, rank 1's about then): not at Slurm's,
        # nor at the launcher's
        assert limit - 2 <= report["time"] - written < limit + 15, report["time"] - written
        (log,) = tmp_path.glob(f".jobs/*/rank{rank}.log")
        assert f"it exits with status {TEARDOWN_EXIT} (a teardown, not a step)" in log.read_text()


def test_by_default_a_multi_rank_step_captures_no_nccl_work_and_says_so_once(tmp_path: Path, monkeypatch) -> None:
    """Until a lent GPU has run graphs holding NCCL work to their end, a multi-rank step runs eager by default
    (train.graph_collectives=false), saying so once and naming the key; a one-rank step still graphs. The same
    decision plans a GPU run (gems plan: its notes)."""
    monkeypatch.setenv(graphs.STAND_IN_ENV, "1")
    r = gems_here("run", *[a for a in SMALL if "graph_collectives" not in a], "parallel.replicas=2",
                  f"results.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(str(tmp_path))
    said = [n for n in rec["notes"] if "train.graph_collectives=true" in n]
    assert rec["cuda_graphs"] is False and len(said) == 1, rec["notes"]
    assert said[0].startswith("train.cuda_graphs: the step runs eager: its graph would hold NCCL work")
    plain = SimpleNamespace(pipelined=False)
    cfg = SimpleNamespace(train=SimpleNamespace(cuda_graphs=True, graph_spatial=True, graph_collectives=False),
                          parallel=SimpleNamespace(checkpoint=False), comm=SimpleNamespace(backend="auto"))
    cuda = torch.device("cuda", 0)
    assert graphs.decide(cfg, plain, SimpleNamespace(spatial=1, size=1), cuda) == (True, None)
    ok, note = graphs.decide(cfg, plain, SimpleNamespace(spatial=2, size=2), cuda)
    assert not ok and note is not None and "the halo messages" in note
    piped = SimpleNamespace(pipelined=True, schedule=SimpleNamespace(split=False))
    cfg.train.graph_pieces = True  # a pipeline's pieces hold none: they graph
    assert graphs.decide(cfg, piped, SimpleNamespace(spatial=1, size=2), cuda) == (True, None)


def test_the_plan_prices_the_chain_a_graph_of_spatial_parts_puts_its_sums_on(monkeypatch) -> None:
    """Inside a graph every NCCL launch follows the one before it (the chain), so at S > 1 each backward halo, and
    the compute that needs it, waits for every gradient sum launched before it: the plan of a graphed spatial step
    hides none of its sums behind the backward (their window is 0) and says so; a graphed step of replicas alone,
    whose sums no halo follows, keeps the backward as its window, as eagerly."""
    import gems.plan.timing as timing
    from gems.config import compose
    from gems.plan.make import make_plan

    windows: list[float] = []
    real = timing._gradient_sum

    def gradient_sum(*args: Any) -> float:
        windows.append(args[4])
        return real(*args)

    monkeypatch.setattr(timing, "_gradient_sum", gradient_sum)
    base = ["model.size=32", "model.width=0.25", "train.batch_size=4", "train.device=cuda", "cluster.gpu=h100",
            "parallel.replicas=2", "train.graph_collectives=true"]
    spatial = make_plan(compose([*base, "parallel.spatial=2", "train.graph_spatial=true"]))
    assert windows[-1] == 0.0 and any("the sums chained with the halos" in a for a in spatial.prediction.assumptions)
    replicas = make_plan(compose(base))
    assert windows[-1] > 0.0 and not any("chained" in a for a in replicas.prediction.assumptions)
