"""The layouts of sample files gems reads, one module a layout, registered by name (``data.layout``).

A layout is how a published data set lies in its files (ExaLearn's universes, LBANN's crops, gems's own ``.h5``,
MLPerf's TFRecords, NIfTI volumes, ...): a :class:`Layout` that opens a folder's :class:`Samples`. Every user of files
(the run, ``gems plan``, ``gems bench data``, ``gems data convert``) asks the one object :func:`detect` hands out for a
folder, never the files themselves. The protocol and the rules every reader keeps: docs/data.md, "Adding a layout".
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Protocol, Sequence, TypeVar

import numpy as np

from gems.checkpoint.files import lists
from gems.config import import_modules, owned
from gems.errors import ConfigError

if TYPE_CHECKING:
    import torch

#: bytes a second one reader thread moves from the page cache into a batch, where no file is at hand to time: one
#: thread of `gems bench data` here (results/bench/data.md)
THREAD_RATE = 4.4e9
#: the class of a voxel that counts nowhere (gems.rank.loss: the loss, accuracy and Dice leave it out): the
#: padding of a volume's edge tiles, and every voxel of the samples that fill a last partial evaluation batch
IGNORE = 255


@dataclass(frozen=True)
class Options:
    """What :meth:`Layout.open` takes besides the folder and the model's input shape."""

    key: str = "data.path"  # the setting that names the folder (messages)
    slices: tuple[slice, ...] | None = None  # this rank's part of each spatial dim (None: all)
    crop: int | None = None  # data.crop: a file holds crops of this edge (the model's)
    standardize: Sequence[float] | None = None
    augment: str = "none"
    readers: int = 4  # threads a rank reads on (capped: reader_threads)
    target: str = "vector"  # the model's: vector (one per sample) or dense (a class per voxel)
    classes: int | None = None  # a model of dense classes: its classes (labels at or over it are bad input)
    window: Sequence[float] | None = None  # data.window: CT volumes' [low, high] Hounsfield units (nifti)
    orientation: str = "stored"  # data.orientation: volumes read as stored, or in RAS+ (nifti)
    affine_tolerance: float | None = None  # data.affine_tolerance: voxels a file may lie off its grid (nifti; None: default)


class Samples(Protocol):
    """What :meth:`Layout.open` returns: one rank's view of a set's samples (:class:`FileSamples` is its base).

    * ``layout``, ``files`` (the sorted paths), ``shape`` (C, *spatial) of one sample, ``dtype`` (numpy: the values
      as read, native byte order), ``symmetries`` (how many ``data.augment`` draws among), ``len()``,
      ``part_shape()`` ((C, *part): this rank's part of a sample);
    * ``read(ids, symmetries=None, pin=False, out=None) -> (raw, targets)``: this rank's part of each sample, as
      stored (``raw``: a tensor, or an object that moves like one: ``is_cuda``, ``pin_memory()``, ``to(device,
      non_blocking)`` and ``data``, the tensor holding it), each from the part its symmetry takes it from
      (gems.data.augment.source_slices); ``targets`` (N, outputs) for vector targets, (N, *part) class indices for
      dense ones; ``pin``: into pinned memory (a GPU rank's); ``out``: the buffer ``raw.data`` to read into;
    * ``finish(raw) -> Tensor``: the network's float32 input (N, C, *part) on ``raw``'s device (the symmetries
      applied, channels first, ``log1p`` and ``data.standardize`` where the values are counts);
    * ``batch(ids, symmetries=None, raw=False, pin=False)``: ``read`` then ``finish`` (``raw``: oriented only);
    * ``target(i)`` (sample i's target alone: a rank that computes the loss but reads no input), ``group(i)`` (the
      file sample i is cut from: validation averages a file's crops);
    * ``check_all(count=None, target_size=None)``: the headers of every file the first ``count`` samples read
      (ConfigError naming the first bad one), ``notes()`` (what the run and the plan must say), ``close()``;
    * optional, the base's defaults where they do not apply: ``runs(ids, symmetries)`` (the byte ranges ``read``
      reads by position: ``gems bench data``'s bound; None where reads are not ranges of files), ``ignore`` (dense
      classes: the label of voxels that count nowhere, :data:`IGNORE`; a set that has it is evaluated to its last
      sample), ``class_names`` (dense classes: each class's name by label where the files name them).
    """

    layout: Layout
    files: list[Path]
    shape: tuple[int, ...]
    symmetries: int

    @property
    def dtype(self) -> np.dtype: ...

    def __len__(self) -> int: ...
    def part_shape(self) -> tuple[int, ...]: ...
    def read(self, indices: Sequence[int], symmetries: Sequence[int] | None = None, pin: bool = False,
             out: Any = None) -> tuple[Any, Any]: ...
    def finish(self, x: Any) -> Any: ...
    def batch(self, indices: Sequence[int], symmetries: Sequence[int] | None = None, raw: bool = False,
              pin: bool = False) -> tuple[Any, Any]: ...
    def target(self, index: int) -> Any: ...
    def group(self, index: int) -> int: ...
    def check_all(self, count: int | None = None, target_size: int | None = None) -> None: ...
    def notes(self) -> list[str]: ...
    def close(self) -> None: ...


