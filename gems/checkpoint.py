"""Checkpoints that do not depend on the mesh, the trained model's file, and resuming on any mesh.

gems's meshes are transparent: every R x D x S computes what one process computes, and every rank holds the
serial model's own tensors (the spatial layers adopt them, the partitions slice the sequence). So a checkpoint
is written under the *whole model's names* (the keys of the serial model's ``state_dict``:
``gems.rank.compose.whole_names``), and any mesh reads it back:

* ``model.<name>``: parameters and persistent buffers;
* ``optim.<name>.<key>``: the optimizer's state of each parameter (Adam's moments and step, SGD's momentum);
* ``ema.<name>``: ``train.ema``'s average of each parameter.

The tensors go through ``torch.distributed.checkpoint`` (DCP): one copy of each pipeline position writes its
partitions' tensors (replica 0, spatial part 0: :func:`share_of`; a mirrored GEMS position holds the same
partitions as its mirror, and DCP keeps one of two equal entries), every writer in parallel, each into its own
file; loading reshards, each rank reading the names it holds whatever mesh wrote them. Written by hand, beside
the tensors, only what DCP does not hold: ``gems.json`` (rank 0: the step, the configuration that shapes the
state, the mesh and global batch that wrote it, the model section) and ``rank<k>.pt`` (each rank's history:
losses, evaluations, the fp16 loss scale, its own step times), plain data a resumed run reads back as it was.
``train.checkpoint_async`` saves through DCP's ``async_save``: the step waits only while the tensors are copied
to host memory (that copy is what it costs, counted by ``gems plan``); the files are written by a thread over a
gloo group of their own, and ``latest`` moves once they are complete.

A Slurm job can be preempted or requeued at any time; ``fault.preempt_at_step`` does it on purpose, and a job's
time limit does it for certain: gems asks Slurm for ``SIGUSR2`` ``cluster.signal_margin_s`` before the limit
(``--signal=USR2@margin``); :func:`install_time_limit_handler` turns it into a request that the worker's
per-step sync shares with every rank, so all of them save after the same step, and rank 0 requeues the job.
Once every rank has saved, rank 0 points ``latest`` at the step and removes the older one, so a crash while
saving leaves the previous checkpoint whole. The launchers restart a preempted job: Slurm requeues it
(``scontrol requeue``; ``SLURM_RESTART_COUNT`` counts), the local launcher starts the ranks again with
``GEMS_RESTART_COUNT`` set. Exit status 75 (EX_TEMPFAIL) tells the local launcher that a rank stopped to be
resumed.

``train.resume_from=PATH`` continues another run's training on the mesh now given (the same global batch gives
the same losses: data and dropout are pure functions of (seed, step, sample)); ``train.init_from=PATH`` takes the
weights only. At the end of a run rank 0 writes the trained model (:func:`export`): one file that
``torch.load(path, weights_only=True)`` reads into ``{"model": the model section, "state_dict": ...}``, which loads
strictly into ``gems.models.build_model(d["model"]).module``.

Why one module of this length: the format is one decision (what a checkpoint, a model file and their readers
agree on), and the time-limit and requeue protocol that writes it is read beside it.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from gems.errors import ConfigError

PREEMPTED_EXIT = 75
#: the keys a job's own checkpoint must be resumed with (a requeued job comes back with them; the mesh, the
#: schedule and the micro-batches may change: the state is the whole model's). Another run's checkpoint
#: (train.resume_from) asks only for its model and optimizer, and a different global batch is said in the record
FINGERPRINT_KEYS = ("model", "train.batch_size", "train.optimizer", "train.precision", "train.seed", "data.name",
                    "data.num_samples")
META = "gems.json"
MODEL_FILE_FORMAT = "gems.model/1"
#: history entries that are the rank's own timings: a run resumed on another mesh starts them afresh
TIMINGS = ("step_times", "every_step_time", "tensor_peaks", "breakdown", "reader_s", "elapsed_s")
_STOP: dict[str, Any] = {"requested": False, "signal": None}


@dataclass(frozen=True)
class Share:
    """Whether this rank writes its position's tensors (one copy of each pipeline position does)."""

    name: str
    writes: bool


def share_of(mesh: Any, rank: int) -> Share:
    """One copy of each pipeline position writes its state: replica 0, spatial part 0 (:mod:`gems.checkpoint`)."""
    c = mesh.coord(rank)
    return Share(f"d{c.pipeline}", c.replica == 0 and c.spatial == 0)


