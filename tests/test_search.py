"""gems chooses the mesh (gems/plan/search.py, issue 72): `gems plan parallel=auto` ranks every R x D x S mesh,
cut, schedule and option of a world by the planner's own model; pruning never drops the best of the exhaustive
search on small worlds; every candidate's overrides are accepted by `gems run`; `gems run parallel=auto` runs the
best and its record says so; bad input is one line, exit 2. The searches here plan GPU ranks (cluster.gpu=h100:
nothing measured, the same figures every time); `gems run parallel=auto` plans this machine's CPU ranks."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _cli import gems_here, records

from gems.config import compose
from gems.plan import search as S

GPU = ["cluster.gpu=h100", "train.device=cuda"]
SMALL = ["model=cosmoflow_small", "model.size=32", "model.width=0.25"]
UNET = ["model=unet3d", "model.size=32", "model.width=0.25"]


def _search(*over: str, exhaustive: bool = False) -> S.Search:
    return S.search(compose(["parallel=auto", *over]), exhaustive=exhaustive)


def test_the_candidates_are_every_mesh_cut_and_schedule_of_the_world() -> None:
    """World 4, batch 8, a 3-D model: R in {1, 2, 4}, D x S the rest; S cut in depth, pencils and cubes (parts
    non-increasing over the dims); every registered schedule at D >= its least ranks; recomputation where a
    candidate does not fit; and the cuts' helper itself."""
    from gems.pipeline.schedules import registered

    assert S.cuts(8, [32, 32, 32]) == [([8], [0]), ([4, 2], [0, 1]), ([2, 2, 2], [0, 1, 2])]
    assert S.cuts(4, [2, 32]) == [([2, 2], [0, 1])]  # (4 parts refused by a 2-voxel depth)
    assert S.cuts(16, [32, 32, 32]) == [([16], [0]), ([4, 4], [0, 1]), ([4, 2, 2], [0, 1, 2])]  # the most even
    assert ([8, 2], [0, 1]) in S.cuts(16, [32, 32, 32], every=True)
    s = _search(*SMALL, *GPU, "parallel.world=4", "train.batch_size=8", exhaustive=True)
    meshes = {c.mesh() for c in s.candidates if c.plan is not None}
    assert {"R4 x D1 x S1", "R2 x D2 x S1", "R2 x D1 x S2", "R1 x D4 x S1", "R1 x D2 x S2", "R1 x D1 x S4",
            "R1 x D1 x S2x2"} <= meshes, sorted(meshes)
    schedules = {c.overrides["parallel.schedule"] for c in s.candidates if c.overrides["parallel.pipeline"] > 1}
    assert schedules == set(registered())
    splits = [c for c in s.candidates if c.overrides.get("parallel.split_backward")]
    assert splits and all(registered()[c.overrides["parallel.schedule"]].split == "optional" for c in splits)
    ranked, same, ties = s.ranked, s.same(), s.ties()
    fit = [i for i, c in enumerate(ranked) if i not in same and c.fits]  # (one program under several names: once)
    assert ranked[0].fits and fit == list(range(len(fit)))
    # by predicted samples/s, but within a tie (the simpler first)
    assert all(ranked[i].throughput >= ranked[j].throughput or ties.get(j, j) == ties.get(i, i)
               for i in fit for j in fit if i < j)
    assert len(s.candidates) == len({tuple(sorted(c.args())) for c in s.candidates})


def test_one_program_under_several_names_is_shown_once_and_named_in_the_json() -> None:
    """At one micro-batch GPipe, 1F1B and ZB-H1 with a split backward run the same action lists: one run. The ranking
    puts each program once among those that fit (its shortest command), the others after them with ``same_as`` in
    the JSON; the table shows distinct programs and counts the others; they plan alike."""
    from gems.pipeline.schedules import make_schedule

    assert make_schedule("gpipe", 2, 1, None, None, True).actions == make_schedule("zbh1", 2, 1).actions
    cfg = compose(["parallel=auto", *SMALL, *GPU, "parallel.world=2", "train.batch_size=2"])
    s = S.search(cfg)
    ranked, same = s.ranked, s.same()
    assert same, "no program under two names at world 2"
    firsts = [c for i, c in enumerate(ranked) if c.fits and i not in same]
    assert len({c.program() for c in firsts}) == len(firsts)
    for i, j in same.items():
        assert j < i and ranked[i].program() == ranked[j].program()
        assert ranked[i].throughput == ranked[j].throughput and len(ranked[j].args()) <= len(ranked[i].args())
        assert all(k in same or not c.fits or k < i for k, c in enumerate(ranked[:i]))  # after every distinct one
    got = S.as_json(cfg, s)["candidates"]
    assert {k: c["same_as"] - 1 for k, c in enumerate(got) if c["same_as"]} == same
    table = S.render(cfg, s)
    assert f"{len(same)} that fit run the action lists of one above under another name" in table


