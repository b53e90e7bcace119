"""Labelled volumes as users hold them (issue 71): segmentations whose affines differ from their volume's by flips
and permutations of the axes are read onto the volume's grid exactly and train as the aligned ones do; any other
difference is refused before launch naming both files and both affines; data.orientation=RAS reads every case in
one orientation. Files written by nibabel, as ITK-SNAP, SimpleITK or a reorientation of the volumes leave them."""
from __future__ import annotations

import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from _cli import gems_here, records

from gems.data import layouts
from gems.errors import ConfigError

SPACING = np.diag([0.7, 0.7, 2.5, 1.0])


def _save(path: Path, zyx: np.ndarray, dtype: str, affine: np.ndarray) -> None:
    img = nib.Nifti1Image(np.asarray(zyx).T.astype(dtype), affine)
    img.set_data_dtype(dtype)
    nib.save(img, str(path))


def flipped_x(zyx: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same voxels stored with x running the other way, and the affine that keeps each in its place."""
    flip = np.eye(4)
    flip[0, 0], flip[0, 3] = -1.0, zyx.shape[2] - 1
    return zyx[:, :, ::-1], affine @ flip


def swapped_xy(zyx: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same voxels stored with x and y swapped, and the affine that keeps each in its place."""
    swap = np.eye(4)[[1, 0, 2, 3]].T
    return zyx.transpose(0, 2, 1), affine @ swap


def _case(folder: Path, i: int, rng: np.random.Generator, shape: tuple[int, int, int],
          label_as: str = "aligned") -> tuple[np.ndarray, np.ndarray]:
    """Volume i (int16, HU) and its labels in ``folder``, the labels stored as ``label_as`` says; returns the
    volume's voxels and labels on its own grid (z, y, x)."""
    folder.mkdir(parents=True, exist_ok=True)
    vol = rng.integers(-300, 400, shape)
    lab = rng.integers(0, 3, shape)
    _save(folder / f"volume-{i}.nii", vol, "<i2", SPACING)
    stored, affine = lab, SPACING
    if label_as in ("flip", "flip+swap"):
        stored, affine = flipped_x(stored, affine)
    if label_as in ("swap", "flip+swap"):
        stored, affine = swapped_xy(stored, affine)
    if label_as == "shifted":
        affine = SPACING.copy()
        affine[0, 3] = 3.5  # five voxels of 0.7 mm to the side
    if label_as == "spacing":
        affine = np.diag([0.8, 0.7, 2.5, 1.0])
    if label_as == "identity":  # an unrelated affine, as a tool that drops the header's leaves
        affine = np.eye(4)
    _save(folder / f"segmentation-{i}.nii", stored, "uint8", affine)
    return vol, lab


@pytest.mark.parametrize("label_as", ["flip", "swap", "flip+swap"])
def test_labels_flipped_or_permuted_by_their_affine_are_read_on_the_volumes_grid(tmp_path: Path, label_as) -> None:
    """Every rank's part of every tile holds the labels of the aligned file exactly, and the set says what it
    reoriented (the record's notes)."""
    rng = np.random.default_rng(1)
    shape = (6, 9, 9)  # x and y equal: a swap keeps the shape; tiles of 8 pad them
    _, want = _case(tmp_path, 0, rng, shape, label_as)
    for slices in (None, (slice(2, 6),)):
        s = layouts.get("nifti").open(tmp_path, (1, 8, 8, 8), target="dense", slices=slices)
        part = tuple(slices or ()) + (slice(None),) * (3 - len(slices or ()))
        _, labels = s.read(list(range(len(s))))
        for i in range(len(s)):
            _, origin = s.locate(i)
            tile = np.full([max(o + 8, n) for o, n in zip(origin, shape)], 255, np.int64)
            tile[tuple(slice(0, n) for n in shape)] = want
            np.testing.assert_array_equal(labels[i].numpy(), tile[tuple(slice(o, o + 8) for o in origin)][part])
    (note,) = [n for n in s.notes() if "reoriented" in n]
    assert "segmentation-0.nii" in note and ("x flipped" in note) == ("flip" in label_as), note


@pytest.mark.parametrize("label_as, why", [
    ("shifted", "another origin: the labels' grid is shifted by (-5, 0, 0) voxels"),
    ("spacing", "spacing: (0.8, 0.7, 2.5) mm against the volume's (0.7, 0.7, 2.5)"),
    ("identity", "spacing: (1, 1, 1) mm against the volume's (0.7, 0.7, 2.5)"),
])
def test_labels_on_another_grid_are_refused_naming_both_files_and_affines(tmp_path: Path, label_as, why) -> None:
    _case(tmp_path, 0, np.random.default_rng(2), (6, 8, 8), label_as)
    with pytest.raises(ConfigError) as e:
        layouts.get("nifti").open(tmp_path, (1, 8, 8, 8), target="dense")
    text = str(e.value)
    assert e.value.key == "data.path" and why in text, text
    assert "segmentation-0.nii's affine [" in text and "volume-0.nii's [0.7 0 0 0; 0 0.7 0 0; 0 0 2.5 0]" in text


def _header(name: str, zyx: tuple[int, int, int], affine: np.ndarray):
    from gems.data.layouts.nifti import Header

    return Header(Path("/data") / name, zyx, np.dtype("<i2"), 352, 1.0, 0.0,
                  affine=tuple(tuple(float(v) for v in row) for row in np.asarray(affine, dtype=np.float32)))


def _rotated(degrees: float, about: np.ndarray) -> np.ndarray:
    """A rotation by ``degrees`` about z through the world point ``about`` (4 x 4)."""
    t = np.radians(degrees)
    r = np.eye(4)
    r[:2, :2] = [[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]]
    shift, back = np.eye(4), np.eye(4)
    shift[:3, 3], back[:3, 3] = -about, about
    return back @ r @ shift


def test_the_tolerance_is_in_voxels_of_error_at_the_volumes_corners() -> None:
    """Two grids are one where every corner of the volume, mapped through one affine and back through the other,
    moves less than data.affine_tolerance voxels (0.01). A per-entry tolerance of 1e-3 passed a z spacing of 0.9992
    against 1.0 over 1000 slices (the last 0.8 of a slice off) and a rotation of 0.05 degrees of a 512^2 slice (0.45
    voxels at its corners); both are refused now, saying what differs. The same affine (as NIfTI stores it, in
    float32), a permutation of the axes, and a tolerance raised to cover the error pass."""
    from gems.data.layouts._grids import lined_up

    vol = _header("volume-0.nii", (1000, 64, 64), np.diag([1.0, 1.0, 1.0, 1.0]))
    near = _header("segmentation-0.nii", (1000, 64, 64), np.diag([1.0, 1.0, 0.9992, 1.0]))
    with pytest.raises(ConfigError) as e:
        lined_up(vol, near, "data.path")
    text = str(e.value)
    assert "spacing: (1, 1, 0.9992) mm against the volume's (1, 1, 1)" in text and "0.8 voxels off" in text, text
    assert "rotation" not in text and "origin" not in text
    assert lined_up(vol, near, "data.path", tolerance=0.9).identity  # asked for: within 0.9 voxels
    ct = np.diag([0.7, 0.7, 2.5, 1.0])
    ct[:3, 3] = [-180.0, -200.0, -400.0]
    slab = _header("volume-1.nii", (8, 512, 512), ct)
    centre = ct[:3, :3] @ np.array([255.5, 255.5, 3.5]) + ct[:3, 3]
    turned = _header("segmentation-1.nii", (8, 512, 512), _rotated(0.05, centre) @ ct)
    with pytest.raises(ConfigError) as e:
        lined_up(slab, turned, "data.path")
    text = str(e.value)
    assert "a rotation of 0.05 degrees" in text and "spacing" not in text and "voxels off" in text, text
    about_origin = _header("segmentation-1.nii", (8, 512, 512), _rotated(0.05, np.zeros(3)) @ ct)
    with pytest.raises(ConfigError) as e:  # about the world's origin: the volume's corner moves too, both said
        lined_up(slab, about_origin, "data.path")
    assert "a rotation of 0.05 degrees; another origin" in str(e.value), str(e.value)
    assert lined_up(slab, _header("segmentation-1.nii", (8, 512, 512), ct), "data.path").identity
    swap = np.eye(4)[[1, 0, 2, 3]].T
    got = lined_up(slab, _header("segmentation-1.nii", (8, 512, 512), ct @ swap), "data.path")
    assert got.axes == (0, 2, 1) and not any(got.flips)


def test_ras_reads_a_case_stored_in_another_orientation_as_the_ras_one(tmp_path: Path) -> None:
    """data.orientation=RAS: a volume and its labels stored with x flipped (LAS, as DICOM converters often leave
    them) read as the same case stored RAS+; as stored (the default) they read flipped."""
    rng = np.random.default_rng(3)
    vol, lab = rng.integers(-300, 400, (8, 8, 8)), rng.integers(0, 3, (8, 8, 8))
    ras, las = tmp_path / "ras", tmp_path / "las"
    for folder, (v, a), (g, b) in ((ras, (vol, SPACING), (lab, SPACING)),
                                   (las, flipped_x(vol, SPACING), flipped_x(lab, SPACING))):
        folder.mkdir()
        _save(folder / "volume-0.nii", v, "<i2", a)
        _save(folder / "segmentation-0.nii", g, "uint8", b)
    got = {}
    for name, folder in (("ras", ras), ("las", las)):
        for how in ("stored", "RAS"):
            s = layouts.get("nifti").open(folder, (1, 8, 8, 8), target="dense", orientation=how)
            voxels, labels = s.read([0])
            got[name, how] = (voxels.data[0, 0].numpy(), labels[0].numpy())
    for k in (0, 1):
        np.testing.assert_array_equal(got["las", "RAS"][k], got["ras", "RAS"][k])
        np.testing.assert_array_equal(got["ras", "stored"][k], got["ras", "RAS"][k])
        np.testing.assert_array_equal(got["las", "stored"][k], got["ras", "RAS"][k][:, :, ::-1])


UNET = ["model=unet3d", "model.size=8", "model.width=0.125", "train.batch_size=2", "train.steps=3",
        "train.warmup_steps=1", "data=hdf5", "train.optimizer=adam", "train.lr=0.003", "train.check_fit=false"]


def test_a_flipped_and_permuted_segmentation_trains_as_the_aligned_one_and_a_shifted_one_is_refused(
        tmp_path: Path) -> None:
    """The U-Net on two volumes: with their segmentations stored flipped and with x and y swapped (affines to
    match), the run's losses are the aligned run's bit for bit and its record says what was reoriented; a
    segmentation whose origin is shifted is refused before launch (exit 2, one line naming both files), and
    nothing is written."""
    losses = {}
    for label_as in ("aligned", "flip+swap"):
        rng = np.random.default_rng(4)
        for i in range(2):
            _case(tmp_path / label_as, i, rng, (8, 8, 8), label_as)
        out = gems_here("run", *UNET, f"data.path={tmp_path / label_as}", f"results.dir={tmp_path / 'r' / label_as}")
        assert out.returncode == 0, out.stderr[-2000:]
        (rec,) = records(str(tmp_path / "r" / label_as))
        losses[label_as] = rec["loss"]
        assert any("reoriented" in n for n in rec["notes"]) == (label_as != "aligned")
    assert losses["flip+swap"] == losses["aligned"] and len(losses["aligned"]) == 3
    bad = tmp_path / "shifted"
    shutil.copytree(tmp_path / "aligned", bad)
    _case(bad, 1, np.random.default_rng(5), (8, 8, 8), "shifted")
    out = gems_here("run", *UNET, f"data.path={bad}", f"results.dir={tmp_path / 'r' / 'shifted'}")
    assert out.returncode == 2 and not (tmp_path / "r" / "shifted").exists()
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("gems: error:")]
    assert "segmentation-1.nii's affine" in line and "volume-1.nii's" in line and "data.path" in line