def restart_count() -> int:
    for key in ("SLURM_RESTART_COUNT", "GEMS_RESTART_COUNT"):
        val = os.environ.get(key)
        if val:
            return int(val)
    return 0


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
            out[key] = val
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


def _write(obj: Any, path: Path) -> None:
    tmp = path.parent / f".{path.name}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


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
class Saver:
    """Writes a run's checkpoints: :meth:`save` (synchronous, or through DCP's ``async_save``), and says how long the
    steps were held for them (``held_s``, ``saves``)."""

    def __init__(self, cfg: Any, world: Any, asynchronous: bool = False) -> None:
        import torch.distributed as dist

        self.cfg, self.world, self.asynchronous = cfg, world, asynchronous
        self.held_s, self.saves = 0.0, 0
        self._pending: tuple[Any, Path, int] | None = None  # (future, folder, step) of an async save
        # an async save talks over its own gloo group from its thread: never the group the steps use
        self.group = dist.new_group(backend="gloo") if asynchronous and dist.is_initialized() else None

    def save(self, step: int, hold: Holding, history: dict[str, Any], share: Share, wait: bool = False) -> None:
        """Every rank saves its history before ``step``, one copy of each position its tensors; ``latest`` moves once
        every rank's files are complete. ``wait``: complete before returning (a preemption)."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        self.finish()  # at most one save in flight
        root = ckpt_dir(self.cfg)
        d = root / f"step{step:08d}"
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(root, 0o700)
        rank = self.world.rank
        own = {k: v for k, v in history.items() if k != "weight_average"}
        _write({"step": step, "history": own}, d / f"rank{rank}.pt")
        if rank == 0:
            write_meta(d, self.cfg, step, self.world.size)
        state = hold.state() if share.writes else {}
        if self.asynchronous and not wait:
            fut = dcp.async_save(state, checkpoint_id=str(d), process_group=self.group)
            self._pending = (fut, d, step)
        else:
            dcp.save(state, checkpoint_id=str(d))
            if dist.is_initialized():
                dist.barrier()
            self._complete(d, step)
        self.held_s += time.perf_counter() - t0
        self.saves += 1

    def poll(self) -> None:
        """After a step: move ``latest`` once an async save has completed (nothing waits for it)."""
        if self._pending is not None and self._pending[0].done():
            self.finish()

    def finish(self) -> None:
        """Wait for an async save in flight, then move ``latest`` to it."""
        if self._pending is None:
            return
        fut, d, step = self._pending
        self._pending = None
        fut.result()  # DCP's coordinator wrote the metadata after every rank's files: this save is complete
        self._complete(d, step)

    def _complete(self, d: Path, step: int) -> None:
        if self.world.rank != 0:
            return
        root = d.parent
        tmp_latest = root / ".latest.tmp"
        tmp_latest.write_text(str(step))
        os.replace(tmp_latest, root / "latest")
        for old in root.glob("step*"):  # the new one is complete: the older ones are not needed
            if old.is_dir() and old != d and (self._pending is None or old != self._pending[1]):
                shutil.rmtree(old, ignore_errors=True)


def mesh_of(mesh: Any) -> dict[str, Any]:
    """The mesh as ``gems.json`` keeps it (what a resumed run compares its own with)."""
    return {"replicas": mesh.replicas, "pipeline": mesh.pipeline, "spatial": list(mesh.parts)}


def write_meta(d: Path, cfg: Any, step: int, world_size: int) -> None:
    """``gems.json``: what the tensors do not say (rank 0 writes it)."""
    from omegaconf import OmegaConf

    from gems.mesh import mesh_from_config

    mesh = mesh_from_config(cfg, world_size)
    meta = {"format": "gems.checkpoint/1", "step": step, "fingerprint": fingerprint(cfg),
            "model": OmegaConf.to_container(cfg.model, resolve=True), "world_size": world_size,
            "mesh": mesh_of(mesh),
            "schedule": str(cfg.parallel.schedule), "global_batch": int(cfg.train.batch_size),
            "optimizer": str(cfg.train.optimizer), "ema": cfg.train.ema, "run_id": str(cfg.run_id),
            "trained_on": trained_on(cfg)}
    tmp = d / f".{META}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, d / META)


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


def is_model_file(p: Path) -> bool:
    """Whether ``p`` names a model file (else a checkpoint: a folder, or a run's ``latest`` file)."""
    return p.is_file() and p.name != "latest"


def resolve(path: str | os.PathLike[str], key: str) -> Path:
    """What ``path`` names, absolute: a model file as it is, a checkpoint as its step's folder (:func:`find`)."""
    p = Path(path).expanduser()
    if is_model_file(p):
        return p.resolve()
    return find(p, key).resolve()


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


def check_model(have: dict[str, tuple[tuple[int, ...], Any]], want: dict[str, tuple[int, ...]], key: str,
                path: Any) -> None:
    """A ConfigError naming the first entry in which a model's ``state_dict`` (``want``: {name: shape}) and the saved
    one (``have``) differ: missing, extra, or another shape."""
    for name in list(want) + [n for n in have if n not in want]:
        if name not in have:
            raise ConfigError(key, str(path), f"a model of this configuration's architecture: the saved one has no "
                              f"{name} (of shape {list(want[name])})")
        if name not in want:
            raise ConfigError(key, str(path), f"a model of this configuration's architecture: the saved one has "
                              f"{name} (shape {list(have[name][0])}), which this model has not")
        if tuple(have[name][0]) != tuple(want[name]):
            raise ConfigError(key, str(path), f"a model of this configuration's architecture: {name} is "
                              f"{list(have[name][0])} there, {list(want[name])} here")


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
    if want or _distributed():  # a collective: a rank that holds nothing (a partition of pooling) takes part too
        dcp.load(want, checkpoint_id=str(d), no_dist=not _distributed())
    with torch.no_grad():
        for n, t in tensors.items():
            if f"model.{n}" in want:
                t.copy_(want[f"model.{n}"])
    for p in hold.params:
        n = hold.name_of(p)
        if opt_keys.get(n):
            # a scalar (Adam's step count) stays where torch keeps it, the host
            hold.opt.state[p] = {k: _like(want[f"optim.{n}.{k}"], p) for k in opt_keys[n]}
    meta = read_meta(d)
    meta["average"] = [_like(want[f"ema.{hold.name_of(p)}"], p) for p in hold.params] if has_ema else []
    return meta


def _like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A loaded per-parameter tensor on its parameter's device in its memory format (channels-last weights keep
    their optimizer state channels-last: torch's foreach updates need one layout), a scalar where it was read."""
    if t.dim() == 0:
        return t
    out = torch.empty_like(p, dtype=t.dtype) if t.shape == p.shape else torch.empty(t.shape, dtype=t.dtype,
                                                                                         device=p.device)
    return out.copy_(t)


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def load_history(d: Path, rank: int, same_mesh: bool) -> dict[str, Any]:
    """The history a resumed rank goes on from: its own on the mesh that wrote it, rank 0's elsewhere, whose
    timings (:data:`TIMINGS`) belong to another mesh and start afresh."""
    own = d / f"rank{rank}.pt"
    path = own if same_mesh and own.is_file() else d / "rank0.pt"
    got = torch.load(path, map_location="cpu", weights_only=False)
    h = dict(got["history"])
    if not same_mesh:
        for k in TIMINGS:
            h.pop(k, None)
    return h


# ---- the trained model ---------------------------------------------------------------------------------------
def export(cfg: Any, world: Any, hold: Holding, share: Share, step: int, path: Path, order: list[str]) -> Path | None:
    """The trained model in one file, written by rank 0 from one copy of each position's tensors (gathered to it):
    the averaged weights for a ``train.ema`` run. ``order``: the serial ``state_dict``'s keys. A collective."""
    import torch.distributed as dist
    from omegaconf import OmegaConf

    import gems

    ema = bool(hold.average)
    mine = {k[len("model."):]: v.detach().cpu() for k, v in hold.state(ema_weights=ema).items()
            if k.startswith("model.")} if share.writes else {}
    if _distributed() and world.size > 1:
        parts: list[Any] = [None] * world.size if world.rank == 0 else []
        dist.gather_object(mine, parts if world.rank == 0 else None, dst=0)
    else:
        parts = [mine]
    if world.rank != 0:
        return None
    every: dict[str, torch.Tensor] = {}
    for part in parts:
        every.update(part or {})
    state = OrderedDict((k, every[k]) for k in order if k in every)
    missing = [k for k in order if k not in every]
    if missing:
        raise RuntimeError(f"the trained model misses {missing[:3]}: no rank wrote them")
    out = {"format": MODEL_FILE_FORMAT, "model": OmegaConf.to_container(cfg.model, resolve=True),
           "state_dict": state, "weights": "ema" if ema else "last", "step": int(step), "run_id": str(cfg.run_id),
           "trained_on": trained_on(cfg), "gems": gems.__version__}
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(out, path)
    return path


def trained_on(cfg: Any) -> dict[str, Any]:
    """What a model file and a checkpoint say of the run that trained the model: the defaults of ``gems eval`` (its
    data, so that the evaluated set is the run's validation set, its seed, batch and evaluation settings)."""
    from omegaconf import OmegaConf

    return {"data": OmegaConf.to_container(cfg.data, resolve=True), "seed": int(cfg.train.seed),
            "global_batch": int(cfg.train.batch_size), "bn_recalibrate": int(cfg.train.bn_recalibrate),
            "eval_average_crops": bool(cfg.train.eval_average_crops)}


def read_model_file(path: str | os.PathLike[str], key: str) -> dict[str, Any]:
    """A model file written by :func:`export`, read as plain data (``weights_only``); a ConfigError naming ``key``
    for a path that does not exist, a truncated or corrupt file, or a file that is not a gems model."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(key, str(path), "an existing model file (results/<run_id>.model.pt) or checkpoint folder")
    try:
        d = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConfigError(key, str(path), f"a readable model file (torch.load: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160]})") from None
    if not isinstance(d, dict) or d.get("format") != MODEL_FILE_FORMAT or not isinstance(d.get("state_dict"), dict) \
            or not isinstance(d.get("model"), dict):
        raise ConfigError(key, str(path), f"a gems model file (format {MODEL_FILE_FORMAT}: a dict with model and "
                          "state_dict)")
    return d


def weights(path: str | os.PathLike[str], key: str, averaged: bool = False) -> Callable[[Holding], None]:
    """What ``train.init_from`` and ``gems eval`` load from ``path`` (a model file or a checkpoint): a function that
    loads its weights into a rank's holding. ``averaged``: a checkpoint's ``train.ema`` average in place of its last
    weights, where it has one (a model file holds the average already)."""
    p = Path(path).expanduser()
    if is_model_file(p):
        state = read_model_file(p, key)["state_dict"]

        def from_file(hold: Holding) -> None:
            with torch.no_grad():
                for n, t in hold.tensors().items():
                    t.copy_(state[n])

        return from_file
    folder = find(p, key)

    def from_checkpoint(hold: Holding) -> None:
        got = load(folder, hold, what=("model", "ema") if averaged else ("model",), key=key)
        with torch.no_grad():
            for p, a in zip(hold.params, got["average"]):
                p.copy_(a)

    return from_checkpoint


@dataclass(frozen=True)
class Saved:
    """What a model file or checkpoint says before anything is loaded (the CLI's checks, gems eval's defaults): its
    model section, the run that trained it (:func:`trained_on`), and its model's {name: (shape, dtype)}."""

    model: dict[str, Any]
    trained_on: dict[str, Any]
    shapes: dict[str, tuple[tuple[int, ...], Any]]


def inspect(path: str | os.PathLike[str], key: str) -> Saved:
    """:class:`Saved` of ``path``, read once: a model file whole, a checkpoint's ``gems.json`` and metadata only."""
    p = Path(path).expanduser()
    if is_model_file(p):
        d = read_model_file(p, key)
        shapes = {n: (tuple(t.shape), t.dtype) for n, t in d["state_dict"].items() if isinstance(t, torch.Tensor)}
        return Saved(dict(d["model"]), dict(d.get("trained_on") or {}), shapes)
    folder = find(p, key)
    meta = read_meta(folder)
    shapes = {k[len("model."):]: v for k, v in entries(folder, key).items() if k.startswith("model.")}
    return Saved(dict(meta.get("model") or {}), dict(meta.get("trained_on") or {}), shapes)


def request_requeue() -> bool:
    """Ask Slurm to requeue this job (it restarts with SLURM_RESTART_COUNT + 1). False off Slurm."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return False
    out = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    return out.returncode == 0


# ---- the time limit ------------------------------------------------------------------------------------------
def install_time_limit_handler(sig: int = signal.SIGUSR2) -> None:
    """``sig`` (Slurm's warning before the time limit, or a preemption notice) asks for a checkpoint."""

    def handler(signum: int, frame: Any) -> None:
        _STOP["requested"], _STOP["signal"] = True, signum

    signal.signal(sig, handler)


def stop_requested() -> bool:
    return bool(_STOP["requested"])


def clear_stop() -> None:
    _STOP["requested"], _STOP["signal"] = False, None
