"""Checkpoints and the trained model at scale (gems/checkpoint/): every copy of a pipeline position writes its
share (up to train.checkpoint_writers), no rank writes an empty file or a file of its own, the model file goes
through the disk and rank 0's host and no collective carries its tensors, the bookkeeping is atomic, cleanup
never touches a checkpoint being written, and a crash mid-save or a preemption during an async save resumes from
the last complete checkpoint to the uninterrupted run's losses. At 1024 ranks through the dry run's real code."""
from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli import gems_here, records

from gems import checkpoint as ckpt

SMALL = ["model.size=32", "model.width=0.25", "train.warmup_steps=1", "train.batch_size=4"]
R4 = ["parallel.replicas=4"]
R2D2 = ["parallel.replicas=2", "parallel.pipeline=2", "parallel.schedule=1f1b", "parallel.micro_batches=2"]


def _run(folder: Path, *args: str) -> dict[str, Any]:
    out = gems_here("run", f"results.dir={folder}", *SMALL, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    (r,) = records(str(folder))
    assert r["status"] == "ok"
    return r


def _job(folder: Path) -> Path:
    (job,) = list(folder.glob(".jobs/*"))
    return job


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One rank, 6 steps: the losses every interrupted and resumed run must give."""
    return _run(tmp_path_factory.mktemp("reference"), "train.steps=6")


def _close(got: list[float], want: list[float]) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------- who writes what
def _by_rows(entries: dict[str, tuple[tuple[int, ...], int]], w: int) -> list[list[tuple[str, int, int]]]:
    """layout's rule written row by row: each row goes to the run its middle byte falls in."""
    out: list[list[tuple[str, int, int]]] = [[] for _ in range(w)]
    total = sum((s[0] if s else 1) * math.prod(s[1:]) * b for s, b in entries.values())
    off = 0
    for n in sorted(entries):
        shape, item = entries[n]
        rows, rb = (shape[0], math.prod(shape[1:]) * item) if shape else (1, item)
        owner = [min(w - 1, (2 * (off + i * rb) + rb) * w // (2 * total)) for i in range(rows)]
        for k in range(w):
            mine = [i for i in range(rows) if owner[i] == k]
            if mine:
                out[k].append((n, mine[0], len(mine)))
        off += rows * rb
    return out


def test_each_writer_gets_an_equal_run_of_bytes_at_most_a_row_off_and_one_chunk_an_entry() -> None:
    rng = random.Random(0)
    for _ in range(400):
        entries = {f"e{i}": (tuple(rng.randint(1, 40) for _ in range(rng.randint(0, 3))), rng.choice([1, 2, 4, 8]))
                   for i in range(rng.randint(1, 9))}
        w = rng.randint(1, 16)
        got = ckpt.layout(entries, w)
        assert [[(c.name, c.start, c.rows) for c in run] for run in got] == _by_rows(entries, w)
        total = sum((s[0] if s else 1) * math.prod(s[1:]) * b for s, b in entries.values())
        row = max((math.prod(s[1:]) if s else 1) * b for s, b in entries.values())
        seen: dict[str, list[int]] = {n: [] for n in entries}
        for run in got:
            assert len({c.name for c in run}) == len(run)  # one chunk of an entry at most
            size = sum(c.rows * (math.prod(entries[c.name][0][1:]) if entries[c.name][0] else 1) * entries[c.name][1]
                       for c in run)
            assert abs(size - total / w) <= row
            for c in run:
                seen[c.name] += range(c.start, c.start + c.rows)
        for n, (shape, _) in entries.items():  # every row written once
            assert sorted(seen[n]) == list(range(shape[0] if shape else 1))


def test_the_writers_are_the_first_replicas_of_every_position_at_spatial_part_0() -> None:
    from gems.mesh import Mesh

    mesh = Mesh(replicas=6, pipeline=2, parts=(2,))
    got = ckpt.writer_ranks(mesh, 4)
    assert got == sorted(mesh.rank_of(r, d, 0) for r in range(4) for d in range(2))
    for rank in range(mesh.size):
        s, c = ckpt.share_of(mesh, rank, 4), mesh.coord(rank)
        assert s.writes == (rank in got) and s.writers == 4 and (s.index == c.replica if s.writes else s.index == -1)
    assert ckpt.writer_ranks(Mesh(replicas=2), 8) == [0, 1]  # at most R


# ---------------------------------------------------------------------------- the bookkeeping
def _checkpoint(root: Path, step: int, done: bool) -> Path:
    d = root / f"step{step:08d}"
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"x")
    if done:
        for f in (".metadata", ckpt.META, ckpt.HISTORY):
            (d / f).write_bytes(b"x")
    return d


def test_moving_latest_removes_only_complete_checkpoints_older_than_it(tmp_path: Path) -> None:
    """The async save of step 4 completes while the writers of step 6 are already writing its files: step 2 goes,
    step 6 stays (the cleanup of an earlier gems removed every other folder), and so does an incomplete step 1."""
    old, cut, new, being_written = (_checkpoint(tmp_path, 2, True), _checkpoint(tmp_path, 1, False),
                                    _checkpoint(tmp_path, 4, True), _checkpoint(tmp_path, 6, False))
    ckpt.retire(tmp_path, 4)
    assert (tmp_path / "latest").read_text() == "4" and ckpt.latest_step(tmp_path) == 4
    assert not old.exists() and new.is_dir() and being_written.is_dir() and cut.is_dir()
    assert not list(tmp_path.glob(".*tmp"))  # written under a temporary name, renamed


def test_a_job_starting_removes_the_leftovers_of_a_save_cut_short(tmp_path: Path) -> None:
    keep = _checkpoint(tmp_path, 4, True)
    ckpt.retire(tmp_path, 4)
    cut, older = _checkpoint(tmp_path, 6, False), _checkpoint(tmp_path, 2, False)
    assert sorted(ckpt.tidy(tmp_path)) == [older, cut] and keep.is_dir() and ckpt.complete(keep)
    assert ckpt.tidy(tmp_path / "none") == []


# ---------------------------------------------------------------------------- the model file
@pytest.mark.parametrize("cap", [4, 2])
def test_the_model_file_is_written_through_the_disk_and_no_collective_carries_its_tensors(tmp_path: Path,
                                                                                           cap: int) -> None:
    """Four replicas write the model file: each writer writes its share, rank 0 reads them back, and every call to
    torch.distributed on any rank is on the writers' group and carries a few kilobytes of plans, never the model's
    bytes (an earlier gems gathered every writer's tensors to rank 0 over the world's group: world x largest
    bytes on rank 0's GPU), but one of every rank: whether the file was written (8 bytes: gems.storage)."""
    from _checkpoint_worlds import export_rank

    from gems.launch.world import run_world

    got = run_world(export_rank, 4, str(tmp_path), cap, timeout=300)
    writers = got[0]["writers"]
    assert writers == list(range(cap))
    model = got[0]["model_bytes"]
    assert model > 400_000
    for rank, g in enumerate(got):
        assert g["writes"] == (rank in writers)
        *calls, agreed = g["calls"]
        assert set(agreed["ranks"]) == set(range(4)) and agreed["bytes"] == 8, agreed
        for call in calls:
            assert set(call["ranks"]) <= set(writers), call
            assert call["bytes"] < 64 * 1024, call
        if rank not in writers:
            assert calls == []
    saved = torch.load(tmp_path / "export.model.pt", weights_only=True)
    assert list(saved["state_dict"]) == list(got[0]["state"])
    for k, v in got[0]["state"].items():
        assert torch.equal(saved["state_dict"][k], v), k
    assert not list(tmp_path.glob(".*parts*"))  # the shares are gone once the file is written


# ---------------------------------------------------------------------------- real runs
@pytest.mark.parametrize("mesh,files", [(R4, 4), (R2D2, 4)], ids=["R4", "R2xD2"])
def test_a_checkpoint_holds_one_file_a_writer_and_resumes_on_one_rank(tmp_path: Path, reference: dict[str, Any],
                                                                      mesh: list[str], files: int) -> None:
    """No empty file, no file a rank beyond the data files, the largest data file under 0.6 of the data at R = 4;
    a run on one rank continues it to the uninterrupted run's losses."""
    _run(tmp_path / "cut", "train.steps=3", "train.checkpoint_every=3", *mesh)
    ck = _job(tmp_path / "cut") / "ckpt" / "step00000003"
    names = sorted(f.name for f in ck.iterdir())
    data = [n for n in names if n.endswith(".distcp")]
    assert names == sorted([".metadata", ckpt.META, ckpt.HISTORY, *data]) and len(data) == files
    sizes = [(ck / n).stat().st_size for n in data]
    assert min(sizes) > 0
    if mesh is R4:
        assert max(sizes) < 0.6 * sum(sizes)
    one = _run(tmp_path / "one", "train.steps=6", f"train.resume_from={ck}")
    assert one["resumed_from"]["step"] == 3 and one["resumed_from"]["exact"] is True
    _close(one["loss"], reference["loss"])


def test_a_rank_killed_mid_save_leaves_the_last_complete_checkpoint_to_resume_from(tmp_path: Path,
                                                                                  reference: dict[str, Any]) -> None:
    out = gems_here("run", f"results.dir={tmp_path / 'cut'}", *SMALL, "parallel.replicas=2", "train.steps=6",
                    "train.checkpoint_every=2", "fault.kill_rank=1", "fault.kill_in_save=true", "fault.at_step=4")
    assert out.returncode == 1, out.stderr[-2000:]
    root = _job(tmp_path / "cut") / "ckpt"
    assert ckpt.latest_step(root) == 2 and ckpt.complete(root / "step00000002")
    assert (root / "step00000004" / "__1_0.distcp").is_file() and not ckpt.complete(root / "step00000004")
    again = _run(tmp_path / "again", "parallel.replicas=2", "train.steps=6", f"train.resume_from={root}")
    assert again["resumed_from"]["step"] == 2
    _close(again["loss"], reference["loss"])


def test_a_preemption_while_an_async_save_is_in_flight_resumes_from_its_own_checkpoint(
        tmp_path: Path, reference: dict[str, Any]) -> None:
    """The async save of step 2 is still being written (its writers wait 3 s) when the job is preempted before step
    3: the preemption's save waits for it, then writes its own, and the job resumes from step 3 exactly."""
    r = _run(tmp_path, "parallel.replicas=2", "train.steps=6", "train.checkpoint_every=2",
             "train.checkpoint_async=true", "fault.save_delay_s=3", "fault.preempt_at_step=3")
    assert r["restarts"] == 1
    _close(r["loss"], reference["loss"])
    job = _job(tmp_path)
    logs = "".join(p.read_text() for p in job.rglob("*.log"))
    assert "waiting for the save of step 2, still being written" in logs
    assert "preempting the job (checkpoint before step 3)" in logs
    root = job / "ckpt"
    assert ckpt.latest_step(root) == 6 and [d.name for d in root.glob("step*")] == ["step00000006"]


# ---------------------------------------------------------------------------- at 1024 ranks
@pytest.mark.parametrize("overrides,rank,D", [
    (["model=cosmoflow_mlperf", "parallel.replicas=1024", "train.batch_size=1024"], 0, 1),
    (["model=cosmoflow_mlperf", "parallel.replicas=1024", "train.batch_size=1024"], 513, 1),
    (["model=resnet", "model.depth=56", "model.size=256", "parallel.pipeline=4", "parallel.schedule=1f1b",
      "parallel.micro_batches=4", "parallel.replicas=256", "train.batch_size=1024"], 3, 4)])
def test_at_1024_ranks_a_checkpoint_is_a_few_files_of_one_small_group(overrides: list[str], rank: int, D: int) -> None:
    """One rank of the full world through the dry run (its real model, optimizer and checkpoint shares, on fake
    tensors): the only group made for checkpoints holds 8 writers a position, a checkpoint is at most 8 files a
    position and three more, a writer writes 1/8 of its position, and the model file takes the model's bytes on
    rank 0's host (an earlier gems put world x largest bytes on rank 0's GPU)."""
    out = gems_here("plan", *overrides, "cluster=perlmutter", "cluster.account=x", "plan.dry_run=true",
                    f"plan.dry_run_rank={rank}", "plan.format=json")
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["world_size"] == 1024
    c = got["checkpoint"]
    assert c["model_file_device_bytes_added"] == 0  # the shares are views of the rank's own tensors
    assert c["group_ranks"] == 8 * D and c["files_per_checkpoint"] == 8 * D + 3 and c["writers_per_position"] == 8
    if rank in (0, 3):  # replica 0
        assert c["writes"] and c["in_group"]
        assert c["share_bytes"] == pytest.approx(c["position_bytes"] / 8, rel=0.02)
    else:
        assert not c["writes"] and not c["in_group"] and c["share_bytes"] == 0
    if rank == 0:
        from gems.config import compose
        from gems.models import build_model

        with torch.device("meta"):
            whole = build_model(compose(overrides).model).module.state_dict()
        assert c["model_file_host_bytes"] == sum(t.numel() * t.element_size() for t in whole.values())


# ---------------------------------------------------------------------------- the first thing a user tries
def test_gems_run_then_gems_eval_of_its_model_file_works_with_no_data_keys(tmp_path: Path) -> None:
    """The default job names no validation data: gems eval draws fresh samples of its kind from another seed, says
    how many and which keys choose them, and evaluates; the same keys given by hand give the same figures. (The
    default job on the smallest CosmoFlow, its steps cut to two: no data key given either.)"""
    run = gems_here("run", f"results.dir={tmp_path}", "model.size=32", "model.width=0.25", "train.steps=2",
                    "train.warmup_steps=1")
    assert run.returncode == 0, run.stderr[-2000:]
    (r,) = records(str(tmp_path))
    ev = gems_here("eval", r["model_file"], f"results.dir={tmp_path / 'eval'}")
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert "evaluating 16 fresh synthetic samples of its run's kind, drawn from train.seed=1" in ev.stderr
    assert "data.val_samples=N train.seed=S" in ev.stderr
    (e,) = records(str(tmp_path / "eval"))
    assert e["evaluation"]["samples"] == 16 and math.isfinite(e["evaluation"]["mae"])
    by_hand = gems_here("eval", r["model_file"], f"results.dir={tmp_path / 'hand'}", "data.val_samples=16",
                        "train.seed=1")
    assert by_hand.returncode == 0 and "fresh synthetic" not in by_hand.stderr, by_hand.stderr[-2000:]
    (h,) = records(str(tmp_path / "hand"))
    assert h["evaluation"]["mae"] == e["evaluation"]["mae"]


def test_a_unet_on_replicas_of_spatial_parts_is_written_by_part_0_of_each_replica_and_resumes_alone(
        tmp_path: Path) -> None:
    """Another model and mesh: the U-Net (skips across the spatial cut) on R2 x S2. Spatial part 0 of each replica
    writes half (its part 1 holds the same tensors and writes nothing), and one rank resumes it exactly. (Without
    norms: a replica's BatchNorm normalises over its own samples, so R = 2 with it is not one rank's step.)"""
    unet = ["model=unet3d", "model.size=16", "model.width=0.125", "model.norm=none", "train.batch_size=2",
            "train.warmup_steps=1"]
    out = gems_here("run", f"results.dir={tmp_path / 'cut'}", *unet, "train.steps=2", "train.checkpoint_every=2",
                    "parallel.replicas=2", "parallel.spatial=2")
    assert out.returncode == 0, out.stderr[-2000:]
    ck = _job(tmp_path / "cut") / "ckpt" / "step00000002"
    data = sorted(f.name for f in ck.glob("*.distcp"))
    assert data == ["__0_0.distcp", "__1_0.distcp"] and all((ck / n).stat().st_size > 0 for n in data)
    assert sorted(f.name for f in ck.iterdir()) == sorted([".metadata", ckpt.META, ckpt.HISTORY, *data])
    one = gems_here("run", f"results.dir={tmp_path / 'one'}", *unet, "train.steps=4", f"train.resume_from={ck}")
    ref = gems_here("run", f"results.dir={tmp_path / 'ref'}", *unet, "train.steps=4")
    assert one.returncode == 0 and ref.returncode == 0, (one.stderr + ref.stderr)[-2000:]
    (a,), (b,) = records(str(tmp_path / "one")), records(str(tmp_path / "ref"))
    _close(a["loss"], b["loss"])


def _history_folder(d: Path, old: bool) -> Path:
    """A checkpoint folder's histories as this gems writes them (one history.pt), or as an earlier one did (a
    rank<k>.pt a rank, each its own timings)."""
    d.mkdir(parents=True)
    base = {"losses": [0.5, 0.4, 0.3], "lrs": [0.1] * 3, "validation": [], "elapsed_s": 3.0, "reader_s": 0.2,
            "every_step_time": [1.0, 1.1, 1.2], "breakdown": {"compute": 2.0}}
    if old:
        for rank, (times, peak) in enumerate([([1.0, 1.1], 100), ([1.3, 1.0], 300)]):
            torch.save({"step": 3, "history": {**base, "step_times": times, "tensor_peaks": [peak]}},
                       d / f"rank{rank}.pt")
    else:
        torch.save({"step": 3, "history": {**base, "step_times": [1.0, 1.1], "tensor_peaks": [100],
                                           "slowest_step_times": [1.3, 1.1], "tensor_peak_by_rank": [100, 300]}},
                   d / ckpt.HISTORY)
    return d


@pytest.mark.parametrize("old", [False, True], ids=["history.pt", "rank files of an earlier gems"])
def test_a_resumed_rank_reads_the_history_the_record_needs_of_it(tmp_path: Path, old: bool) -> None:
    """On the mesh that wrote it, rank 0 goes on with its own timings and every other rank with the slowest rank's
    step times and its own tensor peak (what the record's all-reduce and gather read: the same record as an
    uninterrupted run's); on another mesh every rank takes rank 0's history without timings."""
    d = _history_folder(tmp_path / "step", old)
    zero, one = ckpt.load_history(d, 0, True), ckpt.load_history(d, 1, True)
    assert zero["step_times"] == [1.0, 1.1] and zero["tensor_peaks"] == [100]
    assert one["step_times"] == ([1.3, 1.0] if old else [1.3, 1.1]) and one["tensor_peaks"] == [300]
    assert one["losses"] == zero["losses"] == [0.5, 0.4, 0.3]
    assert "slowest_step_times" not in zero and "tensor_peak_by_rank" not in one
    for rank in (0, 1, 5):
        other = ckpt.load_history(d, rank, False)
        assert other["losses"] == [0.5, 0.4, 0.3] and not any(k in other for k in ckpt.TIMINGS)
    for f in (".metadata", ckpt.META):
        (d / f).write_bytes(b"x")
    assert ckpt.complete(d)  # an earlier gems's checkpoint is complete too: retire removes it once older


def test_the_writers_gloo_group_is_made_once_and_holds_the_writers_alone(tmp_path: Path) -> None:
    """Even one writer gets a gloo group (DCP's async_save asks its group for a CPU backend, which a GPU world's
    NCCL default group has not); the rank outside writes nothing and holds no group."""
    from _checkpoint_worlds import group_rank

    from gems.launch.world import run_world

    got = run_world(group_rank, 4, str(tmp_path), 1, timeout=120)
    assert [g["member"] for g in got] == [True, False, False, False]
    assert got[0]["size"] == 1 and got[0]["same"] is True
