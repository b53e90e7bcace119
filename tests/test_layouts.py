"""The HDF5 layouts of issue 65 (gems.data.layouts): files written as the published tools write them (h5py,
their layouts, types and byte order) are detected, read where they lie and give the samples of the same values
in gems's own layout, bit for bit; and the findings of the issue's read of the reader, each mended."""
from __future__ import annotations

import os
import resource
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from gems.data import layouts
from gems.data import reader as preader
from gems.data.hdf5 import HDF5Samples, read_sample
from gems.errors import ConfigError

EDGE = 12  # a universe of 12^3 cells, cut into crops of 6^3


def _universes(n: int = 2, edge: int = EDGE, seed: int = 0, dtype=np.int16):
    """(counts (4, edge, edge, edge), unitPar) of ``n`` universes: Poisson counts, as ExaLearn's int16."""
    rng = np.random.default_rng(seed)
    return [(rng.poisson(rng.uniform(2, 40), size=(4, edge, edge, edge)).astype(dtype),
             rng.uniform(-1, 1, 4).astype(np.float32)) for _ in range(n)]


@pytest.fixture(scope="module")
def same(tmp_path_factory):
    """The same universes in ExaLearn's layout (channels last, .hdf5) and in gems's own (channels first, .h5)."""
    root = tmp_path_factory.mktemp("same")
    values = _universes()
    layouts.get("exalearn").write(root / "exalearn", values, "univ_ics_2019-03_a{:07d}")
    layouts.get("gems").write(root / "gems", values)
    return root, values


def test_each_layout_is_detected_from_its_files_and_a_wrong_or_ambiguous_one_names_the_key(same, tmp_path):
    root, values = same
    assert layouts.detect(root / "exalearn").name == "exalearn" and layouts.detect(root / "gems").name == "gems"
    with h5py.File(sorted((root / "exalearn").iterdir())[0]) as f:  # as NERSC's: no attribute of gems's
        assert f["full"].shape == (EDGE, EDGE, EDGE, 4) and f["full"].dtype == np.int16 and not dict(f.attrs)
        assert f["full"].id.get_create_plist().get_layout() == h5py.h5d.CONTIGUOUS
    files = layouts.get("lbann").write(tmp_path / "lbann", values)
    assert [f.name for f in files] == ["universe_00000_0_0_0.hdf5", "universe_00001_0_0_0.hdf5"]
    assert layouts.detect(tmp_path / "lbann").name == "lbann"
    with pytest.raises(ConfigError, match=r"^data.layout=lbann: expected the layout of the files at data.path=.*"
                                          r"\(they look like exalearn\)"):
        layouts.detect(root / "exalearn", "lbann")
    with pytest.raises(ConfigError, match=r"^data.layout=hdf6: expected one of .*exalearn.*gems.*lbann"):
        layouts.detect(root / "exalearn", "hdf6")
    odd = tmp_path / "odd"  # a cube of 4 cells with 4 channels: either end may be the channels
    odd.mkdir()
    with h5py.File(odd / "a.h5", "w") as f:
        f["full"], f["unitPar"] = np.ones((4, 4, 4, 4), np.int16), np.zeros(4, np.float32)
    with pytest.raises(ConfigError, match=r"^data.layout=None: expected one of exalearn, gems: the files at "
                                          r"data.path=.* fit each of them, so name theirs"):
        layouts.detect(odd)
    assert layouts.detect(odd, "exalearn").name == "exalearn" and layouts.detect(odd, "gems").name == "gems"
    from _cli import gems

    out = gems("run", "data=hdf5", f"data.path={odd}", f"results.dir={tmp_path / 'res'}", timeout=300)
    assert out.returncode == 2 and out.stderr.startswith("gems: error: data.layout=None: expected one of exalearn, "
                                                         "gems") and len(out.stderr.strip().splitlines()) == 1, out.stderr
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "x.h5").write_bytes(b"not HDF5")
    with pytest.raises(ConfigError, match=r"^data.path=.*: expected a folder \(or file\) of samples in a layout gems "
                                          r"reads .*x\.h5 is none of them"):
        layouts.detect(tmp_path / "none")


