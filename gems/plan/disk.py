"""The disk space a run will write (its checkpoints, the trained model's file, its records) against the space its
folders have, checked before launch."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gems.errors import ConfigError
from gems.storage import free_bytes, size

#: what a run's records take at most beside its checkpoints (the JSON record, the per-step CSV, rank logs, reports)
RECORDS_BYTES = 4 << 20


def state_copies(train: Any) -> int:
    """Copies of the parameters the optimizer and ``train.ema`` keep beside them: Adam two, SGD with momentum one,
    plain SGD none; one more for train.ema's average (what a checkpoint holds and a rank's memory carries)."""
    copies = 2 if str(train.optimizer) == "adam" else (1 if float(train.momentum) > 0 else 0)
    return copies + (1 if float(train.ema) > 0 else 0)


@dataclass(frozen=True)
class Written:
    """The bytes a run writes into ``results.dir``: one checkpoint, how many are on disk at once, the model file."""

    checkpoint: int
    kept: int  # checkpoints on disk at once: the last whole one and the one being written
    model_file: int

    @property
    def peak(self) -> int:
        """The most the run holds on the disk at once: while a checkpoint is written, or while the model file is
        (its tensors written as parts first, then the file), beside the records."""
        during_export = (self.checkpoint if self.kept else 0) + 2 * self.model_file
        return max(self.kept * self.checkpoint, during_export) + RECORDS_BYTES

    def describe(self) -> str:
        ckpts = (f"{self.kept} checkpoint(s) of {size(self.checkpoint)} at once, " if self.kept else "")
        return f"{size(self.peak)} ({ckpts}the model file {size(self.model_file)} written through parts of its size)"


def written(cfg: Any) -> Written:
    """What ``cfg``'s run writes (the model built on the meta device: nothing allocated)."""
    from gems.config import section
    from gems.models import build_model

    with torch.device("meta"):
        state = build_model(section(cfg, "model")).module.state_dict()
    model = int(sum(t.numel() * t.element_size() for t in state.values()))
    params = int(sum(t.numel() * 4 for t in state.values() if t.is_floating_point()))  # fp32 optimizer state
    checkpoint = model + state_copies(cfg.train) * params
    every = int(cfg.train.checkpoint_every or 0)
    slurm = str(cfg.cluster.launcher) != "local"  # the time limit's signal saves one too
    kept = 2 if every > 0 else (1 if slurm else 0)
    return Written(checkpoint, kept, model)


def check_space(cfg: Any) -> Written:
    """ConfigError naming ``results.dir`` where its file system has less room than the run will write."""
    need = written(cfg)
    folder = Path(str(cfg.results.dir))
    free = free_bytes(folder)
    if free is not None and free < need.peak:
        raise ConfigError("results.dir", str(folder), f"a folder with room for what the run writes: "
                          f"{need.describe()}, and {size(free)} is free there (results.dir=PATH moves the run's "
                          "files; train.checkpoint_every=0 writes fewer checkpoints)")
    return need