@pytest.mark.parametrize("world,model", [(2, SMALL), (4, SMALL), (4, UNET), (8, SMALL), (16, SMALL)],
                         ids=["cosmoflow-2", "cosmoflow-4", "unet-4", "cosmoflow-8", "cosmoflow-16"])
def test_pruning_never_drops_the_best_of_the_exhaustive_search(world: int, model: list[str]) -> None:
    over = [*model, *GPU, f"parallel.world={world}", "train.batch_size=8"]
    pruned, every = _search(*over), _search(*over, exhaustive=True)
    assert pruned.best is not None and every.best is not None
    assert pruned.best.throughput == pytest.approx(every.best.throughput, rel=1e-9), (pruned.best.args(),
                                                                                       every.best.args())
    assert len(pruned.candidates) <= len(every.candidates)


def test_every_candidates_overrides_are_accepted_by_gems_run(tmp_path: Path) -> None:
    """The overrides of every candidate that fits (as plan.format=json hands them), added to the user's command:
    composed, placed on a preset's nodes and checked as `gems run` checks a configuration before launch."""
    from gems.prepare import preflight

    on = ["cluster=perlmutter", "cluster.account=x"]  # a GPU cluster the check before launch takes
    out = gems_here("plan", "parallel=auto", *SMALL, *on, "parallel.world=4", "train.batch_size=8",
                    "plan.format=json")
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    assert got["schema"] == "gems.search/1" and got["world"] == 4 and got["best"] == 0
    assert got["command"].startswith("gems run ") and "parallel=auto" not in got["command"]
    fits = [c for c in got["candidates"] if c["fits"]]
    firsts = [c for c in fits if c["same_as"] is None]
    tie = [c["tied_with"] or c["rank"] for c in firsts]  # (by samples/s, but within a tie: the simpler first)
    assert firsts and all(a["samples_per_s"] >= b["samples_per_s"] or s == t
                          for a, b, s, t in zip(firsts, firsts[1:], tie, tie[1:]))
    for c in fits:
        assert set(c) >= {"overrides", "samples_per_s", "peak_bytes", "fits", "breakdown", "mesh"}
        cfg = compose([*SMALL, *on, "train.batch_size=8", *c["overrides"]])
        preflight(cfg)
    assert got["tried"] == len(got["candidates"]) and got["rejected"]


def test_bad_input_is_one_line_naming_the_key(tmp_path: Path) -> None:
    """A mesh key beside parallel=auto; no world to search; a world where nothing fits (the closest candidate
    named with what it lacks)."""
    out = gems_here("plan", "parallel=auto", "parallel.world=2", "parallel.replicas=2")
    assert out.returncode == 2 and "parallel.replicas=2: expected unset with parallel=auto" in out.stderr
    out = gems_here("plan", "parallel=auto")
    assert out.returncode == 2 and "parallel.world=None: expected the ranks to choose a mesh for" in out.stderr
    out = gems_here("plan", "parallel=auto", *SMALL, *GPU, "cluster.gpu_memory_gb=0.01", "parallel.world=2",
                    "train.batch_size=8")
    assert out.returncode == 2, out.stderr[-1000:]
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("gems: error:")]
    assert "parallel.world=2: expected a world where a mesh fits; the closest" in line and "GiB a rank" in line


