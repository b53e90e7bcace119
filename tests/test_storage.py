"""A run survives the storage under it (issue 79): a full disk met while a checkpoint is written (a real small file
system: a tmpfs this test mounts), a quota, an I/O error, a read-only file system and a results folder removed during
the run (raised at the write's boundary, where no such file system can be made on demand) each end with their line,
their record, the last whole checkpoint and the model file where there was room; the space a run will write is
checked before launch; and after a full disk, a dead rank or a non-finite loss the same command goes on from the last
whole checkpoint to the losses of a run that was never interrupted."""
from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli import gems_here, merged, records

SMALL = ["model.size=32", "model.width=0.25", "train.batch_size=2", "train.steps=5", "train.warmup_steps=1",
         "train.checkpoint_every=1", "train.checkpoint_async=false", "train.check_fit=false"]


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A tmpfs of 7 MiB (about 1.7 checkpoints of SMALL's model) mounted for the test, and a way to grow it."""
    where = tmp_path / "small"
    where.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=7m", "tmpfs", str(where)], capture_output=True,
                          text=True)
    if made.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not allowed here ({made.stderr.strip() or made.returncode}): the full disk "
                    "is held by the write-boundary tests only")

    def grow(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(where)], check=True)

    try:
        yield where, grow
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _one(folder: Path) -> dict[str, Any]:
    (r,) = records(str(folder))
    return r


