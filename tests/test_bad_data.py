"""A bad file found after training started costs nothing trained (issue 71, item 3): the run stops with its last
checkpoint, its trained model file and a record saying which step it reached and which file stopped it (exit 2);
once the file is mended the same command resumes from the checkpoint and trains as a run that never stopped. A bad
training record (MLPerf's TFRecords, written by TensorFlow: a flipped byte its CRC catches when read, not before
launch) met by one replica ahead of step 3, and a bad validation label (a class over the model's, read at the first
evaluation) on two replicas."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from _cli import gems_here, records

DATA = Path(__file__).parent / "data" / "tfrecord" / "plain"
TINY = ["model=custom", "model._target_=_custom_models.cosmo_tiny", "model.input_shape=[4,8,8,8]",
        "model.num_outputs=4", "train.batch_size=2", "train.steps=5", "train.warmup_steps=1", "data=hdf5", "train.optimizer=sgd",
        "train.eval_every=0", "parallel.replicas=2", "train.check_fit=false"]


def _records(folder: Path) -> list[dict]:
    return sorted(records(str(folder)), key=lambda r: r["run_id"])


def _eight(folder: Path) -> Path:
    """Eight training files: the four TensorFlow wrote, twice (the sixth and seventh are step 3's batch)."""
    folder.mkdir(parents=True)
    for k, src in enumerate(sorted(DATA.glob("train/*.tfrecord")) * 2):
        shutil.copy(src, folder / f"{k:02d}_{src.name}")
    return folder


def test_a_bad_training_record_ahead_of_step_3_keeps_the_training_and_the_same_command_resumes(tmp_path: Path) -> None:
    train = _eight(tmp_path / "train")
    bad = sorted(train.iterdir())[6]
    good = bad.read_bytes()
    raw = bytearray(good)
    raw[112] ^= 0x40  # a byte of its Example: the data CRC no longer matches
    bad.write_bytes(bytes(raw))
    results = tmp_path / "results"
    args = [*TINY, f"data.path={train}"]
    first = gems_here("run", *args, f"results.dir={results}")
    assert first.returncode == 2, first.stderr[-2000:]
    (line,) = [ln for ln in first.stderr.splitlines() if ln.startswith("gems: error:")]
    assert bad.name in line and "after step 3" in line and "run the same command again" in line, line
    (stopped,) = _records(results)
    assert stopped["status"] == "failed" and stopped["failure"]["kind"] == "bad_data"
    assert stopped["failure"]["step"] == 3 and stopped["failure"]["during"] == "training"
    assert len(stopped["loss"]) == 3 and Path(stopped["model_file"]).is_file()
    assert Path(stopped["failure"]["checkpoint"]).is_dir()
    trained = torch.load(stopped["model_file"], map_location="cpu", weights_only=False)
    assert trained["step"] == 3 and all(torch.is_tensor(v) for v in trained["state_dict"].values())
    bad.rename(tmp_path / bad.name)  # deleted instead of mended: the run would go on on another set, silently
    gone = gems_here("run", *args, f"results.dir={results}")
    assert gone.returncode == 2 and len(_records(results)) == 1, gone.stderr[-2000:]
    (line,) = [ln for ln in gone.stderr.splitlines() if ln.startswith("gems: error:")]
    assert f"since then 1 file(s) gone ({bad.name})" in line and "train.resume_stopped=false starts over" in line, line
    (tmp_path / bad.name).rename(bad)
    bad.write_bytes(good)  # mended
    second = gems_here("run", *args, f"results.dir={results}")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "stopped on a bad file after step 3; resuming from its checkpoint" in second.stderr
    resumed = next(r for r in _records(results) if r["status"] == "ok")
    clean = gems_here("run", *args, f"results.dir={tmp_path / 'clean'}", "train.resume_stopped=false")
    assert clean.returncode == 0, clean.stderr[-2000:]
    (whole,) = _records(tmp_path / "clean")
    assert len(whole["loss"]) == 5 and resumed["loss"] == whole["loss"]


def test_a_bad_validation_label_keeps_the_training_and_the_same_command_resumes(tmp_path: Path) -> None:
    """The U-Net on LiTS-like volumes, evaluated after step 2: one validation volume's labels hold a class over the
    model's three. The run writes its checkpoint and model before it stops, and after the labels are mended the
    same command trains on from step 2 to the end, as a run that never stopped."""
    import nibabel as nib

    from gems.config import compose
    from gems.data.segmentation import synth_segmentation

    data = tmp_path / "seg"
    synth_segmentation(compose(["data=hdf5", "data.kind=segmentation", f"data.path={data / 'train'}",
                                f"data.val_path={data / 'val'}", "data.num_samples=2", "data.val_samples=2",
                                "model=unet3d", "model.size=16"], check=False))
    labels = data / "val" / "segmentation-1.nii"
    img = nib.load(str(labels))
    good = np.asarray(img.dataobj).copy()
    broken = good.copy()
    broken.flat[5] = 7
    nib.save(nib.Nifti1Image(broken, img.affine, img.header), str(labels))
    results = tmp_path / "results"
    args = ["model=unet3d", "model.size=16", "model.width=0.125", "train.batch_size=2", "train.steps=4",
            "train.warmup_steps=1", "train.eval_every=2", "data=hdf5", "parallel.replicas=2", "train.check_fit=false",
            f"data.path={data / 'train'}", f"data.val_path={data / 'val'}"]
    first = gems_here("run", *args, f"results.dir={results}")
    assert first.returncode == 2, first.stderr[-2000:]
    (stopped,) = _records(results)
    assert stopped["failure"]["during"] == "validation" and stopped["failure"]["step"] == 2
    assert "segmentation-1.nii holds 7" in stopped["error"] and Path(stopped["model_file"]).is_file()
    assert len(stopped["loss"]) == 2
    nib.save(nib.Nifti1Image(good, img.affine, img.header), str(labels))
    second = gems_here("run", *args, f"results.dir={results}")
    assert second.returncode == 0, second.stderr[-2000:]
    resumed = next(r for r in _records(results) if r["status"] == "ok")
    clean = gems_here("run", *args, f"results.dir={tmp_path / 'clean'}")
    assert clean.returncode == 0, clean.stderr[-2000:]
    (whole,) = _records(tmp_path / "clean")
    assert resumed["loss"] == whole["loss"] and len(whole["loss"]) == 4
    assert resumed["validation"][-1]["dice"] == pytest.approx(whole["validation"][-1]["dice"])
