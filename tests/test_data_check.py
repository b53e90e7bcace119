"""`gems data check` (gems/data/check.py, issue 71 item 2): every file read whole as a run reads it, on worker
processes, each bad one named with what is wrong, exit 2; a clean set passes and is remembered, and a run over a
large set that has not passed says once that the check exists. Bad files made from the TFRecords TensorFlow wrote
(tests/data/tfrecord), from HDF5 files h5py wrote, and from NIfTI volumes nibabel wrote, as a user's go bad: a
flipped byte, a file cut short, a record too many, a dangling external link, labels of a class over the task's,
labels on another grid."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import h5py
import nibabel as nib
import numpy as np
from _cli import gems_here

from gems.data import layouts

DATA = Path(__file__).parent / "data" / "tfrecord" / "plain" / "train"


def _last(out) -> str:
    return [ln for ln in out.stdout.splitlines() if ln.startswith("gems data check:")][-1]


def test_every_bad_tfrecord_is_named_with_what_is_wrong(tmp_path: Path) -> None:
    folder = tmp_path / "records"
    folder.mkdir()
    src = sorted(DATA.iterdir())
    for k, f in enumerate(src * 2):
        shutil.copy(f, folder / f"{k:02d}_{f.name}")
    files = sorted(folder.iterdir())
    raw = bytearray(files[1].read_bytes())
    raw[112] ^= 0x40  # inside the Example: only its data CRC tells (the check before launch does not read it)
    files[1].write_bytes(bytes(raw))
    files[3].write_bytes(files[3].read_bytes() * 2)  # two records in one file
    files[5].write_bytes(files[5].read_bytes()[:-50])  # cut short
    out = gems_here("data", "check", f"data.path={folder}", "data.workers=2")
    assert out.returncode == 2, out.stderr[-2000:]
    line = _last(out)
    assert line.startswith("gems data check: 8 file(s) checked") and "3 bad:" in line, line
    assert f"{files[1].name}: TFRecord files whose records match their CRCs; {files[1].name} has a data CRC" in line
    assert f"{files[3].name}: one tf.train.Example a file" in line and f"{files[5].name}: TFRecord" in line
    for good in (files[0], files[2], files[4], files[6], files[7]):
        assert good.name not in line


def test_every_bad_hdf5_file_is_named_and_a_clean_set_passes_and_is_remembered(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path / "cache"))
    rng = np.random.default_rng(0)
    values = [(rng.poisson(5, size=(4, 16, 16, 16)).astype(np.int16), rng.uniform(-1, 1, 4).astype(np.float32))
              for _ in range(4)]
    folder = tmp_path / "universes"
    files = layouts.get("exalearn").write(folder, values)
    clean = gems_here("data", "check", f"data.path={folder}", "data.workers=1")
    assert clean.returncode == 0 and _last(clean).endswith("all good"), clean.stdout[-2000:]
    from gems.data import check

    assert check.passed(str(folder))
    os.truncate(files[1], files[1].stat().st_size - 4096)  # its counts' last bytes gone
    with h5py.File(files[2], "r+") as h:  # `full` made an external link to a file that is not there
        del h["full"]
        h["full"] = h5py.ExternalLink("elsewhere.h5", "/full")
    out = gems_here("data", "check", f"data.path={folder}", "data.workers=2")
    assert out.returncode == 2, out.stderr[-2000:]
    line = _last(out)
    assert "4 file(s) checked" in line and "2 bad:" in line, line
    assert f"{files[2].name}: " in line and "external link to elsewhere.h5:/full, which is missing" in line
    assert f"{files[1].name}: " in line and files[0].name not in line and files[3].name not in line


def test_every_bad_nifti_volume_is_named_and_a_large_unchecked_set_is_said_once(tmp_path: Path, monkeypatch) -> None:
    from gems.data import check

    affine = np.diag([0.7, 0.7, 2.5, 1.0])
    folder = tmp_path / "lits"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for i in range(5):
        vol, lab = rng.integers(-300, 400, (6, 8, 8)), rng.integers(0, 3, (6, 8, 8))
        lab_affine = affine.copy()
        if i == 2:
            lab[0, 0, 0] = 9  # a class over LiTS's three
        if i == 3:
            lab_affine[0, 3] = 2.1  # the labels' grid three voxels to the side
        nib.save(nib.Nifti1Image(vol.T.astype(np.int16), affine), str(folder / f"volume-{i}.nii"))
        nib.save(nib.Nifti1Image(lab.T.astype(np.uint8), lab_affine), str(folder / f"segmentation-{i}.nii"))
    cut = folder / "volume-4.nii"
    cut.write_bytes(cut.read_bytes()[:-100])
    out = gems_here("data", "check", f"data.path={folder}", "data.workers=2")
    assert out.returncode == 2, out.stderr[-2000:]
    line = _last(out)
    assert "5 file(s) checked" in line and "3 bad:" in line, line
    assert "volume-2.nii: labels 0 .. 2 (background, liver, tumour)" in line and "holds 9" in line
    assert "volume-3.nii: labels on their volume's voxel grid" in line and "another origin" in line
    assert "volume-4.nii: whole NIfTI files; volume-4.nii is cut short" in line
    assert "volume-0.nii" not in line and "volume-1.nii" not in line
    monkeypatch.setattr(check, "LARGE_BYTES", 1)
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path / "cache"))
    files = layouts.get("nifti").files(folder)
    note = check.unchecked_note("data.path", str(folder), files)
    assert note is not None and f"`gems data check data.path={folder}`" in note
    for f in ("volume-2.nii", "volume-3.nii", "volume-4.nii", "segmentation-2.nii", "segmentation-3.nii"):
        (folder / f).unlink()
    assert gems_here("data", "check", f"data.path={folder}", "data.workers=1").returncode == 0
    assert check.unchecked_note("data.path", str(folder), layouts.get("nifti").files(folder)) is None



def test_a_compressed_task_is_read_whole_and_converted_past_its_bad_cases(tmp_path: Path) -> None:
    """A Decathlon task as downloaded (.nii.gz) was every file bad "for being compressed", a cut volume and a label
    of 5 among them unreported; the printed conversion was refused, and convert stopped at the first bad case. Now
    every case is decompressed as a stream: a volume cut short, a label over the task's three classes and a gzip
    CRC that does not match are each named with what is wrong, the good ones pass, the check says once that a run
    reads the task once converted, and its command runs as printed: past the bad cases, naming each, the rest
    converted."""
    task = tmp_path / "Task03_Liver"
    rng = np.random.default_rng(2)
    pairs = [(rng.integers(-300, 400, (6, 8, 8)), rng.integers(0, 3, (6, 8, 8))) for _ in range(6)]
    pairs[2][1][0, 0, 0] = 5  # a class over the task's three
    layouts.get("decathlon").write(task, pairs)
    cut = task / "imagesTr" / "liver_1.nii.gz"
    cut.write_bytes(cut.read_bytes()[:-40])  # its stream's end gone
    crc = task / "imagesTr" / "liver_3.nii.gz"
    raw = bytearray(crc.read_bytes())
    raw[-8] ^= 0x01  # the gzip trailer's CRC: every byte decompresses, the CRC does not match
    crc.write_bytes(bytes(raw))
    out = gems_here("data", "check", f"data.path={task}", "data.workers=2")
    assert out.returncode == 2, out.stderr[-2000:]
    line = _last(out)
    assert "5 file(s) checked" in line and "3 bad:" in line and "liver_0" not in line and "liver_4" not in line, line
    assert "liver_1.nii.gz: whole NIfTI files; imagesTr/liver_1.nii.gz is cut short" in line, line
    assert "labelsTr/liver_2.nii.gz holds 5" in line and "labels 0 .. 2 (background, liver, cancer)" in line, line
    assert "liver_3.nii.gz: whole NIfTI files; imagesTr/liver_3.nii.gz is a corrupt gzip stream" in line, line
    assert "CRC check failed" in line and "compressed;" not in line, line
    (note,) = [ln for ln in out.stdout.splitlines() if ln.startswith("gems: note:")]
    command = note.split("`")[1]
    assert command == f"gems data convert data.path={task} data.out={task}_nii", note
    conv = gems_here(*command.split()[1:], "data.workers=2")
    assert conv.returncode == 2, conv.stdout[-2000:]
    (error,) = [ln for ln in conv.stderr.splitlines() if ln.startswith("gems: error:")]
    assert "2 did not: liver_1.nii.gz: " in error and "; liver_3.nii.gz: " in error and "3 other file(s)" in error
    assert sorted(p.name for p in Path(f"{task}_nii", "imagesTr").iterdir()) == ["liver_0.nii", "liver_2.nii",
                                                                                "liver_4.nii"]
    val = gems_here(*command.split()[1:], f"data.val_path={task}")
    assert val.returncode == 2 and f"data.val_path={task}: expected null for gems data convert" in val.stderr
    assert f"`gems data convert data.path={task} data.out={task}_nii`" in val.stderr, val.stderr