class Layout:
    """One way samples lie in files. Subclasses set the class attributes and override :meth:`holds`, :meth:`open`
    and :meth:`write`; every other method has a default (docs/data.md, "Adding a layout").

    ``name`` (the value of ``data.layout``), ``about`` (one line: what the files are, for messages and the plan),
    ``suffixes`` (the file name endings :meth:`files` lists), ``thread_rate`` (bytes a second one reader thread
    moves into a batch where no file is at hand to time: the planner's figure), ``fast`` (whether ``gems data
    convert`` has nothing to gain: read where it lies at the page cache's rate)."""

    name: ClassVar[str] = ""
    about: ClassVar[str] = ""
    suffixes: ClassVar[tuple[str, ...]] = ()
    thread_rate: ClassVar[float] = THREAD_RATE
    fast: ClassVar[bool] = True
    #: what a sample's target is: a vector (one per sample) or dense (a class per voxel: labelled volumes)
    target: ClassVar[str] = "vector"

    def files(self, path: str | os.PathLike) -> list[Path]:
        """The files of this layout at ``path``: a folder's (sorted by name, hidden ones left out), or the file."""
        p = Path(path)
        if p.is_dir():
            return [p / n for n in listing(p) if n.endswith(self.suffixes)]
        return [p] if p.is_file() and p.name.endswith(self.suffixes) else []

    def companions(self, file: Path) -> list[Path]:
        """Files a sample file of :meth:`files` needs beside it (a NIfTI volume's labels), copied with it where a
        run stages its files (``data.stage=node``): none by default."""
        return []

    def folder_files(self, path: str | os.PathLike) -> list[Path]:
        """Files of the folder ``path`` as a whole, not of one sample (a Decathlon task's ``dataset.json``): copied
        with the samples where a run stages its files (``data.stage=node``). None by default."""
        return []

    def holds(self, files: Sequence[Path]) -> bool:
        """Whether ``files`` (listed by :meth:`files`) are of this layout, from the first file's headers at most;
        False for a foreign file, never an exception. :func:`detect` takes the one layout that holds a folder."""
        raise NotImplementedError

    def declared(self, path: str | os.PathLike) -> dict[str, list[str]]:
        """What the files at ``path`` declare of the model that trains on them, by its key: ``model.num_classes``
        the classes' names by label, ``model.in_channels`` the channels' (a task's dataset.json); gems.data.task sets
        the model by them. None by default."""
        return {}

    def check_whole(self, file: Path, key: str, classes: int | None = None, tolerance: float | None = None) -> bool:
        """``gems data check`` of a file a run reads only once converted (a ``.nii.gz``): read whole here, bad input
        a ConfigError naming it; False (the default) for a file a run reads where it lies, which the check reads
        through the run's own reader."""
        return False

    def convert_command(self, path: str | os.PathLike) -> str:
        """The command that converts the set at ``path``, as it runs (a layout that converts: ``convert``)."""
        return f"gems data convert data.path={path} data.out={path}_converted"

    def convert_hint(self, path: str | os.PathLike, files: Sequence[Path]) -> str | None:
        """What ``gems data check`` says once of the set at ``path`` (its ``files``) where converting it first makes
        a run read it faster, with the command; None by default."""
        return None

    def broken(self, file: Path) -> str | None:
        """Why ``file`` (one :meth:`files` lists) is not this layout's where its headers tell, in a few words naming
        it (the end of the refusal of a folder no layout holds: gems.data.layouts.closest); None by default."""
        return None

    def options(self, **options: Any) -> Options:
        """The :class:`Options` :meth:`open` takes (every key a caller hands in), ``target`` checked against this
        layout's: a layout of one target vector a sample refuses a model of dense targets."""
        o = Options(**options)
        if self.target == "vector" and o.target != "vector":
            raise ConfigError("data.layout", self.name, "a layout with a class per voxel for a model of dense targets "
                              "(these files carry one target vector per sample), or data=synthetic")
        return o

    def open(self, path: str | os.PathLike, shape: Sequence[int] | None, **options: Any) -> Samples:
        """The samples of ``path`` as one rank reads them; ``shape``: the model's input (C, *spatial); ``options``:
        every key of :class:`Options`, taken through :meth:`options`. A file that does not match is a ConfigError
        naming ``options["key"]`` and the file."""
        raise NotImplementedError

    def write(self, folder: str | os.PathLike, samples: Iterable[tuple[np.ndarray, np.ndarray]],
              name: str = "sample_{:05d}", dtype: Any = None, *, sync: bool = False) -> list[Path]:
        """Files of this layout in ``folder`` (``name`` formatted with the sample's index, the layout's
        extension added), from (counts (C, *spatial), target) pairs, as the published tool writes them;
        ``dtype``: the values' type where the tool lets one choose (None: the tool's default); ``sync``: each
        file synced before its rename (gems.paths.commit: what ``gems data convert`` writes)."""
        raise NotImplementedError

    def converted_name(self, source: Path, tile: int | None = None) -> str:
        """The name of what ``gems data convert`` writes of file ``source`` (a layout that is not ``fast``), under
        its output folder; ``tile``: stored tile by tile (``data.tile``, labelled volumes' layouts only)."""
        raise NotImplementedError

    def convert(self, source: Path, folder: Path, channels: int | None = None, key: str = "data.path",
                tile: int | None = None, tolerance: float | None = None) -> Path:
        """``gems data convert``: file ``source`` written into ``folder`` in a fast layout, whole or not at all
        (a hidden name, then renamed); its path. ``key`` names the folder in messages; ``tile``: the tiled layout
        of that edge (gems.data.layouts.tiles: labelled volumes; a layout without it refuses ``data.tile``)."""
        raise NotImplementedError

    def fallback_rate(self, shape: Sequence[int], slices: Sequence[slice] | None = None) -> tuple[float, str]:
        """(bytes a second one reader thread moves into a batch of samples of (C, *spatial) ``shape``, this rank's
        part ``slices`` of each, where no file is at hand to time; what that assumes): :attr:`thread_rate`, a file a
        sample."""
        return self.thread_rate, "a file a sample"

    def rate(self, samples: Samples, ids: Sequence[int], symmetries: Sequence[int] | None = None) -> float:
        """Bytes a second ``samples.read`` moves into a batch here: the second of two reads of ``ids`` into one
        buffer (the first fills the page cache and the buffer's pages, as a rank's reused batches are)."""
        raw, _ = samples.read(ids, symmetries)
        data = getattr(raw, "data", raw)
        t0 = time.perf_counter()
        raw, _ = samples.read(ids, symmetries, out=data)
        seconds = time.perf_counter() - t0
        return data.numel() * data.element_size() / max(seconds, 1e-9)

    def __repr__(self) -> str:
        return f"<layout {self.name}>"


