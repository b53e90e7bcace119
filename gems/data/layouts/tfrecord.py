"""MLPerf HPC's CosmoFlow TFRecords (layout ``tfrecord``), read without TensorFlow: each record's frame read here, both
CRCs checked (``crc32c``), its ``tf.train.Example`` parsed by protobuf with the ``tfrecord`` package's schema.

Read where they lie (:class:`TFRecordSamples`) the files are a first look: every rank reads, decompresses and checks
each of its samples' records whole and keeps its part. ``gems data convert`` writes them into ExaLearn's HDF5 layout,
bit for bit (docs/data.md, "MLPerf HPC's TFRecords").
"""
from __future__ import annotations

import functools
import gzip
import math
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Iterable, Iterator, Sequence

import numpy as np
import torch

from gems.data.layouts import FileSamples, Layout, Options, register
from gems.errors import ConfigError

MASK_DELTA = 0xA282EAD8
#: the features of MLPerf's Examples: the counts' bytes and the target
X_KEY, Y_KEY = "x", "y"
#: the counts' type as ``decode_raw(x, int16)`` reads them (TensorFlow's default: little endian)
DTYPE = np.dtype("<i2")
#: MLPerf's Examples carry this many channels (what a file is read as where no model says)
CHANNELS = 4


# ---------------------------------------------------------------------------- the format
def masked_crc(data: Any) -> int:
    """The TFRecord format's masked CRC32C of ``data`` (bytes-like): ``((crc >> 15 | crc << 17) + 0xa282ead8) mod
    2^32``."""
    import crc32c

    c = crc32c.crc32c(data)
    return (((c >> 15) | (c << 17)) + MASK_DELTA) & 0xFFFFFFFF


def compression(path: str | os.PathLike, key: str = "data.path") -> str:
    """``gzip``, ``zlib`` or ``none``: how the TFRecord file ``path`` is stored, from its first bytes (a gzip
    stream's magic number, or a zlib stream's header: 0x78 and a check that makes the first two bytes a multiple
    of 31, unless they are a record's length and its CRC); an empty file is bad input naming it. gems reads gzip
    and none (:func:`readable`)."""
    with open(path, "rb") as f:
        head = f.read(12)
    if not head:
        raise ConfigError(key, str(path), f"TFRecord files of one record at least; {Path(path).name} is empty")
    if len(head) == 12 and masked_crc(head[:8]) == struct.unpack("<I", head[8:])[0]:
        return "none"
    if head[:2] == b"\x1f\x8b":
        return "gzip"
    return "zlib" if len(head) >= 2 and head[0] == 0x78 and (head[0] << 8 | head[1]) % 31 == 0 else "none"


