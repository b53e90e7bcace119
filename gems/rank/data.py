"""What a rank reads each step, and when: which global samples a step trains on (:class:`Sampler`), the rank's share of
them (its replica's, its spatial part of the inputs where it runs a first stage, the targets where it runs a last
one), read ahead of the step by a background reader (:class:`Prefetcher`), and a node's files staged first.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from omegaconf import DictConfig

from gems.config import DEFAULT_STEPS, reads_files, section
from gems.errors import ConfigError
from gems.models import ModelSpec

if TYPE_CHECKING:
    from gems.rank.steppers import Stepper



# ---------------------------------------------------------------------------- the sets
def make_data(cfg: DictConfig, spec: ModelSpec, slices: tuple[slice, ...] | None = None,
              validation: bool = False, device: torch.device | None = None, staged: Staged | None = None) -> Any:
    """The training set (or, ``validation``, the validation set; None where there is none) as this rank reads it;
    synthetic inputs are drawn on ``device`` (a GPU rank's GPU: gems.data.synthetic.sample_input); ``staged``:
    read from the node-local copies (:func:`stage`)."""
    d = cfg.data
    if reads_files(d):  # files in a layout gems reads (gems.data.layouts: detected, or data.layout)
        from gems.data import layouts

        path = d.val_path if validation else d.path
        if staged is not None and path is not None:
            path = str(staged.val if validation else staged.train)
        key = "data.val_path" if validation else "data.path"
        if path is None:
            return None
        layout = layouts.detect(path, d.get("layout"), key)
        readers, _ = layouts.reader_threads(int(d.readers))  # capped by the task's CPUs (notes: data_notes)
        classes = spec.classes
        return _HDF5Batches(layout.open(path, spec.input_shape, key=key, slices=slices, crop=d.crop,
                                        standardize=d.standardize, augment="none" if validation else d.augment,
                                        readers=readers, target=spec.target, window=d.window, classes=classes,
                                        orientation=str(d.orientation), affine_tolerance=float(d.affine_tolerance)),
                            pin=device is not None and device.type == "cuda", evaluated=validation)
    if d.augment != "none":
        raise ConfigError("data.augment", d.augment, "none for synthetic data (its samples are drawn, not read: "
                                                     "data=files reads files it can mirror)")
    from gems.data.synthetic import SyntheticData

    if validation:  # held out: the indices after the training set's, which no step trains on
        n = int(d.val_samples)
        return SyntheticData(spec, int(cfg.train.seed), n, offset=int(d.num_samples), device=device) if n else None
    return SyntheticData(spec, int(cfg.train.seed), int(d.num_samples), device=device)


def data_notes(cfg: DictConfig, data: Any) -> list[str]:
    """What a run says of how it reads its files (the record's notes): the layout, the reader threads where the
    task's CPUs cap ``data.readers``, files read on a slow path (gems.data.layouts.Samples.notes)."""
    samples = getattr(data, "samples", None)
    if samples is None:
        return []
    from gems.data import layouts

    out = [f"data: {len(samples.files)} file(s) of layout {samples.layout.name} ({samples.layout.about})"]
    why = layouts.reader_threads(int(cfg.data.readers))[1]
    return out + ([why] if why else []) + list(samples.notes())


def class_names(data: Any, metric: Any) -> list[str] | None:
    """The classes' names by label where the metric counts Dice a class (a class a voxel): the data set's (LiTS's,
    a Decathlon task's dataset.json) where it names as many, else ``class K``; None for other models."""
    if metric is None or not getattr(metric, "dice", False):
        return None
    n = int(metric.spec.num_outputs)
    samples = getattr(data, "samples", None)  # (synthetic data has no files)
    names = samples.class_names if samples is not None else None
    return list(names) if names and len(names) == n else [f"class {k}" for k in range(n)]


def dataset_size(cfg: DictConfig, spec: ModelSpec | None = None) -> int:
    """Samples in the training set, without reading them (HDF5: the crops of the files in data.path, from the
    first file's header)."""
    if reads_files(cfg.data):
        if spec is None:
            from gems.models import build_model

            spec = build_model(section(cfg, "model"))
        return len(make_data(cfg, spec))
    return int(cfg.data.num_samples)


def evaluation_batches(data: Any, batch: int) -> int:
    """The batches of ``batch`` samples an evaluation of ``data`` runs: every sample of a set whose labels can be
    ignored (``ignore``: dense classes read from files), its last partial batch filled with samples that count
    nowhere (:meth:`_HDF5Batches.batch`: ids past the end); else its whole batches (a partial last one left out:
    vector targets have no label to ignore, and a smaller batch would not split over every mesh alike)."""
    n = len(data)
    return -(-n // batch) if getattr(data, "fills", False) else n // batch


class _HDF5Batches:
    """The worker's view of HDF5 samples: this rank's hyperslab, inputs or targets as needed."""

    def __init__(self, samples: Any, pin: bool = False, evaluated: bool = False) -> None:
        self.samples = samples
        self.pin = pin  # a GPU rank's: batches of counts read into pinned memory, copied to the GPU as they are
        # a validation set whose labels can be ignored: ids past its end are samples that count nowhere (a training
        # set's wrap around to its first samples, as a run without epochs walks it)
        self.fills = evaluated and samples.ignore is not None

    def __len__(self) -> int:
        return len(self.samples)

    def _past_end(self, indices: Sequence[int], y: torch.Tensor | None) -> torch.Tensor | None:
        """``y`` with the labels of the samples past the set's end (:func:`evaluation_batches`' filling) ignored
        (a validation set with ``ignore``; their inputs are the set's first samples, read as any)."""
        past = [r for r, i in enumerate(indices) if i >= len(self.samples)] if self.fills else []
        if y is None or not past:
            return y
        y = y.clone()
        y[past] = self.samples.ignore
        return y

    @property
    def symmetries(self) -> int:
        return int(self.samples.symmetries)

    def batch(self, indices: list[int], slices: Any = None, want_input: bool = True, want_target: bool = True,
              symmetries: Sequence[int] | None = None, raw: bool = False) -> tuple[Any, torch.Tensor | None]:
        """``raw``: the inputs as the files' counts, which :meth:`finish` turns into the network's input where the
        step runs (the reader's transform on a GPU rank's GPU, not its host: half the bytes to copy for int16 counts
        and no float pass over them on the host). They come as gems.data.hdf5.Counts, each sample as read with its
        symmetry (data.augment) still to apply, which :meth:`finish` applies there too; the Prefetcher copies
        them as it copies a tensor (their ``is_cuda``, ``pin_memory`` and ``to``)."""
        if not want_input:
            return None, self._past_end(indices, torch.stack([self.samples.target(i) for i in indices]))
        x, y = self.samples.read(indices, symmetries, pin=self.pin) if raw else self.samples.batch(indices, symmetries)
        return x, (self._past_end(indices, y) if want_target else None)

    def finish(self, x: Any) -> torch.Tensor:
        return self.samples.finish(x)


# ---------------------------------------------------------------------------- staging
class Staged:
    """The node-local copies of a job's files (``data.stage=node``): ``train`` and ``val`` folders under ``root``."""

    def __init__(self, root: Path, files: int, nbytes: int, seconds: float) -> None:
        self.root, self.train, self.val = root, root / "train", root / "val"
        self.files, self.nbytes, self.seconds = files, nbytes, seconds

    def note(self) -> str:
        return (f"data.stage=node: {self.files} files ({self.nbytes / 2**30:.2f} GiB) copied to {self.root} in "
                f"{self.seconds:.1f} s, once at the start")

    def discard(self, world: Any) -> None:
        """Remove the node's copies without waiting for the other ranks (a failure, a preemption: they stop too;
        one rank per node removes them)."""
        import shutil

        if world.local_rank == 0:
            shutil.rmtree(self.root, ignore_errors=True)


#: seconds between looks at whether the other ranks have copied their share (a wait through the rendezvous store,
#: not a collective: a long copy must not run into the collectives' timeout)
STAGE_POLL_S = 1.0


def stage_root(cfg: DictConfig, run_id: str) -> Path:
    """The node-local folder of a job's copies: unique to the run, the Slurm job and the node, so nodes whose
    ``TMPDIR`` lies on shared storage never write the same paths."""
    import socket

    base = Path(str(cfg.data.stage_dir or os.environ.get("TMPDIR") or "/dev/shm"))
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    return base / f"gems-stage-{run_id}-{os.environ.get('SLURM_JOB_ID', 'local')}-{node}"


def _listing(cfg: DictConfig, world: Any) -> list[tuple[str, str, int]]:
    """(file, where it goes under the node's folder: train|val/its path under its folder, bytes) of every file the
    job reads, listed once by rank 0 and sent to every rank (a parallel filesystem answers one rank's glob and
    stats, not every rank's)."""
    d = cfg.data
    out: list[tuple[str, str, int]] = []
    if world.rank == 0:
        from gems.data import layouts

        for kind, src in (("train", d.path), ("val", d.val_path)):
            if src:
                lay = layouts.detect(str(src), d.get("layout"), "data.path" if kind == "train" else "data.val_path")
                base = Path(str(src)) if Path(str(src)).is_dir() else Path(str(src)).parent
                kept = [g for f in lay.files(str(src)) for g in (f, *lay.companions(f))] + lay.folder_files(str(src))
                out += [(str(g), f"{kind}/{g.relative_to(base)}", g.stat().st_size) for g in kept]
    if world.size > 1:
        import torch.distributed as dist

        box: list[Any] = [out]
        dist.broadcast_object_list(box, src=0)
        out = box[0]
    return out


def _wait_for(counter: Any, key: str, want: int) -> None:
    """Wait until ``want`` ranks have added 1 to ``key`` in the rendezvous store: a wait for peers (the watchdog
    looks for the cause among the ranks still copying, which mark every file)."""
    from gems import progress

    with progress.waiting("staged copies"):
        while counter.add(key, 0) < want:
            time.sleep(STAGE_POLL_S)


def stage(cfg: DictConfig, world: Any, run_id: str) -> Staged | None:
    """``data.stage=node``: copy the files the job reads (the training set, and the validation set) to node-local
    storage once, at job start, split over the node's ranks (each copies every k-th file, k its ranks on the node;
    every node holds all of them, as any rank may read any sample over the epochs), with a progress line.

    At thousands of ranks: rank 0 lists the files and sends the list (:func:`_listing`); every copied file is a
    progress mark, so the watchdog sees a long copy move; the ranks wait for each other through the rendezvous
    store, never in a collective whose timeout a long copy would outlast; the folder is unique to job and node
    (:func:`stage_root`); a file already complete there (a requeued job on the same node) is not copied again.
    The copies are removed by :func:`unstage` at the end, by :meth:`Staged.discard` on a failure or a
    preemption."""
    import shutil

    from gems import progress
    from gems.bootstrap import ranks_on_this_node

    d = cfg.data
    if d.stage != "node" or not reads_files(d):
        return None
    root = stage_root(cfg, run_id)
    per_node, me = max(1, ranks_on_this_node()), world.local_rank
    listing = _listing(cfg, world)
    t0, done, nbytes = time.perf_counter(), 0, sum(n for _, _, n in listing)
    for i, (name, where, size) in enumerate(listing):
        if i % per_node != me:
            continue
        f, to = Path(name), root / where  # its place under its folder kept (a Decathlon task's imagesTr/, labelsTr/)
        to.parent.mkdir(parents=True, exist_ok=True)
        if not (to.is_file() and to.stat().st_size == size):
            tmp = to.with_name(f".{to.name}.part")
            shutil.copyfile(f, tmp)
            tmp.rename(to)  # a reader never sees half a file
        done += 1
        progress.mark("staging")
        if me == 0 and world.rank == 0 and (done % max(1, len(listing) // (10 * per_node)) == 0):
            print(f"gems: staging to {root}: {done * per_node}/{len(listing)} files", flush=True)
    if world.size > 1:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        store.add(f"gems/staged/{run_id}", 1)
        _wait_for(store, f"gems/staged/{run_id}", world.size)
    return Staged(root, len(listing), nbytes, time.perf_counter() - t0)


def unstage(staged: Staged | None, world: Any, barrier: Callable[[], None]) -> None:
    """Remove the node-local copies once every rank is done reading them (one rank per node)."""
    if staged is None:
        return
    barrier()
    staged.discard(world)


# ---------------------------------------------------------------------------- which samples
class Sampler:
    """The global sample indices of each step. Without ``epochs`` step ``t`` trains on samples ``t B .. (t+1) B - 1``
    (wrapping around the set, as a throughput run needs); with it each epoch walks the set once in an order drawn
    from ``(seed, epoch)`` (``shuffle``), the same on every rank, in batches of ``B``, its last partial batch
    dropped. Replica ``r`` takes the ``r``-th contiguous share (docs/design.md, "Global batch and the loss"). The
    order is a pure function of the step, so a resumed run goes on mid-epoch exactly."""

    def __init__(self, num_samples: int, batch: int, seed: int, epochs: int | None = None,
                 steps: int | None = None, shuffle: bool = True, symmetries: int = 1) -> None:
        self.n, self.batch, self.seed, self.epochs, self.shuffle = int(num_samples), int(batch), int(seed), epochs, shuffle
        self.symmetries = int(symmetries)  # data.augment: each sample's symmetry drawn among these, per epoch
        self._syms: dict[int, list[int] | None] = {}
        if epochs is not None and self.n < self.batch:
            raise ConfigError("train.batch_size", batch, f"at most the {self.n} samples of the training set "
                              "(train.epochs walks it in whole batches)")
        self.steps_per_epoch = self.n // self.batch
        self.total = epochs * self.steps_per_epoch if epochs is not None else (DEFAULT_STEPS if steps is None else steps)
        self._orders: dict[int, list[int]] = {}

    def epoch_of(self, step: int) -> float:
        """The (fractional) epoch a step is in: its epoch plus the share of that epoch done before it."""
        per = self.steps_per_epoch if self.epochs is not None else max(1, self.n // self.batch)
        return step / per

    def _generator(self, epoch: int, stream: int) -> torch.Generator:
        """The random stream ``stream`` of ``epoch`` (5: the order, 3: the symmetries), from train.seed."""
        return torch.Generator().manual_seed((self.seed * 1_000_003 + int(epoch)) * 7 + stream)

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            if self.shuffle:
                self._orders = {epoch: torch.randperm(self.n, generator=self._generator(epoch, 5)).tolist()}
            else:
                self._orders = {epoch: list(range(self.n))}
        return self._orders[epoch]

    def indices(self, step: int) -> list[int]:
        """The step's global batch, in the order its replicas share it."""
        if self.epochs is None:  # a throughput run: consecutive indices (the dataset wraps them)
            return list(range(step * self.batch, (step + 1) * self.batch))
        epoch, k = divmod(step, self.steps_per_epoch)
        return self.order(epoch)[k * self.batch:(k + 1) * self.batch]

    def replica_indices(self, step: int, replicas: int, replica: int) -> list[int]:
        """Replica ``replica``'s contiguous share of the step's batch."""
        return share(self.indices(step), replicas, replica)

    def symmetries_of(self, step: int, ids: Sequence[int]) -> list[int] | None:
        """The box symmetry (gems.data.augment) each sample of ``ids`` gets at ``step``: drawn per sample from
        (seed, epoch), so a sample seen again in the same epoch (a run without epochs wraps) gets the same one;
        None without data.augment."""
        epoch = int(self.epoch_of(step))
        if epoch not in self._syms:
            from gems.data.augment import draw

            self._syms = {epoch: draw(self.symmetries, self.n, self._generator(epoch, 3))}
        syms = self._syms[epoch]
        return None if syms is None else [syms[i % self.n] for i in ids]


def share(ids: Sequence[int], replicas: int, replica: int) -> list[int]:
    """The ``replica``-th contiguous share of a batch's sample ids."""
    n = len(ids) // replicas
    return list(ids[replica * n:(replica + 1) * n])


def replica_indices(step: int, batch: int, replicas: int, replica: int) -> list[int]:
    """Global sample indices of replica ``replica`` at ``step`` of a run without epochs."""
    return Sampler(batch, batch, 0).replica_indices(step, replicas, replica)


def step_batch(data: Any, par: Stepper, step: int, batch: int, replicas: int, replica: int,
               sampler: Sampler | None = None,
               raw: bool = False) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
    """(sample indices, input, target) of ``step`` on a rank: its replica's samples, its spatial part of the
    inputs where it runs a first stage, the targets where it runs a last one; ``raw``: the inputs as read, for
    ``data.finish`` (:func:`finisher`)."""
    ids = (sampler.replica_indices(step, replicas, replica) if sampler is not None
           else replica_indices(step, batch, replicas, replica))
    syms = sampler.symmetries_of(step, ids) if sampler is not None else None
    x, y = data.batch(ids, par.input_slices, want_input=par.needs_input, want_target=par.needs_target,
                      symmetries=syms, **({"raw": True} if raw else {}))
    return ids, x, y


def finisher(data: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What turns a set's raw inputs into the network's (read samples: their counts' transform); None for a set
    whose batches come finished (synthetic samples, drawn as the network takes them)."""
    return getattr(data, "finish", None)


# ---------------------------------------------------------------------------- when
Batch = tuple[list[int], Any, Any]


class Prefetcher:
    """Reads the batches of ``steps`` ahead on a thread, ``depth`` (``data.prefetch``) of them at most, in a bounded
    queue; ``fetch`` makes one step's (ids, input, target) on the host. ``depth`` 0 reads in the caller's thread.
    The step waits only for what is not ready yet (the record's ``time_breakdown_s.data``; ``data_reader_s``: the
    reader's own time). On GPU ranks the reader pins host memory and copies on a side stream, and the step's stream
    waits for the copy's event. What a step computes does not change: the losses are the same bit for bit."""

    def __init__(self, fetch: Callable[[int], Batch], steps: Sequence[int], depth: int, device: torch.device,
                 finish: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.fetch, self.steps, self.depth, self.device = fetch, list(steps), int(depth), device
        self.finish = finish  # raw inputs to the network's, where the batch lands (finisher)
        self.reader_s = 0.0  # seconds the reader spent making batches (all steps)
        self.peek_s = 0.0  # seconds the step waited in :meth:`failed_ahead` (data time the step took)
        self._later = set(self.steps)
        self._q: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=max(1, self.depth))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._side: Any = None
        if self.depth > 0 and self.steps:
            if device.type == "cuda":
                self._side = torch.cuda.Stream(device=device)
            self._thread = threading.Thread(target=self._run, name="gems-prefetch", daemon=True)
            self._thread.start()

    def _make(self, step: int) -> tuple[Batch, Any]:
        t0 = time.perf_counter()
        event = None
        if self._side is None:
            ids, x, y = self.fetch(step)
            if self.device.type == "cuda":  # read in the step (depth 0): the files' counts copied from pinned
                # memory as they are, finished on the GPU (not made float32 on the host and copied from pageable)
                x, y = (t if t is None or t.is_cuda else t.pin_memory().to(self.device, non_blocking=True)
                        for t in (x, y))
            if x is not None and self.finish is not None:
                x = self.finish(x)
        else:  # on the side stream: samples drawn on the GPU there, or host ones pinned and copied (read ones as
            # their counts, finished there); the step waits
            from gems.rank.graphs import CUDA_WORK

            with CUDA_WORK, torch.cuda.stream(self._side):  # (never while the step's model is being captured)
                ids, x, y = self.fetch(step)
                x, y = (t if t is None or t.is_cuda else t.pin_memory().to(self.device, non_blocking=True)
                        for t in (x, y))
                if x is not None and self.finish is not None:
                    x = self.finish(x)
                event = torch.cuda.Event()
                event.record(self._side)
        self.reader_s += time.perf_counter() - t0
        return (ids, x, y), event

    def _run(self) -> None:
        if self.device.type == "cuda":
            # the thread's own current device (CUDA keeps one a thread): the rank's GPU, not GPU 0, so that pinning,
            # the side stream's work and leaving its context never make a context on another rank's GPU
            torch.cuda.set_device(self.device)
        for step in self.steps:
            if self._stop.is_set():
                return
            try:
                item: Any = self._make(step)
            except BaseException as e:  # handed to the step that needs it, raised there
                item = e
            while not self._stop.is_set():
                try:
                    self._q.put((step, item), timeout=0.2)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def get(self, step: int) -> tuple[Batch, float]:
        """Step ``step``'s batch on the rank's device, and the seconds the caller waited for it."""
        t0 = time.perf_counter()
        if self._thread is None:
            (ids, x, y), _ = self._make(step)
        else:
            got, item = self._q.get()
            if isinstance(item, BaseException):
                raise item
            assert got == step, f"the reader made step {got}, the run is at step {step}"
            (ids, x, y), event = item
            if event is not None:
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(event)
                for t in (x, y):
                    if t is not None:
                        t.record_stream(stream)
        if self._side is None:
            x = x.to(self.device, non_blocking=True) if x is not None else None
            y = y.to(self.device, non_blocking=True) if y is not None else None
        return (ids, x, y), time.perf_counter() - t0

    def failed_ahead(self, step: int, ahead: int = 1) -> BaseException | None:
        """The error the reader met making step ``step + ahead``'s batch, waiting until it is made (its time added
        to :attr:`peek_s`); None where it was made, where the run ends before it, or where no reader runs ahead far
        enough (``data.prefetch`` under ``ahead``: the queue would never hold it). A rank that finds a bad file this
        way says so in a step's sync before it needs the batch, so that every rank stops together after that step
        (gems.rank.loop: nothing trained is lost)."""
        target = step + ahead
        if self._thread is None or self.depth < ahead or target not in self._later:
            return None
        t0 = time.perf_counter()
        q = self._q
        try:
            with q.not_empty:
                while True:
                    pending = list(q.queue)
                    for got, item in pending:
                        if got == target or isinstance(item, BaseException):
                            return item if isinstance(item, BaseException) else None
                    if not self._thread.is_alive() or self._stop.is_set():
                        return None
                    q.not_empty.wait(0.2)
        finally:
            self.peek_s += time.perf_counter() - t0

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
