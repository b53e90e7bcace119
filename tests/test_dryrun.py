"""gems plan plan.dry_run=true: one rank of a 2048-rank world runs one real step alone, over torch's fake
process group on fake tensors; it names the rank where the real code fails."""
from __future__ import annotations

import json

import pytest
from _cli import gems_here

from gems.config import compose
from gems.mesh import mesh_from_config

PERLMUTTER = ["cluster=perlmutter", "cluster.account=x"]
COSMO = ["model=cosmoflow", "model.size=512", "parallel.spatial=4", "parallel.replicas=512", "train.batch_size=512",
         *PERLMUTTER]
HYBRID = ["model=resnet", "model.depth=56", "model.size=1024", "parallel.spatial=2", "parallel.pipeline=2",
          "parallel.schedule=mast", "parallel.replicas=512", "train.batch_size=1024", *PERLMUTTER]
PIPE = ["model=resnet", "model.depth=110", "model.size=256", "parallel.pipeline=4", "parallel.schedule=1f1b",
        "parallel.micro_batches=4", "parallel.replicas=512", "train.batch_size=2048", *PERLMUTTER]


def _dry(overrides: list[str], rank: int):
    out = gems_here("plan", *overrides, "plan.dry_run=true", f"plan.dry_run_rank={rank}", "plan.format=json")
    return out, (json.loads(out.stdout.strip().splitlines()[-1]) if out.stdout.strip() else None)


@pytest.mark.parametrize("overrides,rank", [(COSMO, 1234), (HYBRID, 1234), (PIPE, 0), (PIPE, 2047)])
def test_one_rank_of_a_2048_rank_world_runs_a_real_step(overrides, rank):
    out, got = _dry(overrides, rank)
    assert out.returncode == 0, out.stderr[-3000:]
    mesh = mesh_from_config(compose(overrides))
    assert mesh.size == got["world_size"] == 2048 and got["rank"] == rank and got["dry_run"] == "ok"
    c = mesh.coord(rank)
    assert got["coord"] == {"replica": c.replica, "pipeline": c.pipeline, "spatial": c.spatial,
                            "spatial_grid": list(c.spatial_grid)}
    sizes = {axis: g["size"] for axis, g in got["groups"].items()}
    assert sizes["spatial"] == mesh.spatial and sizes["replica"] == mesh.replicas
    if mesh.pipeline > 1:
        assert sizes["pipeline"] == mesh.pipeline
    assert got["parameters"] > 0
    if "parallel.schedule=mast" in overrides:  # mirrored: every rank holds a copy of every partition
        assert sizes["grad"] == 2048 and len(got["partitions"]) == 2
    if overrides is COSMO:  # this rank's depth slab of one 512^3 sample
        assert got["input_part"] == [1, 4, 128, 512, 512]
    if overrides is PIPE:
        assert sizes["grad"] == 512 and len(got["partitions"]) == 4


def test_the_rank_where_the_real_code_fails_is_named():
    base = ["model=custom", "model._target_=_custom_models.refuses_part", "model.input_shape=[1,9,8]",
            "model.num_outputs=3", "parallel.spatial=2", "parallel.replicas=2", "train.batch_size=2"]
    ok = [_dry(base, r)[0] for r in range(4)]
    failed = [r for r, o in enumerate(ok) if o.returncode != 0]
    assert len(failed) == 2 and all(ok[r].returncode == 1 for r in failed), [o.stderr[-500:] for o in ok]
    for r in failed:
        assert f"dry run of rank {r} failed: ValueError: the user's layer refuses a part of 4 rows" in ok[r].stderr
    # the same model passes the check gems run makes before launch (a trace of the whole sample): only the
    # ranks holding such a part find it
    from gems.prepare import preflight

    preflight(compose(base))
    # gems plan itself traces every distinct part: it names the layer, the part and the error in one line
    out = gems_here("plan", *base)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-800:]
    assert out.stderr.strip().splitlines()[-1].startswith(
        "gems: error: layer 1 (RefusesPartOf) on spatial part 1 of 2 raised on its input of shape")
    assert "ValueError: the user's layer refuses a part of 4 rows" in out.stderr


def test_a_rank_outside_the_world_is_bad_input():
    out = gems_here("plan", *COSMO, "plan.dry_run=true", "plan.dry_run_rank=2048")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("gems: error: plan.dry_run_rank=2048")
    assert "0..2047" in out.stderr and "Traceback" not in out.stderr


def test_set_up_at_2048_ranks_makes_one_group_call_a_mesh_axis(monkeypatch):
    """R512 x D2 x S2: one call a mesh axis (on GPUs one split of the world's communicator each, every rank in it),
    where one `new_group` a group (and one a pipeline link) made 4101 calls, each a split of the whole world under
    NCCL with a bound device, all inside the set-up's allowance and without a progress mark."""
    import torch.distributed as dist

    from gems.dryrun import dry_run

    calls: list[str] = []
    for name in ("new_group", "split_group"):
        real = getattr(dist, name)
        monkeypatch.setattr(dist, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name), _real(*a, **k))[1])
    got = dry_run(compose(HYBRID + ["plan.dry_run=true", "plan.dry_run_rank=1234"]))
    assert got["world_size"] == 2048
    assert 0 < len(calls) <= 4 and got["setup"]["group_calls"] == len(calls), calls[:8]
    assert set(got["setup"]["axes"]) <= {"spatial", "pipeline", "replica", "grad"}
