"""LiTS's CT volumes with labels (gems.data.layouts.nifti, gems.data.segmentation, Dice in gems.rank.loss.Metric):
files written by nibabel are read by position, each rank its part of each tile, equal to nibabel's own arrays
(padding, scaling, either byte order); the CT window; bad volumes and labels named; `.nii.gz` refused and
converted; synthetic volumes in LiTS's layout; Dice per class as sums that add up over parts; and the U-Net on
NIfTI volumes trains on one rank and on S = 2 alike."""
from __future__ import annotations

import gzip
import shutil
from pathlib import Path
from types import SimpleNamespace

import nibabel as nib
import numpy as np
import pytest
import torch
from _cli import gems_here, records

from gems.config import compose
from gems.data import layouts
from gems.errors import ConfigError


def _save(path: Path, zyx: np.ndarray, dtype: str, slope: float | None = None, inter: float = 0.0) -> None:
    """A volume as nibabel writes it: (x, y, z) voxels of ``zyx`` (C order), type ``dtype`` (its byte order kept),
    a scaling where given."""
    hdr = nib.Nifti1Header(endianness=np.dtype(dtype).byteorder if np.dtype(dtype).byteorder in "<>" else "<")
    img = nib.Nifti1Image(zyx.T.astype(dtype), np.diag([0.7, 0.7, 2.5, 1.0]), hdr)
    img.set_data_dtype(dtype)
    if slope is not None:
        img.header.set_slope_inter(slope, inter)
    nib.save(img, str(path))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """Three volumes of 10-20 voxels an edge (tiles of 8 cover them with padding): little-endian int16, big-endian
    int16 with a scaling of 2 and -1024 (stored values, not HU), int16 with labels stored as floats."""
    out = tmp_path_factory.mktemp("lits")
    rng = np.random.default_rng(0)
    for i, (shape, dtype, slope) in enumerate([((10, 12, 16), "<i2", None), ((9, 8, 20), ">i2", 2.0),
                                               ((16, 11, 8), "<i2", None)]):
        stored = rng.integers(-600, 900, shape)
        _save(out / f"volume-{i}.nii", stored, dtype, slope, -1024.0 if slope else 0.0)
        _save(out / f"segmentation-{i}.nii", rng.integers(0, 3, shape), "float32" if i == 2 else "uint8")
    return out