@pytest.mark.parametrize("cut", [None, (slice(0, 3),), (slice(2, 6), slice(1, 4)), (slice(0, 6), slice(0, 6), slice(2, 5))],
                         ids=["whole", "depth", "two dims", "width"])
def test_an_exalearn_universe_reads_as_the_same_values_in_gems_layout(same, cut):
    """Crops of a channels-last universe, a rank's part of each under every symmetry, read by position (a depth
    slab one run a crop row) and finished (channels moved to the front in the conversion's pass) equal the same
    values in gems's own layout, bit for bit, as counts and as the network's input."""
    root, _ = same
    kw = dict(slices=cut, augment="cube", standardize=[1.0, 0.5], readers=2)
    a, b = HDF5Samples(root / "exalearn", (4, 6, 6, 6), **kw), HDF5Samples(root / "gems", (4, 6, 6, 6), **kw)
    assert a.layout.name == "exalearn" and b.layout.name == "gems" and len(a) == len(b) == 16
    assert all(a._header(i).offset is not None for i in range(2))  # contiguous: read by position
    ids, syms = [(5 * k + 3) % 16 for k in range(12)], [0, 47, 9, 30, 1, 2, 8, 16, 33, 40, 5, 21]
    ra, ya = a.read(ids, syms)
    rb, yb = b.read(ids, syms)
    assert ra.channels_last and not rb.channels_last and torch.equal(ya, yb)
    assert torch.equal(ra.oriented(), rb.oriented()) and torch.equal(a.finish(ra), b.finish(rb))
    assert torch.equal(a.batch(ids, syms)[0], torch.stack([b.__getitem__(i, k)[0] for i, k in zip(ids, syms)]))
    a.close()
    b.close()


def test_a_channels_last_depth_slab_is_one_run_and_the_whole_universe_and_its_crops_come_from_the_same_files(same):
    root, values = same
    assert preader.grid((512, 512, 512, 4), 2, (slice(128, 256),)).counts == ()  # one run: 128 x 512^2 x 4 values
    assert preader.grid((4, 512, 512, 512), 2, (slice(None), slice(128, 256))).counts == (4,)  # a run a channel
    whole = HDF5Samples(root / "exalearn", (4, EDGE, EDGE, EDGE))  # the paper's study: a universe a sample
    crops = HDF5Samples(root / "exalearn", (4, 6, 6, 6), crop=6)  # MLPerf's: crops of data.crop
    x, y = whole.batch([1])
    counts, par = values[1]
    assert torch.equal(x[0], torch.log1p(torch.from_numpy(counts).float())) and torch.equal(y[0], torch.from_numpy(par))
    part, _ = crops.batch([8 + 5])  # universe 1, crop (1, 0, 1)
    assert torch.equal(part[0], x[0][:, 6:12, 0:6, 6:12])
    whole.close()
    crops.close()


def test_lbann_crops_are_the_universe_transposed(tmp_path):
    """LBANN's split script transposes the whole (D, H, W, C) array: its crops come channels first with the spatial
    axes reversed, float32 (or int16); gems reads their axes as they lie, so a crop is the transpose of the same
    cells read from the universe (docs/data.md)."""
    values = _universes(1, edge=6)
    for dtype in (np.float32, np.int16):
        folder = tmp_path / np.dtype(dtype).name
        (f,) = layouts.get("lbann").write(folder, values, dtype=dtype)
        with h5py.File(f) as h:
            assert h["full"].dtype == dtype and h["full"].shape == (4, 6, 6, 6)
        ds = HDF5Samples(folder, (4, 6, 6, 6), slices=(slice(0, 3),))
        assert ds.layout.name == "lbann" and ds.file_dtype == dtype
        counts = torch.from_numpy(values[0][0].astype(np.float32))
        want = torch.log1p(counts.permute(0, 3, 2, 1))[:, 0:3]  # depth of the file = the universe's width
        assert torch.equal(ds.batch([0])[0][0], want)
        ds.close()


