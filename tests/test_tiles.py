"""Labelled volumes stored tile by tile (gems/data/layouts/tiles.py, issue 71 item 7): `gems data convert
data.tile=T` writes each NIfTI case (LiTS's, a Decathlon task's; labels on another orientation lined up at
conversion) as one HDF5 file of unfiltered tiles, which reads exactly as the NIfTI volumes do, every rank's part
of every tile, a tile of the chunks' edge as one block a dataset; the U-Net trains on it as on the volumes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _cli import gems_here, records
from test_labelled import SPACING, _case, flipped_x

from gems.data import layouts


@pytest.fixture(scope="module")
def volumes(tmp_path_factory) -> Path:
    """Three LiTS cases of 9-20 voxels an edge (tiles of 8 pad them), the second's labels stored with x flipped."""
    out = tmp_path_factory.mktemp("lits")
    rng = np.random.default_rng(11)
    for i, shape in enumerate([(10, 12, 16), (9, 8, 20), (16, 11, 8)]):
        _case(out, i, rng, shape, "flip" if i == 1 else "aligned")
    return out


@pytest.fixture(scope="module")
def tiles(volumes: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiles")
    run = gems_here("data", "convert", f"data.path={volumes}", f"data.out={out}", "data.tile=8", "data.workers=1")
    assert run.returncode == 0, run.stderr[-2000:]
    return out


@pytest.mark.parametrize("slices", [None, (slice(4, 8),), (slice(0, 8), slice(0, 3))], ids=["whole", "S2", "H"])
def test_tiles_read_as_the_volumes_do(volumes: Path, tiles: Path, slices) -> None:
    assert layouts.detect(tiles).name == "tiles"
    assert sorted(f.name for f in tiles.iterdir()) == ["volume-0.h5", "volume-1.h5", "volume-2.h5"]
    a = layouts.get("nifti").open(volumes, (1, 8, 8, 8), target="dense", slices=slices)
    b = layouts.get("tiles").open(tiles, (1, 8, 8, 8), target="dense", slices=slices)
    assert len(a) == len(b) == 2 * 2 * 2 + 2 * 1 * 3 + 2 * 2 * 1 and b.class_names == ["background", "liver", "tumour"]
    ids = list(range(len(a)))
    va, la = a.read(ids)
    vb, lb = b.read(ids)
    assert np.array_equal(va.data.numpy(), vb.data.numpy()) and np.array_equal(la.numpy(), lb.numpy())
    assert np.array_equal(a.finish(va).numpy(), b.finish(vb).numpy())
    assert not any("chunk by chunk" in n for n in b.notes())


def test_a_tile_of_the_chunks_edge_is_one_block_and_another_edge_reads_chunk_by_chunk(volumes: Path,
                                                                                       tiles: Path) -> None:
    """A tile of the chunks' edge: one block of exactly its bytes a dataset, where the NIfTI reader reads its rows'
    span; tiles of another edge read correctly, chunk by chunk, and the set says so."""
    b = layouts.get("tiles").open(tiles, (1, 8, 8, 8), target="dense")
    runs = b.runs([0])
    assert len(runs) == 2 and all(n == 8 ** 3 * k for (_, _, n), k in zip(runs, (2, 1)))  # int16 voxels, uint8 labels
    a = layouts.get("nifti").open(volumes, (1, 8, 8, 8), target="dense")
    assert sum(n for _, _, n in a.runs([0])) > 2 * 8 ** 3 * 3  # a NIfTI tile: its rows' span, gaps and all
    four = layouts.get("tiles").open(tiles, (1, 4, 4, 4), target="dense")
    nii = layouts.get("nifti").open(volumes, (1, 4, 4, 4), target="dense")
    ids = list(range(len(nii)))
    (vb, lb), (va, la) = four.read(ids), nii.read(ids)
    assert np.array_equal(va.data.numpy(), vb.data.numpy()) and np.array_equal(la.numpy(), lb.numpy())
    assert any("chunk by chunk" in n for n in four.notes()), four.notes()


def test_the_unet_trains_on_tiles_as_on_the_volumes(volumes: Path, tiles: Path, tmp_path: Path) -> None:
    args = ["model=unet3d", "model.size=8", "model.width=0.125", "train.batch_size=2", "train.steps=3",
            "train.warmup_steps=1", "data=hdf5", "train.check_fit=false", "parallel.spatial=2"]
    losses = []
    for folder in (volumes, tiles):
        out = gems_here("run", *args, f"data.path={folder}", f"results.dir={tmp_path / folder.name}")
        assert out.returncode == 0, out.stderr[-2000:]
        (rec,) = records(str(tmp_path / folder.name))
        losses.append(rec["loss"])
    assert losses[0] == losses[1] and len(losses[0]) == 3


def test_gems_plan_names_the_tiles_and_times_their_read(tiles: Path) -> None:
    from gems.config import compose
    from gems.plan.make import make_plan

    cfg = compose(["model=unet3d", "model.size=8", "model.width=0.125", "train.batch_size=2", "model.norm=none", "data=hdf5",
                   f"data.path={tiles}", "data.readers=1", "data.prefetch=0"])
    pr = make_plan(cfg, suggest=False).prediction
    (said,) = [a for a in pr.assumptions if a.startswith("data read by 1 reader thread(s) timed here")]
    assert "layout tiles" in said, said


def test_tiles_of_a_case_whose_labels_are_on_another_grid_are_refused_at_conversion(tmp_path: Path) -> None:
    import nibabel as nib

    _case(tmp_path / "src", 0, np.random.default_rng(12), (6, 8, 8), "shifted")
    out = gems_here("data", "convert", f"data.path={tmp_path / 'src'}", f"data.out={tmp_path / 'out'}", "data.tile=8")
    assert out.returncode == 2 and "segmentation-0.nii's affine" in out.stderr, out.stderr[-1000:]
    assert not list((tmp_path / "out").glob("*.h5"))
    vol, aff = flipped_x(np.zeros((2, 2, 2)), SPACING)  # (the helper, used above through _case too)
    assert vol.shape == (2, 2, 2) and nib is not None and aff[0, 0] == -0.7