def framed(path: str | os.PathLike, key: str = "data.path") -> None:
    """An uncompressed TFRecord file's framing walked with seeks (no data read): each record's length header and
    its CRC, and its end at the next record or the file's end, one record as MLPerf's files hold. A file cut short,
    padded, or of more records than one is bad input naming it; what lies inside each record (its data CRC, its
    Example) is read when a rank reads the file, or by ``gems data check``."""
    p = Path(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(12)
    if len(head) < 12 or masked_crc(head[:8]) != struct.unpack_from("<I", head, 8)[0]:
        raise ConfigError(key, str(p), f"TFRecord files whose records match their CRCs; {p.name} has a length CRC "
                          "that does not match in record 1 (a corrupt file)")
    (length,) = struct.unpack_from("<Q", head)
    end = 12 + length + 4
    if size < end:
        raise ConfigError(key, str(p), f"TFRecord files whose records match their CRCs; {p.name} ends inside record "
                          f"1 (a truncated file: {size} bytes, its header promises {end})")
    if size > end:
        raise ConfigError(key, str(p), "one tf.train.Example a file, as MLPerf's prepare.py writes them; "
                          f"{p.name} holds {size - end} bytes more after its first record")


def readable(path: str | os.PathLike, key: str = "data.path") -> str:
    """:func:`compression` of a file gems reads (gzip or none); a ZLIB-compressed one (TensorFlow's other
    compression_type) is bad input naming it and what would work."""
    kind = compression(path, key)
    if kind == "zlib":
        name = Path(path).name
        raise ConfigError(key, str(path), f"TFRecord files gzip-compressed (as MLPerf's set is) or uncompressed; {name} "
                          "is ZLIB-compressed (compression_type='ZLIB'), which gems does not read: write the files with "
                          f"compression_type='GZIP' or none (zlib.decompress of {name}'s bytes is the uncompressed "
                          "file)")
    return kind


def _read_exactly(f: BinaryIO, buf: memoryview) -> int:
    got = 0
    while got < buf.nbytes:
        n = f.readinto(buf[got:])  # type: ignore[attr-defined]
        if not n:
            break
        got += n
    return got


def records(path: str | os.PathLike, key: str = "data.path") -> Iterator[memoryview]:
    """The data of every record of the TFRecord file ``path`` (gzip or not), each CRC checked; a memoryview valid
    until the next record is read. A record is framed as ``uint64 length | uint32 masked CRC32C of the length's 8
    bytes | data | uint32 masked CRC32C of the data`` (little endian; :func:`masked_crc`), the whole file optionally
    one gzip stream. A corrupt gzip stream, a record cut short or a CRC that does not match is a ConfigError naming
    the file. (The ``tfrecord`` package's own reader skips the CRCs and decompresses a gzip file twice.)"""
    p = Path(path)

    def bad(what: str) -> ConfigError:
        return ConfigError(key, str(p), f"TFRecord files whose records match their CRCs; {p.name} {what}")

    buf = bytearray(0)
    head, tail = bytearray(12), bytearray(4)
    zipped = readable(p, key) == "gzip"
    try:
        with open(p, "rb") as raw, (gzip.GzipFile(fileobj=raw, mode="rb") if zipped else raw) as f:
            n = 0
            while True:
                got = _read_exactly(f, memoryview(head))  # type: ignore[arg-type]
                if got == 0:
                    return
                if got < 12:
                    raise bad(f"ends inside the header of record {n + 1} (a truncated file)")
                (length,) = struct.unpack_from("<Q", head)
                if masked_crc(memoryview(head)[:8]) != struct.unpack_from("<I", head, 8)[0]:
                    raise bad(f"has a length CRC that does not match in record {n + 1} (a corrupt file)")
                if len(buf) < length:
                    buf = bytearray(length)
                data = memoryview(buf)[:length]
                if _read_exactly(f, data) < length or _read_exactly(f, memoryview(tail)) < 4:  # type: ignore[arg-type]
                    raise bad(f"ends inside record {n + 1} (a truncated file)")
                if masked_crc(data) != struct.unpack("<I", tail)[0]:
                    raise bad(f"has a data CRC that does not match in record {n + 1} (a corrupt file)")
                n += 1
                yield data
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise ConfigError(key, str(p), f"TFRecord files, gzip-compressed or not; {p.name} is a corrupt gzip stream "
                          f"({type(e).__name__}: {e})") from None


@dataclass(frozen=True)
class Record:
    """One MLPerf sample: ``x`` the counts (D, H, W, C) as stored (little-endian int16, channels last), ``y`` the
    target (float32)."""

    x: np.ndarray
    y: np.ndarray


def parse(data: Any, path: str | os.PathLike, channels: int = CHANNELS, key: str = "data.path") -> Record:
    """The counts and target of one record's ``tf.train.Example`` (``x`` bytes of int16, ``y`` floats); the
    counts are shaped as a cube of ``channels`` channels, last. A missing feature, another kind of value or bytes
    that make no such cube is a ConfigError naming the file."""
    from tfrecord import example_pb2

    name = Path(path).name
    ex = example_pb2.Example()
    try:
        ex.ParseFromString(data)  # a memoryview: no copy before protobuf's own
    except Exception as e:  # protobuf's DecodeError
        raise ConfigError(key, str(path), f"records that are tf.train.Examples; {name} holds another message "
                          f"({type(e).__name__})") from None
    feats = ex.features.feature
    want = (f"Examples with `{X_KEY}` (the int16 counts' bytes) and `{Y_KEY}` (the target's floats), as MLPerf's "
            "prepare.py writes them")
    if X_KEY not in feats or Y_KEY not in feats:
        raise ConfigError(key, str(path), f"{want}; {name} has the features {sorted(feats)}")
    fx, fy = feats[X_KEY], feats[Y_KEY]
    if fx.WhichOneof("kind") != "bytes_list" or len(fx.bytes_list.value) != 1 or fy.WhichOneof("kind") != "float_list":
        raise ConfigError(key, str(path), f"{want}; {name} has `{X_KEY}` as {fx.WhichOneof('kind')} and `{Y_KEY}` as "
                                          f"{fy.WhichOneof('kind')}")
    raw = fx.bytes_list.value[0]
    edge = round((len(raw) / DTYPE.itemsize / max(1, channels)) ** (1 / 3))
    if len(raw) != edge ** 3 * channels * DTYPE.itemsize or not len(fy.float_list.value):
        raise ConfigError(key, str(path), f"`{X_KEY}` of a cube of {channels} channels of int16 (model.in_channels) "
                          f"and `{Y_KEY}` of the targets; {name} holds {len(raw)} bytes and {len(fy.float_list.value)} "
                          "target(s)")
    x = np.frombuffer(raw, dtype=DTYPE).reshape(edge, edge, edge, channels)
    return Record(x, np.asarray(fy.float_list.value, dtype=np.float32))


def read_file(path: str | os.PathLike, channels: int = CHANNELS, key: str = "data.path") -> Record:
    """The one sample of an MLPerf TFRecord file (one Example a file, as ``prepare.py`` writes them); a file of
    another number of records is a ConfigError naming it."""
    got: Record | None = None
    for data in records(path, key):
        if got is not None:
            raise ConfigError(key, str(path), "one tf.train.Example a file, as MLPerf's prepare.py writes them; "
                              f"{Path(path).name} holds more")
        got = parse(data, path, channels, key)
    if got is None:
        raise ConfigError(key, str(path), f"one tf.train.Example a file; {Path(path).name} holds no record")
    return got


# ---------------------------------------------------------------------------- read where they lie
class TFRecordSamples(FileSamples):
    """The samples of a folder of MLPerf TFRecords as one rank reads them (gems.data.layouts' ``Samples``): each
    file a crop, cut into samples of the model's edge where it is a whole multiple of it (as HDF5 universes are:
    sample ``i`` is crop ``i % k`` of file ``i // k``); each rank keeps its spatial part of each."""

    looks_at = "the first bytes"

    def __init__(self, layout: Layout, path: str | os.PathLike, shape: Sequence[int] | None,
                 options: Options) -> None:
        from gems.data.samples import standardize

        super().__init__(layout, path, options.key, options.readers, "a folder of MLPerf's *.tfrecord files (its "
                         "train/ or validation/)")
        if options.target != "vector":
            raise ConfigError(self.key, self.path, "samples with a class a voxel, as this model's loss takes them; "
                              "MLPerf's TFRecords carry one target vector `y` each, for model=cosmoflow_mlperf (or "
                              "another model of vector targets)")
        expected = tuple(int(n) for n in shape) if shape is not None else None
        self.channels = expected[0] if expected is not None else CHANNELS
        first = read_file(self.files[0], self.channels, self.key)
        self.file_shape = (self.channels, *first.x.shape[:-1])  # (C, *spatial)
        self.shape = expected if expected is not None else self.file_shape
        self.crop(options.crop)
        if len(self.shape) != 4 or any(f % s for f, s in zip(self.file_shape[1:], self.shape[1:])) or \
                any(s > f for f, s in zip(self.file_shape[1:], self.shape[1:])):
            raise ConfigError(self.key, self.path, f"crops of {list(self.shape)} (C, D, H, W) to match the model, or a "
                              f"whole multiple of its edge; {self.files[0].name} holds {list(self.file_shape)}")
        self.grid = tuple(f // s for f, s in zip(self.file_shape[1:], self.shape[1:]))
        self.crops = math.prod(self.grid)
        self.dtype = np.dtype(np.int16)
        self.slices = tuple(options.slices) if options.slices is not None else None
        self.standardize = standardize(options.standardize)
        self.symmetries = self.augmenting(options.augment)
        self.targets: dict[int, np.ndarray] = {0: first.y}  # read for target() alone (a rank that reads no input)
        self.compression = compression(self.files[0], self.key)
        self.kinds: set[str] = set()  # the compressions of the files read so far (the notes say them all)
        self._kind_of: dict[int, str] = {}

    def notes(self) -> list[str]:
        kinds = self.kinds or {self.compression}
        kind = ("gzip-compressed " if kinds == {"gzip"} else "uncompressed " if kinds == {"none"} else
                "gzip-compressed and uncompressed ")
        return [f"{self.key}: MLPerf's {kind}TFRecords read where they lie, a first look: every rank reads"
                f"{', decompresses' if 'gzip' in kinds else ''} and checks each of its samples' records whole and keeps "
                "its part; "
                "`gems data convert` writes them as contiguous HDF5 (ExaLearn's layout), read by part at the page "
                "cache's rate"]

    def check_targets(self, target_size: int | None) -> None:
        """The first file's record (read whole when the set was opened) against the model's outputs."""
        if target_size is not None and self.targets[0].size != int(target_size):
            raise ConfigError(self.key, self.path, f"`{Y_KEY}` of {int(target_size)} numbers (one per model output); "
                              f"{self.files[0].name} has {self.targets[0].size}")

    def check_file(self, index: int, target_size: int | None) -> None:
        """File ``index`` is a TFRecord, from its first bytes (a record is checked whole, and against its CRCs,
        when it is read); a plain file's framing too, by seeks (cheap: no data read)."""
        if readable(self.files[index], self.key) == "none":
            framed(self.files[index], self.key)

    def _fill(self, row: np.ndarray, targets: np.ndarray, r: int, file: int, part: tuple[slice, ...]) -> None:
        rec = read_file(self.files[file], self.channels, self.key)
        if file not in self._kind_of:  # (each file's first bytes once)
            self._kind_of[file] = compression(self.files[file], self.key)
            self.kinds.add(self._kind_of[file])
        if rec.x.shape != (*self.file_shape[1:], self.channels) or rec.y.shape != targets.shape[1:]:
            raise ConfigError(self.key, self.path, f"crops shaped as the first file's, {list(self.file_shape)}, with "
                              f"{targets.shape[1]} targets; {self.files[file].name} holds {list(rec.x.shape)} (channels "
                              f"last) and {rec.y.size}")
        if row.size:
            row[...] = rec.x[(*part, slice(None))]
        targets[r] = rec.y

    def read(self, indices: Sequence[int], symmetries: Sequence[int] | None = None, pin: bool = False,
             out: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
        """This rank's part of each sample's counts as read (channels last, each from the part its symmetry takes
        it from: gems.data.samples.Counts applies the symmetries and moves the channels where the batch is
        finished), and the targets; each file read whole on the reader's threads."""
        from gems.data.samples import Counts

        syms = [int(k) for k in symmetries] if symmetries is not None else [0] * len(indices)
        part = self.part_shape()
        out = self.batch_buffer((len(indices), *part[1:], part[0]), torch.int16, pin, out)
        targets = np.empty((len(indices), self.targets[0].size), dtype=np.float32)
        rows = out.numpy()
        jobs, shapes = [], []
        for r, (i, k) in enumerate(zip(indices, syms)):
            file, src = self.source(i, k)
            sh = (*(s.stop - s.start for s in src), self.channels)
            shapes.append(sh)
            jobs.append(functools.partial(self._fill, rows[r].reshape(sh), targets, r, file, src))
        self.run([], jobs)
        return Counts(out, syms, shapes, channels_last=True), torch.from_numpy(targets)

    def finish(self, x: Any) -> torch.Tensor:
        from gems.data.samples import finished

        return finished(x, True, self.standardize)

    def target(self, index: int) -> torch.Tensor:
        file = self.locate(index)[0]
        if file not in self.targets:
            self.targets[file] = read_file(self.files[file], self.channels, self.key).y
        return torch.from_numpy(self.targets[file].copy())


# ---------------------------------------------------------------------------- the layout
#: what ``gems data convert`` writes a TFRecord's sample as: ExaLearn's channels-last HDF5, the record's bytes as
#: they are (gems.data.layouts.exalearn)
CONVERTED = "exalearn"


@register
class TFRecordLayout(Layout):
    name: ClassVar[str] = "tfrecord"
    about: ClassVar[str] = ("MLPerf HPC's CosmoFlow TFRecords: one tf.train.Example a *.tfrecord file, gzip or not, "
                            "`x` the int16 counts channels last, `y` the target")
    suffixes: ClassVar[tuple[str, ...]] = (".tfrecord",)
    fast: ClassVar[bool] = False
    #: bytes of counts a second one thread reads, decompresses, checks and parses from gzip files in the page cache
    #: (MLPerf's 128^3 crops written by TensorFlow, here: 0.07 GB/s gzip, 0.26 plain, on this loaded 2-core
    #: machine): the planner's figure where no file is at hand
    thread_rate: ClassVar[float] = 0.07e9

    def holds(self, files: Sequence[Path]) -> bool:
        try:
            compression(files[0])
        except (ConfigError, OSError, IndexError):
            return False
        return True

    def open(self, path: str | os.PathLike, shape: Sequence[int] | None, **options: Any) -> TFRecordSamples:
        return TFRecordSamples(self, path, shape, Options(**options))

    def write(self, folder: str | os.PathLike, samples: Iterable[tuple[np.ndarray, np.ndarray]],
              name: str = "sample_{:05d}", compress: bool = True, *, sync: bool = False) -> list[Path]:
        """One Example a file as MLPerf's prepare.py writes them (``x`` the int16 counts channels last, ``y`` the
        target), through the ``tfrecord`` package's writer (TensorFlow's format: the tests' files come from
        TensorFlow's own, scripts/tfrecord_fixtures.py), gzip-compressed as the published set with ``compress``;
        each written to a hidden name and renamed."""
        from tfrecord.writer import TFRecordWriter

        from gems.paths import commit

        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        files = []
        for i, (counts, target) in enumerate(samples):
            final = out / (name.format(i) + ".tfrecord")
            tmp = out / f".{final.name}.tmp"
            w = TFRecordWriter(str(tmp))
            x = np.ascontiguousarray(np.moveaxis(np.asarray(counts), 0, -1), dtype=DTYPE)
            w.write({X_KEY: (x.tobytes(), "byte"), Y_KEY: (np.asarray(target, dtype=np.float32).tolist(), "float")})
            w.close()
            if compress:
                tmp.write_bytes(gzip.compress(tmp.read_bytes()))
            commit(tmp, final, sync)
            files.append(final)
        return files

    def converted_name(self, source: Path, tile: int | None = None) -> str:
        """The name ``gems data convert`` gives file ``source``'s sample (in the :data:`CONVERTED` layout)."""
        from gems.data import layouts

        return source.name[: -len(".tfrecord")] + str(getattr(layouts.get(CONVERTED), "extension", ".h5"))

    def convert(self, source: Path, folder: Path, channels: int | None = None, key: str = "data.path",
                tile: int | None = None, tolerance: float | None = None) -> Path:
        """Write file ``source``'s sample into ``folder`` in the :data:`CONVERTED` layout (hidden name, synced, then
        renamed: a file there is whole, through a crash too): ``full`` the record's int16 counts (D, H, W, C) as
        they are, ``unitPar`` its target."""
        from gems.data import layouts

        rec = read_file(source, channels or CHANNELS, key)
        target = layouts.get(CONVERTED)
        (path,) = target.write(folder, [(np.moveaxis(rec.x, -1, 0), rec.y)], name=Path(self.converted_name(source)).stem,
                               sync=True)
        return path