# ---------------------------------------------------------------------------- the findings of issue 65
def test_finding_1_a_full_reached_through_an_external_link_is_read_from_the_file_that_holds_it(tmp_path, monkeypatch):
    values = _universes(1, edge=6)
    counts = values[0][0]
    with h5py.File(tmp_path / "data.h5", "w") as f:
        f.create_dataset("padding", data=np.full(5000, 7, np.int16))  # the counts lie elsewhere than in the link's file
        f["full"] = counts
    (tmp_path / "set").mkdir()
    with h5py.File(tmp_path / "set" / "s.h5", "w") as f:
        f["full"] = h5py.ExternalLink(str(tmp_path / "data.h5"), "/full")
        f["unitPar"] = values[0][1]
    ds = HDF5Samples(tmp_path / "set", (4, 6, 6, 6), readers=2)
    head = ds._header(0)
    assert head.offset is not None and head.source == str(tmp_path / "data.h5")
    assert torch.equal(ds.read([0])[0].data[0], torch.from_numpy(counts))
    ds.close()
    # a relative data.path and a relative link, as a user types them
    (tmp_path / "rel").mkdir()
    with h5py.File(tmp_path / "rel" / "s.h5", "w") as f:
        f["full"] = h5py.ExternalLink("../data.h5", "/full")
        f["unitPar"] = values[0][1]
    layouts.get("gems").write(tmp_path / "plain", values)
    monkeypatch.chdir(tmp_path)
    for folder in ("set", "rel", "plain"):
        ds = HDF5Samples(folder, (4, 6, 6, 6), readers=2)
        assert ds._header(0).source == str(tmp_path / ("plain/sample_00000.h5" if folder == "plain" else "data.h5"))
        assert torch.equal(ds.read([0])[0].data[0], torch.from_numpy(counts))
        ds.close()