def test_gems_run_parallel_auto_runs_the_best_and_its_record_says_so(tmp_path: Path) -> None:
    out = gems_here("run", "parallel=auto", "parallel.world=2", *SMALL, "train.batch_size=4", "train.steps=3",
                    "train.warmup_steps=1", "train.check_fit=false", f"results.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-2000:]
    (rec,) = records(str(tmp_path))
    chosen = rec["chosen"]
    assert rec["world_size"] == 2 and chosen["world"] == 2 and chosen["by"].startswith("gems plan's search")
    assert chosen["runner_up"] is not None and chosen["predicted_samples_per_s"] >= \
        chosen["runner_up"]["predicted_samples_per_s"]
    mesh = rec["mesh"]
    assert f"R{mesh['replicas']} x D{mesh['pipeline']}" in chosen["mesh"]
    assert "parallel=auto chose" in out.stderr


@pytest.mark.parametrize("where", ["here", "slurm"])
def test_gems_sweep_parallel_auto_over_worlds_runs_each_points_best_and_the_table_shows_its_mesh(tmp_path: Path,
                                                                                              where: str) -> None:
    """Weak scaling by world with the mesh chosen at each point: `gems sweep parallel=auto parallel.world=1,2`, on
    this machine and on the Slurm test cluster (its jobs' ranks on the cluster's nodes); each point's record says
    its mesh was chosen, and the study's table shows each point's mesh."""
    import shutil

    if where == "slurm" and shutil.which("sinfo") is None:
        pytest.skip("Slurm is not installed (scripts/slurm_cluster.sh start)")
    cluster = ["cluster=local_slurm", "cluster.timeout_min=6"] if where == "slurm" else []
    out = gems_here("sweep", "parallel=auto", "parallel.world=1,2", *SMALL, *cluster, "train.batch_size=4",
                    "train.steps=3", "train.warmup_steps=1", "train.check_fit=false", f"results.dir={tmp_path}",
                    "results.sweep=auto")
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    recs = sorted(records(str(tmp_path)), key=lambda r: r["world_size"])
    assert [r["world_size"] for r in recs] == [1, 2] and all(r["status"] == "ok" and r["chosen"] for r in recs)
    table = (tmp_path / "auto" / "table.md").read_text()
    for r in recs:
        m = r["mesh"]
        assert f"{m['replicas']}x{m['pipeline']}x{m['spatial']}" in table.replace(" ", ""), table
    if where == "slurm":
        assert all(r["env"]["slurm_job_id"] for r in recs)


def test_the_benchmarks_rank_correlation_families_and_picks() -> None:
    """gems bench search's arithmetic: Spearman's rank correlation (ties at their mean rank), a candidate's mesh
    family, and what it runs of a ranking (the top four and the best of every family not among them)."""
    from types import SimpleNamespace

    from gems.bench.search import family, ordered_pairs, picked, spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [5, 5, 9]) == pytest.approx(0.8660254, rel=1e-6)

    def cand(R: int, D: int, S: Any) -> Any:
        return SimpleNamespace(fits=True, overrides={"parallel.replicas": R, "parallel.pipeline": D,
                                                     "parallel.spatial": S})

    assert [family(cand(2, 1, 1).overrides), family(cand(1, 2, 1).overrides), family(cand(1, 1, [2, 2]).overrides)] == \
        ["replicas", "pipeline", "spatial"]
    ranked = [cand(2, 1, 1), cand(2, 1, 1), cand(2, 1, 1), cand(2, 1, 1), cand(2, 1, 1), cand(1, 1, 2), cand(1, 2, 1),
              cand(1, 1, 2)]
    got = picked(ranked)
    assert got[:4] == ranked[:4] and got[4:] == [ranked[6], ranked[5]]
    # the pairs measured apart (every round of one faster than every round of the other) and how many the prediction
    # orders alike, a tie (predictions within 2%) half
    rows = [{"predicted": 100.0, "rounds": [10.0, 11.0]}, {"predicted": 90.0, "rounds": [12.0, 13.0]},
            {"predicted": 101.0, "rounds": [5.0, 6.0]}, {"predicted": 150.0, "rounds": [10.5, 12.5]},
            {"predicted": 60.0, "rounds": []}]
    # apart: (0, 1) the faster predicted 90 < 100: wrong; (0, 2) 100 against 101, within 2%: half; (1, 2) 90 < 101:
    # wrong; (3, 2) 150 > 101: right; (0, 3) and (1, 3) overlap; the last was not measured
    assert ordered_pairs(rows) == (1.5, 4)