# ---- the smaller findings (issue 71, item 6), each with its test ----------------------------------------------------
def test_a_dangling_link_in_data_path_is_refused_naming_it(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    for i in range(2):
        _case(tmp_path / "src", i, rng, (6, 8, 8))
    folder = tmp_path / "linked"
    folder.mkdir()
    for f in (tmp_path / "src").iterdir():
        (folder / f.name).symlink_to(f)
    (tmp_path / "src" / "volume-1.nii").unlink()
    with pytest.raises(ConfigError) as e:
        layouts.detect(folder)
    assert e.value.key == "data.path" and "volume-1.nii is a symbolic link to" in str(e.value), str(e.value)


def test_a_volume_beside_compressed_labels_names_the_gz_file(tmp_path: Path) -> None:
    import gzip

    _case(tmp_path, 0, np.random.default_rng(7), (6, 8, 8))
    lab = tmp_path / "segmentation-0.nii"
    (tmp_path / "segmentation-0.nii.gz").write_bytes(gzip.compress(lab.read_bytes()))
    lab.unlink()
    with pytest.raises(ConfigError) as e:
        layouts.get("nifti").open(tmp_path, (1, 8, 8, 8), target="dense")
    assert "segmentation-0.nii is missing for volume-0.nii (segmentation-0.nii.gz is there" in str(e.value), str(e.value)


def test_a_dangling_external_link_is_named_by_detection(tmp_path: Path) -> None:
    import h5py

    layouts.get("gems").write(tmp_path, [(np.zeros((4, 8, 8, 8), np.int16), np.zeros(4, np.float32))])
    (f,) = tmp_path.glob("*.h5")
    with h5py.File(f, "r+") as h:
        del h["full"]
        h["full"] = h5py.ExternalLink("gone.h5", "/full")
    with pytest.raises(ConfigError) as e:
        layouts.detect(tmp_path)
    assert f"{f.name}'s `full` is an external link to gone.h5:/full, which is missing" in str(e.value), str(e.value)


def test_mixed_plain_and_gzip_tfrecords_are_said_as_both(tmp_path: Path) -> None:
    data = Path(__file__).parent / "data" / "tfrecord"
    for kind in ("plain", "gzip"):
        for f in sorted((data / kind / "train").iterdir())[:2]:
            shutil.copy(f, tmp_path / f"{kind}_{f.name}")
    s = layouts.get("tfrecord").open(tmp_path, None)
    s.read(list(range(len(s))))
    assert "gzip-compressed and uncompressed TFRecords" in s.notes()[0], s.notes()


def test_convert_of_a_parent_of_hdf5_folders_says_there_is_nothing_to_convert(tmp_path: Path) -> None:
    for sub in ("train", "val"):
        layouts.get("exalearn").write(tmp_path / "src" / sub, [(np.zeros((4, 8, 8, 8), np.int16),
                                                                np.zeros(4, np.float32))])
    out = gems_here("data", "convert", f"data.path={tmp_path / 'src'}", f"data.out={tmp_path / 'out'}")
    assert out.returncode == 2 and "nothing to convert" in out.stderr and "train/" in out.stderr, out.stderr


def test_workers_die_with_the_process_that_started_them(tmp_path: Path) -> None:
    """gems data convert's (and check's) pool: its parent killed by SIGKILL (as the out-of-memory killer ends it),
    the workers, which would wait on their queue forever, end too (Linux's parent-death signal)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = ("import os, sys, time\n"
              "from concurrent.futures import ProcessPoolExecutor\n"
              "from gems.data import convert\n"
              "convert._PARENT[:] = [os.getpid()]\n"
              "pool = ProcessPoolExecutor(2, mp_context=convert._context(), initializer=convert._init_worker)\n"
              "futures = [pool.submit(time.sleep, 600) for _ in range(2)]\n"
              "time.sleep(2)\n"
              "print(' '.join(str(p) for p in pool._processes), flush=True)\n"
              "time.sleep(600)\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    workers = [int(w) for w in p.stdout.readline().split()]
    assert len(workers) == 2 and all(os.path.exists(f"/proc/{w}") for w in workers)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(w) for w in workers):
        time.sleep(0.2)
    assert not any(_alive(w) for w in workers)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has ended (its parent is gone: init reaps it)
    except OSError:
        return False
