"""CPU records carry the tensor memory a GPU would count, and it falls with the spatial parts.

The runs and plans go through ``gems.cli.main`` in the test's process (tests/_cli.py's ``gems_here``: the
launcher's own code, its ranks real processes forked by multiprocessing's fork server); a run two tests read (the
serial one, S = 2) runs once for the module."""
from __future__ import annotations

import pytest
from _cli import gems_here, merged, records

RUN = ["model.size=64", "model.width=0.5", "train.steps=3", "train.warmup_steps=1"]


def _full(tmp, *args):
    out = gems_here("run", f"results.dir={tmp}", *merged(*RUN, *args))
    assert out.returncode == 0, out.stderr[-3000:]
    (r,) = records(str(tmp))
    return r


_RUNS: dict = {}  # the module's runs by their arguments, for the session (a worker may set a module's fixtures up twice)


@pytest.fixture
def shared(tmp_path_factory):
    """The record of the run of some arguments, run once (two tests read the serial run and S = 2)."""
    def get(*args):
        if args not in _RUNS:
            _RUNS[args] = _full(tmp_path_factory.mktemp("run"), *args)
        return _RUNS[args]

    return get


def _record(tmp, *args):
    return _full(tmp, *args)["peak_memory_bytes"]


def test_cpu_records_carry_tensor_memory_that_halves_with_two_parts(shared):
    one = shared()["peak_memory_bytes"]
    two = shared("parallel.spatial=2")["peak_memory_bytes"]
    assert one["kind"] == two["kind"] == "rss_growth"
    assert "cuda_requested_max" not in one and "cuda_requested_max" not in two  # GPU ranks' figure only
    assert len(two["tensor_per_rank"]) == 2 and two["tensor_max"] == max(two["tensor_per_rank"])
    # activations dominate this model: each part holds about half, plus the weights every rank keeps
    assert 0.4 * one["tensor_max"] < two["tensor_max"] < 0.75 * one["tensor_max"], (one, two)


def test_without_warmup_steps_the_first_two_steps_are_profiled_and_left_out_of_the_timings(tmp_path):
    # the tensor memory is measured on steps that are not timed: with no warm-up steps 0 and 1 (the second after
    # the first optimizer step, so the optimizer's state counts), and the measured steps start at 2
    rec = _full(tmp_path / "w0", "train.warmup_steps=0")
    mem, st = rec["peak_memory_bytes"], rec["step_time_s"]
    assert mem["tensor_max"] > 0 and mem["tensor_steps"] == [0, 1] and mem["max"] > 0
    assert st["measured_from"] == 2 and len(st["all"]) == 1
    assert any("profiled for tensor memory (after the first optimizer step" in n for n in rec["notes"]), rec["notes"]
    # the same peak as a run whose warm-up steps are the profiled ones (Adam's state included in both)
    warm = _record(tmp_path / "w2", "train.warmup_steps=2")
    assert abs(warm["tensor_max"] - mem["tensor_max"]) < 0.03 * warm["tensor_max"], (warm, mem)


def test_a_two_step_run_says_its_tensor_memory_leaves_the_optimizer_state_out(tmp_path):
    rec = _full(tmp_path, "train.steps=2", "train.warmup_steps=0")
    assert rec["peak_memory_bytes"]["tensor_steps"] == [0]
    assert any("before the optimizer's state exists" in n for n in rec["notes"]), rec["notes"]
    assert not any("after the first optimizer step" in n for n in rec["notes"]), rec["notes"]


def _planned(*args):
    import json

    out = gems_here("plan", "plan.format=json", "plan.predict=false", *merged(*RUN, *args))  # memory only
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


UNET = ["model=unet3d", "model.size=32", "model.width=0.25"]


@pytest.mark.parametrize("args", [[], ["parallel.spatial=2"], ["parallel.pipeline=2", "parallel.schedule=mast"],
                                  ["parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=2"],
                                  ["parallel.checkpoint=true"],
                                  # skips packed across the cut, and held by the recomputed pieces they cross
                                  [*UNET, "parallel.pipeline=2"], [*UNET, "parallel.checkpoint=true"],
                                  [*UNET, "parallel.pipeline=2", "parallel.spatial=2"],
                                  # a recomputed partition's received gradient (packed with the skips') held through
                                  # its backward: 0.94 of the measured on rank 0 before the plan counted it
                                  [*UNET, "parallel.pipeline=2", "parallel.checkpoint=true"],
                                  # a recomputed stage's input counted once: its second stage planned at 1.41 before
                                  ["parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=2",
                                   "parallel.checkpoint=true"],
                                  # a split backward's W holds each deferrable layer's input and output gradient
                                  # from its I, recomputed or not, and the I keeps them from each layer it passes:
                                  # the recomputing one planned at 0.67 of its measured memory before (the U-Net at
                                  # 64^3 under a cap ran past it)
                                  [*UNET, "parallel.pipeline=2", "parallel.schedule=gpipe", "parallel.micro_batches=2",
                                   "parallel.split_backward=true", "parallel.checkpoint=true"],
                                  [*UNET, "parallel.pipeline=2", "parallel.schedule=zbh1", "parallel.micro_batches=2"],
                                  [*UNET, "parallel.pipeline=2", "parallel.schedule=mast", "parallel.split_backward=true"]],
                         ids=["serial", "S=2", "mast D=2", "1f1b D=2 m=2", "checkpoint", "unet D=2",
                              "unet checkpoint", "unet D=2 x S=2", "unet D=2 checkpoint", "1f1b D=2 m=2 checkpoint",
                              "unet gpipe split checkpoint", "unet zbh1 m=2", "unet mast split"])
