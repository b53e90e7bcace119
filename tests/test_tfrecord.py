"""MLPerf HPC's CosmoFlow TFRecords (gems.data.layouts.tfrecord, gems.data.convert): files written by TensorFlow's own
TFRecordWriter as MLPerf's prepare.py uses it, gzip and plain (tests/data/tfrecord, made by
scripts/tfrecord_fixtures.py), are read without TensorFlow bit for bit, every record's CRC checked; bad files are
named; `gems data convert` writes their samples into ExaLearn's channels-last HDF5 bit for bit, resumably; and the
files train through `gems run`, read where they lie and converted, on one rank and cut over S = 2, alike."""
from __future__ import annotations

import gzip
import importlib.util
import shutil
import struct
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from _cli import gems, gems_here, records

from gems.config import compose
from gems.data import layouts
from gems.data.layouts import tfrecord as tfr
from gems.errors import ConfigError

DATA = Path(__file__).parent / "data" / "tfrecord"
_spec = importlib.util.spec_from_file_location("tfrecord_fixtures", Path(__file__).parents[1] / "scripts" /
                                               "tfrecord_fixtures.py")
fixtures = importlib.util.module_from_spec(_spec)  # the arrays TensorFlow wrote, made again
_spec.loader.exec_module(fixtures)  # type: ignore[union-attr]


def _expected(path: Path) -> tuple[np.ndarray, np.ndarray]:
    universe, index = path.name[len("univ_ics_2019-03_a"):-len(".tfrecord")].split("_")
    return fixtures.crop(int(universe), int(index))


@pytest.mark.parametrize("kind", ["plain", "gzip"])
def test_tensorflows_files_are_read_bit_for_bit(kind: str) -> None:
    layout = layouts.detect(DATA / kind / "train")
    assert layout.name == "tfrecord"
    files = layout.files(DATA / kind / "train")
    assert len(files) == 4 and all(tfr.compression(f) == ("none" if kind == "plain" else "gzip") for f in files)
    for f in files:
        rec = tfr.read_file(f)
        x, y = _expected(f)
        assert rec.x.dtype == np.dtype("<i2") and np.array_equal(rec.x, x) and np.array_equal(rec.y, y)
    # a rank's part of each sample, channels moved to the front where the batch is finished
    samples = layout.open(DATA / kind / "train", (4, 8, 8, 8), slices=(slice(3, 8), slice(0, 8), slice(2, 6)))
    counts, targets = samples.read([0, 1, 2, 3])
    whole = np.stack([np.moveaxis(_expected(f)[0], -1, 0) for f in files])
    assert np.array_equal(counts.oriented().numpy(), whole[:, :, 3:8, :, 2:6])
    assert np.array_equal(targets.numpy(), np.stack([_expected(f)[1] for f in files]))
    want = torch.log1p(torch.from_numpy(whole[:, :, 3:8, :, 2:6]).float())
    assert torch.equal(samples.finish(counts), want)
    assert "read where they lie" in samples.notes()[0] and "gems data convert" in samples.notes()[0]