#: seconds a look at many files (a pre-launch check of every file's headers) goes on before it prints its progress,
#: and between its lines
PROGRESS_S = 10.0


class Looking:
    """The progress of a long look at ``total`` files (``what``: the files, for the line): nothing for the first
    :data:`PROGRESS_S` seconds, then a line every :data:`PROGRESS_S` (``gems: checking ...: 120000/524288 files, 41
    s``) and one at the end; :meth:`__call__` with the files done so far. A check of MLPerf's half a million files
    takes minutes on a parallel filesystem: the line says it is moving."""

    def __init__(self, total: int, what: str) -> None:
        self.total, self.what = int(total), what
        self.t0 = self.last = time.perf_counter()
        self.said = False

    def __call__(self, done: int) -> None:
        now = time.perf_counter()
        if now - self.last >= PROGRESS_S or (self.said and done >= self.total):
            self.last, self.said = now, True
            print(f"gems: checking {self.what}: {done}/{self.total} files, {now - self.t0:.0f} s", flush=True)


class FileSamples:
    """The base of a layout's samples (the protocol :class:`Samples`). A subclass sets ``shape``,
    ``dtype`` and ``symmetries`` (and ``grid``/``crops`` where a file holds several samples) in its constructor,
    after this one's, and writes :meth:`read`, :meth:`finish` and :meth:`target`; where its files hold one sample
    each, or a row-major grid of crops, :meth:`locate` is done, and :meth:`source` says which part of which file
    a sample's part is read from. The base keeps the rules every reader keeps:

    * the files are the layout's at ``path`` (none: bad input naming ``key``, with what ``wanted`` says);
    * each file is stamped where its headers are read (:meth:`remember`) and looked at before a batch reads it
      (:meth:`still`), so a file cut, deleted, replaced or rewritten under a run is bad input naming it, never
      read at its old offsets; a read that fails all the same (:meth:`run`) is that refusal, never a traceback;
    * reads are positional (gems.data.reader.array_reads, or a library's own reads), never a mapping;
    * :meth:`check_all` looks at every file the first ``count`` samples read, with a progress line where that takes
      long (:class:`Looking`), through :meth:`check_targets` (once) and :meth:`check_file` (a file);
    * :meth:`batch`, :meth:`group`, :meth:`part_shape`, :meth:`notes` and :meth:`close` as the protocol says."""

    #: what :meth:`check_all` looks at in each file (its progress line)
    looks_at: ClassVar[str] = "the headers"
    dtype: np.dtype
    shape: tuple[int, ...]
    symmetries: int = 1
    grid: tuple[int, ...] = ()
    crops: int = 1
    #: dense classes only: the label of voxels that count nowhere (:data:`IGNORE`: a tile's padding); a set that has
    #: one is evaluated to its last sample (gems.rank.data.evaluation_batches). None: every target counts
    ignore: int | None = None
    #: dense classes only: each class's name by its label where the files name them (the Dice columns'), else None
    class_names: list[str] | None = None

    def __init__(self, layout: Layout, path: str | os.PathLike, key: str = "data.path", readers: Any = 4,
                 wanted: str = "") -> None:
        from gems.data import reader as preader

        self.layout: Any = layout
        self.key, self.path, self.is_dir = key, str(path), Path(path).is_dir()
        self.files = layout.files(path)
        if not self.files:
            raise ConfigError(key, self.path, wanted or f"a folder of {layout.about}")
        if isinstance(readers, bool) or not isinstance(readers, int) or readers < 1:
            raise ConfigError("data.readers", readers, "a positive number of threads reading a rank's samples")
        self.reader = preader.Reader(readers)  # no thread or open file before the first read
        self.slices: tuple[slice, ...] | None = None  # this rank's part of each spatial dim (None: all)
        self._notes: list[str] = []
        self._stamps: dict[int, tuple[tuple[str, tuple[int, int, int, int]], ...]] = {}

    # -- the set's shape
    def __len__(self) -> int:
        return len(self.files) * self.crops

    def locate(self, index: int) -> tuple[int, tuple[int, ...]]:
        """(file, the origin of sample ``index``'s crop in it per spatial dim): crop ``i % crops`` of file
        ``i // crops``, the crops in row-major order over ``grid``."""
        file, rest = divmod(index % len(self), self.crops)
        origin: list[int] = []
        for n, edge in zip(reversed(self.grid or (1,) * len(self.shape[1:])), reversed(self.shape[1:])):
            rest, k = divmod(rest, n)
            origin.append(k * edge)
        return file, tuple(reversed(origin))

    def group(self, index: int) -> int:
        """The file sample ``index`` is cut from: validation averages a file's crops."""
        return self.locate(index)[0]

    def source(self, index: int, symmetry: int = 0) -> tuple[int, tuple[slice, ...]]:
        """(file, the part of it per spatial dim, explicit bounds) that this rank's part of sample ``index`` is read
        from under ``symmetry`` (gems.data.augment.source_slices), within its crop (:meth:`locate`)."""
        from gems.data import augment as augmentation
        from gems.data.samples import full_slices

        file, origin = self.locate(index)
        edges = self.shape[1:]
        parts = full_slices(self.slices or (), edges)
        if symmetry:
            parts = augmentation.source_slices(symmetry, parts, edges)
        return file, tuple(slice(o + s.start, o + s.stop) for o, s in zip(origin, parts))

    def part_shape(self) -> tuple[int, ...]:
        """(C, *this rank's part) of every sample."""
        from gems.data.samples import full_slices

        return (self.shape[0], *(s.stop - s.start for s in full_slices(self.slices or (), self.shape[1:])))

    def crop(self, value: int | None) -> None:
        """``data.crop`` (a file holds crops of this edge) must be the model's input edge, or null."""
        if value is not None and any(int(value) != n for n in self.shape[1:]):
            raise ConfigError("data.crop", value, f"the model's input edge ({'x'.join(map(str, self.shape[1:]))}: "
                              "a crop is one sample), or null for it")

    def augmenting(self, augment: str) -> int:
        """How many symmetries ``data.augment`` draws among for samples of this set's shape (bad input where a
        kind does not fit them)."""
        from gems.data import augment as augmentation

        edges = self.shape[1:]
        if augment not in augmentation.KINDS:
            raise ConfigError("data.augment", augment, " | ".join(augmentation.KINDS))
        if augment == "cube" and len(set(edges)) > 1:
            raise ConfigError("data.augment", augment, f"flip or none (a sample of {'x'.join(map(str, edges))} is not "
                                                       "a cube: swapping its axes changes its shape)")
        return augmentation.count(augment, len(edges))

    # -- files that change under a run
    def where(self, index: int) -> str:
        """File ``index`` in a message: its name and place in the folder."""
        return f"{self.files[index].name} (file {index + 1} of {len(self.files)})" if self.is_dir else "the file"

    def remember(self, index: int, paths: Iterable[str | os.PathLike | tuple[str | os.PathLike, Any]]) -> None:
        """Stamp the files sample file ``index`` reads (itself, its labels, the file its values lie in), each a
        path or (path, the stamp taken where its headers were read: gems.data.samples.stamp)."""
        from gems.data.samples import stamp

        self._stamps[index] = tuple((str(p[0]), tuple(p[1])) if isinstance(p, tuple) else (str(p), stamp(p))
                                    for p in paths)

    def changed(self, index: int, what: str) -> ConfigError:
        """The refusal of file ``index`` that ``what`` happened to under the run."""
        return self._refusal(self.where(index), what)

    def _refusal(self, subject: str, what: str) -> ConfigError:
        """The one refusal of a file (``subject``: it in a message) that changed or failed a read under the run."""
        return ConfigError(self.key, self.path, "files that stay as they were when the run first read them; "
                           f"{subject} {' '.join(str(what).split())}")

    def still(self, index: int) -> None:
        """The files of sample file ``index`` as they were stamped (:meth:`remember`), else bad input naming the
        one that changed."""
        from gems.data.samples import change

        for path, was in self._stamps.get(index, ()):
            how = change(path, was)  # type: ignore[arg-type]
            if how is None:
                continue
            if os.path.realpath(path) == os.path.realpath(self.files[index]):
                raise self.changed(index, f"{how} while the run read it")
            raise self._refusal(Path(path).name, f"{how} while the run read it (it is read with {self.where(index)}: "
                                f"{path})")

    def run(self, tasks: Sequence[Any], others: Sequence[Any] = ()) -> None:
        """Do a batch's reads on the reader's threads (gems.data.reader.Reader.run); a read that fails (a file cut
        short or gone between :meth:`still` and the read) is the refusal naming the file."""
        try:
            self.reader.run(tasks, others)
        except OSError as e:
            name = str(getattr(e, "filename", None) or e)
            where = next((i for i, f in enumerate(self.files) if str(f) in name or
                          any(p in name for p, _ in self._stamps.get(i, ()))), None)
            what = f"could not be read as its headers said ({type(e).__name__}: {e})"
            if where is not None:
                raise self.changed(where, what) from None
            if getattr(e, "filename", None):  # a file of the set's, not one of the folder's list (a label file)
                raise self._refusal(Path(str(e.filename)).name, what) from None
            raise  # not a file's failure (out of file descriptors, say): not the data's fault

    # -- looking before the run
    def check_all(self, count: int | None = None, target_size: int | None = None) -> None:
        """Look at every file the first ``count`` samples read (all where None), in order, without reading the
        samples: :meth:`check_targets` once, then :meth:`check_file` a file, the first bad one a ConfigError
        naming it; a progress line where it takes long. ``target_size``: the model's outputs (a vector target's
        length, or a dense model's classes)."""
        self.check_targets(target_size)
        total = len(self)
        if count is None or int(count) >= total:
            n = len(self.files)
        else:
            n = self.locate(int(count) - 1)[0] + 1 if int(count) > 0 else 0
        tick = Looking(n, f"{self.looks_at} of {self.key}'s files")
        for i in range(n):
            self.check_file(i, target_size)
            tick(i + 1)

    def check_targets(self, target_size: int | None) -> None:
        """The set's targets against the model's outputs, once (:meth:`check_all`): none by default."""

    def check_file(self, index: int, target_size: int | None) -> None:
        """File ``index`` against the set, from its headers at most (:meth:`check_all`): none by default."""

    # -- reading
    def batch_buffer(self, shape: Sequence[int], dtype: torch.dtype, pin: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """The host tensor a batch of ``shape`` and ``dtype`` is read into: ``out`` (a previous batch's, checked),
        else a new one, pinned with ``pin`` (a GPU rank's), else numpy's memory (it asks the kernel for huge
        pages, which the copies into it run faster on, ~1.3x here)."""
        import torch

        shape = tuple(int(n) for n in shape)
        if out is None:
            return (torch.empty(shape, dtype=dtype, pin_memory=True) if pin else
                    torch.from_numpy(np.empty(shape, dtype=torch.empty(0, dtype=dtype).numpy().dtype)))
        if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError(f"out: a contiguous host tensor of {shape} {dtype}, not {tuple(out.shape)} {out.dtype}")
        return out

    def read(self, indices: Sequence[int], symmetries: Sequence[int] | None = None, pin: bool = False,
             out: Any = None) -> tuple[Any, Any]:
        raise NotImplementedError

    def finish(self, x: Any) -> torch.Tensor:
        raise NotImplementedError

    def target(self, index: int) -> Any:
        raise NotImplementedError

    def runs(self, indices: Sequence[int], symmetries: Sequence[int] | None = None) -> list[tuple[str, int, int]] | None:
        """The byte ranges (file, offset, bytes) :meth:`read` reads by position for ``indices``: what ``gems bench
        data``'s bound reads with no reader around it. None where a layout's reads are not ranges of its files
        (TFRecords: each record read whole and decoded)."""
        return None

    def batch(self, indices: Sequence[int], symmetries: Sequence[int] | None = None, raw: bool = False,
              pin: bool = False) -> tuple[Any, Any]:
        """:meth:`read` (into pinned memory with ``pin``), then :meth:`finish` on the host; ``raw``: the values as
        stored, each sample's symmetry applied, channels first (the raw batch's ``oriented()``)."""
        x, targets = self.read(indices, symmetries, pin)
        return (x.oriented() if raw else self.finish(x)), targets

    def notes(self) -> list[str]:
        return list(self._notes)

    def close(self) -> None:
        """Stop the reader's threads and close its files (a later read opens them again)."""
        self.reader.close()


_LISTINGS: dict[str, list[str]] | None = None  # while :func:`detect` asks every layout: each folder listed once


def listing(folder: Path) -> list[str]:
    """The names of ``folder``'s regular files, hidden ones left out, sorted, from its directory entries alone (a
    data set may hold half a million files: none is looked at more); listed once while :func:`detect` asks every
    layout."""
    if _LISTINGS is not None and str(folder) in _LISTINGS:
        return _LISTINGS[str(folder)]
    with os.scandir(folder) as entries:
        names = sorted(e.name for e in entries if not e.name.startswith(".") and e.is_file())
    if _LISTINGS is not None:
        _LISTINGS[str(folder)] = names
    return names


_REGISTRY: dict[str, Layout] = {}
L = TypeVar("L", bound=type[Layout])


def register(cls: L) -> L:
    """Register a :class:`Layout` subclass under its ``name`` (the value of ``data.layout``)."""
    if not cls.name or cls.name in _REGISTRY and type(_REGISTRY[cls.name]) is not cls:
        raise ValueError(f"layout {cls.__name__}: a name of its own (not {cls.name!r})")
    _REGISTRY[cls.name] = cls()
    return cls


def registered() -> dict[str, Layout]:
    """Every layout, by name (sorted)."""
    _load()
    return dict(sorted(_REGISTRY.items()))


def get(name: str, key: str = "data.layout") -> Layout:
    """The layout named ``name``; an unknown name is bad input naming ``key``."""
    layouts = registered()
    if name not in layouts:
        raise ConfigError(key, name, "one of " + ", ".join(layouts) + ", or null to detect it from the files")
    return layouts[name]


def detect(path: str | os.PathLike, name: str | None = None, key: str = "data.path") -> Layout:
    """The layout of the files at ``path`` (``key`` names it): ``name`` (``data.layout``) where given, and then it
    must hold them; else the one layout that holds them (none, or several, is bad input naming the key to set)."""
    global _LISTINGS
    _LISTINGS = {}
    try:
        return _detect(path, name, key)
    finally:
        _LISTINGS = None


def dangling(path: str | os.PathLike, key: str = "data.path") -> None:
    """A symbolic link in the folder ``path`` whose target is missing is bad input naming it: the docs advise
    gathering files with links, and one that points nowhere would leave its samples out of the set silently."""
    p = Path(path)
    if not p.is_dir():
        return
    with os.scandir(p) as entries:
        for e in entries:
            if not e.name.startswith(".") and e.is_symlink() and not os.path.exists(e.path):
                raise ConfigError(key, str(p), f"files that are there; {e.name} is a symbolic link to "
                                  f"{os.readlink(e.path)}, which is missing (mend or remove the link)")


def _detect(path: str | os.PathLike, name: str | None, key: str) -> Layout:
    dangling(path, key)
    layouts = registered()
    if name is not None:
        layout = get(name)
        files = layout.files(path)
        if not files:
            raise ConfigError("data.layout", name, f"the layout of the files at {key}={path} (it holds no file "
                              f"ending in {' or '.join(layout.suffixes)}), or null to detect it")
        if not layout.holds(files):
            others = [n for n, lay in layouts.items() if n != name and (fs := lay.files(path)) and lay.holds(fs)]
            seen = f"they look like {' or '.join(others)}" if others else f"{files[0].name} is not {layout.about}"
            raise ConfigError("data.layout", name, f"the layout of the files at {key}={path} ({seen}), or null to "
                              "detect it")
        return layout
    found = [lay for lay in layouts.values() if (fs := lay.files(path)) and lay.holds(fs)]
    if len(found) == 1:
        return found[0]
    if found:
        raise ConfigError("data.layout", None, f"one of {', '.join(lay.name for lay in found)}: the files at "
                          f"{key}={path} fit each of them, so name theirs")
    raise ConfigError(key, str(path), f"a folder (or file) of samples in a layout gems reads ({', '.join(layouts)}: "
                      f"docs/data.md; `gems data synth` writes one); {closest(path, layouts, key)}")


#: names of a training set's and a validation set's folders, as published sets split them
_TRAIN, _VAL = ("train", "training"), ("validation", "val", "valid")


def closest(path: str | os.PathLike, layouts: dict[str, Layout], key: str = "data.path") -> str:
    """What a folder no layout holds comes closest to, in a few words (the refusal's end): the layout whose files
    it holds under other names, the subfolders that hold samples (a training and a validation folder: the keys
    that name them), or that it holds nothing gems reads."""
    listed = sorted({f for lay in layouts.values() for f in lay.files(path)})
    if listed:
        why = (lay.broken(listed[0]) for lay in layouts.values() if listed[0] in lay.files(path))
        return next((w for w in why if w), f"{listed[0].name} is none of them")
    p = Path(path)
    subs = holding_subfolders(path, layouts.values())
    if subs:
        names = {s.name.lower(): s for s, _, _ in subs}
        train = next((names[n] for n in _TRAIN if n in names), None)
        val = next((names[n] for n in _VAL if n in names), None)
        if train is not None and val is not None and key == "data.path":
            return (f"it holds no sample file but a training and a validation folder: data.path={train} "
                    f"data.val_path={val}")
        shown = ", ".join(f"{s.name}/ ({n} {what})" for s, n, what in subs[:4]) + (", ..." if len(subs) > 4 else "")
        return (f"it holds no sample file, but {len(subs)} subfolder(s) of them: {shown}. gems reads the files of one "
                "folder, not its subfolders: name one, or gather their files into one folder (symbolic links will do)")
    if p.is_dir():  # files a layout reads, by their ending, under names or places it does not take
        near = [(lay, n) for lay in layouts.values() for n in listing(p) if n.endswith(lay.suffixes)]
        if near:
            lay, n = near[0]
            return f"it comes closest to {lay.name} ({lay.about}), whose files end as {n} does"
    return "it holds no file any of them reads"


def holding_subfolders(path: str | os.PathLike, candidates: Iterable[Layout]) -> list[tuple[Path, int, str]]:
    """(subfolder, files, what they are: their endings) of each folder right under ``path`` that holds files a layout of
    ``candidates`` reads (a universe set split into folders: the message of a folder that holds only those)."""
    p = Path(path)
    if not p.is_dir():
        return []
    with os.scandir(p) as entries:
        subs = sorted(Path(e.path) for e in entries if not e.name.startswith(".") and e.is_dir())
    layouts = list(candidates)
    out = []
    for sub in subs:
        found = {f for lay in layouts for f in lay.files(sub)}
        if found:
            kinds = sorted({"".join(f.suffixes[-2:]) if f.name.endswith(".gz") else f.suffix for f in found})
            out.append((sub, len(found), "/".join(kinds) + " file(s)"))
    return out


def reader_threads(requested: int, cpus: int | None = None) -> tuple[int, str | None]:
    """(reader threads, why fewer than ``requested``): ``data.readers`` capped by the CPUs a Slurm task has
    (``cpus`` where given: the plan's ``cluster.cpus_per_task``; in a Slurm task, its ``SLURM_CPUS_PER_TASK``
    and the CPUs it may run on; elsewhere no cap). Slurm's default is one CPU a task, where four reader threads
    would take turns on that one core with the step."""
    if cpus is None:
        if not any(k in os.environ for k in ("SLURM_JOB_ID", "SLURM_CPUS_PER_TASK")):
            return max(1, int(requested)), None
        have = [len(os.sched_getaffinity(0))] if hasattr(os, "sched_getaffinity") else [os.cpu_count() or 1]
        slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
        if slurm.isdigit() and int(slurm) > 0:
            have.append(int(slurm))
        cpus = min(have)
    n = max(1, min(int(requested), int(cpus)))
    if n < int(requested):
        return n, (f"data.readers={requested} capped to {n}: a Slurm task of {cpus} CPU(s) (cluster.cpus_per_task); "
                   "more reader threads would only take turns on them with the step")
    return n, None


_loaded = False


def _load() -> None:
    """Import every module of this package (each registers its layouts)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    import_modules(__name__)


#: each set's listing: (key, folder) -> (its files' names, the modification times of the folders they lie in)
_SET_FILES: dict[tuple[str, str], tuple[list[str], dict[str, int]]] = {}


def set_files(cfg: Any) -> dict[str, list[str]]:
    """The files of each data set ``cfg`` reads (``data.path``'s, ``data.val_path``'s), by key: the sample files its
    layout lists, as names under the set's folder, sorted; listed again only where a folder they lie in changed.
    What a checkpoint keeps of the sets its run trained on (gems.checkpoint.files)."""
    from gems.config import reads_files

    d = cfg.data
    out: dict[str, list[str]] = {}
    for key, path in (("data.path", d.path), ("data.val_path", d.get("val_path"))) if reads_files(d) else ():
        if path in (None, ""):
            continue
        kept = _SET_FILES.get((key, str(path)))
        if kept is None or any(os.stat(f).st_mtime_ns != t for f, t in kept[1].items()):
            root = Path(str(path))
            found = detect(root, d.get("layout"), key).files(root)
            folders = {str(f) for f in (root, *(f.parent for f in found))}
            kept = _SET_FILES[key, str(path)] = (sorted(str(f.relative_to(root)) if root.is_dir() else f.name
                                                        for f in found), {f: os.stat(f).st_mtime_ns for f in folders})
        out[key] = kept[0]
    return out


owned("data.layout", lambda: registered())  # the configuration checks and lists them (gems.config.owned)
lists(set_files)  # a checkpoint keeps each set's files (gems.checkpoint.files)
