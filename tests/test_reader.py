"""The parallel reader (gems.data.reader, HDF5Samples.read): positional reads of contiguous datasets on several
threads give, bit for bit, what h5py's serial reads give: hyperslabs cut in every dim, crops, steps, every
symmetry of the cube (applied after the read, where the batch is finished), 2D samples; chunked, compressed
and other-typed files fall back to h5py and still equal; the files stay open, a bounded number, closed by
close(); a forked process reads on its own threads and files."""
from __future__ import annotations

import multiprocessing
import os

import h5py
import numpy as np
import pytest
import torch

from gems.data import augment
from gems.data import reader as preader
from gems.data.hdf5 import Counts, HDF5Samples, read_sample
from gems.data.synth import write_synthetic
from gems.errors import ConfigError


def _old(ds: HDF5Samples, ids, syms):
    """The host path as it was (git show ba7c543:gems/data/hdf5.py, HDF5Samples.batch): each sample read by
    h5py from the hyperslab its symmetry takes it from, the symmetry applied on the host; (counts, targets)."""
    xs, ys = [], []
    for i, k in zip(ids, syms):
        f, hyperslab = ds._hyperslab(i, k)
        x, y = read_sample(ds.files[f], hyperslab, raw=True)
        xs.append(augment.apply(k, x))
        ys.append(y)
    return torch.stack(xs), torch.stack(ys)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(scope="module")
def cube(tmp_path_factory):
    """Two 4 x 12^3 int16 universes, cut into 6^3 crops (the crops are hyperslabs of a larger file)."""
    root = tmp_path_factory.mktemp("cube")
    write_synthetic(root, 2, (4, 12, 12, 12), seed=11)
    return root


@pytest.fixture(params=[(256, 64, 64, 1 << 16), (1000, 16, 4096, 1 << 16), (4096, 8, 1 << 16, 1 << 16),
                        (4096, 4096, 1 << 16, 0),
                        (preader.PIECE, preader.SMALL_RUN, preader.MEDIUM_RUN, preader.GAP)],
                ids=["256B", "1000B-gather", "4KiB-gather", "4KiB-no-gap", "default"])
def small_pieces(monkeypatch, request):
    """Tasks of 256, 1000 or 4096 bytes (and the default): even these small files are read by every thread, long
    runs cut in many pieces, short runs read in blocks through a buffer (one row set, or several planes and a
    share of a channel's; or, no gap read between them, a row set a block), runs of a middle size gathered by one
    call each share of a row set."""
    piece, small, medium, gap = request.param
    monkeypatch.setattr(preader, "PIECE", piece)
    monkeypatch.setattr(preader, "SMALL_RUN", small)
    monkeypatch.setattr(preader, "MEDIUM_RUN", medium)
    monkeypatch.setattr(preader, "GAP", gap)


def test_grid_finds_the_runs_of_a_c_order_hyperslab():
    shape = (4, 8, 6, 10)  # (C, D, H, W), int16
    whole = preader.grid(shape, 2, ())
    assert whole == preader.Grid(0, 4 * 8 * 6 * 10 * 2, (), ())  # one run
    depth = preader.grid(shape, 2, (slice(None), slice(2, 6)))
    assert depth == preader.Grid(2 * 60 * 2, 4 * 60 * 2, (4,), (8 * 60 * 2,))  # one run per channel
    height = preader.grid(shape, 2, (slice(None), slice(None), slice(3, 6)))
    assert height == preader.Grid(3 * 10 * 2, 3 * 10 * 2, (4, 8), (480 * 2, 60 * 2))  # per (channel, plane)
    width = preader.grid(shape, 2, (slice(1, 2), slice(None), slice(None), slice(5, 10)))
    assert width == preader.Grid((480 + 5) * 2, 5 * 2, (1, 8, 6), (480 * 2, 60 * 2, 10 * 2))  # per row
    stepped = preader.grid(shape, 2, (slice(None), slice(0, 8, 3)))
    assert stepped.counts == (4, 3) and stepped.run == 60 * 2 and stepped.strides == (480 * 2, 180 * 2)
    assert preader.grid(shape, 2, (slice(None), slice(3, 3))).nbytes == 0
    with pytest.raises(ValueError, match="steps must be positive"):
        preader.grid(shape, 2, (slice(None), slice(None, None, -1)))


