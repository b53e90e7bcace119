"""gems: train CNNs on samples too large for one GPU.

Three strategies on one R x D x S mesh, composed in ``gems.rank.compose``: spatial parts of a sample
(``gems.spatial``), pipelines and GEMS (``gems.pipeline``), and replicas (``gems.replication``). For your own
training script: ``gems.init``, ``gems.Mesh``, ``gems.apply_spatial``, ``gems.apply_pipeline``,
``gems.GradientReducer`` (docs/parallelism.md, "Python API"; examples/).
"""
from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["init", "Mesh", "Axis", "SpatialContext", "apply_spatial", "apply_pipeline", "GradientReducer",
           "ConfigError", "batch_context", "__version__"]


def init(backend: str = "auto", device: str = "auto", timeout_s: int = 300) -> Any:
    """Discover this rank (torchrun, Slurm/submitit, mpirun with ``backend="mpi"``, or a
    single process), pick its device and initialise torch.distributed. Returns a ``World``."""
    from omegaconf import OmegaConf

    from gems.bootstrap import init_world

    cfg = OmegaConf.create({"comm": {"backend": backend, "timeout_s": timeout_s}, "train": {"device": device}})
    return init_world(cfg)


def __getattr__(name: str) -> Any:  # lazy: `import gems` stays cheap for the CLI
    if name in ("Mesh", "Axis"):
        from gems import mesh

        return getattr(mesh, name)
    if name in ("SpatialContext", "apply_spatial"):
        from gems import spatial

        return getattr(spatial, name)
    if name == "apply_pipeline":
        from gems.pipeline import apply_pipeline

        return apply_pipeline
    if name == "GradientReducer":
        from gems.replication import GradientReducer

        return GradientReducer
    if name == "ConfigError":
        from gems.errors import ConfigError

        return ConfigError
    if name == "batch_context":
        from gems.layers import batch_context

        return batch_context
    raise AttributeError(f"module 'gems' has no attribute {name!r}")
