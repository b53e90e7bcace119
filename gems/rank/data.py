"""What a rank reads each step: its replica's samples of the step, its spatial part of the inputs where it runs
a first stage, the targets where it runs a last one (synthetic samples or HDF5 hyperslabs).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from gems.errors import ConfigError
from gems.models import ModelSpec

# ---------------------------------------------------------------------------- data
if TYPE_CHECKING:
    from gems.rank.compose import Parallel


def make_data(cfg: DictConfig, spec: ModelSpec, slices: tuple[slice, ...] | None = None) -> Any:
    if cfg.data.name == "hdf5":
        from gems.data.hdf5 import HDF5Samples

        if spec.target != "vector":
            raise ConfigError("data", "hdf5",
                              f"synthetic for {spec.name} (the ExaLearn files carry one target vector per sample)")
        return _HDF5Batches(HDF5Samples(cfg.data.path, spec.input_shape, slices=slices))
    from gems.data.synthetic import SyntheticData

    return SyntheticData(spec, int(cfg.train.seed), int(cfg.data.num_samples))


class _HDF5Batches:
    """The worker's view of HDF5 samples: this rank's hyperslab, inputs or targets as needed."""

    def __init__(self, samples: Any) -> None:
        self.samples = samples

    def batch(self, indices: list[int], slices: Any = None, want_input: bool = True,
              want_target: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if not want_input:
            from gems.data.hdf5 import read_target

            return None, torch.stack([read_target(self.samples.files[i % len(self.samples)]) for i in indices])
        x, y = self.samples.batch(indices)
        return x, (y if want_target else None)


def replica_indices(step: int, batch: int, replicas: int, replica: int) -> list[int]:
    """Global sample indices of replica ``replica`` at ``step`` (contiguous shares of the step's batch)."""
    share = batch // replicas
    start = step * batch + replica * share
    return list(range(start, start + share))



def step_batch(data: Any, par: Parallel, step: int, batch: int, replicas: int, replica: int
               ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
    """(sample indices, input, target) of ``step`` on a rank: its replica's samples, its spatial part of the
    inputs where it runs a first stage, the targets where it runs a last one."""
    ids = replica_indices(step, batch, replicas, replica)
    x, y = data.batch(ids, par.input_slices, want_input=par.needs_input, want_target=par.needs_target)
    return ids, x, y