@pytest.mark.parametrize("threads", [1, 3])
def test_positional_reads_equal_numpy_slicing_of_the_file(tmp_path, small_pieces, threads):
    """Any hyperslab with positive steps, read by the runs of gems.data.reader from the file's bytes, equals
    h5py's read of the same hyperslab, on one thread and on three (also for a big-endian file, whose bytes are
    swapped after the read)."""
    rng = np.random.default_rng(0)
    data = rng.integers(-3000, 3000, size=(3, 7, 6, 9)).astype(np.int16)
    for dtype in ("<i2", ">i2"):
        path = tmp_path / f"a{dtype[0] == '>'}.h5"
        with h5py.File(path, "w") as f:
            f.create_dataset("full", data=data.astype(dtype))
        with h5py.File(path, "r") as f:
            offset = f["full"].id.get_offset()
        r = preader.Reader(threads)
        cases = [(), (slice(1, 3),), (slice(None), slice(2, 5)), (slice(None), slice(None), slice(1, 4)),
                 (slice(None), slice(None), slice(None), slice(3, 8)), (slice(0, 3, 2), slice(1, 7, 2)),
                 (slice(None), slice(0, 7, 3), slice(1, 6), slice(0, 9, 4)), (slice(2, 3), slice(4, 5)),
                 (slice(None), slice(6, 7), slice(5, 6), slice(8, 9))]
        for sel in cases:
            with h5py.File(path, "r") as f:
                want = f["full"][sel] if sel else f["full"][()]
            out = np.zeros(want.shape, np.int16)
            swap = np.dtype(np.int16) if dtype == ">i2" else None
            tasks = list(preader.tasks(str(path), offset, preader.grid(data.shape, 2, sel),
                                       out.reshape(-1).view(np.uint8), swap))
            r.run(tasks)
            assert np.array_equal(out, want), (dtype, sel)
        r.close()


@pytest.mark.parametrize("cut", ["whole", "depth", "height", "width", "two dims"])
def test_every_symmetry_read_in_parallel_then_applied_equals_the_host_path(cube, small_pieces, cut):
    """The 48 symmetries of a crop (a hyperslab of a larger file) read by three threads as the hyperslab each
    comes from, into the batch's rows, and applied afterwards (Counts.oriented; on a GPU rank after the copy to
    the device), equal the old host path (read by h5py, applied on the host) bit for bit, as counts and as the
    finished input; with the standardisation too."""
    parts = {"whole": None, "depth": (slice(2, 5),), "height": (slice(0, 6), slice(1, 4)),
             "width": (slice(0, 6), slice(0, 6), slice(3, 6)), "two dims": (slice(0, 2), slice(2, 6))}[cut]
    ds = HDF5Samples(cube, (4, 6, 6, 6), slices=parts, augment="cube", standardize=[1.0, 0.5], readers=3)
    serial = HDF5Samples(cube, (4, 6, 6, 6), slices=parts, augment="cube", standardize=[1.0, 0.5], readers=1)
    ids = [(5 * k + 3) % len(ds) for k in range(48)]  # every crop of both files, every symmetry
    for chunk in range(0, 48, 6):
        i, k = ids[chunk:chunk + 6], list(range(chunk, chunk + 6))
        want, targets = _old(ds, i, k)
        counts, y = ds.read(i, k)
        assert isinstance(counts, Counts) and counts.symmetries == tuple(k)
        assert torch.equal(counts.oriented(), want) and torch.equal(y, targets)
        assert torch.equal(serial.read(i, k)[0].oriented(), want)
        assert torch.equal(ds.finish(counts), ds.finish(want))
        x, yb = ds.batch(i, k)
        assert torch.equal(x, torch.stack([ds.__getitem__(a, b)[0] for a, b in zip(i, k)])) and torch.equal(yb, y)
    ds.close()
    serial.close()


def test_flips_of_2d_samples_equal_the_host_path(tmp_path):
    write_synthetic(tmp_path, 3, (3, 10, 14), seed=2)
    for kind, parts in (("flip", None), ("flip", (slice(0, 10), slice(4, 11))), ("cube", None)):
        edges = (10, 14) if kind == "flip" else None
        if edges is None:
            write_synthetic(tmp_path / "sq", 2, (3, 12, 12), seed=3)
        folder, shape = (tmp_path, (3, 10, 14)) if edges else (tmp_path / "sq", (3, 12, 12))
        ds = HDF5Samples(folder, shape, slices=parts, augment=kind, readers=2)
        syms = list(range(ds.symmetries))
        ids = [s % len(ds) for s in syms]
        want, _ = _old(ds, ids, syms)
        assert torch.equal(ds.read(ids, syms)[0].oriented(), want), kind
        ds.close()


