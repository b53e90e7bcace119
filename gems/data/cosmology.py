"""Universes that carry the physics: the samples behind ``gems data synth data.kind=cosmology``.

One universe is a pure function of ``(seed, index)`` (:func:`make_universe`): its parameters drawn from
:data:`RANGES`, colossus's linear power spectrum, a Gaussian field of it, Zel'dovich displacements at each of
:data:`REDSHIFTS`, and a cloud-in-cell deposit to int16 counts (docs/science.md, "Universes that carry the physics").
The deposit may be split over processes by slabs of particle planes (:func:`deposit`), in :func:`memory_bytes`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

#: the targets, in ``unitPar``'s order
PARAMETERS = ("Omega_m", "sigma_8", "n_s", "H_0")
#: the CosmoFlow data set's parameter ranges (Omega_m, sigma_8 and n_s as Mathuriya et al. 2018 give them;
#: H_0 in km/s/Mpc), the default of ``data.param_ranges``
RANGES: dict[str, tuple[float, float]] = {"Omega_m": (0.25, 0.35), "sigma_8": (0.78, 0.95), "n_s": (0.90, 1.00),
                                          "H_0": (60.0, 80.0)}
#: the redshifts of the 4 channels, as in CosmoFlow's 2019 data set (earliest first)
REDSHIFTS = (3.0, 1.5, 0.5, 0.0)
#: baryons, fixed (Planck 2018): not a target
OMEGA_B = 0.049


@dataclass(frozen=True)
class Universes:
    """What every universe of a data set shares: the box, the channels, the count scale, the ranges, the seed."""

    cells: int
    box_mpc: float
    redshifts: tuple[float, ...] = REDSHIFTS
    mean_count: float = 8.0
    ranges: tuple[tuple[float, float], ...] = tuple(RANGES.values())
    seed: int = 0

    def attrs(self) -> dict[str, Any]:
        """What a file records of how it was made (a resumed run checks it before skipping a file)."""
        return {"cells": self.cells, "box_mpc": self.box_mpc, "redshifts": list(self.redshifts),
                "mean_count": self.mean_count, "ranges": [list(r) for r in self.ranges], "seed": self.seed}


# ---------------------------------------------------------------------------- one universe's physics
def parameters(u: Universes, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(physical values, ``unitPar`` in [-1, 1]) of universe ``index``, drawn uniformly in the ranges."""
    unit = np.random.default_rng([u.seed, index, 1]).uniform(-1.0, 1.0, len(PARAMETERS))
    lo, hi = np.array(u.ranges, dtype=np.float64).T
    return lo + (unit + 1.0) / 2.0 * (hi - lo), unit.astype(np.float32)


def cosmology(physical: Sequence[float] | np.ndarray) -> Any:
    """The colossus cosmology of ``(Omega_m, sigma_8, n_s, H_0)``: flat LCDM, Omega_b = :data:`OMEGA_B`, nothing
    written to colossus's cache (one cosmology a universe)."""
    from colossus.cosmology import cosmology as cc

    om, s8, ns, h0 = (float(x) for x in physical)
    return cc.Cosmology(name="gems", flat=True, Om0=om, Ob0=OMEGA_B, H0=h0, sigma8=s8, ns=ns, persistence="",
                        interpolation=False, print_warnings=False)


def white_noise(u: Universes, index: int, planes: range | None = None) -> torch.Tensor:
    """Unit Gaussian noise of universe ``index``, plane by plane (each plane its own seed): any range of
    planes is the same wherever it is drawn."""
    n = u.cells
    rows = [np.random.default_rng([u.seed, index, 2, d]).standard_normal((n, n), dtype=np.float32)
            for d in (planes if planes is not None else range(n))]
    return torch.from_numpy(np.stack(rows))


def _k_squared(n: int) -> torch.Tensor:
    """|k|^2 in units of the fundamental mode, an integer on the rfft grid (n, n, n // 2 + 1)."""
    f = torch.fft.fftfreq(n, d=1.0 / n)
    r = torch.fft.rfftfreq(n, d=1.0 / n)
    return (f.view(-1, 1, 1) ** 2 + f.view(1, -1, 1) ** 2 + r.view(1, 1, -1) ** 2).round().long()


def density_modes(u: Universes, index: int, power: Callable[[np.ndarray], np.ndarray]) -> torch.Tensor:
    """delta_k at z = 0 (rfft layout, complex64): the noise's modes times sqrt(P(k) / V_cell), no mean mode.
    ``power``: P(k) in (Mpc/h)^3 of k in h/Mpc. P is looked up per integer |k|^2 (exact, and few values)."""
    n = u.cells
    modes = torch.fft.rfftn(white_noise(u, index))
    m2 = _k_squared(n)
    kf = 2.0 * math.pi / u.box_mpc
    table = np.zeros(int(m2.max()) + 1)
    k = kf * np.sqrt(np.arange(1, len(table), dtype=np.float64))
    v_cell = (u.box_mpc / n) ** 3
    table[1:] = np.sqrt(np.maximum(power(k), 0.0) / v_cell)
    return modes * torch.from_numpy(table.astype(np.float32))[m2]


def displacement(u: Universes, modes: torch.Tensor) -> torch.Tensor:
    """The Zel'dovich displacement Psi = IFFT(i k delta_k / k^2) at z = 0, (3, n, n, n) float32, in cells."""
    n = u.cells
    f = torch.fft.fftfreq(n, d=1.0 / n)
    r = torch.fft.rfftfreq(n, d=1.0 / n)
    m2 = _k_squared(n).to(torch.float32)
    m2[0, 0, 0] = 1.0  # the mean mode is 0 already
    out = torch.empty((3, n, n, n), dtype=torch.float32)
    for axis, kc in enumerate((f.view(-1, 1, 1), f.view(1, -1, 1), r.view(1, 1, -1))):
        # k in units of the fundamental mode: Psi in units of box / (2 pi), then cells (n / box of them)
        out[axis] = torch.fft.irfftn(modes * (1j * kc / m2), s=(n, n, n)) * (n / (2.0 * math.pi))
    return out