def _copy(tmp: Path, kind: str = "plain") -> Path:
    src = sorted((DATA / kind / "train").iterdir())[0]
    out = tmp / "bad"
    out.mkdir(exist_ok=True)
    return Path(shutil.copy(src, out / src.name))


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how, said", [
    ("data", "data CRC that does not match in record 1"),
    ("length", "length CRC that does not match in record 1"),
    ("cut", "ends inside record 1"),
    ("gzip-cut", "corrupt gzip stream"),
    ("gzip-flip", "corrupt gzip stream"),
    ("empty", "is empty"),
    ("two", "holds more"),
    ("zlib", "is ZLIB-compressed (compression_type='ZLIB'), which gems does not read: write the files with "
             "compression_type='GZIP' or none"),
])
def test_a_bad_file_is_named(tmp_path: Path, how: str, said: str) -> None:
    path = _copy(tmp_path, "gzip" if how.startswith("gzip") else "plain")
    if how == "data":
        _flip(path, 12 + 100)  # a byte of the Example
    elif how == "length":
        _flip(path, 2)
    elif how == "cut":
        path.write_bytes(path.read_bytes()[:-100])
    elif how == "gzip-cut":
        path.write_bytes(path.read_bytes()[:-30])
    elif how == "gzip-flip":
        _flip(path, len(path.read_bytes()) // 2)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "two":  # two records in one file (TFRecord files concatenate)
        path.write_bytes(path.read_bytes() * 2)
    elif how == "zlib":  # TensorFlow's other compression (it was taken for a plain file whose length CRC is wrong)
        path.write_bytes(zlib.compress(path.read_bytes()))
    with pytest.raises(ConfigError) as e:
        tfr.read_file(path)
    assert path.name in str(e.value) and said in str(e.value), str(e.value)


def test_an_example_without_mlperfs_features_is_named(tmp_path: Path) -> None:
    from tfrecord.writer import TFRecordWriter

    path = tmp_path / "other.tfrecord"
    w = TFRecordWriter(str(path))
    w.write({"image": (b"\0" * 64, "byte"), "label": ([1.0], "float")})
    w.close()
    with pytest.raises(ConfigError) as e:
        tfr.read_file(path)
    assert e.value.key == "data.path" and "other.tfrecord" in str(e.value) and "['image', 'label']" in str(e.value)
    with pytest.raises(ConfigError, match=r"a cube of 3 channels"):  # 8^3 x 4 int16 read as 3 channels
        tfr.read_file(sorted((DATA / "plain" / "train").iterdir())[0], channels=3)


def _convert(src: Path, out: Path, *more: str) -> int:
    from gems.data.convert import convert_main

    given = {m.split("=", 1)[0] for m in more}
    base = [a for a in ("data=hdf5", f"data.path={src}", f"data.out={out}", "data.workers=1")
            if a.split("=", 1)[0] not in given]
    return convert_main(compose([*base, *more], check=False))


def test_convert_writes_exalearns_layout_bit_for_bit_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _convert(DATA / "gzip", out) == 6
    train = sorted((out / "train").iterdir())
    assert [p.name for p in train] == [p.name.replace(".tfrecord", ".hdf5")
                                       for p in sorted((DATA / "gzip" / "train").iterdir())]
    assert len(list((out / "validation").iterdir())) == 2
    for p in train:
        with h5py.File(p) as f:
            ds = f["full"]
            assert ds.dtype == np.dtype("<i2") and ds.chunks is None and ds.compression is None  # read by position
            x, y = _expected(p.with_suffix(".tfrecord"))
            assert np.array_equal(ds[()], x) and np.array_equal(f["unitPar"][()], y)
    assert layouts.detect(out / "train").name == "exalearn"
    # resumed: a finished file is never written again, a missing or half-written one is
    kept = {p: p.stat().st_mtime_ns for p in train[1:]}
    train[0].unlink()
    (out / "train" / f".{train[0].name}.tmp").write_bytes(b"half")
    assert _convert(DATA / "gzip", out) == 1
    assert train[0].is_file() and {p: p.stat().st_mtime_ns for p in train[1:]} == kept
    with h5py.File(train[0]) as f:
        assert np.array_equal(f["full"][()], _expected(train[0].with_suffix(".tfrecord"))[0])
    assert _convert(DATA / "gzip", out) == 0


def test_convert_goes_on_past_a_bad_record_names_it_and_keeps_what_it_wrote(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(DATA / "plain" / "train", src)
    bad = sorted(src.iterdir())[2]
    _flip(bad, len(bad.read_bytes()) - 2)  # the data CRC itself
    out = gems("data", "convert", f"data.path={src}", f"data.out={tmp_path / 'out'}", "data.workers=2", timeout=300)
    assert out.returncode == 2, out.stderr
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("gems: error: data.path=") and bad.name in err, err
    # past the bad file: the three good ones converted and kept
    assert "1 did not: " in err and "data CRC" in err and "3 other file(s) were converted" in err
    assert len(list((tmp_path / "out").glob("*.hdf5"))) == 3


@pytest.mark.parametrize("args, key", [
    (["data.out=null"], "data.out"),
    (["data.path={tmp}/nothing"], "data.path"),
    (["data.layout=exalearn"], "data.layout"),
])
def test_convert_refuses_bad_input(tmp_path: Path, args: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        _convert(DATA / "gzip" / "train", tmp_path / "out", *(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert e.value.key == key
    assert not (tmp_path / "out").exists()


def test_convert_says_what_it_does_not_convert_and_names_a_zlib_file(tmp_path: Path) -> None:
    """`gems data convert` of a folder of HDF5 files (read where they lie) exited 1 with NotImplementedError: it says
    there is nothing to convert, exit 2. A ZLIB-compressed TFRecord is named with what would work."""
    from _cli import gems_here

    layouts.get("exalearn").write(tmp_path / "univ", [(np.ones((4, 8, 8, 8), np.int16), np.zeros(4, np.float32))])
    out = gems_here("data", "convert", f"data.path={tmp_path / 'univ'}", f"data.out={tmp_path / 'out'}")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "these are exalearn files" in out.stderr and "nothing to convert" in out.stderr, out.stderr
    assert not (tmp_path / "out").exists()
    src = tmp_path / "zlib"
    src.mkdir()
    first = sorted((DATA / "plain" / "train").iterdir())[0]
    (src / first.name).write_bytes(zlib.compress(first.read_bytes()))
    out = gems_here("data", "convert", f"data.path={src}", f"data.out={tmp_path / 'out'}", "data.workers=1")
    assert out.returncode == 2 and f"{first.name} is ZLIB-compressed" in out.stderr, out.stderr


def test_a_long_check_says_how_far_it_is_and_the_slurm_progress_lists_a_folder_once(tmp_path: Path, monkeypatch,
                                                                                 capsys) -> None:
    """The pre-launch check of MLPerf's half a million files takes minutes: it prints its progress. The progress of
    a conversion as a Slurm job lists each output folder once, not a stat a file."""
    from gems.data.convert import plan_of
    from gems.models import build_model
    from gems.prepare import check_data

    monkeypatch.setattr(layouts, "PROGRESS_S", 0.0)
    cfg = compose([*TINY, f"data.path={DATA / 'gzip' / 'train'}", f"data.val_path={DATA / 'gzip' / 'validation'}"],
                  check=False)
    check_data(cfg, build_model(cfg.model))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("gems: checking")]
    assert any(ln.startswith("gems: checking the first bytes of data.path's files: 4/4 files") for ln in lines), lines
    assert lines[-1].startswith("gems: checking the first bytes of data.val_path's files: 2/2 files"), lines
    assert _convert(DATA / "gzip", tmp_path / "out") == 6
    (tmp_path / "out" / "train" / "univ_ics_2019-03_a10000668_001.hdf5").unlink()
    work = plan_of(compose(["data=hdf5", f"data.path={DATA / 'gzip'}", f"data.out={tmp_path / 'out'}"], check=False))

    def no_stat(self: Path) -> bool:
        raise AssertionError(f"a stat of {self}")

    monkeypatch.setattr(Path, "is_file", no_stat)
    assert [src.name for _, src, _ in work.left()] == ["univ_ics_2019-03_a10000668_001.tfrecord"]


def test_converted_files_are_synced_before_and_after_their_rename(tmp_path: Path, monkeypatch) -> None:
    """A resumed conversion takes a file that is there as finished: each is synced before its rename and the
    rename after (a crash could leave a name on half a file); `.nii.gz` volumes and their labels alike."""
    import os

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert _convert(DATA / "gzip" / "validation", tmp_path / "out") == 2
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert sorted(Path(p).name for p in synced if not Path(p).is_dir()) == sorted(f".{n}.tmp" for n in names)
    assert sum(Path(p) == tmp_path / "out" for p in synced) == 2  # each rename
    from gems.data.layouts.nifti import NiftiLayout

    src = tmp_path / "lits"
    NiftiLayout().write(src, [(np.zeros((4, 4, 4), np.int16), np.zeros((4, 4, 4), np.uint8))], compress=True)
    synced.clear()
    assert _convert(src, tmp_path / "nii") == 1
    assert sorted(Path(p).name for p in synced if not Path(p).is_dir()) == [".segmentation-0.nii.tmp",
                                                                          ".volume-0.nii.tmp"]


def test_the_masked_crc_is_tensorflows() -> None:
    """The first record's header of a file TensorFlow wrote: its length and the masked CRC32C TensorFlow put
    beside it."""
    head = sorted((DATA / "plain" / "train").iterdir())[0].read_bytes()[:12]
    assert tfr.masked_crc(head[:8]) == struct.unpack("<I", head[8:])[0]
    assert gzip.decompress(sorted((DATA / "gzip" / "train").iterdir())[0].read_bytes())[:12] == head


TINY = ["model=custom", "model._target_=_custom_models.cosmo_tiny", "model.input_shape=[4,8,8,8]",
        "model.num_outputs=4", "train.batch_size=2", "train.steps=3", "train.warmup_steps=1", "data=hdf5",
        "train.optimizer=sgd", "train.eval_every=3"]


def _run(tmp: Path, folder: Path, *args: str) -> dict:
    out = gems_here("run", *TINY, f"data.path={folder / 'train'}", f"data.val_path={folder / 'validation'}",
                    f"results.dir={tmp}", *args)
    assert out.returncode == 0, out.stderr[-3000:]
    (rec,) = records(str(tmp))
    return rec


@pytest.fixture(scope="module")
def serial(tmp_path_factory) -> dict:
    """One rank, reading the gzip files where they lie."""
    return _run(tmp_path_factory.mktemp("gzip1"), DATA / "gzip")


def test_tfrecords_train_on_one_rank_and_say_how_they_are_read(serial: dict) -> None:
    notes = " ".join(serial["notes"])
    assert "layout tfrecord" in notes and "read where they lie" in notes
    assert len(serial["loss"]) == 3 and serial["validation"][-1]["samples"] == 2


def test_s2_equals_one_rank(tmp_path: Path, serial: dict) -> None:
    """The plain files cut over S = 2 ranks (each reads its part of each record): the losses and the validation
    of the gzip files read whole by one rank. (Their converted form is ExaLearn's layout, whose runs
    tests/test_layouts.py compares, and whose samples equal the records bit for bit: above.)"""
    got = _run(tmp_path / "run", DATA / "plain", "parallel.spatial=2")
    np.testing.assert_allclose(got["loss"], serial["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["validation"][-1]["mae_per_target"], serial["validation"][-1]["mae_per_target"],
                               rtol=1e-5)
    assert "layout tfrecord" in " ".join(got["notes"])


def test_converted_files_train_as_the_records_on_s2(tmp_path: Path, serial: dict) -> None:
    """What `gems data convert` writes of the gzip files (ExaLearn's layout) trains through `gems run` cut over
    S = 2 as the records read whole by one rank; the run names the converted layout."""
    conv = gems_here("data", "convert", f"data.path={DATA / 'gzip'}", f"data.out={tmp_path / 'conv'}",
                     "data.workers=1")  # (in this process: no worker forked from the test's threads)
    assert conv.returncode == 0, conv.stderr[-2000:]
    got = _run(tmp_path / "run", tmp_path / "conv", "parallel.spatial=2")
    np.testing.assert_allclose(got["loss"], serial["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["validation"][-1]["mae_per_target"], serial["validation"][-1]["mae_per_target"],
                               rtol=1e-5)
    assert "layout exalearn" in " ".join(got["notes"]) and "layout tfrecord" not in " ".join(got["notes"])


def test_gems_plan_names_the_layout_and_times_the_read_on_the_files() -> None:
    """`gems plan` on TFRecords names their layout, says they are read whole where they lie, and prices the read
    at the rate it times on them."""
    from gems.plan.make import make_plan

    cfg = compose([*TINY, f"data.path={DATA / 'gzip' / 'train'}", "data.readers=1", "data.prefetch=0"])
    pr = make_plan(cfg, suggest=False).prediction
    (said,) = [a for a in pr.assumptions if a.startswith("data read by 1 reader thread(s) timed here")]
    assert "layout tfrecord, from the page cache" in said and "read where they lie" in said, said
    rate = float(said.rsplit(": ", 1)[1].split(" GB/s")[0]) * 1e9
    assert pr.breakdown["data"] == pytest.approx(2 * 4 * 8 ** 3 * 2 / rate, rel=0.01)


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sinfo") is None, reason="no Slurm test cluster")
def test_convert_as_a_slurm_job_shares_the_files_over_its_tasks(tmp_path: Path) -> None:
    """Two tasks, each every other file of all of them (not of those left when it starts: a task that starts
    later would skip one the other had just converted)."""
    out = gems("data", "convert", f"data.path={DATA / 'gzip'}", f"data.out={tmp_path / 'out'}", "cluster=local_slurm",
               "cluster.nodes=2", "cluster.tasks_per_node=1", f"results.dir={tmp_path / 'res'}", timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Slurm job" in out.stdout and "over 2 task(s)" in out.stdout
    files = sorted((tmp_path / "out").rglob("*.hdf5"))
    assert len(files) == 6
    for p in files:
        with h5py.File(p) as f:
            assert np.array_equal(f["full"][()], _expected(p.with_suffix(".tfrecord"))[0])


def test_a_model_of_a_class_a_voxel_is_refused_naming_the_folder() -> None:
    with pytest.raises(ConfigError) as e:
        layouts.get("tfrecord").open(DATA / "gzip" / "train", (4, 8, 8, 8), target="dense")
    assert e.value.key == "data.path" and "model=cosmoflow_mlperf" in str(e.value)
