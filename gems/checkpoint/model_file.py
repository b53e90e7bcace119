"""The trained model's file and what reads it: :func:`export` writes it at the end of a run (rank 0, through
the disk and its host, never a device), one file that ``torch.load(path, weights_only=True)`` reads into
``{"model": the model section, "state_dict": ...}``, which loads strictly into
``gems.models.build_model(d["model"]).module``. ``train.init_from`` and ``gems eval`` take the weights of a model
file or a checkpoint (:func:`weights`); the CLI's checks read what either says before loading (:func:`inspect`).
"""
from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from gems.checkpoint.sharded import (
    Holding,
    Saver,
    entries,
    find,
    load,
    read_meta,
    save_file,
    state_bytes,
    trained_on,
    without_dcp_warning,
)
from gems.errors import ConfigError
from gems.storage import StorageFailed, writing

MODEL_FILE_FORMAT = "gems.model/1"


def is_model_file(p: Path) -> bool:
    """Whether ``p`` names a model file (else a checkpoint: a folder, or a run's ``latest`` file)."""
    return p.is_file() and p.name != "latest"


def resolve(path: str | os.PathLike[str], key: str) -> Path:
    """What ``path`` names, absolute: a model file as it is, a checkpoint as its step's folder (:func:`find`)."""
    p = Path(path).expanduser()
    if is_model_file(p):
        return p.resolve()
    return find(p, key).resolve()


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


def export(cfg: Any, world: Any, hold: Holding, saver: Saver, step: int, path: Path, order: list[str]) -> Path | None:
    """The trained model in one file (``train.ema``'s averaged weights where a run keeps them), through host
    memory and the disk: the writers write their shares of the model's tensors as a checkpoint beside the file
    (``.<name>.parts``, :meth:`Saver.write`), rank 0 reads it back into host memory (the model's bytes, once) and
    writes the file, then removes the parts. No device holds more than its own tensors, and no collective but
    the writers' gloo group's carries a byte of them. ``order``: the serial ``state_dict``'s keys. Every rank
    calls it (the group is made by all)."""


    ema = bool(hold.average)
    parts = path.parent / f".{path.name}.parts"
    what = "the trained model file"
    saver.group()
    failed: StorageFailed | None = None
    if saver.share.writes:  # (a killed export's stale files: overwritten or not named by the new metadata)
        mine = {k[len("model."):]: v for k, v in hold.state(ema_weights=ema).items() if k.startswith("model.")}
        try:
            with writing(what, parts, state_bytes(mine)):
                saver.write(mine, parts, step, faults=False)  # DCP's coordinator (rank 0) returns once every writer's are
        except StorageFailed as e:
            failed = e
    if world.rank == 0 and failed is None:
        try:
            with writing(what, path):
                _write_model(cfg, parts, path, order, ema, step)
        except StorageFailed as e:
            failed = e
    if world.rank == 0:
        shutil.rmtree(parts, ignore_errors=True)
    saver.agree(failed, None)  # every rank knows whether the file was written
    return path if world.rank == 0 else None


def _write_model(cfg: Any, parts: Path, path: Path, order: list[str], ema: bool, step: int) -> None:
    """Rank 0: the model's tensors read back from ``parts`` into host memory, written as the model file."""
    from omegaconf import OmegaConf

    import gems

    have = entries(parts, "model file")
    missing = [k for k in order if k not in have]
    if missing:
        raise RuntimeError(f"the trained model misses {missing[:3]}: no rank wrote them")
    state = OrderedDict((k, torch.empty(have[k][0], dtype=have[k][1])) for k in order)
    import torch.distributed.checkpoint as dcp

    with without_dcp_warning():
        dcp.load(state, checkpoint_id=str(parts), no_dist=True)
    out = {"format": MODEL_FILE_FORMAT, "model": OmegaConf.to_container(cfg.model, resolve=True),
           "state_dict": state, "weights": "ema" if ema else "last", "step": int(step), "run_id": str(cfg.run_id),
           "trained_on": trained_on(cfg), "gems": gems.__version__}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(out, path)


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