# ---------------------------------------------------------------------------- the particles, deposited
def deposit(psi: torch.Tensor, plane0: int, n: int, growth: Sequence[float]) -> tuple[int, torch.Tensor]:
    """Cloud-in-cell deposit of the particles of lattice planes ``plane0 ..`` (``psi``: their displacement,
    (3, planes, n, n), in cells) moved by ``D * psi`` for each growth factor D: one channel each, one particle
    a cell (weight 1). Returns ``(first, grid)``: the grid's planes are ``first + 0 .. len - 1`` (mod n), a slab
    widened by the largest displacement, or the whole box."""
    planes = psi.shape[1]
    reach = int(math.ceil(float(psi[0].abs().max()) * max(abs(d) for d in growth))) + 1
    length = min(n, planes + 2 * reach)
    first = (plane0 - reach) % n if length < n else 0
    grid = torch.zeros((len(growth), length * n * n), dtype=torch.float32)
    q = [torch.arange(plane0, plane0 + planes, dtype=torch.float32).view(-1, 1, 1),
         torch.arange(n, dtype=torch.float32).view(1, -1, 1), torch.arange(n, dtype=torch.float32).view(1, 1, -1)]
    for c, d in enumerate(growth):
        cells, fracs = [], []
        for axis in range(3):
            x = (q[axis] + float(d) * psi[axis]).reshape(-1)
            lo = torch.floor(x)
            fracs.append(x - lo)
            cells.append(lo.long())
        cells[0] = (cells[0] - first) % n  # planes of the slab (all of them fit in it: see reach)
        for ox in (0, 1):
            wx = fracs[0] if ox else 1.0 - fracs[0]
            ix = (cells[0] + ox) % n if length == n else cells[0] + ox
            for oy in (0, 1):
                wy = wx * (fracs[1] if oy else 1.0 - fracs[1])
                iy = ix * n + (cells[1] + oy) % n
                for oz in (0, 1):
                    w = wy * (fracs[2] if oz else 1.0 - fracs[2])
                    grid[c] += torch.bincount(iy * n + (cells[2] + oz) % n, w, minlength=length * n * n)
    return first, grid.view(len(growth), length, n, n)


def add_slab(total: torch.Tensor, first: int, slab: torch.Tensor) -> None:
    """Add a slab (:func:`deposit`) into the whole box's grid (C, n, n, n), wrapping around."""
    n = total.shape[1]
    planes = (torch.arange(slab.shape[1]) + first) % n
    total.index_add_(1, planes, slab)


def to_counts(grid: torch.Tensor, mean_count: float) -> np.ndarray:
    """Particles a cell (mean 1) as int16 counts of mean ``mean_count``, rounded."""
    return torch.round(grid * float(mean_count)).clamp_(0, np.iinfo(np.int16).max).to(torch.int16).numpy()


def slabs(n: int, parts: int) -> list[range]:
    """``parts`` contiguous ranges of lattice planes covering ``n``."""
    parts = max(1, min(parts, n))
    edges = [round(i * n / parts) for i in range(parts + 1)]
    return [range(edges[i], edges[i + 1]) for i in range(parts)]


def make_universe(u: Universes, index: int,
                  map_slabs: Callable[[Callable[..., Any], list[tuple[Any, ...]]], list[Any]] | None = None,
                  parts: int = 1) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Universe ``index``: (counts int16 (channels, n, n, n), ``unitPar`` float32 (4,), its physical parameters).

    ``map_slabs(fn, args)`` runs the deposit of ``parts`` slabs (e.g. a process pool's map; None: here, one
    after the other); the result does not depend on how the work is split, to float rounding of the sums."""
    physical, unit = parameters(u, index)
    cosmo = cosmology(physical)
    modes = density_modes(u, index, lambda k: cosmo.matterPowerSpectrum(k, 0.0))
    psi = displacement(u, modes)
    del modes
    growth = [float(g) for g in cosmo.growthFactor(np.array(u.redshifts, dtype=np.float64))]
    n = u.cells
    jobs = [(psi[:, r.start:r.stop].contiguous(), r.start, n, growth) for r in slabs(n, parts)]
    done = map_slabs(deposit, jobs) if map_slabs is not None else [deposit(*j) for j in jobs]
    total = torch.zeros((len(growth), n, n, n), dtype=torch.float32)
    for first, slab in done:
        add_slab(total, first, slab)
    return to_counts(total, u.mean_count), unit, dict(zip(PARAMETERS, (float(x) for x in physical)))


def memory_bytes(cells: int, channels: int = 4, parts: int = 1) -> int:
    """Peak host memory of one universe of ``cells``^3 with its deposit in ``parts`` slabs, from what it was
    measured to take (resident growth; tests/test_cosmology.py checks it): about 106 + 6 x channels bytes a cell
    for the noise, the modes, the displacement, the grids and the counts, and about 110 bytes a particle of the
    slab being deposited (positions, fractions, int64 cell indices, weights); 15% more for the allocator."""
    n3 = cells ** 3
    return int(1.15 * ((106 + 6 * channels) * n3 + 110 * n3 / max(1, parts)))


__all__ = ["PARAMETERS", "RANGES", "REDSHIFTS", "Universes", "parameters", "cosmology", "white_noise",
           "density_modes", "displacement", "deposit", "add_slab", "to_counts", "slabs", "make_universe",
           "memory_bytes"]
