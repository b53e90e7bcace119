"""gems plan's GPU memory and reserve: a GPU's total as CUDA reports it (not its data sheet's "GB" read as GiB
or as 10^9 bytes), and the reserve from its parts (CUDA context, BLAS workspaces, NCCL's buffers per
communicator the rank uses, fragmentation), which sum to it; plan.reserve_gb still replaces them."""
from __future__ import annotations

import json
import math

import pytest

from gems.config import compose
from gems.plan import GiB, make_plan, render_table, to_json
from gems.plan.devices import GPUS, gpu_memory_bytes
from gems.plan.reserve import (
    CUDA_CONTEXT_BYTES,
    FRAGMENTATION,
    NCCL_BUFFSIZE,
    NCCL_CHANNELS,
    NCCL_CONNECTIONS,
    NCCL_LINK_CONNECTIONS,
    NCCL_LL128_BUFFSIZE,
    NCCL_LL_BUFFSIZE,
    blas_workspace_bytes,
    nccl_communicator_bytes,
    rank_communicators,
)

SMALL = ["model=cosmoflow", "model.size=32", "model.width=0.25", "plan.predict=false"]
A100 = ["cluster.gpu_memory_gb=40", "cluster.gpu=a100-40gb"]
MiB = 2**20


def _plan(extra, batch=2):
    return make_plan(compose(SMALL + [f"train.batch_size={batch}"] + extra), suggest=False)


def test_an_a100_40gb_is_the_42298834944_bytes_cuda_reports():
    """An A100 "40 GB" is 40 GiB of HBM2 (nvidia-smi: 40960 MiB), of which CUDA reports 42298834944 bytes: more
    than 40 GB (10^9) and less than 40 GiB. The old planner counted 40 GiB, 651 MiB that are not there."""
    assert GPUS["a100-40gb"].memory_bytes == 42298834944  # 40339.3 MiB
    assert 40e9 < GPUS["a100-40gb"].memory_bytes < 40 * GiB
    assert gpu_memory_bytes(40, "a100-40gb")[0] == 42298834944
    plan = _plan(A100)
    assert plan.device["memory_bytes"] == 42298834944 and plan.device["nominal_gb"] == 40
    # the perlmutter and juwels_booster presets are such GPUs
    for preset in ("perlmutter", "juwels_booster"):
        cfg = compose(SMALL + ["train.batch_size=2", f"cluster={preset}", "cluster.account=x"])
        assert make_plan(cfg, suggest=False).device["memory_bytes"] == 42298834944


def test_every_preset_gpu_reports_less_than_its_nominal_gib_and_more_than_its_nominal_gb():
    for name, g in GPUS.items():
        assert g.nominal_gb * 1e9 < g.memory_bytes < g.nominal_gb * GiB, name
    assert GPUS["h100"].memory_bytes == 81089 * MiB
    # without a measured total (no cluster.gpu, or one of another size): that many GiB less what a driver keeps
    assert gpu_memory_bytes(40, None)[0] == pytest.approx(42298834944, abs=1)
    assert gpu_memory_bytes(80, "a100-40gb")[0] == pytest.approx(2 * 42298834944, abs=2)


def test_the_communicators_a_rank_joins_grow_with_the_mesh_axes():
    """1x1x8: the world, the spatial group and the gradient group; 2x2x2 also joins the pipeline group (its
    messages, one point-to-point connection a channel each way) and the replica group (created, idle): more
    communicators, more NCCL."""
    flat = _plan(A100 + ["parallel.spatial=8"]).device["reserve"]
    mixed = _plan(A100 + ["parallel.replicas=2", "parallel.pipeline=2", "parallel.spatial=2",
                          "parallel.schedule=1f1b", "parallel.micro_batches=2"], batch=4).device["reserve"]
    alone = _plan(A100).device["reserve"]
    names = lambda r: [c["name"] for c in r["communicators"]]  # noqa: E731
    assert names(alone) == [] and alone["parts"]["nccl"] == 0
    assert names(flat) == ["world", "spatial", "grad"]
    assert names(mixed) == ["world", "spatial", "pipeline", "replica", "grad"]
    assert [c["used"] for c in mixed["communicators"]] == [True, True, True, False, True]
    assert [c["size"] for c in mixed["communicators"]] == [8, 2, 2, 2, 4]
    coll, link = nccl_communicator_bytes(), nccl_communicator_bytes(connections=NCCL_LINK_CONNECTIONS)
    assert flat["parts"]["nccl"] == 3 * coll and mixed["parts"]["nccl"] == 3 * coll + 2 * link
    assert len(mixed["communicators"]) > len(flat["communicators"]) > len(alone["communicators"])
    assert mixed["parts"]["nccl"] > flat["parts"]["nccl"] > alone["parts"]["nccl"]
    assert sum(c["bytes"] for c in mixed["communicators"]) == mixed["parts"]["nccl"]
    assert coll == NCCL_CHANNELS * NCCL_CONNECTIONS * (NCCL_BUFFSIZE + NCCL_LL128_BUFFSIZE + NCCL_LL_BUFFSIZE)
    assert NCCL_BUFFSIZE == 4 * MiB and NCCL_LL128_BUFFSIZE == 4915200 and NCCL_LL_BUFFSIZE == 512 * 1024
    # Grace hosts: NCCL's SIMPLE buffer is 1 MiB
    assert nccl_communicator_bytes(arm_host=True) == coll - NCCL_CHANNELS * NCCL_CONNECTIONS * 3 * MiB