def test_ties_within_the_predictions_noise_go_to_the_simpler_mesh() -> None:
    """Candidates predicted within TIE of the fastest left are one tie, the simplest first (the fewest ranks each
    rank talks to, then the fewest options), the faster within that; the table and the JSON say which tie each is in,
    and the choice is the tie's first."""
    from types import SimpleNamespace

    def cand(rate: float, **o: Any) -> S.Candidate:
        mesh = {"parallel.replicas": 1, "parallel.pipeline": 1, "parallel.spatial": 1, "parallel.spatial_dims": None,
                "parallel.schedule": "lp", "parallel.micro_batches": 1, **{k.replace("_", "."): v for k, v in o.items()}}
        return S.Candidate(mesh, plan=SimpleNamespace(fits=True, prediction=SimpleNamespace(throughput=rate)))

    two = cand(200.0, parallel_replicas=2)
    mast = cand(201.0, parallel_pipeline=2, parallel_schedule="mast", parallel_micro_batches=2,
                parallel_split_backward=True)
    cut = cand(199.5, parallel_spatial=2, parallel_spatial_dims=[0])
    slow = cand(150.0, parallel_pipeline=2)
    assert two.simplicity() < cut.simplicity() < mast.simplicity()  # (options: 1, 2 and 4)
    order, ties = S.tied([mast, two, cut, slow])
    assert order == [two, cut, mast, slow] and ties == {1: 0, 2: 0}
    s = S.Search(2, [mast, slow, cut, two])
    assert s.best is two and s.ties() == {1: 0, 2: 0} and s.ranked[:3] == [two, cut, mast]
    assert S.tied([cand(100.0), cand(100.0 * (1 - 1.5 * S.TIE))])[1] == {}  # past the noise: no tie


def test_the_same_command_in_two_processes_ranks_the_same_candidates_alike(tmp_path: Path) -> None:
    """CPU ranks' kernel times are kept across processes (gems.plan.cpu): a second `gems plan parallel=auto` ranks
    the candidates the first ranked in the same order at the same figures, and says its times were kept; or, where
    the rule measured them again (the reference convolution ran faster than DRIFT allows), it says so."""
    import os
    import subprocess
    import sys

    def plan() -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-m", "gems.cli", "plan", "parallel=auto", "parallel.world=2", *SMALL,
                              "train.batch_size=4", "plan.format=json"], capture_output=True, text=True,
                             env=dict(os.environ, GEMS_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1"), timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout)

    first, second = plan(), plan()
    assert "measured now" in first["rates"]
    if "kept from" in second["rates"]:
        assert [(c["mesh"], c["options"], c["samples_per_s"]) for c in second["candidates"]] == \
            [(c["mesh"], c["options"], c["samples_per_s"]) for c in first["candidates"]]
    else:
        assert "faster than when those kept were measured" in second["rates"], second["rates"]


def test_the_benchmarks_accuracy_holds_every_pipeline_candidate_of_the_search() -> None:
    """gems bench search's accuracy section (gems.bench.accuracy, a benchmark: its figures are load's to move): each
    pipeline candidate the search ranks, its busiest rank's predicted and measured compute as shares of one rank's
    plain step, measured by the rank's real step over torch's fake process group; its table. The plumbing only."""
    from gems.bench.accuracy import WITHIN, accuracy, accuracy_text

    got = accuracy("small", [*SMALL, "train.batch_size=2"], rounds=1, steps=1, top=2)
    assert len(got["rows"]) == 2 and got["plain_s"] > 0 and got["plain_predicted_s"] > 0
    for r in got["rows"]:
        assert r["overrides"] and r["predicted_share"] > 0 and r["measured_share"] > 0
        assert r["within"] == (abs(r["predicted_share"] / r["measured_share"] - 1) <= WITHIN)
    assert got["within"] == sum(r["within"] for r in got["rows"])
    text = accuracy_text([got], 1)
    assert "| small |" in text and text.count("| small |") == 3  # (the summary's row and the two candidates')