def test_chunked_compressed_and_big_endian_files_are_read_and_equal(tmp_path):
    """Files the positional reads cannot take (chunked, compressed) are read through h5py, beside the contiguous
    ones of the same batch (a big-endian one by position, its bytes swapped); the batch equals the host path,
    and the set says which files took the slow path (its notes: what `gems run` and `gems plan` print)."""
    rng = np.random.default_rng(5)
    counts = [rng.integers(0, 500, size=(2, 8, 8, 8)).astype(np.int16) for _ in range(5)]
    kinds = [dict(), dict(chunks=(1, 4, 8, 8)), dict(compression="gzip"), dict(dtype=">i2"), dict(shuffle=True)]
    for n, (c, kw) in enumerate(zip(counts, kinds)):
        with h5py.File(tmp_path / f"s{n}.h5", "w") as f:
            dtype = kw.pop("dtype", np.int16)
            f.create_dataset("full", data=c.astype(dtype), **kw)
            f.create_dataset("unitPar", data=rng.random(4).astype(np.float32))
    ds = HDF5Samples(tmp_path, (2, 8, 8, 8), slices=(slice(2, 7),), augment="cube", readers=4)
    ids, syms = [0, 1, 2, 3, 4, 1], [7, 0, 33, 21, 46, 5]
    counts_read, y = ds.read(ids, syms)
    want, targets = _old(ds, ids, syms)
    assert torch.equal(counts_read.oriented(), want) and torch.equal(y, targets)
    offsets = [ds._header(i).offset for i in range(5)]
    assert offsets[0] is not None and offsets[1] is None and offsets[2] is None  # contiguous, chunked, gzip
    assert offsets[3] is not None  # big-endian: read by position, its bytes swapped
    ds.close()


def test_files_stay_open_a_bounded_number_and_close(tmp_path):
    """A batch's files are opened once and kept (no open per sample), at most the reader's capacity of them;
    close() (or the set's collection) closes them, and nothing is opened before the first read."""
    import gc

    write_synthetic(tmp_path, 6, (4, 8, 8, 8), seed=1)
    base = _fds()
    ds = HDF5Samples(tmp_path, (4, 8, 8, 8), readers=2)
    assert ds.reader.open_files() == 0 and _fds() == base
    ds.read([0, 1, 2])
    assert ds._header(0).offset is not None  # gems data synth writes contiguous datasets: read by position
    assert ds.reader.open_files() == 3 and _fds() == base + 3
    for _ in range(3):
        ds.read([2, 1, 0])
    assert _fds() == base + 3  # the same three, not reopened
    ds.reader.capacity = 4
    ds.reader.close()
    ds.read(list(range(6)))  # a batch holds all its files while it reads; then at most 4 stay
    assert ds.reader.open_files() == 4 and _fds() == base + 4
    ds.close()
    assert ds.reader.open_files() == 0 and _fds() == base
    ds.read([5])  # reopens
    assert _fds() == base + 1
    del ds
    gc.collect()
    assert _fds() == base  # collected: closed


def _child(path: str, want: bytes, q) -> None:
    ds = _SHARED["ds"]
    counts, _ = ds.read([0, 1], [3, 17])
    q.put(counts.oriented().numpy().tobytes() == want and ds.reader.open_files() == 2)


_SHARED: dict = {}


def test_a_forked_process_reads_on_its_own_threads_and_files(tmp_path):
    write_synthetic(tmp_path, 2, (4, 8, 8, 8), seed=7)
    ds = HDF5Samples(tmp_path, (4, 8, 8, 8), augment="cube", readers=3)
    want = ds.read([0, 1], [3, 17])[0].oriented().numpy().tobytes()  # the parent's threads and files exist now
    _SHARED["ds"] = ds
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(str(tmp_path), want, q))
    p.start()
    got = q.get(timeout=60)
    p.join(60)
    assert got is True and p.exitcode == 0
    assert ds.reader.open_files() == 2 and torch.equal(ds.read([1])[0].data, ds.read([1])[0].data)
    ds.close()
    _SHARED.clear()