def test_gems_plan_bounds_the_measured_tensor_memory_closely(shared, args):
    """`gems plan` is an upper bound of what each rank's tensors really reach, and a close one (within 40%):
    the rank with the largest measured memory against the plan of its mesh position."""
    got = shared(*args)["peak_memory_bytes"]["tensor_per_rank"]
    plan = _planned(*args)
    by_rank = {}
    for pos in plan["positions"]:
        for s in pos["spatial"]:
            by_rank[pos["pipeline"] * plan["mesh"]["spatial"] + s] = pos["bytes"]["total"]
    assert len(by_rank) == len(got)
    for rank, measured in enumerate(got):
        ratio = by_rank[rank] / measured
        assert 1.0 <= ratio <= 1.4, f"rank {rank}: planned {by_rank[rank]} B, measured {measured} B ({ratio:.2f}x)"


def test_the_plan_counts_the_workspace_a_cpu_convolution_backward_allocates(tmp_path):
    """At 32^3 CosmoFlow's 256-channel convolutions dominate: oneDNN's backward allocates about 4x their weights
    for itself (27 MiB at batch 2, whatever the extent), a quarter of a rank's tensors. The plan measures it
    (gems.plan.cpu.conv_workspace) and lands within 10% of each rank's measured tensor peak, both ways;
    without that term it would be more than 10% short."""
    import json

    args = ["model=cosmoflow", "model.size=32", "train.batch_size=2", "parallel.spatial=2"]
    out = gems_here("run", f"results.dir={tmp_path}", "train.steps=3", "train.warmup_steps=2", *args)
    assert out.returncode == 0, out.stderr[-3000:]
    (r,) = records(str(tmp_path))
    got = r["peak_memory_bytes"]["tensor_per_rank"]
    out = gems_here("plan", "plan.format=json", "plan.predict=false", *args)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    by_rank = {s: pos for pos in plan["positions"] for s in pos["spatial"]}
    for rank, measured in enumerate(got):
        pos = by_rank[rank]
        planned, ws = pos["bytes"]["total"], pos["activations_detail"]["workspace"]
        assert abs(planned / measured - 1) <= 0.10, f"rank {rank}: planned {planned} B, measured {measured} B"
        assert (planned - ws) / measured < 0.90, f"rank {rank}: the workspace ({ws} B) is not what makes it hold"


def test_a_gpu_meter_reads_the_peaks_of_allocated_and_of_requested_bytes(monkeypatch):
    """On GPU the meter gives CUDA's two peaks: the blocks the caching allocator handed out (what the planner is
    held to) and the bytes the tensors asked for (its ``requested_bytes``), whose difference is the allocator's
    rounding and unsplit blocks. No GPU here: torch.cuda's two readings stand in, as CUDA fills them."""
    import torch

    from gems.memory import MemoryMeter

    stats = {"requested_bytes.all.peak": 1433 * 2**20}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 1435 * 2**20)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    meter = MemoryMeter(torch.device("cuda", 0))
    assert meter.peak() == 1435 * 2**20 and meter.requested_peak() == 1433 * 2**20
    stats.clear()  # a torch that does not count requests
    assert meter.requested_peak() is None
    assert MemoryMeter(torch.device("cpu")).requested_peak() is None


def test_one_process_plans_the_unet_on_mesh_after_mesh(monkeypatch):
    """The planner's traces leave the U-Net's skip store as they found it, so a process plans one mesh after
    another (a program calling gems.cli.main, these tests): a later plan replayed a skip's pop from the layer memo
    without popping, its stash stayed in the model's store, and the next trace of the model popped that stash (a
    sample's, at another batch) in place of its own."""
    import gems.plan.memory as pm
    from gems.config import compose
    from gems.models.skips import store_of
    from gems.plan.fit import check_fit

    monkeypatch.setenv("GEMS_CACHE_DIR", "")  # traced here, not read from the session's store
    monkeypatch.setattr(pm, "_CACHE", {})
    unet = ["model=unet3d", "model.size=16", "model.width=0.125", "train.batch_size=2"]
    for mesh in (["parallel.checkpoint=true"], ["parallel.checkpoint=true", "parallel.spatial=2"],
                 ["parallel.pipeline=2"]):
        check_fit(compose([*unet, *mesh]))
        (spec,) = [v for k, v in pm._CACHE.items() if k[0] == "model"]
        assert len(store_of(list(spec.module))) == 0, mesh


