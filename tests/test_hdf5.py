"""Partitioned HDF5 input: a rank reads its hyperslab and about 1/S of a sample's bytes."""
import io

import h5py
import numpy as np
import pytest
import torch

from gems.data.hdf5 import HDF5Samples, read_sample, sample_shape
from gems.data.synth import make_sample, synth_main, write_synthetic
from gems.errors import ConfigError
from gems.spatial import SpatialContext

SHAPE = (4, 32, 24, 20)


class CountingFile(io.RawIOBase):
    """A real file that counts the bytes HDF5 reads through it."""

    def __init__(self, path):
        self.f = open(path, "rb")
        self.nbytes = 0

    def readinto(self, b):
        n = self.f.readinto(b)
        self.nbytes += n or 0
        return n

    def seek(self, *a):
        return self.f.seek(*a)

    def tell(self):
        return self.f.tell()

    def seekable(self):
        return True

    def readable(self):
        return True

    def close(self):
        self.f.close()
        super().close()


def _bytes_read(path, slices):
    with CountingFile(path) as c:
        x, _ = read_sample(c, slices)
    return c.nbytes, x


def _ctx(parts, dims, s):
    ranks = list(range(int(np.prod(parts))))
    grid = np.unravel_index(s, parts)
    return SpatialContext(None, ranks, parts, dims, tuple(int(g) for g in grid))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("cosmo"), 3, SHAPE, seed=4)


def test_files_have_the_exalearn_layout(files):
    with h5py.File(files[0], "r") as f:
        assert f["full"].dtype == np.int16 and f["full"].shape == SHAPE
        assert f["unitPar"].shape == (4,) and f["unitPar"].dtype == np.float32
        counts = f["full"][()]
    assert counts.min() >= 0 and counts.max() > 20 and len(np.unique(counts)) > 20  # a spread of values
    a, _ = make_sample(4, 0, SHAPE)
    b, _ = make_sample(4, 1, SHAPE)
    assert np.array_equal(a, counts) and not np.array_equal(a, b)  # pure function of (seed, index)


@pytest.mark.parametrize("parts,dims", [((4,), (0,)), ((2, 2), (0, 1)), ((3,), (2,))])
def test_a_rank_reads_its_share_of_the_bytes(files, parts, dims):
    empty, _ = _bytes_read(files[0], (slice(0, 0),))  # metadata: superblock, headers, unitPar
    whole, x_full = _bytes_read(files[0], None)
    data = whole - empty
    assert data >= x_full.numel() * 2  # the whole sample's int16 payload was read
    S = int(np.prod(parts))
    for s in range(S):
        ctx = _ctx(parts, dims, s)
        sl = ctx.local_slices(SHAPE[1:])
        got, x = _bytes_read(files[0], sl)
        share = (got - empty) / data
        expect = x.numel() / x_full.numel()  # ~1/S (exactly the part's cells)
        assert abs(expect - 1 / S) < 0.1 / S
        assert expect - 0.01 <= share <= expect + 0.02, (s, share, expect)
        torch.testing.assert_close(x, x_full[(slice(None), *sl)], rtol=0, atol=0)


def test_values_are_log1p_of_counts(files):
    x, y = read_sample(files[1])
    with h5py.File(files[1], "r") as f:
        counts = torch.from_numpy(f["full"][()].astype(np.float32))
        par = torch.from_numpy(f["unitPar"][()])
    torch.testing.assert_close(x, torch.log1p(counts))
    torch.testing.assert_close(y, par)
    assert sample_shape(files[1]) == SHAPE


def test_dataset_gives_this_ranks_part(files):
    ctx = _ctx((2, 2), (0, 2), 3)
    ds = HDF5Samples(files[0].parent, SHAPE, ctx)
    assert len(ds) == 3
    xb, yb = ds.batch([2, 0])
    full, y2 = read_sample(files[2])
    assert xb.shape == (2, 4, 16, 24, 10)
    torch.testing.assert_close(xb[0], full[:, 16:32, :, 10:20], rtol=0, atol=0)
    torch.testing.assert_close(yb[0], y2)


def test_shape_mismatch_names_the_file(files, tmp_path):
    with pytest.raises(ConfigError, match=r"data.path=.*sample_00000.h5.*\[4, 64, 64, 64\].*\[4, 32, 24, 20\]"):
        HDF5Samples(files[0].parent, (4, 64, 64, 64))
    import shutil

    shutil.copy(files[0], tmp_path / "a.h5")
    odd = write_synthetic(tmp_path / "odd", 1, (4, 16, 24, 20), seed=0)[0]
    shutil.copy(odd, tmp_path / "b.h5")
    ds = HDF5Samples(tmp_path, SHAPE)  # the first file matches; the other fails when it is read
    ds[0]
    with pytest.raises(ConfigError, match=r"b.h5.*\[4, 16, 24, 20\]"):
        ds[1]


def test_more_parts_than_cells_is_a_config_error(files):
    with pytest.raises(ConfigError, match=r"parallel.spatial=.*at most 20 parts along spatial dim 2"):
        HDF5Samples(files[0].parent, SHAPE, _ctx((21,), (2,), 0))


def test_synth_main_writes_and_refuses_to_overwrite(tmp_path):
    cfg = {"data": {"path": str(tmp_path / "d"), "num_samples": 2}, "model": {"size": 8, "name": "cosmoflow"},
           "train": {"seed": 3}}
    files = synth_main(cfg)
    assert [f.name for f in files] == ["sample_00000.h5", "sample_00001.h5"]
    assert sample_shape(files[0]) == (4, 8, 8, 8)
    with pytest.raises(ConfigError, match="data.path"):
        synth_main(cfg)
    with pytest.raises(ConfigError, match="data.path"):
        synth_main({"data": {"path": "???"}, "model": {"size": 8}})
