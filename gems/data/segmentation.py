"""``gems data synth data.kind=segmentation``: CT volumes with labels in LiTS's layout, for ``model=unet3d``, each a pure
function of ``(train.seed, index)``: a body with a spine, a liver and one to three hypodense lesions in it, labels 0
background, 1 liver, 2 tumour (docs/data.md, "Synthetic volumes").
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from gems.errors import ConfigError

#: validation volume j is volume VAL_BASE + j: the same volumes whatever the training set's size
VAL_BASE = 1 << 20
AIR, TISSUE, BONE, LIVER, TUMOUR, NOISE = -1000.0, 20.0, 500.0, 110.0, 45.0, 20.0


def _ellipsoid(grid: tuple[np.ndarray, ...], centre: np.ndarray, radii: np.ndarray) -> np.ndarray:
    return sum(((g - c) / r) ** 2 for g, c, r in zip(grid, centre, radii)) < 1.0  # type: ignore[return-value]


def make_volume(seed: int, index: int, edge: int) -> tuple[np.ndarray, np.ndarray]:
    """Hounsfield values (int16, (z, y, x)) and labels (uint8) of volume ``index``: tissue, spine, liver and lesions
    in air, with noise of 20 HU a voxel; ``edge`` voxels in-plane and 3/4 to all of that in slices."""
    rng = np.random.default_rng([int(seed), int(index), 65])
    slices = int(rng.integers(max(1, (3 * edge) // 4), edge + 1))
    axes = [np.linspace(-1, 1, n) for n in (slices, edge, edge)]
    z, y, x = np.meshgrid(*axes, indexing="ij", sparse=True)
    hu = np.full((slices, edge, edge), AIR)
    body = (y / 0.85) ** 2 + (x / 0.95) ** 2 < 1.0
    body = np.broadcast_to(body, hu.shape)
    hu[body] = TISSUE
    hu[np.broadcast_to(((y - 0.55) / 0.16) ** 2 + (x / 0.13) ** 2 < 1.0, hu.shape)] = BONE
    labels = np.zeros(hu.shape, dtype=np.uint8)
    centre = np.array([rng.uniform(-0.3, 0.3), rng.uniform(-0.35, 0.05), rng.uniform(-0.5, -0.1)])
    radii = np.array([rng.uniform(0.5, 0.75), rng.uniform(0.35, 0.5), rng.uniform(0.35, 0.5)])
    liver = _ellipsoid((z, y, x), centre, radii) & body
    hu[liver], labels[liver] = LIVER, 1
    for _ in range(int(rng.integers(1, 4))):
        at = centre + rng.uniform(-0.45, 0.45, 3) * radii
        tumour = _ellipsoid((z, y, x), at, rng.uniform(0.12, 0.25, 3)) & liver
        hu[tumour], labels[tumour] = TUMOUR, 2
    hu += rng.normal(0.0, NOISE, hu.shape)
    return np.clip(np.rint(hu), -1024, 3071).astype(np.int16), labels


def synth_segmentation(cfg: Any) -> list[Path]:
    """Write the volumes ``cfg`` asks for (``data.num_samples`` to ``data.path``, ``data.val_samples`` or a quarter as
    many to ``data.val_path``); a folder that already holds volumes is bad input
    (nothing is overwritten)."""
    from gems.data.layouts import get
    from gems.paths import writable_dir

    d = cfg.data
    edge = cfg.model.size
    if not isinstance(edge, int) or edge < 8:
        raise ConfigError("model.size", edge, "the volumes' in-plane edge in voxels, e.g. 64 (model=unet3d)")
    n = int(d.num_samples)
    sets = [("data.path", d.path, 0, n)]
    if d.val_path:
        if Path(str(d.val_path)).absolute() == Path(str(d.path)).absolute():
            raise ConfigError("data.val_path", d.val_path, "a folder other than data.path")
        sets.append(("data.val_path", d.val_path, VAL_BASE, int(d.val_samples) or max(1, n // 4)))
    layout = get("nifti")
    for key, path, _, _ in sets:
        if path in (None, "", "???"):
            raise ConfigError(key, path, "a folder to write the volumes to, e.g. data.path=/scratch/lits/train")
        writable_dir(key, str(path), "a folder gems can create or write the volumes into")
        if Path(str(path)).is_dir() and layout.files(str(path)):
            raise ConfigError(key, str(path), "a new or empty folder (it holds volumes; nothing was overwritten)")
    seed = int(cfg.train.seed)
    written: list[Path] = []
    for key, path, base, count in sets:
        written += layout.write(str(path), (make_volume(seed, base + i, edge) for i in range(count)))
        print(f"gems data synth: wrote {count} CT volumes ({edge} x {edge} voxels in-plane, {(3 * edge) // 4}-{edge} "
              f"slices) with labels to {path}", flush=True)
    return written
