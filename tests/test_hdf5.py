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
    with pytest.raises(ConfigError, match=r"data.path=.*: expected `full` shaped \[4, 64, 64, 64\].*; "
                                          r"sample_00000.h5 .*has \[4, 32, 24, 20\]"):
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


# ---------------------------------------------------------------------------- every file checked before launch
CLI_SHAPE = (4, 32, 32, 32)  # cosmoflow model.size=32


def _write(path, full_shape=CLI_SHAPE, full_dtype=np.int16, par=4, par_dtype=np.float32):
    """One sample file in the ExaLearn layout (``par=None``: no ``unitPar``)."""
    with h5py.File(path, "w") as f:
        f.create_dataset("full", data=np.ones(full_shape, dtype=full_dtype))
        if par is not None:
            f.create_dataset("unitPar", data=np.zeros(par, dtype=par_dtype))


def _folder(root, n=4, bad=None, **kw):
    """``n`` good files ``sample_0000i.h5`` in ``root``; file ``bad`` written with ``kw`` instead."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        _write(root / f"sample_{i:05d}.h5", **(kw if i == bad else {}))
    return root


@pytest.mark.parametrize("kw,found", [
    (dict(full_shape=(4, 16, 32, 32)), "has [4, 16, 32, 32]"),
    (dict(par=None), "has no `unitPar` dataset"),
    (dict(full_dtype="S2"), "has `full` of dtype |S2"),
    (dict(par=3), "has `unitPar` shaped [3] of dtype float32"),
], ids=["shape", "no unitPar", "full dtype", "unitPar size"])
def test_run_names_the_first_bad_file_before_launch(tmp_path, kw, found):
    """The 3rd of 4 files is bad: `gems run` names it in one line, exit 2, before any rank starts
    (today's workers would fail on it at step 2 with exit 1)."""
    from _cli import gems_here

    data = _folder(tmp_path / "data", bad=2, **kw)
    results = tmp_path / "results"
    results.mkdir()
    (results / "earlier.json").write_text("{}")  # what is there stays, and nothing is added
    out = gems_here("run", f"results.dir={results}", "model.size=32", "model.width=0.25", "train.batch_size=2",
                    "train.steps=2", "train.warmup_steps=1", "data=hdf5", f"data.path={data}")
    assert out.returncode == 2, out.stderr + out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    line = lines[0]
    assert f"data.path={data}:" in line and "sample_00002.h5 (file 3 of 4)" in line and found in line, line
    if "shape" in kw:
        assert "`full` shaped [4, 32, 32, 32]" in line, line  # the shape the model needs
    assert "Traceback" not in out.stderr and "step" not in out.stdout
    assert [p.name for p in results.iterdir()] == ["earlier.json"]


def test_check_all_reads_headers_only_and_only_the_files_the_run_reads(tmp_path):
    data = _folder(tmp_path / "d", n=6, bad=4, full_shape=(4, 8, 32, 32))
    ds = HDF5Samples(data, CLI_SHAPE)
    ds.check_all(4, 4)  # steps x batch = 4 samples read: files 0..3, all good
    with pytest.raises(ConfigError, match=r"sample_00004\.h5 \(file 5 of 6\) has \[4, 8, 32, 32\]$"):
        ds.check_all(5, 4)
    with pytest.raises(ConfigError, match=r"sample_00004\.h5"):
        ds.check_all(None)  # every file
    # a file that is not HDF5 at all, and a single-file data.path
    (data / "sample_00001.h5").write_bytes(b"not hdf5")
    with pytest.raises(ConfigError, match=r"sample_00001\.h5 \(file 2 of 6\) has an unreadable file \(OSError"):
        HDF5Samples(data, CLI_SHAPE).check_all(2)
    with pytest.raises(ConfigError, match=r"data\.path=.*sample_00004\.h5: expected `full` shaped .*; the file has"):
        HDF5Samples(data / "sample_00004.h5", CLI_SHAPE)
    # headers only: the counts of a file whose raw data is gone (external storage, removed) are never read
    raw = tmp_path / "counts.bin"
    raw.write_bytes(np.ones(CLI_SHAPE, np.int16).tobytes())
    with h5py.File(tmp_path / "ext.h5", "w") as f:
        f.create_dataset("full", shape=CLI_SHAPE, dtype=np.int16, external=[(str(raw), 0, raw.stat().st_size)])
        f.create_dataset("unitPar", data=np.zeros(4, np.float32))
    read_sample(tmp_path / "ext.h5")  # the file works while its raw data is there
    raw.unlink()
    HDF5Samples(tmp_path / "ext.h5", CLI_SHAPE).check_all(None, 4)
    with pytest.raises(OSError):
        read_sample(tmp_path / "ext.h5")  # reading the counts would fail now
    # every file's headers, however many: one bad file among 1000 is found and named
    many = tmp_path / "many"
    many.mkdir()
    for i in range(1000):
        _write(many / f"s{i:04d}.h5", full_shape=(1, 2, 2, 3) if i == 777 else (1, 2, 2, 2))
    with pytest.raises(ConfigError) as e:
        HDF5Samples(many, (1, 2, 2, 2)).check_all(None, 4)
    assert "s0777.h5 (file 778 of 1000)" in str(e.value), str(e.value)


def test_files_larger_than_a_sample_are_cut_into_crops_each_read_as_its_own_hyperslab(tmp_path):
    files = write_synthetic(tmp_path / "u", 2, (4, 16, 16, 16), seed=4)
    ds = HDF5Samples(tmp_path / "u", (4, 8, 8, 8))
    assert len(ds) == 16 and ds.crops == 8 and ds.grid == (2, 2, 2)
    assert ds.locate(9) == (1, (0, 0, 8)) and ds.locate(14) == (1, (8, 8, 0)) and ds.group(9) == 1
    full, target = read_sample(files[1])
    x, y = ds[9]
    torch.testing.assert_close(x, full[:, 0:8, 0:8, 8:16], rtol=0, atol=0)
    torch.testing.assert_close(y, target) and torch.testing.assert_close(ds.target(9), target)
    # under spatial parallelism a rank reads its part of its crop only: the second of two depth slabs
    part = HDF5Samples(tmp_path / "u", (4, 8, 8, 8), _ctx((2,), (0,), 1))
    torch.testing.assert_close(part[14][0], full[:, 12:16, 8:16, 0:8], rtol=0, atol=0)
    # a crop's part is read as a hyperslab: its bytes and HDF5's metadata, not the universe's (a 64^3 one here,
    # large enough that the metadata does not dominate: an 8th of it, a crop, is 256 KiB)
    (big,) = write_synthetic(tmp_path / "big", 1, (4, 64, 64, 64), seed=5)
    counted = CountingFile(big)
    read_sample(counted, (slice(32, 64), slice(0, 32), slice(32, 64)))
    assert 4 * 32 ** 3 * 2 <= counted.nbytes < 1.2 * 4 * 32 ** 3 * 2, counted.nbytes
    counted.close()


def test_every_symmetry_of_a_crop_read_in_parts_is_the_part_of_the_transformed_crop(tmp_path):
    """data.augment: the 48 symmetries of a 3D crop, each rank of an uneven 2-dim cut reading the hyperslab its
    part comes from (mirrored, or another axis's range), equal the parts of the crop transformed whole."""
    from gems.data import augment

    files = write_synthetic(tmp_path / "u", 1, (4, 14, 14, 14), seed=6)
    whole = HDF5Samples(tmp_path / "u", (4, 7, 7, 7), augment="cube")
    assert whole.symmetries == 48 and augment.count("flip", 3) == 8 and augment.count("cube", 2) == 8
    full, _ = read_sample(files[0])
    crop = full[:, 7:14, 0:7, 7:14]  # sample 5: the crop at (7, 0, 7)
    seen = set()
    for k in range(48):
        perm, flips = augment._parts(k, 3)
        ref = crop.permute(0, *(1 + p for p in perm))
        ref = torch.flip(ref, [1 + d for d in flips]) if flips else ref
        seen.add(ref.numpy().tobytes())
        torch.testing.assert_close(whole.__getitem__(5, k)[0], ref, rtol=0, atol=0)
        for a, b in ((slice(0, 2), slice(0, 5)), (slice(2, 7), slice(5, 7))):  # an uneven cut over dims 0 and 1
            part = HDF5Samples(tmp_path / "u", (4, 7, 7, 7), slices=(a, b, slice(0, 7)), augment="cube")
            torch.testing.assert_close(part.__getitem__(5, k)[0], ref[:, a, b], rtol=0, atol=0)
    assert len(seen) == 48  # 48 different samples from one crop
    # the hyperslab a part comes from: the mirrored range along a flipped dim, another dim's range along a swap
    whole, first_two = (slice(0, 7), slice(0, 7)), slice(0, 2)
    assert augment.source_slices(1, (first_two, *whole), (7, 7, 7)) == (slice(5, 7), *whole)  # dim 0 flipped
    assert augment.source_slices(8, (*whole, first_two), (7, 7, 7)) == (whole[0], first_two, whole[1])  # 1 <-> 2
    with pytest.raises(ConfigError, match=r"^data.augment=cube: expected flip or none \(a sample of 8x4x4"):
        HDF5Samples(write_synthetic(tmp_path / "flat", 1, (4, 8, 4, 4), seed=1)[0], augment="cube")


def test_a_crop_that_does_not_fit_the_model_or_the_files_is_named(tmp_path):
    write_synthetic(tmp_path / "u", 1, (4, 16, 16, 16), seed=4)
    with pytest.raises(ConfigError, match=r"^data.crop=4: expected the model's input edge \(8x8x8"):
        HDF5Samples(tmp_path / "u", (4, 8, 8, 8), crop=4)
    with pytest.raises(ConfigError, match=r"data.path=.*whole multiple of it .*has \[4, 16, 16, 16\]"):
        HDF5Samples(tmp_path / "u", (4, 6, 6, 6))


def test_standardize_shifts_and_scales_the_log_counts(tmp_path):
    files = write_synthetic(tmp_path / "s", 1, (4, 8, 8, 8), seed=2)
    plain, _ = read_sample(files[0])
    ds = HDF5Samples(tmp_path / "s", (4, 8, 8, 8), standardize=[1.5, 0.5])
    torch.testing.assert_close(ds[0][0], (plain - 1.5) / 0.5)
    for bad in ([1.0], [1.0, 0.0], ["a", "b"]):
        with pytest.raises(ConfigError, match=r"^data.standardize="):
            HDF5Samples(tmp_path / "s", (4, 8, 8, 8), standardize=bad)


def test_counts_read_raw_and_finished_after_stacking_equal_the_host_transform_bit_for_bit(tmp_path):
    """The training reader reads the files' counts (int16: half a float's bytes to copy to a GPU) and finishes
    them where the step runs (gems.rank.data.finisher): crops, every symmetry, a rank's part and the
    standardisation give the same input, to the bit, as samples transformed one by one on the host."""
    from gems.rank.data import finisher

    write_synthetic(tmp_path / "u", 2, (4, 14, 14, 14), seed=9)
    for slices in (None, (slice(2, 7), slice(0, 7), slice(0, 4))):
        ds = HDF5Samples(tmp_path / "u", (4, 7, 7, 7), slices=slices, augment="cube", standardize=[2.0, 0.5])
        ids, syms = [3, 11, 5, 14], [0, 47, 9, 30]
        one_by_one = [ds.__getitem__(i, k) for i, k in zip(ids, syms)]  # each sample read and transformed alone
        x, y = torch.stack([a for a, _ in one_by_one]), torch.stack([t for _, t in one_by_one])
        raw, y_raw = ds.batch(ids, syms, raw=True)
        assert raw.dtype == torch.int16 and x.dtype == torch.float32 and raw.shape == x.shape
        assert torch.equal(ds.finish(raw), x) and torch.equal(y_raw, y)
        assert torch.equal(ds.batch(ids, syms)[0], x)
    # counts of other types: kept as they are where torch holds them (float64), else read as float32 (uint16,
    # which HDF5 converts as it reads into the batch's row); the same input either way, mirrored samples too
    rng = np.random.default_rng(3)
    for dtype, held in ((np.uint16, torch.float32), (np.float64, torch.float64), (np.int32, torch.int32)):
        folder = tmp_path / f"t{np.dtype(dtype).name}"
        folder.mkdir()
        for f in range(2):
            with h5py.File(folder / f"s{f}.h5", "w") as h:
                h["full"] = rng.integers(0, 40, size=(4, 8, 8, 8)).astype(dtype)
                h["unitPar"] = rng.random(4).astype(np.float32)
        typed = HDF5Samples(folder, (4, 8, 8, 8), augment="flip", standardize=[2.0, 0.5])
        raw, _ = typed.batch([0, 1], [0, 5], raw=True)
        alone = torch.stack([typed.__getitem__(0, 0)[0], typed.__getitem__(1, 5)[0]])
        assert raw.dtype == held and torch.equal(typed.finish(raw), alone), dtype
    # the reader on a CPU rank finishes in its thread (depth 1) or in the step (depth 0), and what the step gets
    # is the transformed batch
    from _prefetched import prefetched

    from gems.rank.data import _HDF5Batches

    data = _HDF5Batches(ds)
    assert finisher(data) is not None and finisher(object()) is None
    got = prefetched(data, ids, syms)
    assert len(got) == 4 and all(torch.equal(g, x) for g in got)