def test_a_middle_pipeline_stage_joins_the_most_links_and_sets_the_reserve():
    plan = _plan(A100 + ["parallel.pipeline=4", "parallel.schedule=1f1b", "parallel.micro_batches=4"], batch=4)
    r = plan.device["reserve"]
    assert r["pipeline_position"] == 1
    # no gradient communicator where a position's gradients are its own (R = S = 1, no mirrored copy); the middle
    # position's pipeline communicator connects four directed links, the first position's two
    assert [(c["name"], c["used"]) for c in r["communicators"]] == [("world", True), ("pipeline", True)]
    link = nccl_communicator_bytes(connections=NCCL_LINK_CONNECTIONS)
    assert r["communicators"][1]["bytes"] == 4 * link
    first = rank_communicators(1, 4, 1, 1, [(0, 1), (1, 0)])
    assert [(c.name, c.used, c.connections) for c in first] == [("world", True, 2), ("pipeline", True, 2)]
    # a plain pipeline's first position does not talk to the last; an interleaved one does (the ring back)
    assert rank_communicators(1, 4, 1, 1, [])[1].used is False
    # GEMS-MAST: positions d and D-1-d hold copies of the same partitions and sum their gradients
    mast = _plan(A100 + ["parallel.pipeline=4", "parallel.schedule=mast"], batch=2).device["reserve"]
    assert [(c["name"], c["size"]) for c in mast["communicators"] if c["used"]] == [
        ("world", 4), ("pipeline", 4), ("grad", 2)]


def test_the_reserve_parts_sum_to_the_total_and_the_verdict_counts_it():
    plan = _plan(A100 + ["parallel.replicas=2"])
    dev, r = plan.device, plan.device["reserve"]
    assert r["source"] == "modelled"
    assert sum(r["parts"].values()) == r["bytes"] == dev["reserve_bytes"]
    assert dev["usable_bytes"] == dev["memory_bytes"] - dev["reserve_bytes"]
    assert r["parts"]["cuda_context"] == CUDA_CONTEXT_BYTES
    # cuBLAS's workspaces come from the caching allocator: in the peak (what CUDA counts allocated), not here
    assert r["parts"]["cublas_workspace"] == 0
    assert plan.worst.activations_detail["blas_workspace"] == blas_workspace_bytes("a100-40gb") == 2 * (8 * MiB + 128 * 1024)
    assert blas_workspace_bytes("h100") == 2 * 32 * MiB  # torch's sm90 default
    assert r["parts"]["cudnn_workspace"] == 0  # it takes what the caching allocator has free
    assert r["parts"]["fragmentation"] == math.ceil(FRAGMENTATION * plan.worst.bytes.total) > 0
    assert json.loads(json.dumps(to_json(plan)))["device"]["reserve"]["parts"] == r["parts"]


def test_max_batch_is_the_largest_that_fits_within_the_modelled_reserve():
    base = ["model=cosmoflow", "model.size=64", "model.width=0.5", "cluster.gpu_memory_gb=1.5", "plan.predict=false",
            "parallel.replicas=2"]
    plan = make_plan(compose(base + ["train.batch_size=2"]))
    b = plan.max_global_batch
    assert b >= 2 and b % 2 == 0
    fits = make_plan(compose(base + [f"train.batch_size={b}"]), suggest=False)
    assert fits.fits and fits.worst.bytes.total + fits.device["reserve_bytes"] <= fits.device["memory_bytes"]
    over = make_plan(compose(base + [f"train.batch_size={b + 2}"]), suggest=False)
    assert not over.fits and over.worst.bytes.total + over.device["reserve_bytes"] > over.device["memory_bytes"]
    # without a reserve more fits
    assert make_plan(compose(base + ["train.batch_size=2", "plan.reserve_gb=0"])).max_global_batch > b


def test_plan_reserve_gb_replaces_the_modelled_reserve():
    plan = _plan(A100 + ["parallel.spatial=8", "plan.reserve_gb=2.5"])
    r = plan.device["reserve"]
    assert r["source"] == "plan.reserve_gb" and r["parts"] == {"plan.reserve_gb": int(2.5 * GiB)}
    assert plan.device["reserve_bytes"] == r["bytes"] == int(2.5 * GiB)
    assert plan.device["usable_bytes"] == 42298834944 - int(2.5 * GiB)
    zero = _plan(A100 + ["plan.reserve_gb=0"])
    assert zero.device["reserve_bytes"] == 0 and zero.device["usable_bytes"] == zero.device["memory_bytes"]


@pytest.mark.parametrize("extra,expected", [([], 0.5 * GiB), (["plan.reserve_gb=0.25"], 0.25 * GiB),
                                            (["plan.reserve_gb=3"], 0.5 * GiB)])
def test_cpu_ranks_keep_their_reserve(extra, expected):
    plan = _plan(extra)
    assert plan.device["kind"] == "cpu" and plan.device["reserve_bytes"] == int(expected)
    assert "reserve: 0." in render_table(plan)


def test_the_table_prints_the_device_in_gib_and_the_reserve_part_by_part():
    text = render_table(_plan(A100 + ["parallel.spatial=8"]))
    assert "device: local GPU a100-40gb (data sheet: 40 GB): 39.39 GiB (a100-40gb's total as CUDA reports it)" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("reserve:"))
    for part in ("CUDA context 0.50", "cuBLAS's workspaces come from the caching allocator",
                 "NCCL 0.86 (3 communicator(s) with buffers: world of 8 0.29, spatial of 8 0.29, grad of 8 0.29)",
                 "fragmentation", "10% of the peak", "usable"):
        assert part in line, line
    text = render_table(_plan(A100 + ["plan.reserve_gb=1"]))
    assert "reserve: 1.00 GiB a rank (plan.reserve_gb); usable 38.39 GiB" in text