def test_a_file_that_changes_under_a_run_is_named(tmp_path):
    """Issue 65, finding 6: a file cut short, deleted, replaced or rewritten after its headers were read is bad
    input naming it (a ConfigError: exit 2), never read at its old offset nor an OSError (exit 1); so is one cut
    between that look and the read itself."""
    files = write_synthetic(tmp_path, 4, (4, 8, 8, 8), seed=3)
    ds = HDF5Samples(tmp_path, (4, 8, 8, 8), readers=2)
    ds.read([0, 1, 2, 3])
    with open(files[0], "r+b") as h:
        h.truncate(ds._header(0).offset + 1000)  # its counts' first 1000 bytes left
    with pytest.raises(ConfigError, match=r"^data.path=.*: expected files that stay as they were .*; "
                                          r"sample_00000\.h5 \(file 1 of 4\) was cut short"):
        ds.read([0])
    files[1].unlink()
    with pytest.raises(ConfigError, match=r"sample_00001\.h5 \(file 2 of 4\) is gone"):
        ds.read([1])
    (other,) = write_synthetic(tmp_path / "other", 1, (4, 8, 8, 8), seed=9)
    os.replace(other, files[2])  # another sample renamed over it: same size, another inode
    with pytest.raises(ConfigError, match=r"sample_00002\.h5 \(file 3 of 4\) was replaced by another file"):
        ds.read([2])
    before = files[3].stat().st_mtime_ns
    with open(files[3], "r+b") as h:  # rewritten in place
        h.seek(ds._header(3).offset)
        h.write(b"\x01\x02")
    os.utime(files[3], ns=(before + 10**9, before + 10**9))
    with pytest.raises(ConfigError, match=r"sample_00003\.h5 \(file 4 of 4\) was rewritten"):
        ds.read([3])
    ds.close()
    # cut between the look at the file and the read: the short read names it too
    files = write_synthetic(tmp_path / "late", 1, (4, 8, 8, 8), seed=3)
    late = HDF5Samples(tmp_path / "late", (4, 8, 8, 8), readers=2)
    late._header(0)
    with open(files[0], "r+b") as h:
        h.truncate(late._header(0).offset + 1000)
    late.still = lambda *a: None  # the look passed before the cut (gems.data.layouts.FileSamples.still)
    with pytest.raises(ConfigError, match=r"sample_00000\.h5 \(file 1 of 1\) could not be read as its headers "
                                          r"said \(OSError: .*ends at byte"):
        late.read([0])
    late.close()


def test_the_prefetcher_finishes_counts_read_with_their_symmetries(cube):
    """A rank's reader hands the Prefetcher Counts (raw=True); it finishes them, in its thread or in the
    step, into the batch the host path gives."""
    from _prefetched import prefetched

    from gems.rank.data import _HDF5Batches

    ds = HDF5Samples(cube, (4, 6, 6, 6), slices=(slice(1, 5),), augment="cube", readers=2)
    data = _HDF5Batches(ds)
    ids, syms = [3, 9, 14], [0, 41, 22]
    want = ds.finish(_old(ds, ids, syms)[0])
    raw, _ = data.batch(ids, symmetries=syms, raw=True)
    assert isinstance(raw, Counts) and not raw.is_cuda
    moved = raw.to(torch.device("cpu"))
    assert isinstance(moved, Counts) and moved.symmetries == raw.symmetries
    got = prefetched(data, ids, syms)
    assert len(got) == 4 and all(torch.equal(g, want) for g in got)
    ds.close()


def test_data_readers_must_be_a_positive_count(capsys):
    from gems.cli import main
    from gems.errors import ConfigError

    for bad in ("0", "-2", "two"):
        assert main(["run", f"data.readers={bad}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"data.readers={bad}" in err[0], err
    with pytest.raises(ConfigError, match=r"^data.readers=0: expected a positive number"):
        HDF5Samples(write_synthetic_once(), (4, 8, 8, 8), readers=0)


def write_synthetic_once():
    import tempfile

    root = tempfile.mkdtemp(prefix="gems-readers-")
    write_synthetic(root, 1, (4, 8, 8, 8), seed=0)
    return root


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU rank's path: pinned batches, the copy on a side stream")
def test_on_a_gpu_the_symmetries_are_applied_after_the_copy_and_equal_the_host_path(cube):
    """A GPU rank's reader: counts read into pinned memory, copied on the Prefetcher's side stream as Counts,
    oriented and transformed on the GPU: the same input as the host path's counts (read by h5py, turned on the
    host) transformed on the GPU, bit for bit (the transform's float rounding is the device's either way)."""
    from gems.rank.data import Prefetcher, _HDF5Batches, finisher

    device = torch.device("cuda", torch.cuda.current_device())
    ds = HDF5Samples(cube, (4, 6, 6, 6), slices=(slice(1, 5),), augment="cube", standardize=[1.0, 0.5], readers=3)
    data = _HDF5Batches(ds, pin=True)
    ids, syms = [3, 9, 14, 0], [0, 41, 22, 47]
    want = ds.finish(_old(ds, ids, syms)[0].to(device)).cpu()
    raw, _ = data.batch(ids, symmetries=syms, raw=True)
    assert isinstance(raw, Counts) and raw.data.is_pinned()
    pf = Prefetcher(lambda step: ([step], data.batch(ids, symmetries=syms, raw=True)[0], None), [0, 1], 1, device,
                    finisher(data))
    try:
        for step in (0, 1):
            (_, got, _), _ = pf.get(step)
            assert got.is_cuda and torch.equal(got.cpu(), want)
    finally:
        pf.close()
    ds.close()