def test_a_full_disk_is_named_its_last_checkpoint_kept_and_the_same_command_goes_on(small_disk: Any,
                                                                                 tmp_path: Path) -> None:
    where, grow = small_disk
    refused = gems_here("run", *SMALL, f"results.dir={where}")  # item 2: checked before launch
    assert refused.returncode == 2, refused.stderr[-2000:]
    (line,) = [ln for ln in refused.stderr.splitlines() if ln.startswith("gems: error:")]
    assert f"results.dir={where}" in line and "2 checkpoint(s) of" in line and "free there" in line, line
    assert not records(str(where)) and not (where / ".jobs").exists()  # nothing written

    args = [*SMALL, f"results.dir={where}", "results.check_space=false"]  # launched anyway: it meets the full disk
    first = gems_here("run", *args)
    assert first.returncode == 1, first.stderr[-2000:]
    (line,) = [ln for ln in first.stderr.splitlines() if ln.startswith("gems: error:")]
    assert "writing the checkpoint before step 2" in line and "the disk is full" in line, line
    assert " free, " in line and "needed" in line and "its last whole checkpoint" in line, line
    stopped = _one(where)
    assert stopped["status"] == "failed" and stopped["failure"]["kind"] == "storage"
    assert stopped["failure"]["storage"] == "disk_full" and stopped["failure"]["needed_bytes"] > 0
    kept = Path(stopped["failure"]["checkpoint"])
    assert kept.name == "step00000001" and (kept / ".metadata").is_file()
    assert sorted(p.name for p in kept.parent.glob("step*")) == ["step00000001"]  # the partial one gone first
    assert not stopped.get("model_file") or Path(stopped["model_file"]).is_file()
    assert not list(where.rglob(".*tmp")) and not list(where.rglob("*.parts"))  # no half file left
    assert (where / f"{stopped['run_id']}.steps.csv").is_file()  # its steps so far

    grow("64m")  # room made: the same command goes on from the checkpoint
    second = gems_here("run", *args)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "stopped when its storage failed after step 1; resuming from its checkpoint" in second.stderr
    done = [r for r in records(str(where)) if r["status"] == "ok"][0]
    assert done["resumed_from"]["run_id"] == stopped["run_id"] and done["resumed_from"]["step"] == 1
    whole = gems_here("run", *SMALL, f"results.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert done["loss"] == _one(tmp_path / "whole")["loss"]


# ---- the write's boundary: a quota, an I/O error, a read-only file system, a folder removed --------------------------
def _train_here(folder: Path, *extra: str) -> tuple[BaseException | None, str]:
    """One rank's training (gems.rank.loop.train) in this process: (what it raised, what it printed)."""
    from omegaconf import open_dict

    from gems.bootstrap import World
    from gems.config import compose
    from gems.rank.loop import train

    cfg = compose([*SMALL, f"results.dir={folder}", *extra])
    with open_dict(cfg):
        cfg.run_id = "storage"
    world = World(0, 1, 0, "127.0.0.1", 0, "single", torch.device("cpu"), "gloo", "torch", None, "localhost")
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            train(cfg, world)
    except BaseException as e:  # noqa: BLE001 - what the rank raises is what is tested
        return e, err.getvalue()
    return None, err.getvalue()


@pytest.mark.parametrize("code,kind,words", [
    (errno.EDQUOT, "quota", "the quota is full"),
    (errno.EIO, "io_error", "an I/O error"),
    (errno.EROFS, "read_only", "read-only"),
])
def test_a_quota_an_io_error_and_a_read_only_disk_are_named_at_the_checkpoint(tmp_path: Path, monkeypatch, code: int,
                                                                               kind: str, words: str) -> None:
    from gems.checkpoint import sharded
    from gems.rank.hooks.faults import StorageStopped

    real = sharded.write_meta

    def failing(d: Path, cfg: Any, step: int, world_size: int) -> None:
        if step == 3:
            raise OSError(code, os.strerror(code), str(d / sharded.META))
        real(d, cfg, step, world_size)

    monkeypatch.setattr(sharded, "write_meta", failing)
    raised, _ = _train_here(tmp_path)
    assert isinstance(raised, StorageStopped), raised
    assert "writing the checkpoint before step 3" in str(raised) and words in str(raised), raised
    r = _one(tmp_path)
    assert r["failure"]["kind"] == "storage" and r["failure"]["storage"] == kind and r["failure"]["step"] == 3
    kept = Path(r["failure"]["checkpoint"])
    assert kept.name == "step00000002" and sorted(p.name for p in kept.parent.glob("step*")) == ["step00000002"]
    assert Path(r["model_file"]).is_file()  # room for it: the trained model is kept too
    assert len(r["loss"]) == 3


def test_a_results_folder_removed_during_the_run_is_named_and_a_record_its_folder_refuses_goes_elsewhere(
        tmp_path: Path, monkeypatch) -> None:
    from gems.checkpoint import sharded
    from gems.results import record

    folder, elsewhere = tmp_path / "results", tmp_path / "fallback"
    elsewhere.mkdir()
    monkeypatch.setenv("TMPDIR", str(elsewhere))
    real_save, real_write = sharded.Saver.save, record.write_result_json

    def removed(self: Any, step: int, *a: Any, **k: Any) -> None:
        if step == 3:
            shutil.rmtree(folder)  # a purge of the scratch file system, say
        real_save(self, step, *a, **k)

    def read_only(path: Any, *a: Any, **k: Any) -> Path:
        if Path(path).parent == folder:  # the folder made again takes no record: the file system turned read-only
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_write(path, *a, **k)

    monkeypatch.setattr(sharded.Saver, "save", removed)
    monkeypatch.setattr(record, "write_result_json", read_only)
    raised, _ = _train_here(folder)
    assert raised is not None and f"the folder {folder} was removed during the run" in str(raised), raised
    r = _one(elsewhere)  # the record in $TMPDIR, under its own name
    assert r["failure"]["storage"] == "gone" and r["failure"]["checkpoint"] is None
    assert "no whole checkpoint was kept: the same command starts over" in r["error"]
    assert record.find_record(folder / f"{r['run_id']}.json") == elsewhere / f"{r['run_id']}.json"


# ---- after any failure that left a whole checkpoint, the same command goes on ----------------------------------------
@pytest.mark.parametrize("fault,kind", [
    (["fault.kill_rank=1", "fault.at_step=3"], "signal"),
    (["fault.nan_rank=0", "fault.at_step=3", "train.on_nonfinite=stop"], "nonfinite"),
])
def test_after_a_dead_rank_or_a_non_finite_loss_the_same_command_goes_on_from_the_last_whole_checkpoint(
        tmp_path: Path, fault: list[str], kind: str) -> None:
    base = merged(*SMALL, "parallel.replicas=2", "train.steps=6", "train.batch_size=4")
    folder = tmp_path / "results"
    first = gems_here("run", *base, *fault, f"results.dir={folder}")
    assert first.returncode == 1, first.stderr[-2000:]
    stopped = _one(folder)
    assert stopped["status"] == "failed" and stopped["failure"]["kind"] == kind
    # another mesh is another run (BatchNorm's statistics and the rounding follow the mesh): it starts over
    mesh = gems_here("run", *merged(*base, "parallel.replicas=1"), f"results.dir={folder}")
    assert mesh.returncode == 0 and "resuming" not in mesh.stderr and "starting over" not in mesh.stderr, mesh.stderr
    # a key that changes the training changed: it starts over, naming the key
    other = gems_here("run", *base, "train.lr=0.002", f"results.dir={folder}")
    assert other.returncode == 0 and "train.lr was 0.001 there and is 0.002 here: starting over" in other.stderr, \
        other.stderr
    # the same command (a fault injected is no key of the training): from the checkpoint before step 3
    second = gems_here("run", *base, f"results.dir={folder}")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resuming from its checkpoint" in second.stderr and "step00000003" in second.stderr, second.stderr
    done = [r for r in records(str(folder)) if r.get("resumed_from")][0]
    assert done["resumed_from"]["step"] == 3 and done["resumed_from"]["run_id"] == stopped["run_id"]
    whole = gems_here("run", *base, f"results.dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert done["loss"] == _one(tmp_path / "whole")["loss"]

