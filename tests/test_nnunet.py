"""nnU-Net's raw dataset folders (gems/data/layouts/nnunet.py, issue 81 item 4), written by nibabel as nnU-Net takes
them (a file a channel, NAME_CCCC.nii.gz; dataset.json of v1 and of v2): detected, each rank's part of each case's
channels read as nibabel reads the files (joined in channel_names' order; a channel other than CT not windowed),
converted, and trained with the classes and channels dataset.json names setting model.num_classes and
model.in_channels (a value the user set otherwise refused, naming both). The Decathlon's 4D multi-modal volumes
are read as channels alike."""
from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from _cli import gems_here, records

from gems.data import layouts
from gems.errors import ConfigError


def _cases(n: int, channels: int, classes: int, shape: tuple[int, int, int], seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [(rng.integers(-300, 400, (channels, *shape)), rng.integers(0, classes, shape)) for _ in range(n)]


def _tile(files: list[Path], origin: tuple[int, ...], edge: int = 8, pad: int = 0) -> np.ndarray:
    """nibabel's stored voxels of each file (C-order (z, y, x)), one channel after the other, of one tile (padding
    ``pad``)."""
    out = []
    for f in files:
        stored = np.asarray(nib.load(str(f)).dataobj.get_unscaled()).T
        stored = stored.reshape((-1, *stored.shape[-3:]))  # a 4D file: (C, z, y, x)
        big = np.full((stored.shape[0], *[max(o + edge, n) for o, n in zip(origin, stored.shape[1:])]), pad,
                      stored.dtype)
        big[(slice(None), *[slice(0, n) for n in stored.shape[1:]])] = stored
        out.append(big[(slice(None), *[slice(o, o + edge) for o in origin])])
    return np.concatenate(out)


@pytest.mark.parametrize("version, channels", [(1, 4), (2, 2)])
def test_a_raw_dataset_is_detected_and_each_case_read_as_its_channel_files(tmp_path: Path, version: int,
                                                                           channels: int) -> None:
    modality = ("CT", "T1", "T1c", "T2")[:channels]
    layouts.get("nnunet").write(tmp_path, _cases(2, channels, 3, (6, 10, 9), 1), compress=False, version=version,
                                modality=modality)
    assert layouts.detect(tmp_path).name == "nnunet"
    s = layouts.get("nnunet").open(tmp_path, (channels, 8, 8, 8), target="dense", slices=(slice(2, 8),))
    assert [f.name for f in s.files] == ["liver_000_0000.nii", "liver_001_0000.nii"]
    assert s.class_names == ["background", "liver", "tumor"] and s.ct == (True,) + (False,) * (channels - 1)
    voxels, labels = s.read(list(range(len(s))))
    x = s.finish(voxels)
    for i in range(len(s)):
        v, origin = s.locate(i)
        case = s.files[v].name[:-len("_0000.nii")]
        want = _tile([tmp_path / "imagesTr" / f"{case}_{c:04d}.nii" for c in range(channels)], origin)[:, 2:8]
        np.testing.assert_array_equal(voxels.data[i].numpy(), want)
        np.testing.assert_allclose(x[i, 0].numpy()[want[0] != 0], (np.clip(want[0], -200, 250) + 200)[want[0] != 0] / 450,
                                   atol=2e-7)  # CT: windowed
        np.testing.assert_array_equal(x[i, 1:].numpy(), want[1:].astype(np.float32))  # MR: as stored, scaled
        lab = _tile([tmp_path / "labelsTr" / f"{case}.nii"], origin, pad=255)[0, 2:8]
        np.testing.assert_array_equal(labels[i].numpy(), lab)
    (tmp_path / "imagesTr" / f"liver_001_{channels - 1:04d}.nii").unlink()
    with pytest.raises(ConfigError) as e:
        layouts.get("nnunet").open(tmp_path, (channels, 8, 8, 8), target="dense")
    assert f"imagesTr/liver_001_{channels - 1:04d}.nii is missing" in str(e.value), str(e.value)


def test_the_decathlons_4d_multi_modal_volumes_are_read_as_channels(tmp_path: Path) -> None:
    """BrainTumour's layout: a 4D volume a case, one 3D volume a modality; refused before, read now as the input's
    channels, each as nibabel reads it."""
    task = tmp_path / "Task01_BrainTumour"
    modality = ("FLAIR", "T1w", "t1gd", "T2w")
    layouts.get("decathlon").write(task, _cases(3, 4, 4, (6, 9, 8), 2), compress=False, modality=modality,
                                   classes=("background", "edema", "non-enhancing tumor", "enhancing tumour"))
    assert layouts.detect(task).name == "decathlon"
    assert layouts.get("decathlon").declared(task) == {"model.num_classes": ["background", "edema",
                                                                             "non-enhancing tumor", "enhancing tumour"],
                                                       "model.in_channels": list(modality)}
    s = layouts.get("decathlon").open(task, (4, 8, 8, 8), target="dense")
    voxels, _ = s.read(list(range(len(s))))
    for i in range(len(s)):
        v, origin = s.locate(i)
        np.testing.assert_array_equal(voxels.data[i].numpy(), _tile([s.files[v]], origin))
    with pytest.raises(ConfigError) as e:
        layouts.get("decathlon").open(task, (1, 8, 8, 8), target="dense")
    assert e.value.key == "model.in_channels" and "4 for these volumes" in str(e.value) and "FLAIR" in str(e.value)


def test_the_dataset_converts_and_trains_with_the_classes_and_channels_it_names(tmp_path: Path) -> None:
    """A two-class task trained with the default model.num_classes=3 gave a silently wrong Dice (a class that never
    occurs averaged in, its names dropped): dataset.json's classes and channels now set the model, said once; a
    model.num_classes the user set otherwise is refused before launch, naming both. The converted dataset reads as
    nnU-Net v2's (its file_ending .nii)."""
    raw = tmp_path / "Dataset009_Spleen"
    layouts.get("nnunet").write(raw, _cases(3, 2, 2, (12, 16, 16), 3), classes=("background", "spleen"),
                                modality=("CT", "MR"))
    out = tmp_path / "Dataset009_Spleen_nii"
    check = gems_here("data", "check", f"data.path={raw}", "data.workers=1")  # as downloaded: read whole, compressed
    assert check.returncode == 0 and "3 file(s) checked" in check.stdout and "all good" in check.stdout, check.stdout
    assert f"`gems data convert data.path={raw} data.out={raw}_nii`" in check.stdout
    conv = gems_here("data", "convert", f"data.path={raw}", f"data.out={out}", "data.workers=1")
    assert conv.returncode == 0, conv.stderr[-2000:]
    assert sorted(p.name for p in (out / "imagesTr").iterdir()) == [f"liver_00{i}_000{c}.nii" for i in range(3)
                                                                    for c in range(2)]
    assert json.loads((out / "dataset.json").read_text())["file_ending"] == ".nii"
    args = ["model=unet3d", "model.size=16", "model.width=0.125", "train.batch_size=2", "train.steps=2",
            "train.warmup_steps=1", "data=files", f"data.path={out}", f"data.val_path={out}", "train.check_fit=false"]
    run = gems_here("run", *args, f"results.dir={tmp_path / 'r'}")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "model.num_classes=2: the classes the set at data.path declares (background, spleen)" in run.stderr
    assert "model.in_channels=2: the channels the set at data.path declares (CT, MR)" in run.stderr
    (rec,) = records(str(tmp_path / "r"))
    assert rec["classes"] == ["background", "spleen"] and len(rec["validation"][-1]["dice"]) == 2
    plan = gems_here("plan", *args)  # the plan takes the task's channels as the run does
    assert plan.returncode == 0 and "model.in_channels=2: the channels" in plan.stderr, plan.stderr[-2000:]
    assert rec["config"]["model"]["num_classes"] == 2 and rec["config"]["model"]["in_channels"] == 2
    from gems.results.table import rows_for

    last = {**rec["validation"][-1], "dice": [rec["validation"][-1]["dice"][0], None]}  # spleen found nowhere
    (row,) = rows_for([{**rec, "validation": [last]}], sweep=False)
    assert "spleen: neither labelled nor predicted" in row["note"] and "dice_spleen" not in row, row["note"]
    bad = gems_here("run", *args, "model.num_classes=3", f"results.dir={tmp_path / 'r3'}")
    assert bad.returncode == 2 and not (tmp_path / "r3").exists()
    (line,) = [ln for ln in bad.stderr.splitlines() if ln.startswith("gems: error:")]
    assert "model.num_classes=3: expected 2, the classes the set at data.path declares (background, spleen" in line
