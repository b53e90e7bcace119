"""Write the tests' MLPerf HPC CosmoFlow TFRecords with TensorFlow's own writer (run it where TensorFlow is installed;
gems itself never imports TensorFlow):

    python3 -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install tensorflow-cpu
    /tmp/tfenv/bin/python scripts/tfrecord_fixtures.py tests/data/tfrecord          # the tests' files (8^3 crops)
    /tmp/tfenv/bin/python scripts/tfrecord_fixtures.py /tmp/mlperf128 --edge 128    # MLPerf's size, 12 files

Each file holds one ``tf.train.Example`` as MLPerf HPC's ``prepare.py`` writes it: ``x``, the raw bytes of an int16
crop shaped (D, H, W, C) (channels last), and ``y``, the universe's 4 ``unitPar`` floats; one crop a file, named
``<universe>_<crop>.tfrecord``, under ``train/`` and ``validation/``. ``plain/`` is written by
``tf.io.TFRecordWriter(path)`` (prepare.py's call), ``gzip/`` with ``TFRecordOptions(compression_type="GZIP")`` (how
the published ``cosmoUniverse_2019_05_4parE_tf_v2`` set is stored). The crops are 8^3 x 4, so that the files are a few
KiB; their values come from numpy's frozen legacy generator (:func:`crop`), so a test makes the same arrays again and
compares what gems reads with them bit for bit. The script reads every file back with TensorFlow
(``TFRecordDataset(compression_type=...)``, ``decode_raw(x, int16)``: the reference's reader) before it returns.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

EDGE, CHANNELS = 8, 4
#: (split, universe, crops) of the fixture set
FILES = (("train", 10000668, 2), ("train", 10000669, 2), ("validation", 10000712, 2))


def crop(universe: int, index: int, edge: int = EDGE, channels: int = CHANNELS) -> tuple[np.ndarray, np.ndarray]:
    """Counts (int16, (edge, edge, edge, channels)) and unitPar (float32, 4) of one crop: log-normal Poisson counts
    from ``np.random.RandomState`` (a stream numpy keeps fixed across versions), one of them 30000 (both bytes of an
    int16 used: their order)."""
    rs = np.random.RandomState([universe % (2**31), index])
    lam = np.exp(0.8 * rs.standard_normal((edge, edge, edge, channels)))
    x = rs.poisson(lam).astype(np.int16)
    x.flat[rs.randint(x.size)] = 30000
    y = rs.uniform(-1, 1, 4).astype(np.float32)
    return x, y


def name(universe: int, index: int) -> str:
    return f"univ_ics_2019-03_a{universe}_{index:03d}.tfrecord"


def main(out: str, edge: int = EDGE) -> None:
    import tensorflow as tf

    root = Path(out)
    for kind, options in (("plain", None), ("gzip", tf.io.TFRecordOptions(compression_type="GZIP"))):
        for split, universe, crops in FILES:
            folder = root / kind / split
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(crops):
                x, y = crop(universe, i, edge)
                feature = dict(x=tf.train.Feature(bytes_list=tf.train.BytesList(value=[x.tobytes()])),
                               y=tf.train.Feature(float_list=tf.train.FloatList(value=y)))
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                path = str(folder / name(universe, i))
                with (tf.io.TFRecordWriter(path) if options is None else tf.io.TFRecordWriter(path, options)) as w:
                    w.write(example.SerializeToString())
                # read back as the reference does
                got = next(iter(tf.data.TFRecordDataset(path, compression_type="GZIP" if options else "")))
                parsed = tf.io.parse_single_example(got, {"x": tf.io.FixedLenFeature([], tf.string),
                                                          "y": tf.io.FixedLenFeature([4], tf.float32)})
                back = tf.reshape(tf.io.decode_raw(parsed["x"], tf.int16), x.shape).numpy()
                assert np.array_equal(back, x) and np.array_equal(parsed["y"].numpy(), y), path
    print(f"wrote {2 * sum(c for _, _, c in FILES)} TFRecord files under {root} with TensorFlow {tf.__version__}")


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="MLPerf HPC CosmoFlow TFRecords written with TensorFlow's own writer")
    p.add_argument("out", nargs="?", default="tests/data/tfrecord", help="the folder (plain/ and gzip/ under it)")
    p.add_argument("--edge", type=int, default=EDGE, help=f"a crop's edge in cells (default {EDGE}; MLPerf's is 128)")
    a = p.parse_args()
    main(a.out, a.edge)