def _tile(folder: Path, v: int, origin: tuple[int, ...], edge: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """nibabel's stored voxels, scaled voxels and labels of one tile (z, y, x), padded as gems pads: stored 0, HU
    below any window (0 once windowed), labels ignored (255)."""
    img = nib.load(str(folder / f"volume-{v}.nii"))
    stored = np.asarray(img.dataobj.get_unscaled()).T
    hu = np.asarray(img.get_fdata()).T
    lab = np.asarray(nib.load(str(folder / f"segmentation-{v}.nii")).get_fdata()).T
    big = [max(o + edge, n) for o, n in zip(origin, stored.shape)]
    out = [np.zeros(big, stored.dtype), np.full(big, -1e9), np.full(big, 255, np.int64)]
    box = tuple(slice(0, n) for n in stored.shape)
    out[0][box], out[1][box], out[2][box] = stored, hu, lab
    sl = tuple(slice(o, o + edge) for o in origin)
    return out[0][sl], out[1][sl], out[2][sl]


@pytest.mark.parametrize("slices", [None, (slice(4, 8),), (slice(0, 8), slice(0, 3))], ids=["whole", "S2", "H"])
def test_each_ranks_part_of_each_tile_is_nibabels(folder: Path, slices) -> None:
    layout = layouts.detect(folder)
    assert layout.name == "nifti"
    s = layout.open(folder, (1, 8, 8, 8), slices=slices, target="dense")
    assert len(s) == 2 * 2 * 2 + 2 * 1 * 3 + 2 * 2 * 1  # tiles per volume: ceil of each edge over 8
    part = tuple(slices or ()) + (slice(None),) * (3 - len(slices or ()))
    ids = list(range(len(s)))
    voxels, labels = s.read(ids)
    x = s.finish(voxels)
    assert x.shape == (len(ids), 1, *s.part_shape()[1:]) and labels.dtype == torch.uint8
    for i in ids:
        v, origin = s.locate(i)
        stored, hu, lab = _tile(folder, v, origin)
        assert np.array_equal(voxels.data[i, 0].numpy(), stored[part]) and np.array_equal(labels[i].numpy(), lab[part])
        want = (np.clip(hu[part], -200, 250) + 200) / 450
        np.testing.assert_allclose(x[i, 0].numpy(), want, atol=2e-7)
        assert torch.equal(s.target(i), labels[i])


def test_the_window_is_the_key_and_checked(folder: Path) -> None:
    s = layouts.get("nifti").open(folder, (1, 8, 8, 8), target="dense", window=[0, 100])
    voxels, _ = s.read([0])
    hu = _tile(folder, 0, (0, 0, 0))[1]
    np.testing.assert_allclose(s.finish(voxels)[0, 0].numpy(), np.clip(hu, 0, 100) / 100, atol=2e-7)
    with pytest.raises(ConfigError) as e:
        layouts.get("nifti").open(folder, (1, 8, 8, 8), target="dense", window=[250, -200])
    assert e.value.key == "data.window"


@pytest.mark.parametrize("case, named", [
    ("missing", "segmentation-1.nii is missing for volume-1.nii"),
    ("shape", "segmentation-1.nii holds [8, 8, 8] voxels"),
    ("broken", "volume-1.nii is not one"),
    ("gz", "volume-1.nii.gz is gzip-compressed"),
])
def test_bad_volumes_and_labels_are_named(tmp_path: Path, folder: Path, case: str, named: str) -> None:
    for f in ("volume-0.nii", "segmentation-0.nii"):
        shutil.copy(folder / f, tmp_path / f)
    vol, lab = np.zeros((6, 7, 8)), np.zeros((6, 7, 8))
    if case == "shape":
        lab = np.zeros((8, 8, 8))
    _save(tmp_path / ("volume-1.nii" + (".gz" if case == "gz" else "")), vol, "<i2")
    if case != "missing":
        _save(tmp_path / ("segmentation-1.nii" + (".gz" if case == "gz" else "")), lab, "uint8")
    if case == "broken":
        (tmp_path / "volume-1.nii").write_bytes((tmp_path / "volume-1.nii").read_bytes()[:200])
    with pytest.raises(ConfigError) as e:
        layouts.get("nifti").open(tmp_path, (1, 8, 8, 8), target="dense")
    assert e.value.key == "data.path" and named in str(e.value), str(e.value)


def _run_set(folder: Path, *over: str, validation: bool = False):
    """The set a run's rank reads (gems.rank.data.make_data) of the U-Net on 16^3 tiles of ``folder``."""
    from gems.models import build_model
    from gems.rank.data import make_data

    cfg = compose(["model=unet3d", "model.size=16", "data=hdf5", f"data.path={folder}",
                   *([f"data.val_path={folder}"] if validation else []), *over], check=False)
    return make_data(cfg, build_model(cfg.model), validation=validation)


def test_labels_outside_the_classes_are_named_by_the_runs_own_set(tmp_path: Path) -> None:
    """A label at or over model.num_classes was read by the rank's set unchecked (only the pre-launch check's set
    knew the classes) and the loss raised IndexError (exit 1): now the set the run reads names the file (exit 2)."""
    _save(tmp_path / "volume-0.nii", np.zeros((16, 16, 16)), "<i2")
    lab = np.zeros((16, 16, 16))
    lab[3, 3, 3] = 3
    _save(tmp_path / "segmentation-0.nii", lab, "uint8")
    data = _run_set(tmp_path)
    for want_input in (True, False):  # a rank that reads the input, and one that reads the targets alone
        with pytest.raises(ConfigError, match=r"labels 0 \.\. 2 .*segmentation-0.nii holds 3"):
            data.batch([0], want_input=want_input)
    assert _run_set(tmp_path, "model.num_classes=4").batch([0])[1].max() == 3


def test_a_volume_or_labels_replaced_under_a_run_are_named(tmp_path: Path, folder: Path) -> None:
    """A volume replaced mid-run by another of the same size (another scaling, say) was read at its old offset and
    scaling, silently: each file's identity is now looked at every batch."""
    import os

    for f in ("volume-0.nii", "segmentation-0.nii"):
        shutil.copy(folder / f, tmp_path / f)
    data = _run_set(tmp_path, "model.size=8")
    data.batch([0])
    for name in ("volume-0.nii", "segmentation-0.nii"):
        img = nib.load(str(tmp_path / name))
        other = tmp_path / f".other-{name}"
        nib.save(nib.Nifti1Image(np.asarray(img.dataobj), img.affine, img.header), str(other))
        os.replace(other, tmp_path / name)  # the same bytes, another file
        with pytest.raises(ConfigError) as e:
            data.batch([0])
        assert e.value.key == "data.path" and f"{name} was replaced by another file" in str(e.value), str(e.value)
        data = _run_set(tmp_path, "model.size=8")  # a new run reads it
        data.batch([0])


def test_volumes_of_mixed_types_are_read_as_float32(tmp_path: Path, folder: Path) -> None:
    """int16 and uint8 volumes together were refused; they are read as float32, exactly, and the run says so. The
    uint8 volume's padding (stored 0 is 0 HU, inside the window) is 0 in the network's input, as air."""
    from gems.rank.data import data_notes

    for f in ("volume-0.nii", "segmentation-0.nii"):
        shutil.copy(folder / f, tmp_path / f)
    rng = np.random.default_rng(1)
    _save(tmp_path / "volume-1.nii", rng.integers(0, 256, (5, 6, 7)), "uint8")
    _save(tmp_path / "segmentation-1.nii", rng.integers(0, 3, (5, 6, 7)), "uint8")
    data = _run_set(tmp_path, "model.size=8")
    s = data.samples
    assert s.dtype == np.float32 and "volumes of 2 types (int16, uint8) read as float32" in " ".join(s.notes())
    assert any("read as float32" in n for n in data_notes(compose(["data=hdf5"], check=False), data))
    ids = list(range(len(s)))
    voxels, labels = s.read(ids)
    x = s.finish(voxels)
    for i in ids:
        v, origin = s.locate(i)
        stored, hu, lab = _tile(tmp_path, v, origin)
        assert np.array_equal(voxels.data[i, 0].numpy(), stored.astype(np.float32)) and np.array_equal(labels[i], lab)
        np.testing.assert_allclose(x[i, 0].numpy(), (np.clip(hu, -200, 250) + 200) / 450, atol=2e-7)
    last = s.locate(ids[-1])[0]
    assert last == 1 and float(x[-1, 0, 5:].abs().max()) == 0.0  # depth 5 of 8: padding, 0 after the window


def test_nii_gz_converts_to_the_same_nii(tmp_path: Path, folder: Path) -> None:
    src = tmp_path / "gz"
    src.mkdir()
    for f in sorted(folder.iterdir()):
        (src / (f.name + ".gz")).write_bytes(gzip.compress(f.read_bytes()))
    from gems.data.convert import convert_main

    cfg = compose(["data=hdf5", f"data.path={src}", f"data.out={tmp_path / 'out'}", "data.workers=1"], check=False)
    assert convert_main(cfg) == 3
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in folder.iterdir())
    for f in folder.iterdir():
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes()
    assert convert_main(cfg) == 0  # resumed: nothing left
    # a gzip stream cut short is named, and nothing of it written
    (tmp_path / "out" / "volume-1.nii").unlink()
    data = (src / "volume-1.nii.gz").read_bytes()
    (src / "volume-1.nii.gz").write_bytes(data[:len(data) // 2])
    with pytest.raises(ConfigError, match=r"volume-1.nii.gz is cut short: its gzip stream ends before its end"):
        convert_main(cfg)
    assert not (tmp_path / "out" / "volume-1.nii").exists()


def test_synthetic_volumes_have_liver_and_lesions_inside_it(tmp_path: Path) -> None:
    from gems.data.segmentation import make_volume, synth_segmentation

    hu, lab = make_volume(0, 5, 32)
    again, _ = make_volume(0, 5, 32)
    assert np.array_equal(hu, again) and hu.dtype == np.int16 and 24 <= hu.shape[0] <= 32 and hu.shape[1:] == (32, 32)
    share = np.bincount(lab.ravel(), minlength=3) / lab.size
    assert 0.02 < share[1] < 0.2 and 0 < share[2] < share[1]  # liver a few %, lesions fewer
    assert abs(hu[lab == 1].mean() - 110) < 5 and abs(hu[lab == 2].mean() - 45) < 10
    cfg = compose(["data=hdf5", "data.kind=segmentation", f"data.path={tmp_path / 't'}",
                   f"data.val_path={tmp_path / 'v'}", "data.num_samples=2", "model=unet3d", "model.size=16"],
                  check=False)
    synth_segmentation(cfg)
    assert sorted(p.name for p in (tmp_path / "v").iterdir()) == ["segmentation-0.nii", "volume-0.nii"]
    img = nib.load(str(tmp_path / "t" / "volume-1.nii"))
    assert np.array_equal(np.asarray(img.dataobj).T, make_volume(0, 1, 16)[0]) and img.get_data_dtype() == np.int16
    with pytest.raises(ConfigError, match="nothing was overwritten"):
        synth_segmentation(cfg)


def test_dice_per_class_is_sums_that_add_up_over_parts() -> None:
    from gems.rank.loss import Metric

    spec = SimpleNamespace(loss="cross_entropy", target="dense", num_outputs=3)
    m = Metric(spec, None, True)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    out, y = torch.randn(2, 3, 4, 6, 6, generator=g), torch.randint(0, 3, (2, 4, 6, 6), generator=g)
    y[y == 2] = 0  # class 2 labelled nowhere
    out[:, 2] = -10  # and predicted nowhere
    whole = m(out, y)
    parts = m(out[:, :, :2], y[:, :2]) + m(out[:, :, 2:], y[:, 2:])  # S = 2's sum
    assert torch.equal(whole[1:], parts[1:]) and float(whole[0]) == pytest.approx(float(parts[0]), rel=1e-6)
    r = m.report(whole)
    p, t = out.argmax(1).numpy(), y.numpy()
    for c in (0, 1):
        want = 2 * ((p == c) & (t == c)).sum() / ((p == c).sum() + (t == c).sum())
        assert r["dice"][c] == pytest.approx(want)
    assert r["dice"][2] is None and r["dice_foreground"] == r["dice"][1]
    assert r["accuracy"] == pytest.approx((p == t).mean()) and r["cells"] == y.numel()


def test_padding_counts_nowhere_in_the_loss_accuracy_and_dice() -> None:
    """A tile's padding was labelled background: it counted in the loss, the accuracy and background's Dice. Its
    label is now ignored (255): the loss sums the other voxels over the constant divisor cells x batch (so S = 2's
    parts still add up to it), the figures count the other voxels alone, and a sample's part of padding alone
    writes no row of gems eval's predictions."""
    import torch.nn.functional as F

    from gems.rank.loss import Metric, make_loss_fn

    spec = SimpleNamespace(loss="cross_entropy", target="dense", num_outputs=3, input_shape=(1, 4, 6, 6),
                           spatial_end=None)
    g = torch.Generator().manual_seed(0)
    out, y = torch.randn(3, 3, 4, 6, 6, generator=g), torch.randint(0, 3, (3, 4, 6, 6), generator=g).to(torch.uint8)
    y[1, 2:] = 255  # sample 1's far half in depth: padding
    y[2] = 255  # sample 2: a last partial batch's filling
    valid = y != 255
    scores, labels = out.movedim(1, -1)[valid], y[valid].long()
    loss = make_loss_fn(spec, SimpleNamespace(spatial_enabled=False, spatial=1), 3)  # type: ignore[arg-type]
    whole = loss(out, y)
    assert float(whole) == pytest.approx(float(F.cross_entropy(scores, labels, reduction="sum")) / (4 * 6 * 6 * 3))
    assert float(loss(out[:, :, :2], y[:, :2]) + loss(out[:, :, 2:], y[:, 2:])) == pytest.approx(float(whole))
    m = Metric(spec, None, True)  # type: ignore[arg-type]
    m.keep = []
    r = m.report(m(out, y, [0, 1, 2]))
    p = scores.argmax(1)
    assert r["cells"] == int(valid.sum()) and r["accuracy"] == pytest.approx(float((p == labels).float().mean()))
    assert r["loss"] == pytest.approx(float(F.cross_entropy(scores, labels)), rel=1e-6)
    for c in range(3):
        want = 2 * float(((p == c) & (labels == c)).sum()) / float((p == c).sum() + (labels == c).sum())
        assert r["dice"][c] == pytest.approx(want)
    ((ids, rows, _),) = m.keep
    assert ids == [0, 1] and rows[:, 2].tolist() == [4 * 6 * 6, 2 * 6 * 6]


UNET = ["model=unet3d", "model.size=16", "model.width=0.125", "train.batch_size=2", "train.steps=3",
        "train.warmup_steps=1", "train.eval_every=3", "data=hdf5", "train.optimizer=adam", "train.lr=0.003"]


@pytest.fixture(scope="module")
def volumes(tmp_path_factory) -> Path:
    from gems.data.segmentation import synth_segmentation

    out = tmp_path_factory.mktemp("seg")
    synth_segmentation(compose(["data=hdf5", "data.kind=segmentation", f"data.path={out / 'train'}",
                                f"data.val_path={out / 'val'}", "data.num_samples=2", "data.val_samples=3",
                                "model=unet3d", "model.size=16"], check=False))
    return out


def test_the_unet_on_nifti_volumes_s2_equals_one_rank(tmp_path: Path, volumes: Path) -> None:
    """Two volumes of 16^2 x 12-16 voxels (a tile each, padded in depth), validation on three others (batches of
    two: the last one filled with a sample that counts nowhere): losses, accuracy and Dice per class of S = 2 (each
    rank reads its slab; the volumes staged to node-local storage first, their labels with them) equal one rank's,
    and the validation counts every voxel of the three volumes, no padding."""
    recs = []
    for mesh in ([], ["parallel.spatial=2", "data.stage=node", f"data.stage_dir={tmp_path / 'node'}"]):
        res = tmp_path / f"S{len(mesh) + 1}"
        out = gems_here("run", *UNET, f"data.path={volumes / 'train'}", f"data.val_path={volumes / 'val'}",
                        f"results.dir={res}", *mesh)
        assert out.returncode == 0, out.stderr[-3000:]
        (rec,) = records(str(res))
        recs.append(rec)
    one, two = recs
    assert "layout nifti" in " ".join(one["notes"])
    assert "data.stage=node: 10 files" in " ".join(two["notes"]), two["notes"]  # 2 + 3 volumes and their labels
    np.testing.assert_allclose(two["loss"], one["loss"], rtol=1e-5)
    v1, v2 = one["validation"][-1], two["validation"][-1]
    voxels = sum(nib.load(str(f)).dataobj.shape[2] * 16 ** 2 for f in (volumes / "val").glob("volume-*.nii"))
    assert v1["cells"] == v2["cells"] == voxels < 3 * 16 ** 3 and len(v1["dice"]) == 3
    np.testing.assert_allclose([v2["loss"], v2["accuracy"]], [v1["loss"], v1["accuracy"]], rtol=1e-5)
    np.testing.assert_allclose([d or 0.0 for d in v2["dice"]], [d or 0.0 for d in v1["dice"]], rtol=1e-5)


def test_gems_plan_names_the_layout_and_times_the_read_on_the_volumes(volumes: Path) -> None:
    from gems.plan.make import make_plan

    cfg = compose([*UNET, f"data.path={volumes / 'train'}", "data.readers=1", "data.prefetch=0"])
    pr = make_plan(cfg, suggest=False).prediction
    (said,) = [a for a in pr.assumptions if a.startswith("data read by 1 reader thread(s) timed here")]
    assert "layout nifti, from the page cache" in said and said.endswith(" GB/s"), said
    rate = float(said.rsplit(": ", 1)[1].split(" GB/s")[0]) * 1e9
    assert pr.breakdown["data"] == pytest.approx(2 * 16 ** 3 * 2 / rate, rel=0.01)  # int16 voxels


def test_a_model_of_target_vectors_is_refused_naming_the_folder(folder: Path) -> None:
    with pytest.raises(ConfigError) as e:
        layouts.get("nifti").open(folder, (1, 8, 8, 8))  # target: vector, CosmoFlow's
    assert e.value.key == "data.path" and "model=unet3d" in str(e.value)


def test_a_volume_cut_short_under_a_run_is_named(tmp_path: Path, folder: Path) -> None:
    for f in ("volume-0.nii", "segmentation-0.nii"):
        shutil.copy(folder / f, tmp_path / f)
    s = layouts.get("nifti").open(tmp_path, (1, 8, 8, 8), target="dense")
    s.read([0])
    data = (tmp_path / "volume-0.nii").read_bytes()
    (tmp_path / "volume-0.nii").write_bytes(data[:len(data) // 2])
    with pytest.raises(ConfigError) as e:
        s.read(list(range(len(s))))
    assert e.value.key == "data.path" and "volume-0.nii" in str(e.value), str(e.value)
