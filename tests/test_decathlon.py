"""The Medical Segmentation Decathlon's task folders (gems/data/layouts/decathlon.py, issue 71 item 4): a task written
by nibabel as the Decathlon ships it (imagesTr/ and labelsTr/ of .nii.gz, macOS's ._ forks beside them,
dataset.json, imagesTs/ without labels) is detected, refused where it lies with the way on (its volumes are
compressed), converted by `gems data convert` (resumably), trained by `gems run` with per-class Dice by the task's
class names in the end-of-run table and the record, evaluated by `gems eval` saying per-class Dice, and staged
node-locally with its folders kept. A folder of no known layout is refused naming what it comes closest to."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _cli import gems_here, records

from gems.data import layouts
from gems.data.segmentation import make_volume
from gems.errors import ConfigError


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> Path:
    """Task03_Liver as the Decathlon ships it: five training volumes of 16^2 x 12-16 voxels with LiTS-like
    organs, one test volume, classes background, liver, cancer."""
    out = tmp_path_factory.mktemp("decathlon") / "Task03_Liver"
    pairs = [make_volume(7, i, 16) for i in range(6)]
    layouts.get("decathlon").write(out, pairs)
    return out


@pytest.fixture(scope="module")
def converted(task: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "Task03_Liver"
    run = gems_here("data", "convert", f"data.path={task}", f"data.out={out}", "data.workers=2")
    assert run.returncode == 0, run.stderr[-2000:]
    return out


def test_a_task_folder_is_detected_and_refused_where_it_lies_naming_the_conversion(task: Path) -> None:
    assert layouts.detect(task).name == "decathlon"
    assert sorted(f.name for f in layouts.get("decathlon").files(task)) == [f"liver_{i}.nii.gz" for i in range(5)]
    with pytest.raises(ConfigError) as e:
        layouts.get("decathlon").open(task, (1, 16, 16, 16), target="dense")
    assert "liver_0.nii.gz is gzip-compressed" in str(e.value) and "gems data convert" in str(e.value)


def test_convert_writes_the_task_uncompressed_resumably_and_reads_as_nibabel(task: Path, converted: Path) -> None:
    import nibabel as nib

    assert sorted(p.name for p in (converted / "imagesTr").iterdir()) == [f"liver_{i}.nii" for i in range(5)]
    assert sorted(p.name for p in (converted / "labelsTr").iterdir()) == [f"liver_{i}.nii" for i in range(5)]
    assert json.loads((converted / "dataset.json").read_text())["labels"]["2"] == "cancer"
    assert not (converted / "imagesTs").exists()
    again = gems_here("data", "convert", f"data.path={task}", f"data.out={converted}", "data.workers=1")
    assert again.returncode == 0 and "5 already there, 0 to convert" in again.stdout, again.stdout[-1000:]
    s = layouts.get("decathlon").open(converted, (1, 16, 16, 16), target="dense")
    assert s.class_names == ["background", "liver", "cancer"]
    assert any("imagesTs/ (1 volumes without labels) left out" in n for n in s.notes()) is False  # (converted: none)
    _, labels = s.read(list(range(len(s))))
    for i in range(len(s)):
        v, _ = s.locate(i)
        want = np.asarray(nib.load(str(task / "labelsTr" / f"liver_{v}.nii.gz")).dataobj).T
        np.testing.assert_array_equal(labels[i].numpy()[:want.shape[0]], want)


def test_the_task_trains_with_dice_by_class_name_and_gems_eval_says_it(task: Path, converted: Path,
                                                                       tmp_path: Path) -> None:
    """The U-Net on the converted task, validating on the same volumes: the end-of-run table's Dice columns are
    the task's class names (no empty regression column), the record carries them, and `gems eval` of the trained
    model prints per-class Dice by name. The task's test volumes (imagesTs/) are left out, and said; a node's copy
    of the task (data.stage=node) keeps its folders and its dataset.json."""
    shutil_copy_test_folder(task, converted)
    args = ["model=unet3d", "model.size=16", "model.width=0.125", "train.batch_size=2", "train.steps=3",
            "train.warmup_steps=1", "data=hdf5", f"data.path={converted}", f"data.val_path={converted}",
            "train.check_fit=false"]
    out = gems_here("run", *args, f"results.dir={tmp_path}")
    assert out.returncode == 0, out.stderr[-2000:]
    header = next(ln for ln in out.stdout.splitlines() if "dice_liver" in ln)
    assert "dice_background" in header and "dice_cancer" in header and "val_mae" not in header, header
    (rec,) = records(str(tmp_path))
    assert rec["classes"] == ["background", "liver", "cancer"] and len(rec["validation"][-1]["dice"]) == 3
    from gems.results.table import markdown, rows_for

    table = markdown(rows_for([rec], sweep=False)).splitlines()  # gems results' tables
    assert all(f"dice_{c}" in table[0] for c in rec["classes"]) and table[2].count("|") == table[0].count("|")
    assert any("imagesTs/ (1 volumes without labels) left out" in n for n in rec["notes"]), rec["notes"]
    log = (tmp_path / ".jobs" / rec["run_id"] / "rank0.log").read_text()
    assert "Dice background" in log and ", liver " in log, log[-800:]  # the validation line
    ev = gems_here("eval", rec["model_file"], f"data.val_path={converted}", f"results.dir={tmp_path / 'eval'}")
    assert ev.returncode == 0, ev.stderr[-2000:]
    said = next(ln for ln in ev.stdout.splitlines() if ln.startswith("gems eval: "))
    assert "Dice background" in said and "liver" in said and "cancer" in said, said
    from types import SimpleNamespace

    from gems.config import compose
    from gems.rank.data import _listing

    staged = _listing(compose([*args, "data.stage=node"], check=False), SimpleNamespace(rank=0, size=1))
    where = {w for _, w, _ in staged}
    assert {"train/imagesTr/liver_0.nii", "train/labelsTr/liver_0.nii", "train/dataset.json",
            "val/dataset.json"} <= where and not any("imagesTs" in w for w in where), sorted(where)[:8]


def shutil_copy_test_folder(task: Path, converted: Path) -> None:
    """The task's test volumes beside the converted ones (as a user who copies the task whole has them)."""
    import shutil

    if not (converted / "imagesTs").exists():
        shutil.copytree(task / "imagesTs", converted / "imagesTs")


def test_a_folder_of_no_known_layout_is_refused_naming_what_it_comes_closest_to(task: Path, tmp_path: Path) -> None:
    import shutil

    flat = tmp_path / "flat"
    flat.mkdir()
    for f in (task / "imagesTr").glob("liver_*.nii.gz"):
        shutil.copy(f, flat / f.name)
    with pytest.raises(ConfigError) as e:
        layouts.detect(flat)
    text = str(e.value)
    assert "decathlon" in text and "nifti" in text and "tfrecord" in text and len(text) - len(str(flat)) < 430, text
    assert "comes closest to decathlon" in text and "liver_0.nii.gz" in text, text
    split = tmp_path / "split"
    for sub in ("train", "validation"):
        layouts.get("gems").write(split / sub, [(np.zeros((4, 8, 8, 8), np.int16), np.zeros(4, np.float32))])
    with pytest.raises(ConfigError) as e:
        layouts.detect(split)
    assert f"data.path={split / 'train'} data.val_path={split / 'validation'}" in str(e.value), str(e.value)