def test_finding_2_a_big_endian_first_file_keeps_the_int16_batch_and_the_positional_reads(tmp_path):
    values = _universes(3, edge=6)
    for i, (c, p) in enumerate(values):
        with h5py.File(tmp_path / f"s{i}.h5", "w") as f:
            f["full"] = c.astype(">i2" if i != 1 else "<i2")
            f["unitPar"] = p
    ds = HDF5Samples(tmp_path, (4, 6, 6, 6), readers=2)
    assert ds.file_dtype == np.int16 and all(ds._header(i).offset is not None for i in range(3))
    counts, _ = ds.read([0, 1, 2])
    assert counts.data.dtype == torch.int16 and torch.equal(counts.data, torch.from_numpy(np.stack([c for c, _ in values])))
    ds.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_finding_3_chunked_and_compressed_files_are_read_on_the_threads_and_said(tmp_path, threads):
    """A chunked file, gzip-compressed or not, shuffled or not, big-endian or not, is read chunk by chunk on the
    reader's threads (each chunk's bytes by position, inflated and unshuffled here, not under h5py's lock); a
    filter gems does not undo (lzf) goes through h5py. Any part of any of them equals h5py's read, and the set
    says which files took which path (its notes: the run's record and `gems plan` print them); a corrupt
    deflate stream is bad input naming the file."""
    values = _universes(6, edge=6)
    kinds = [{}, dict(chunks=(2, 4, 6, 5)), dict(compression="gzip", chunks=(1, 3, 3, 3)),
             dict(compression="gzip", shuffle=True, dtype=">i2"), dict(compression="lzf"),
             dict(shuffle=True, chunks=(4, 6, 6, 6))]
    for i, ((c, p), kw) in enumerate(zip(values, kinds)):
        kw = dict(kw)
        with h5py.File(tmp_path / f"s{i}.h5", "w") as f:
            f.create_dataset("full", data=c.astype(kw.pop("dtype", np.int16)), **kw)
            f["unitPar"] = p
    want = torch.from_numpy(np.stack([c for c, _ in values]))
    for cut in (None, (slice(1, 5), slice(2, 6))):
        ds = HDF5Samples(tmp_path, (4, 6, 6, 6), slices=cut, augment="cube", readers=threads)
        ids, syms = list(range(6)), [0, 5, 17, 33, 47, 2]
        counts, _ = ds.read(ids, syms)
        ref = torch.stack([ds.__getitem__(i, k)[0] for i, k in zip(ids, syms)])  # h5py's, transformed on the host
        assert torch.equal(ds.finish(counts), ref)
        assert [ds._header(i).chunks is not None for i in ids] == [False, True, True, True, False, True]
        ds.close()
    assert torch.equal(HDF5Samples(tmp_path, (4, 6, 6, 6)).read(list(range(6)))[0].data, want)
    notes = ds.notes()
    assert any("1 file(s) chunked, read chunk by chunk on data.readers threads" in n for n in notes), notes
    assert any("1 file(s) compressed (deflate), read chunk by chunk" in n for n in notes), notes
    assert any("1 file(s) compressed (shuffle, deflate), read chunk by chunk" in n for n in notes), notes
    assert any("1 file(s) compressed (lzf), read through h5py one at a time" in n for n in notes), notes
    # a deflate stream cut in one chunk: named, exit 2
    head = ds._header(2)
    _, at, size, _ = head.chunks.index[3]
    with open(tmp_path / "s2.h5", "r+b") as h:
        h.seek(at + size // 2)
        h.write(bytes(4))
    st = (tmp_path / "s2.h5").stat()
    bad = HDF5Samples(tmp_path, (4, 6, 6, 6), readers=threads)
    with pytest.raises(ConfigError, match=r"s2\.h5 \(file 3 of 6\) could not be read as its headers said .*does "
                                          r"not inflate"):
        bad.read([2])
    assert st.st_size == (tmp_path / "s2.h5").stat().st_size
    bad.close()


def test_finding_4_a_file_of_another_type_is_named(tmp_path):
    values = _universes(3, edge=6)
    for i, (c, p) in enumerate(values):
        with h5py.File(tmp_path / f"s{i}.h5", "w") as f:
            f["full"] = c.astype(np.float32) + 0.7 if i == 2 else c
            f["unitPar"] = p
    ds = HDF5Samples(tmp_path, (4, 6, 6, 6))
    with pytest.raises(ConfigError, match=r"^data.path=.*: expected `full` of the first file's type, int16 \(mixed "
                                          r"types would be converted.*; s2.h5 \(file 3 of 3\) has `full` of dtype float32$"):
        ds.check_all()
    with pytest.raises(ConfigError, match=r"s2.h5 \(file 3 of 3\)"):
        ds.read([2])


def test_unwritten_chunks_read_as_the_datasets_fill_value(tmp_path):
    """A chunked file of which some chunks were never written: those read as the dataset's fill value, as h5py
    reads them (they were taken for 0)."""
    with h5py.File(tmp_path / "s0.h5", "w") as f:
        ds = f.create_dataset("full", shape=(4, 6, 6, 6), dtype=np.int16, chunks=(1, 3, 6, 6), fillvalue=7)
        ds[1, :3] = 1  # one chunk of 8
        f["unitPar"] = np.zeros(4, np.float32)
        want = torch.from_numpy(ds[()])
    s = layouts.detect(tmp_path).open(tmp_path, (4, 6, 6, 6))
    assert s._header(0).chunks is not None and not s._header(0).chunks.complete((4, 6, 6, 6))
    assert torch.equal(s.read([0])[0].data[0], want) and int(want[0, 0, 0, 0]) == 7
    s.close()


def test_universes_in_subfolders_are_named_in_the_message(tmp_path):
    """MLPerf's prepare.py walks a tree of universe folders; gems reads one folder: a data.path that holds only
    subfolders of sample files says so and names them (it said only that it is no layout gems reads)."""
    from gems.config import compose
    from gems.models import build_model
    from gems.rank.data import make_data

    for sub in ("a", "b"):
        layouts.get("exalearn").write(tmp_path / sub, _universes(2, edge=6), "univ_" + sub + "{:03d}")
    (tmp_path / "notes").mkdir()
    cfg = compose(["model.size=32", "data=hdf5", f"data.path={tmp_path}"], check=False)
    with pytest.raises(ConfigError) as e:
        make_data(cfg, build_model(cfg.model))
    assert e.value.key == "data.path" and "it holds no sample file, but 2 subfolder(s) of them: a/ (2 .hdf5 file(s)), " \
        "b/ (2 .hdf5 file(s)). gems reads the files of one folder, not its subfolders" in str(e.value), str(e.value)


def test_finding_5_a_batch_of_more_files_than_the_process_may_open_is_read(tmp_path):
    values = _universes(1, edge=2)
    n = 80
    layouts.get("gems").write(tmp_path, values * n)
    ds = HDF5Samples(tmp_path, (4, 2, 2, 2), readers=2)
    for i in range(n):
        ds._header(i)  # (the headers are read once, by h5py, before a batch)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 40, hard))  # 80 files at once would not open
    try:
        counts, _ = ds.read(list(range(n)))
        assert ds.reader.open_files() <= (open_now + 40) // 4
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert torch.equal(counts.data, torch.from_numpy(np.stack([values[0][0]] * n)))
    ds.close()


def test_finding_7_data_readers_are_capped_by_a_slurm_tasks_cpus(monkeypatch):
    assert layouts.reader_threads(4, cpus=1) == (1, layouts.reader_threads(4, cpus=1)[1])
    n, why = layouts.reader_threads(4, cpus=1)
    assert n == 1 and why.startswith("data.readers=4 capped to 1: a Slurm task of 1 CPU(s) (cluster.cpus_per_task)")
    assert layouts.reader_threads(2, cpus=8) == (2, None)
    for k in ("SLURM_JOB_ID", "SLURM_CPUS_PER_TASK"):
        monkeypatch.delenv(k, raising=False)
    assert layouts.reader_threads(4) == (4, None)  # no Slurm task: as asked
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    assert layouts.reader_threads(4)[0] == 1


def test_finding_7_the_run_reads_on_the_capped_threads_and_says_so(tmp_path, monkeypatch):
    from gems.config import compose
    from gems.models import build_model
    from gems.rank.data import data_notes, make_data

    layouts.get("exalearn").write(tmp_path, _universes(1, edge=32))
    cfg = compose(["model.size=32", "data=hdf5", f"data.path={tmp_path}", "data.readers=4"], check=False)
    spec = build_model(cfg.model)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    data = make_data(cfg, spec)
    assert data.samples.reader.threads == 1
    notes = data_notes(cfg, data)
    assert notes[0].startswith("data: 1 file(s) of layout exalearn") and "data.readers=4 capped to 1" in notes[1]


def test_finding_8_finishing_a_batch_makes_one_full_size_tensor(same):
    """The transform ran on up to four full-size float32 temporaries; the finish now makes its result only (the
    symmetry's flip of one row aside), the channels moved and the type converted in the one copy."""
    from torch.profiler import ProfilerActivity, profile

    root, _ = same
    ds = HDF5Samples(root / "exalearn", (4, EDGE, EDGE, EDGE), augment="cube", standardize=[1.0, 0.5])
    counts, _ = ds.read([0, 1], [5, 0])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x = ds.finish(counts)
    made = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0 and not e.cpu_children)
    row = counts.data[0].numel() * counts.data.element_size()
    assert x.numel() * 4 <= made <= x.numel() * 4 + row + 1024, (made, x.numel() * 4)  # (+ a few small ones)
    ds.close()


