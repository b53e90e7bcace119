"""Synthetic samples in gems's own HDF5 layout, for ``gems data synth``: what CosmoFlow's files hold (``full`` int16
counts, channels first, ``unitPar`` 4 floats in [-1, 1]) and a similar spread, a log-normal field of power-law
spectrum drawn as Poisson counts, one channel a "redshift", whose four parameters the network can learn; each
sample a pure function of ``(seed, index)``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from gems.errors import ConfigError


def _field(rng: np.random.Generator, shape: Sequence[int], slope: float) -> np.ndarray:
    noise = rng.standard_normal(shape)
    k2 = np.zeros([n if i < len(shape) - 1 else n // 2 + 1 for i, n in enumerate(shape)])
    for i, n in enumerate(shape):
        f = np.fft.rfftfreq(n) if i == len(shape) - 1 else np.fft.fftfreq(n)
        k2 = k2 + (f ** 2).reshape([-1 if j == i else 1 for j in range(len(shape))])
    k2.flat[0] = np.inf  # no mean
    spec = np.fft.rfftn(noise) * k2 ** (-slope / 4.0)
    out = np.fft.irfftn(spec, s=shape, axes=list(range(len(shape))))
    return out / (out.std() + 1e-12)


def make_sample(seed: int, index: int, shape: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Counts (int16, ``shape`` = (C, *spatial)) and ``unitPar`` (float32, 4) of one sample."""
    rng = np.random.default_rng([int(seed), int(index)])
    par = rng.uniform(-1.0, 1.0, 4)
    c, spatial = int(shape[0]), [int(n) for n in shape[1:]]
    field = _field(rng, spatial, slope=2.0 + 0.5 * par[0])
    amp, mean = 0.8 + 0.3 * par[1], 4.0 * np.exp(0.5 * par[2])
    counts = np.empty((c, *spatial), dtype=np.int16)
    for ch in range(c):
        growth = 1.0 + (0.15 + 0.1 * par[3]) * ch
        density = np.exp(amp * growth * field)
        lam = mean * (1 + ch) * density / density.mean()
        counts[ch] = np.minimum(rng.poisson(lam), np.iinfo(np.int16).max)
    return counts, par.astype(np.float32)


def write_synthetic(path: str | os.PathLike, n_samples: int, shape: Sequence[int], seed: int = 0) -> list[Path]:
    """Write ``n_samples`` files ``sample_00000.h5``... under the directory ``path``."""
    import h5py

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(int(n_samples)):
        counts, par = make_sample(seed, i, shape)
        final = out / f"sample_{i:05d}.h5"
        tmp = out / f".{final.name}.tmp"
        with h5py.File(tmp, "w") as f:
            f.create_dataset("full", data=counts)
            f.create_dataset("unitPar", data=par)
            f.attrs["generator"] = f"gems.data.synth seed={seed} index={i}"
            f.attrs["layout"] = "gems"  # gems.data.layouts.own (channels first)
        os.replace(tmp, final)
        files.append(final)
    return files


def synth_main(cfg: Any, shape: Sequence[int] | None = None) -> list[Path]:
    """``gems data synth``: ``data.path``, ``data.num_samples`` (default 8), ``train.seed``; samples of the
    model's input ``shape`` (C, *spatial: the command hands in the configured model's), else ``model.in_channels``
    (default 4) x ``model.size``^3."""

    def get(node: Any, key: str, default: Any) -> Any:
        if node is None:
            return default
        return node.get(key, default) if hasattr(node, "get") else getattr(node, key, default)

    data, model, train = get(cfg, "data", None), get(cfg, "model", None), get(cfg, "train", None)
    path = get(data, "path", None)
    if path in (None, "", "???"):
        raise ConfigError("data.path", path, "a directory to write the samples to, e.g. data.path=/scratch/cosmo")
    n = get(data, "num_samples", 8)
    if not isinstance(n, int) or n < 1:
        raise ConfigError("data.num_samples", n, "a positive number of samples")
    if shape is None:
        size = get(model, "size", None)
        if not isinstance(size, int) or size < 1:
            raise ConfigError("model.size", size, "the sample edge in cells, e.g. 128")
        shape = (int(get(model, "in_channels", 4)), size, size, size)
    from gems.paths import writable_dir

    writable_dir("data.path", path, "a folder gems can create or write the samples into")
    existing = sorted(Path(path).glob("sample_*.h5")) if Path(path).is_dir() else []
    if existing:
        raise ConfigError("data.path", str(path), f"a new or empty directory (it holds {len(existing)} sample files; "
                                                  "nothing was overwritten)")
    files = write_synthetic(path, n, tuple(shape), int(get(train, "seed", 0)))
    print(f"wrote {len(files)} samples of shape {list(shape)} (int16) to {path}")
    return files