# ---- a rank's memory capped: cluster.rank_memory_gb, planned and held alike --------------------------------------
def test_a_rank_memory_cap_is_planned_as_the_device_and_held_by_the_run(shared, tmp_path):
    """The cap is a CPU rank's whole memory in the plan (no interpreter reserve: it counts tensors, as a GPU's
    allocator does), and the run measures every rank's tensors against it: a mesh planned past it is refused before
    launch (train.check_fit), run anyway it stops every rank after its profiled steps with one line and a record
    naming the rank, and a cap at the plan's peak runs to its end."""
    S2 = "parallel.spatial=2"
    measured = shared(S2)["peak_memory_bytes"]["tensor_max"]
    peak = max(p["bytes"]["total"] for p in _planned(S2)["positions"])
    assert peak >= measured  # the plan bounds it (test_gems_plan_bounds_the_measured_tensor_memory_closely)
    under, at = f"{0.9 * measured / 2**30:.4f}", f"{peak / 2**30 + 1e-4:.4f}"
    small = _planned(S2, f"cluster.rank_memory_gb={under}")
    dev = small["device"]
    assert not small["fits"] and dev["capped"] and dev["memory_bytes"] == int(float(under) * 2**30)
    assert dev["reserve_bytes"] == 0 and "cluster.rank_memory_gb" in dev["memory_source"]
    assert _planned(S2, f"cluster.rank_memory_gb={at}")["fits"]

    refused = gems_here("run", f"results.dir={tmp_path / 'refused'}", *merged(*RUN, S2, f"cluster.rank_memory_gb={under}"))
    assert refused.returncode == 2 and "train.check_fit" in refused.stderr, refused.stderr[-2000:]
    assert not (tmp_path / "refused").exists() or not records(str(tmp_path / "refused"))

    out = gems_here("run", f"results.dir={tmp_path / 'over'}",
                    *merged(*RUN, S2, f"cluster.rank_memory_gb={under}", "train.check_fit=false"))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (r,) = records(str(tmp_path / "over"))
    f = r["failure"]
    assert r["status"] == "failed" and f["kind"] == "memory" and f["rank"] in (0, 1), r["error"]
    assert f["tensor_peak_bytes"] > f["cap_bytes"] == int(float(under) * 2**30) and f["step"] == 1
    assert f"past cluster.rank_memory_gb={float(under):g}" in r["error"] and "rank_memory_gb" in out.stderr
    assert len(r["loss"]) == 2  # the two profiled steps ran; nothing after them

    ok = gems_here("run", f"results.dir={tmp_path / 'at'}", *merged(*RUN, S2, f"cluster.rank_memory_gb={at}"))
    assert ok.returncode == 0, ok.stderr[-3000:]
    (r,) = records(str(tmp_path / "at"))
    assert r["status"] == "ok" and max(r["peak_memory_bytes"]["tensor_per_rank"]) <= float(at) * 2**30


def test_a_gpu_ranks_allocator_is_held_to_the_cap_and_planned_under_it(monkeypatch):
    """On GPU ranks the caching allocator is limited to the cap (a fraction of the device's total; a cap past the
    device leaves it whole), and the plan counts the capped memory, the context and NCCL's buffers inside it. No GPU
    here: torch.cuda's two calls stand in for the device."""
    import torch

    from gems.memory import limit_gpu

    calls: list = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 * 2**30}))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d: calls.append((f, d)))
    gpu = torch.device("cuda", 0)
    assert limit_gpu(8 * 2**30, gpu) == 0.1 and calls == [(0.1, gpu)]
    assert limit_gpu(100 * 2**30, gpu) == 1.0
    assert limit_gpu(None, gpu) == 1.0 and calls[-1] == (1.0, gpu)  # no cap: the whole device, set again
    assert limit_gpu(2**30, torch.device("cpu")) is None and len(calls) == 3
    monkeypatch.undo()
    h100 = ["model.size=32", "model.width=0.25", "train.batch_size=2", "cluster.gpu=h100", "train.device=cuda"]
    whole = _planned(*h100)["device"]
    capped = _planned(*h100, "cluster.rank_memory_gb=2")["device"]
    assert capped["memory_bytes"] == 2 * 2**30 < whole["memory_bytes"] and capped["capped"]
    assert capped["reserve_bytes"] > 0  # the context and the allocator's share, counted against the cap
    assert _planned(*h100, "cluster.rank_memory_gb=500")["device"]["memory_bytes"] == whole["memory_bytes"]