def test_a_rank_error_from_bad_input_is_exit_2():
    """A file that changes under a run fails its rank with a ConfigError (test_reader): `gems run` exits 2."""
    from gems.cli import failed_status

    assert failed_status({"status": "failed", "failure": {"kind": "rank_error", "exception": "ConfigError"}}) == 2
    assert failed_status({"status": "failed", "failure": {"kind": "rank_error", "exception": "OSError"}}) == 1
    assert failed_status({"status": "failed", "failure": {"kind": "signal"}}) == 1


def test_read_sample_of_either_order(same):
    root, values = same
    a = sorted((root / "exalearn").iterdir())[0]
    x, y = read_sample(a, (slice(1, 4),), raw=True, channels="last")
    assert torch.equal(x, torch.from_numpy(values[0][0][:, 1:4]))


# ---------------------------------------------------------------------------- end to end: gems run and gems plan
RUN = ["model.size=32", "model.width=0.25", "train.batch_size=4", "train.steps=3", "train.warmup_steps=1",
       "data=hdf5", "data.crop=32", "data.augment=cube"]


def _run(tmp, folder, *args):
    from _cli import gems_here, records

    out = gems_here("run", *RUN, f"data.path={folder}", f"results.dir={tmp}", *args)
    assert out.returncode == 0, out.stderr[-2000:]
    (rec,) = records(str(tmp))
    return rec


