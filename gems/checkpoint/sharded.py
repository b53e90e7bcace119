"""Checkpoints under the whole model's names, written by the writers through DCP and read back on any mesh.

Every rank holds the serial model's own tensors, so a checkpoint is keyed by the serial ``state_dict``'s names
(``model.<name>``, ``optim.<name>.<key>``, ``ema.<name>``: ``gems.rank.compose.whole_names``); the first
``train.checkpoint_writers`` replicas of each pipeline position write it (:class:`Saver`), and loading reshards,
each rank reading the names it holds. ``latest`` moves once every writer's files are complete (:func:`retire`).
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from gems.config import FILES
from gems.errors import ConfigError
from gems.storage import StorageFailed, writing

#: the keys a job's own checkpoint must be resumed with (a requeued job comes back with them; the mesh, the
#: schedule and the micro-batches may change: the state is the whole model's). Another run's checkpoint
#: (train.resume_from) asks only for its model and optimizer, and a different global batch is said in the record
FINGERPRINT_KEYS = ("model", "train.batch_size", "train.optimizer", "train.precision", "train.seed", "data.name",
                    "data.num_samples")
META = "gems.json"
#: history entries that are the rank's own timings: a run resumed on another mesh starts them afresh
TIMINGS = ("step_times", "every_step_time", "tensor_peaks", "breakdown", "reader_s", "elapsed_s")


@dataclass(frozen=True)
class Share:
    """Whether this rank writes its pipeline position's tensors, and which of the position's ``writers`` it is
    (:func:`share_of`)."""

    name: str
    writes: bool
    index: int = 0
    writers: int = 1


def writer_count(mesh: Any, cap: int) -> int:
    """Copies of each pipeline position that write its checkpoint: ``train.checkpoint_writers``, at most R."""
    return max(1, min(int(mesh.replicas), int(cap)))


def share_of(mesh: Any, rank: int, cap: int = 1) -> Share:
    """The first :func:`writer_count` replicas of each pipeline position write it, spatial part 0 of each (the
    parts of one replica hold the same tensors and mostly share a node): writer ``k`` is replica ``k``."""
    c, w = mesh.coord(rank), writer_count(mesh, cap)
    writes = c.replica < w and c.spatial == 0
    return Share(f"d{c.pipeline}", writes, c.replica if writes else -1, w)


def writer_ranks(mesh: Any, cap: int) -> list[int]:
    """Every rank that writes checkpoints (:func:`share_of`), in order: the ranks of their process group."""
    return sorted(mesh.rank_of(r, d, 0) for d in range(mesh.pipeline) for r in range(writer_count(mesh, cap)))


@dataclass(frozen=True)
class Chunk:
    """Rows ``[start, start + rows)`` along dim 0 of entry ``name`` (a 0-dim tensor: all of it, rows 1)."""

    name: str
    start: int
    rows: int


def layout(entries: dict[str, tuple[tuple[int, ...], int]], writers: int) -> list[list[Chunk]]:
    """What each of a position's ``writers`` writes of its ``entries`` ({name: (shape, bytes an element)}): the
    entries laid end to end in name order and cut into ``writers`` runs of equal bytes, each row (dim 0) going to
    the run its middle byte falls in. Every writer gets about 1/``writers`` of the bytes (at most a row more or
    less), at most one chunk of each entry, and a writer whose run holds no row writes nothing. A pure function of
    the entries: every copy of a position computes the same one, and mirrored positions (GEMS, which hold the
    same partitions) the same chunks, which DCP's planner then keeps once."""
    out: list[list[Chunk]] = [[] for _ in range(max(1, writers))]
    names = sorted(entries)

    def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:  # (rows, elements a row)
        return (int(shape[0]), math.prod(shape[1:])) if len(shape) else (1, 1)

    total = sum(rows_of(entries[n][0])[0] * rows_of(entries[n][0])[1] * entries[n][1] for n in names)
    w, off = len(out), 0
    for n in names:
        shape, itemsize = entries[n]
        rows, per = rows_of(shape)
        rb = per * itemsize
        if rows == 0 or rb == 0 or total == 0:  # an empty tensor: its metadata, from the first writer
            out[0].append(Chunk(n, 0, rows))
            continue
        def run(i: int) -> int:  # the run row i's middle byte falls in
            return min(w - 1, (2 * (off + i * rb) + rb) * w // (2 * total))

        def first_row(k: int) -> int:  # the first row of run k (rows of run k or later: middle byte >= k T / w)
            return max(0, -(-(2 * k * total - (2 * off + rb) * w) // (2 * rb * w)))

        a, b = run(0), run(rows - 1)
        starts = [0] + [first_row(k) for k in range(a + 1, b + 1)] + [rows]
        for k, (lo, hi) in zip(range(a, b + 1), zip(starts, starts[1:])):
            if hi > lo:
                out[k].append(Chunk(n, lo, hi - lo))
        off += rows * rb
    return out


def ckpt_dir(cfg: Any) -> Path:
    from gems.results.record import job_dir

    return job_dir(cfg) / "ckpt"


def fingerprint(cfg: Any) -> dict[str, Any]:
    """The values of :data:`FINGERPRINT_KEYS` (flattened, resolved) in ``cfg``."""
    from omegaconf import OmegaConf

    out: dict[str, Any] = {}
    for key in FINGERPRINT_KEYS:
        val = OmegaConf.select(cfg, key, default=None)
        if OmegaConf.is_config(val):
            val = OmegaConf.to_container(val, resolve=True)
        if isinstance(val, dict):
            for k, v in sorted(val.items()):
                out[f"{key}.{k}"] = v
        else:
            out[key] = "files" if key == "data.name" and val in FILES else val  # (hdf5: files' older name)
    return json.loads(json.dumps(out))  # tuples -> lists: compares equal to what was saved


def _differs(saved: dict[str, Any], now: dict[str, Any], keys: Callable[[str], bool] = lambda k: True
             ) -> str | None:
    return next((k for k in sorted(set(saved) | set(now)) if keys(k) and saved.get(k) != now.get(k)), None)


def check_fingerprint(cfg: Any, where: Path | None = None) -> None:
    """ConfigError naming the first key in which ``cfg`` differs from the checkpoint in ``where`` (the job's own)."""
    d = where if where is not None else ckpt_dir(cfg)
    step = latest_step(d)
    if step is None:
        return
    meta = read_meta(d / f"step{step:08d}")
    now = fingerprint(cfg)
    key = _differs(meta.get("fingerprint") or {}, now)
    if key is not None:
        raise ConfigError(key, now.get(key), f"{meta['fingerprint'].get(key)} (the value the checkpoint in {d} was "
                          "saved with; a job resumes only with the model and optimizer it started with, or give a "
                          "new run_id)")


def has_checkpoint(cfg: Any) -> bool:
    return (ckpt_dir(cfg) / "latest").is_file()


def latest_step(root: Path) -> int | None:
    try:
        return int((root / "latest").read_text())
    except (OSError, ValueError):
        return None


def read_meta(d: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((d / META).read_text()))
    except (OSError, ValueError):
        return {}


def save_file(obj: Any, path: Path) -> None:
    """``torch.save`` under a temporary name, flushed and synced, then renamed: a reader finds the whole file or
    none (:func:`_commit`)."""
    tmp = path.parent / f".{path.name}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
        _commit(tmp, path)
    finally:  # (a write the disk cut short leaves no part behind)
        with contextlib.suppress(OSError):
            tmp.unlink()


def _write_text(path: Path, text: str) -> None:
    tmp = path.parent / f".{path.name}.tmp"
    try:
        tmp.write_text(text)
        _commit(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _commit(tmp: Path, path: Path) -> None:
    """``tmp`` synced to the disk, renamed to ``path``, and the rename synced (the folder's entry): a crash at any
    moment leaves the old file or the new one (gems.paths.commit: one rule with the data files gems writes)."""
    from gems.paths import commit

    commit(tmp, path)


# ---- what a rank holds ---------------------------------------------------------------------------------------
def held(names: dict[str, tuple[nn.Module, str]]) -> dict[str, torch.Tensor]:
    """The tensors behind ``names`` ({whole-model name: (module, attribute)}) as they are now (a buffer moved to a
    device is a new tensor)."""
    out = {}
    for name, (m, attr) in names.items():
        t = m._parameters.get(attr) if attr in m._parameters else m._buffers.get(attr)
        if t is not None:
            out[name] = t
    return out


@dataclass
class Holding:
    """What one rank saves and loads: its tensors under the whole model's names, the optimizer of its parameters
    and ``train.ema``'s average of them (``average``: aligned with ``params``, empty until the first update)."""

    names: dict[str, tuple[nn.Module, str]]
    params: list[nn.Parameter]
    opt: Any
    average: list[torch.Tensor] | None = None
    _ids: dict[int, str] = field(default_factory=dict)

    def tensors(self) -> dict[str, torch.Tensor]:
        return held(self.names)

    def name_of(self, p: torch.Tensor) -> str:
        if not self._ids:
            self._ids = {id(t): n for n, t in self.tensors().items()}
        return self._ids[id(p)]

    def state(self, ema_weights: bool = False) -> dict[str, torch.Tensor]:
        """``model.*``, ``optim.*`` and ``ema.*`` entries; ``ema_weights``: the model's parameters replaced by their
        average (the trained model of a ``train.ema`` run)."""
        out = {f"model.{n}": t.detach() for n, t in self.tensors().items()}
        for p in self.params:
            n = self.name_of(p)
            for k, v in (self.opt.state.get(p) or {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"optim.{n}.{k}"] = v
        for p, a in zip(self.params, self.average or []):
            out[f"ema.{self.name_of(p)}"] = a
            if ema_weights:
                out[f"model.{self.name_of(p)}"] = a
        return out


# ---- writing -------------------------------------------------------------------------------------------------
def chunks_of(state: dict[str, torch.Tensor], share: Share) -> dict[str, tuple[torch.Tensor, int]]:
    """This writer's part of a position's ``state`` (:func:`layout`): {entry: (its rows as a view, first row)}."""
    entries = {k: (tuple(v.shape), v.element_size()) for k, v in state.items()}
    mine = layout(entries, share.writers)[share.index] if share.writes else []
    return {c.name: (state[c.name] if state[c.name].dim() == 0 else state[c.name].detach().narrow(0, c.start, c.rows),
                     c.start) for c in mine}


@contextlib.contextmanager
def without_dcp_warning() -> Any:
    """DCP without a process group warns that it assumes one process, which is what gems asks of it there."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _planner(chunks: dict[str, tuple[torch.Tensor, int]], full: dict[str, torch.Size]) -> Any:
    """DCP's default planner, given each entry as the chunk this rank writes of it (offsets along dim 0; the
    whole tensor's size in the metadata): loading reshards from the chunks as from any sharded tensor, and
    chunks two writers both give (mirrored GEMS positions) are written once (DCP's deduplication)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    class ChunkPlanner(DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

        def create_local_plan(self) -> SavePlan:
            items = []
            for fqn, t in self.state_dict.items():
                size = full[fqn]
                offsets = torch.Size((chunks[fqn][1], *([0] * (len(size) - 1))) if len(size) else ())
                items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(
                                           chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                                           properties=TensorProperties.create_from_tensor(t), size=size)))
            self.plan = SavePlan(items)
            return self.plan

        def lookup_object(self, index: Any) -> Any:
            return self.state_dict[index.fqn]

    return ChunkPlanner()


def _storage(path: Path, before: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> Any:
    """DCP's file writer, except that a rank whose plan holds nothing writes no file (DCP's writes an empty one);
    ``before``/``after`` its writes (the fault injections)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.futures import Future

    class Writer(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            if before is not None:
                before()
            if plan.items:
                fut = super().write_data(plan, planner)
            else:
                fut = Future()
                fut.set_result([])
            if after is not None:
                fut.wait()
                after()
            return fut

    return Writer(str(path))


HISTORY = "history.pt"


def gathered_history(history: dict[str, Any], world: Any) -> dict[str, Any]:
    """What a checkpoint keeps of the ranks' histories, in one file (rank 0 writes it): rank 0's own history (the
    losses, evaluations, learning rates and loss scale are every rank's), with what the record needs of the
    others: each measured step's time on the slowest rank (``slowest_step_times``) and each rank's tensor peak
    (``tensor_peak_by_rank``). Two small all-reduces on the ranks' devices: a collective of every rank."""
    own = {k: v for k, v in history.items() if k != "weight_average"}
    if world.size > 1:
        import torch.distributed as dist

        times = torch.tensor(history["step_times"], dtype=torch.float64, device=world.device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        peaks = torch.full((world.size,), -1.0, dtype=torch.float64, device=world.device)
        if history.get("tensor_peaks"):
            peaks[world.rank] = float(max(history["tensor_peaks"]))
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        own["slowest_step_times"] = times.tolist()
        own["tensor_peak_by_rank"] = [None if p < 0 else int(p) for p in peaks.tolist()]
    return own


class Saver:
    """Writes a run's checkpoints (:meth:`save`, synchronous or through DCP's ``async_save``) and its trained model
    (:func:`export`), and says how long the steps were held for them (``held_s``, ``saves``).

    A checkpoint's tensors are written by the writers alone (:func:`share_of`), each its :func:`layout` share of
    its position, over one gloo group of theirs made once at the first save (every rank takes part in making it,
    as torch asks); the other ranks only take part in :func:`gathered_history`. Rank 0 (the first writer, DCP's
    coordinator) writes ``gems.json`` and ``history.pt`` and, once DCP's ``.metadata`` says every writer's files are
    complete, moves ``latest`` (older complete ones go: :func:`retire`): :meth:`_complete`. A job that starts removes
    what a crash while saving left (:func:`tidy`)."""

    def __init__(self, cfg: Any, world: Any, mesh: Any, asynchronous: bool = False) -> None:
        from gems.config import section

        self.cfg, self.world, self.mesh, self.asynchronous = cfg, world, mesh, asynchronous
        self.fault = section(cfg, "fault")
        self.restarts = 0  # the job's restarts, once the run knows them (a fault injection acts in the first only)
        self.cap = int(cfg.train.checkpoint_writers)
        self.share = share_of(mesh, world.rank, self.cap)
        self.writers = writer_ranks(mesh, self.cap)
        self.held_s, self.saves = 0.0, 0
        self._pending: tuple[Any, Path, int] | None = None  # (future, folder, step) of an async save
        self._failed: tuple[StorageFailed, Path] | None = None  # an async save that failed, said at finish()
        self._in_flight = False  # an async save was started: every rank agrees on its end at finish()
        self._root_made = False  # rank 0 made the checkpoints' folder: one missing later was removed under the run
        self._group: Any = None
        self._made = False

    def group(self) -> Any:
        """The writers' gloo group (None off it, and in a process without torch.distributed), made once: the first
        time any rank asks, which every rank does at the same step (a save, or the export at the end). One writer
        gets one too: DCP's async_save asks its group for a CPU backend, which a GPU world's NCCL one has not."""
        if not self._made:
            self._made = True
            if _distributed():
                import torch.distributed as dist

                g = dist.new_group(self.writers, backend="gloo", timeout=self.world.timeout)
                self._group = g if self.world.rank in self.writers else None
        return self._group

    def write(self, state: dict[str, torch.Tensor], d: Path, step: int, asynchronous: bool = False,
              faults: bool = True) -> Any:
        """This writer's share of ``state`` into the DCP folder ``d`` (a collective of the writers); an async save's
        future, or None once written. ``faults``: the fault injections of a checkpoint act here (not the model
        file's)."""
        import torch.distributed.checkpoint as dcp

        group = self.group()
        # the folder made inside the job's (never the job's folder again: one removed under the run is a failure, which
        # DCP's write then meets on every writer)
        with contextlib.suppress(OSError):
            if d.parent.parent.is_dir():
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
        chunks = chunks_of(state, self.share)
        f, rank = self.fault, self.world.rank
        delay = (lambda: time.sleep(f.save_delay_s)) if faults and f.save_delay_s > 0 else None
        kill = None
        if faults and f.kill_in_save and f.kill_rank == rank:
            from gems.fault import inject

            def kill() -> None:
                inject.in_save(f, rank, step, self.restarts)
        kw = {"storage_writer": _storage(d, delay, kill), "planner": _planner(chunks, {k: v.shape for k, v in
                                                                                      state.items()}),
              "process_group": group, "no_dist": group is None}
        local = {k: v for k, (v, _) in chunks.items()}
        with without_dcp_warning():
            if asynchronous:
                return dcp.async_save(local, **kw)
            dcp.save(local, **kw)
        return None

    def save(self, step: int, hold: Holding, history: dict[str, Any], wait: bool = False) -> None:
        """Every rank saves before ``step``: the writers their shares of the tensors, rank 0 the history and the
        bookkeeping; ``latest`` moves once the writers' files are complete. ``wait``: complete before returning (a
        preemption). Where the storage fails on any rank (a full disk, a quota, an I/O error), every rank raises
        :class:`gems.storage.StorageFailed`, the partial checkpoint removed and the last whole one kept."""
        t0 = time.perf_counter()
        self.finish()  # at most one save in flight
        kept = gathered_history(history, self.world)  # every rank
        self.group()
        root = ckpt_dir(self.cfg)
        d = root / f"step{step:08d}"
        what = f"the checkpoint before step {step}"
        needed = state_bytes(hold.state()) if self.world.rank == 0 or self.share.writes else None
        failed: StorageFailed | None = None
        if self.world.rank == 0:
            try:
                with writing(what, d, needed):
                    if self._root_made and not root.is_dir():  # its folder, made by an earlier save, removed since
                        raise FileNotFoundError(errno.ENOENT, "the run's folder is gone", str(root))
                    d.mkdir(parents=True, exist_ok=True, mode=0o700)
                    os.chmod(root, 0o700)
                    write_meta(d, self.cfg, step, self.world.size)
                    save_file({"step": step, "history": kept, "world_size": self.world.size}, d / HISTORY)
                    self._root_made = True
            except StorageFailed as e:
                failed = e
        if self.share.writes:
            fut = None
            try:
                with writing(what, d, needed):  # a writer's failure is every writer's (DCP gathers them)
                    fut = self.write(hold.state(), d, step, asynchronous=self.asynchronous and not wait)
            except StorageFailed as e:
                failed = failed or e
            if fut is not None:
                self._pending = (fut, d, step)
            elif failed is None:
                try:
                    with writing(what, d.parent / "latest"):
                        self._complete(d, step)
                except StorageFailed as e:
                    failed = e
        elif self.fault.kill_in_save:  # a rank that writes no tensor dies once it has taken its part
            from gems.fault import inject

            inject.in_save(self.fault, self.world.rank, step, self.restarts)
        self.agree(failed, d)
        self._in_flight = self.asynchronous and not wait  # every rank: its completion is agreed at finish()
        self.held_s += time.perf_counter() - t0
        self.saves += 1

    def poll(self) -> None:
        """After a step: move ``latest`` once an async save has completed (nothing waits for it). A save that
        failed is said at the next point every rank passes (:meth:`finish`)."""
        if self._pending is not None and self._pending[0].done():
            self._collect()

    def finish(self) -> None:
        """Wait for an async save in flight, then move ``latest`` to it; where it failed on any rank for the
        storage's reason, every rank raises that failure (every rank calls this at the same point)."""
        if self._pending is not None:
            self._collect()
        if self._in_flight:
            self._in_flight = False
            failed, self._failed = self._failed, None
            self.agree(*(failed if failed is not None else (None, None)))

    def _collect(self) -> None:
        """This rank's async save, waited for: ``latest`` moved where it completed, its failure kept where not."""
        assert self._pending is not None
        fut, d, step = self._pending
        self._pending = None
        if not fut.done() and self.world.rank == 0:
            print(f"gems: checkpoint: waiting for the save of step {step}, still being written", file=sys.stderr,
                  flush=True)
        try:
            with writing(f"the checkpoint before step {step}", d):
                fut.result()  # DCP's coordinator wrote the metadata after every writer's files: the save is complete
            with writing(f"the checkpoint before step {step}", d.parent / "latest"):
                self._complete(d, step)
        except StorageFailed as e:
            self._failed = (e, d)

    def agree(self, failed: StorageFailed | None, d: Path | None) -> None:
        """Every rank learns whether any rank's part of a save failed (one collective of every rank; a one-rank job:
        none); where one did, rank 0 removes the partial checkpoint ``d`` and every rank raises the first rank's
        failure."""
        if self.world.size > 1 and _distributed():
            import torch.distributed as dist

            flag = torch.tensor([0.0 if failed is None else 1.0], dtype=torch.float64, device=self.world.device)
            dist.all_reduce(flag)
            if float(flag.item()) > 0:
                said = None if failed is None else (failed.as_dict(), failed.reason)
                gathered: list[Any] = [None] * self.world.size
                dist.all_gather_object(gathered, said)
                first, reason = next(g for g in gathered if g is not None)
                failed = failed or StorageFailed.from_dict(first, reason)
        if failed is None:
            return
        if self._pending is not None:  # an async save still under way: its end waited for, whatever it was
            with contextlib.suppress(BaseException):
                self._pending[0].result()
            self._pending, self._in_flight = None, False
        if self.world.rank == 0 and d is not None and latest_step(d.parent) != _step_of(d):
            shutil.rmtree(d, ignore_errors=True)  # the partial checkpoint goes first: the record needs the room
        raise failed

    def _complete(self, d: Path, step: int) -> None:
        """Rank 0, once the checkpoint in ``d`` is complete: ``latest`` points at it, and the complete checkpoints
        older than it go. Nothing newer is touched (other writers may be writing the next one already), nor an
        incomplete one (:func:`tidy` removes those when a job starts)."""
        if self.world.rank == 0:
            retire(d.parent, step)


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """The bytes of a checkpoint's tensors (this rank's share of the names it holds: on rank 0 a position's)."""
    return int(sum(t.numel() * t.element_size() for t in state.values()))


def retire(root: Path, step: int) -> None:
    """``latest`` in ``root`` points at ``step`` (complete), and the complete checkpoints older than it go; nothing
    newer (the next save may be under way) and nothing incomplete (:func:`tidy`'s, when a job starts)."""
    _write_text(root / "latest", str(step))
    for old in root.glob("step*"):
        n = _step_of(old)
        if n is not None and n < step and complete(old):
            shutil.rmtree(old, ignore_errors=True)


def at_scale(mesh: Any, rank: int, state: dict[str, torch.Tensor], cap: int,
             whole: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What rank ``rank`` of ``mesh`` writes and holds for checkpoints and the model file, from its own ``state``
    (:meth:`Holding.state`; fake tensors will do: the dry run's at full size) and the serial model's tensors
    ``whole``: whether it writes, the bytes it writes of its position's, the one group made for checkpoints
    (the writers': ``group_ranks``; a rank outside it is in none), the files a checkpoint holds at most (a file a
    writer, ``.metadata``, ``gems.json`` and the history), and the host bytes of the model file (rank 0 reads the
    whole model once; a writer copies its share of its position's model to its host). No device holds more than
    the rank's own tensors meanwhile: the shares are views of them, which DCP's writer copies to the host, and no
    collective carries them (tests/test_checkpoints.py records every call of an export)."""
    share = share_of(mesh, rank, cap)

    def size(chunks: dict[str, tuple[torch.Tensor, int]]) -> int:
        return sum(v.numel() * v.element_size() for v, _ in chunks.values())

    model = {k[len("model."):]: v for k, v in state.items() if k.startswith("model.")}
    shares = chunks_of(model, share)
    # what the model file's shares add on the rank's device: a share in storage other than the rank's own tensor's
    # would be a new tensor there
    added = sum(v.numel() * v.element_size() for k, (v, _) in shares.items()
                if v.untyped_storage()._cdata != model[k].untyped_storage()._cdata)
    writers = writer_ranks(mesh, cap)  # the ranks of Saver.group, which every distributed run makes
    return {"writes": share.writes, "writers_per_position": share.writers,
            "position_bytes": sum(v.numel() * v.element_size() for v in state.values()),
            "share_bytes": size(chunks_of(state, share)), "group_ranks": len(writers),
            "in_group": rank in writers, "files_per_checkpoint": len(writers) + 3,
            "model_file_host_bytes": (sum(t.numel() * t.element_size() for t in whole.values()) if rank == 0
                                      else size(shares)),
            "model_file_device_bytes_added": int(added)}


def _step_of(d: Path) -> int | None:
    try:
        return int(d.name[len("step"):]) if d.is_dir() and d.name.startswith("step") else None
    except ValueError:
        return None


def complete(d: Path) -> bool:
    """Whether the checkpoint in ``d`` was written whole: DCP's ``.metadata`` (its coordinator writes it last, after
    every writer's files), ``gems.json`` and the history (``history.pt``; an earlier gems's ``rank0.pt``)."""
    return all((d / f).is_file() for f in (".metadata", META)) and \
        ((d / HISTORY).is_file() or (d / "rank0.pt").is_file())


def tidy(root: Path) -> list[Path]:
    """When a job starts (rank 0, before any rank can save again): remove every step folder but ``latest``'s, the
    leftovers of a save that a crash or a kill cut short; returns them."""
    keep = latest_step(root)
    gone = []
    for d in sorted(root.glob("step*")) if root.is_dir() else []:
        n = _step_of(d)
        if n is not None and n != keep:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


def mesh_of(mesh: Any) -> dict[str, Any]:
    """The mesh as ``gems.json`` keeps it (what a resumed run compares its own with)."""
    return {"replicas": mesh.replicas, "pipeline": mesh.pipeline, "spatial": list(mesh.parts)}


def write_meta(d: Path, cfg: Any, step: int, world_size: int) -> None:
    """``gems.json``: what the tensors do not say (rank 0 writes it)."""
    from omegaconf import OmegaConf

    from gems.checkpoint.files import listing
    from gems.mesh import mesh_from_config

    mesh = mesh_from_config(cfg, world_size)
    meta = {"format": "gems.checkpoint/1", "step": step, "fingerprint": fingerprint(cfg),
            "model": OmegaConf.to_container(cfg.model, resolve=True), "world_size": world_size,
            "mesh": mesh_of(mesh),
            "schedule": str(cfg.parallel.schedule), "global_batch": int(cfg.train.batch_size),
            "optimizer": str(cfg.train.optimizer), "ema": cfg.train.ema, "run_id": str(cfg.run_id),
            "trained_on": trained_on(cfg), "files": listing(cfg)}
    _write_text(d / META, json.dumps(meta, indent=1))


# ---- reading -------------------------------------------------------------------------------------------------
def find(path: str | os.PathLike[str], key: str) -> Path:
    """The checkpoint folder ``path`` names: a step's folder, a run's ``ckpt`` folder or its ``latest`` file, or
    the run's folder holding ``ckpt``; a ConfigError naming ``key`` otherwise."""
    p = Path(path).expanduser()
    if p.is_file() and p.name == "latest":
        p = p.parent
    for root in (p, p / "ckpt"):
        step = latest_step(root)
        if step is not None:
            p = root / f"step{step:08d}"
            break
    if not p.exists():
        raise ConfigError(key, str(path), "an existing model file (results/<run_id>.model.pt) or checkpoint folder "
                          "(a run's ckpt/ or one of its step folders)")
    if not (p / ".metadata").is_file():
        raise ConfigError(key, str(path), "a complete checkpoint (a folder with DCP's .metadata: a run's ckpt/ or "
                          "ckpt/step<N>/), or a model file written by a run")
    return p


def entries(d: Path, key: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of the checkpoint in ``d``: {entry: (shape, dtype)} (its metadata only)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(str(d)).read_metadata()
    except Exception as e:  # a truncated or foreign .metadata
        raise ConfigError(key, str(d), f"a readable checkpoint (its metadata: {type(e).__name__}: {e})") from None
    out = {}
    for k, m in md.state_dict_metadata.items():
        size, props = getattr(m, "size", None), getattr(m, "properties", None)
        if size is not None and props is not None:
            out[k] = (tuple(size), props.dtype)
    return out


def load(d: Path, hold: Holding, what: tuple[str, ...] = ("model", "optim", "ema"), key: str = "train.resume_from"
         ) -> dict[str, Any]:
    """Read into this rank what it holds of the checkpoint in ``d`` (any mesh wrote it): ``model`` its tensors,
    ``optim`` its parameters' optimizer state, ``ema`` their average (returned under ``"average"``, aligned with
    ``hold.params``; empty where the checkpoint has none). Returns the checkpoint's meta (``gems.json``)."""
    import torch.distributed.checkpoint as dcp

    saved = entries(d, key)
    want: dict[str, torch.Tensor] = {}
    tensors = hold.tensors()
    if "model" in what:
        for n, t in tensors.items():
            want[f"model.{n}"] = torch.empty(t.shape, dtype=t.dtype)
    opt_keys: dict[str, list[str]] = {}
    if "optim" in what:
        for p in hold.params:
            n = hold.name_of(p)
            keys = [k[len(f"optim.{n}."):] for k in saved if k.startswith(f"optim.{n}.")]
            opt_keys[n] = keys
            for k in keys:
                shape, dtype = saved[f"optim.{n}.{k}"]
                want[f"optim.{n}.{k}"] = torch.empty(shape, dtype=dtype)
    has_ema = "ema" in what and any(k.startswith("ema.") for k in saved)
    if has_ema:
        for p in hold.params:
            want[f"ema.{hold.name_of(p)}"] = torch.empty(p.shape, dtype=p.dtype)
    missing = [k for k in want if k not in saved]
    if missing:
        raise ConfigError(key, str(d), f"a checkpoint of this model: it has no {missing[0]}")
    if want:  # each rank alone, from the metadata and the chunks it needs: no collective at any scale
        with without_dcp_warning():
            dcp.load(want, checkpoint_id=str(d), no_dist=True)
    with torch.no_grad():
        for n, t in tensors.items():
            if f"model.{n}" in want:
                t.copy_(want[f"model.{n}"])
    for p in hold.params:
        n = hold.name_of(p)
        if opt_keys.get(n):
            group: dict[str, Any] = next((g for g in hold.opt.param_groups if any(q is p for q in g["params"])), {})
            hold.opt.state[p] = {k: _like(want[f"optim.{n}.{k}"], p, k, group) for k in opt_keys[n]}
    meta = read_meta(d)
    meta["average"] = [_like(want[f"ema.{hold.name_of(p)}"], p) for p in hold.params] if has_ema else []
    return meta


def _like(t: torch.Tensor, p: torch.Tensor, key: str = "", group: dict[str, Any] | None = None) -> torch.Tensor:
    """A loaded per-parameter tensor on its parameter's device in its memory format (channels-last weights keep
    their optimizer state channels-last: torch's fused and foreach updates need one layout). A scalar (Adam's step
    count) goes where torch's own loading puts it (``Optimizer._process_value_according_to_param_policy``): on
    the parameter's device as float32 in a fused or capturable group (their kernels read it on the device: a host
    one beside a GPU's parameters would be read there as a device address; inside a captured step it would not
    count), on the host otherwise."""
    if t.dim() == 0:
        if key == "step" and group is not None and (group.get("fused") or group.get("capturable")):
            return t.to(device=p.device, dtype=torch.float32)
        return t
    out = torch.empty_like(p, dtype=t.dtype) if t.shape == p.shape else torch.empty(t.shape, dtype=t.dtype,
                                                                                         device=p.device)
    return out.copy_(t)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def load_history(d: Path, rank: int, same_mesh: bool) -> dict[str, Any]:
    """The history a resumed rank goes on from (:func:`gathered_history`): rank 0's; on the mesh that wrote it,
    every other rank takes the slowest rank's step times and its own tensor peak in place of rank 0's (what the
    record reads of them); elsewhere the timings (:data:`TIMINGS`) belong to another mesh and start afresh. A
    checkpoint of an earlier gems (a ``rank<k>.pt`` a rank) is read as it was written."""
    p = d / HISTORY
    if not p.is_file():
        own = d / f"rank{rank}.pt"
        p = own if same_mesh and own.is_file() else d / "rank0.pt"
    got = torch.load(p, map_location="cpu", weights_only=False)
    h = dict(got["history"])
    slowest, peaks = h.pop("slowest_step_times", None), h.pop("tensor_peak_by_rank", None)
    if not same_mesh:
        for k in TIMINGS:
            h.pop(k, None)
    elif rank != 0 and p.name == HISTORY:
        if slowest is not None:
            h["step_times"] = list(slowest)
        h["tensor_peaks"] = [peaks[rank]] if peaks and rank < len(peaks) and peaks[rank] is not None else []
    return h


def trained_on(cfg: Any) -> dict[str, Any]:
    """What a model file and a checkpoint say of the run that trained the model: the defaults of ``gems eval`` (its
    data, so that the evaluated set is the run's validation set, its seed, batch and evaluation settings)."""
    from omegaconf import OmegaConf

    return {"data": OmegaConf.to_container(cfg.data, resolve=True), "seed": int(cfg.train.seed),
            "global_batch": int(cfg.train.batch_size), "bn_recalibrate": int(cfg.train.bn_recalibrate),
            "eval_average_crops": bool(cfg.train.eval_average_crops)}