def test_published_layouts_train_through_gems_run_and_s2_equals_s1(tmp_path):
    """Files written as ExaLearn's (h5py, channels last, int16) and LBANN's split script (float32, CDHW transposed)
    write them train through `gems run`, 64^3 universes cut into 32^3 crops with every symmetry drawn: on one rank
    and on S = 2 (each rank reading its depth slab), S = 2 equal to S = 1 to float rounding; an ExaLearn universe
    and the same values in gems's own layout give the same losses, to the bit; the record names the layout."""
    values = _universes(2, edge=64, seed=3)
    layouts.get("exalearn").write(tmp_path / "exalearn", values)
    layouts.get("gems").write(tmp_path / "gems", values)
    layouts.get("lbann").write(tmp_path / "lbann", [(c[:, :32, :32, :32], p) for c, p in values] * 2)
    one = _run(tmp_path / "r1", tmp_path / "exalearn")
    two = _run(tmp_path / "r2", tmp_path / "exalearn", "parallel.spatial=2")
    own = _run(tmp_path / "r3", tmp_path / "gems")
    assert one["loss"] == own["loss"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-6)
    assert any(n.startswith("data: 2 file(s) of layout exalearn") for n in one["notes"]), one["notes"]
    lb1 = _run(tmp_path / "l1", tmp_path / "lbann")
    lb2 = _run(tmp_path / "l2", tmp_path / "lbann", "parallel.spatial=2")
    assert lb2["loss"] == pytest.approx(lb1["loss"], rel=1e-5, abs=1e-6)
    assert any(n.startswith("data: 4 file(s) of layout lbann") for n in lb1["notes"]), lb1["notes"]


@pytest.mark.parametrize("how", ["rewritten", "cut short", "deleted"])
def test_finding_6_a_file_that_changes_under_gems_run_ends_it_with_exit_2_naming_the_file(tmp_path, how):
    """Finding 6 end to end: `gems run` reads ExaLearn's universes a batch a step (no read ahead); once its second
    step is done every file is rewritten by h5py in place (a data set written anew where it lies: the same size),
    cut short, or deleted. The run ends with exit 2 and one line naming the key and a file, no traceback, and its
    record says bad input (not exit 1 and a rank's OSError, nor a silent read at the old offsets); what it trained
    is kept (its checkpoint and model file)."""
    import subprocess
    import sys
    import time

    from _cli import records

    folder = tmp_path / "universes"
    values = _universes(4, edge=32, seed=5)
    files = layouts.get("exalearn").write(folder, values)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "gems.cli", "run", "model.size=32", "model.width=0.25",
                          "train.batch_size=2", "train.steps=400", "train.warmup_steps=1", "data=hdf5",
                          f"data.path={folder}", "data.prefetch=0", "fault.step_delay_s=0.2",
                          f"results.dir={tmp_path / 'out'}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    t0 = time.monotonic()
    while not any("gems: step 2/" in log.read_text(errors="replace")
                  for log in (tmp_path / "out").glob(".jobs/*/rank0.log")):
        assert p.poll() is None and time.monotonic() - t0 < 300, "the run ended or hung before its second step"
        time.sleep(0.2)
    for f, (counts, target) in zip(files, values[::-1]):
        if how == "rewritten":
            with h5py.File(f, "w") as h:  # truncated and written again, as a data set made anew
                h["full"] = np.moveaxis(counts, 0, -1)
                h["unitPar"] = target
        elif how == "cut short":
            os.truncate(f, f.stat().st_size // 2)
        else:
            f.unlink()
    _, err = p.communicate(timeout=300)
    lines = err.strip().splitlines()
    assert p.returncode == 2, err[-3000:]
    assert lines[-1].startswith("gems: error: ") and "failed: data.path=" in lines[-1], err[-3000:]
    assert "Traceback" not in err and "expected files that stay as they were" in lines[-1], err[-3000:]
    assert any(f.name in lines[-1] for f in files) or how == "deleted" and "universes" in lines[-1], lines[-1]
    (rec,) = records(str(tmp_path / "out"))
    assert rec["status"] == "failed" and rec["failure"]["exception"] == "ConfigError", rec["failure"]
    # (issue 71: what it trained is kept, its checkpoint and model file, the step it reached said)
    assert "kept its checkpoint" in lines[-1] and Path(rec["model_file"]).is_file() and rec["failure"]["step"] >= 2


def test_gems_plan_names_each_layout_and_times_its_read_rate(tmp_path):
    """`gems plan` on files names their layout and prices their read at the rate it times on them (its samples'
    own read), and says a slower path (a compressed file, read chunk by chunk)."""
    from gems.config import compose
    from gems.plan.make import make_plan

    values = _universes(2, edge=32, seed=1)
    layouts.get("exalearn").write(tmp_path / "exalearn", values)
    layouts.get("lbann").write(tmp_path / "lbann", values)
    with h5py.File(tmp_path / "lbann" / "slow_0_0_0.hdf5", "w") as f:
        f.create_dataset("full", data=values[0][0].astype(np.float32), compression="gzip")
        f["unitPar"] = values[0][1]
    for name in ("exalearn", "lbann"):
        cfg = compose(["model.size=32", "train.batch_size=2", "data=hdf5", f"data.path={tmp_path / name}",
                       "data.readers=2", "data.prefetch=0"])
        pr = make_plan(cfg, suggest=False).prediction
        (said,) = [a for a in pr.assumptions if a.startswith("data read by 2 reader thread(s) timed here")]
        assert f"layout {name}, from the page cache" in said and said.endswith(" GB/s"), said
        assert ("1 file(s) compressed (deflate), read chunk by chunk on data.readers threads" in said) == (name == "lbann"), said
        rate = float(said.rsplit(": ", 1)[1].split(" GB/s")[0]) * 1e9
        itemsize = 2 if name == "exalearn" else 4
        assert pr.breakdown["data"] == pytest.approx(2 * 4 * 32 ** 3 * itemsize / rate, rel=0.01)


def test_the_plan_prices_crops_of_universes_it_cannot_time_by_the_bytes_the_reader_reads():
    """Where no file is at hand, MLPerf's 128^3 crops of ExaLearn's 512^3 universes were priced at a whole file's
    rate (4.4 GB/s a thread); a crop's rows are 1 KiB runs 4 KiB apart, and the reader reads 4x its bytes: the
    plan's rate is the whole file's times that share, one rule with gems bench data's crop row
    (gems.data.reader.read_share), and says so. The reader no longer reads over the gaps between a crop's planes
    (64^3 crops of 256^3 read 10x their bytes)."""
    from gems.config import compose
    from gems.plan.make import make_plan

    assert layouts.get("exalearn").fallback_rate((4, 128, 128, 128))[1] == (
        "128x128x128 crops of the published 512x512x512 files: a part's rows are 1024 B runs 4096 B apart, the "
        "reader reads 4x its bytes")
    cfg = compose(["model.size=32", "model.width=0.25", "train.batch_size=2", "data=hdf5",
                   "data.path=/nowhere/universes", "data.layout=exalearn", "data.readers=1", "data.prefetch=0"])
    pr = make_plan(cfg, suggest=False).prediction
    (said,) = [a for a in pr.assumptions if a.startswith("data read by 1 reader thread(s) at")]
    share = (32 * 256) / (31 * 4096 + 256)
    assert said.startswith(f"data read by 1 reader thread(s) at {layouts.THREAD_RATE * share / 1e9:.2g} GB/s each "
                           "(layout exalearn, 32x32x32 crops of the published 512x512x512 files: a part's rows are "
                           "256 B runs 4096 B apart, the reader reads 16x its bytes"), said
    assert pr.breakdown["data"] == pytest.approx(2 * 4 * 32 ** 3 * 2 / (layouts.THREAD_RATE * share), rel=1e-6)
    assert preader.read_share((256, 256, 256, 4), 2, [slice(0, 64)] * 3)[0] == pytest.approx(
        64 * 512 / (63 * 2048 + 512))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU rank's copy with data.prefetch=0")
def test_finding_8_with_prefetch_0_a_gpu_rank_copies_the_counts_and_finishes_them_on_its_gpu(same):
    """Read in the step (data.prefetch=0), a GPU rank's counts are copied as they are (int16, channels last,
    from pinned memory) and finished on its GPU, not made float32 on the host and copied from pageable memory;
    the input equals the same counts copied and finished on the GPU by hand, bit for bit."""
    from gems.rank.data import Prefetcher, _HDF5Batches

    root, _ = same
    device = torch.device("cuda", torch.cuda.current_device())
    ds = HDF5Samples(root / "exalearn", (4, 6, 6, 6), slices=(slice(1, 5),), augment="cube", standardize=[1.0, 0.5])
    data = _HDF5Batches(ds, pin=True)
    ids, syms = [3, 9, 14, 0], [0, 41, 22, 47]
    seen = []

    def finish(x):
        seen.append((x.is_cuda, x.data.dtype))
        return data.finish(x)

    pf = Prefetcher(lambda step: ([step], data.batch(ids, symmetries=syms, raw=True)[0], None), [0], 0, device, finish)
    try:
        (_, got, _), _ = pf.get(0)
    finally:
        pf.close()
    assert seen == [(True, torch.int16)] and got.is_cuda
    want = ds.finish(ds.read(ids, syms)[0].to(device))
    assert torch.equal(got, want)
    ds.close()


def test_the_data_packages_modules_import_one_another_in_no_circle():
    """Within gems.data, one unit of the layer map (tests/test_layers.py), no module imports, at its top or lazily,
    one that imports it back (issue 78: gems.data.hdf5 and gems.data.layouts, nifti and tiles did)."""
    import ast

    from test_layers import ROOT, circle

    files = sorted((ROOT / "gems" / "data").rglob("*.py"))
    names = {f: ".".join(f.relative_to(ROOT).with_suffix("").parts[:-1 if f.name == "__init__.py" else None])
             for f in files}
    modules = set(names.values())
    graph: dict[str, set[str]] = {}
    for f, me in names.items():
        package = me.split(".") if f.name == "__init__.py" else me.split(".")[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]) if node.level else node.module
                found = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else str(base) for a in node.names]
            else:
                continue
            graph.setdefault(me, set()).update(t for t in found if t in modules and t != me)
    assert len(graph) > 10 and "gems.data.hdf5" in graph["gems.data.layouts._h5"]  # (the reading found them)
    assert circle(graph) is None, circle(graph)
