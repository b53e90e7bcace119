"""Universes that carry the physics (gems/data/cosmology.py, gems/data/universes.py): the field has colossus's
spectrum and the universe's sigma_8, particles move by the Zel'dovich displacement and are all deposited, a
universe is a pure function of (seed, index) however its deposit is split, and ``gems data synth
data.kind=cosmology`` writes training and validation universes apart, resumably, refusing what it would
overwrite."""
from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from _cli import gems_here

from gems.data import cosmology as cos
from gems.data.universes import VAL_BASE

SMALL = cos.Universes(cells=32, box_mpc=256.0)


def _power(u: cos.Universes, index: int):
    physical, _ = cos.parameters(u, index)
    c = cos.cosmology(physical)
    return physical, c, lambda k: c.matterPowerSpectrum(k, 0.0)


def test_parameters_are_drawn_in_the_ranges_and_normalised_to_unit_par() -> None:
    lo, hi = np.array(SMALL.ranges).T
    for i in range(20):
        physical, unit = cos.parameters(SMALL, i)
        assert np.all(lo <= physical) and np.all(physical <= hi)
        np.testing.assert_allclose(unit, 2 * (physical - lo) / (hi - lo) - 1, atol=1e-6)
    assert not np.allclose(cos.parameters(SMALL, 0)[1], cos.parameters(SMALL, 1)[1])


def test_the_gaussian_field_has_the_spectrum_of_its_cosmology() -> None:
    """The variance of the linear field on the grid is the sum of P(k) / V over the grid's modes, and the
    colossus cosmology is normalised to the universe's sigma_8."""
    physical, c, power = _power(SMALL, 3)
    assert c.sigma(8.0, 0.0) == pytest.approx(physical[1], rel=1e-3)
    n, box = SMALL.cells, SMALL.box_mpc
    delta = torch.fft.irfftn(cos.density_modes(SMALL, 3, power), s=(n,) * 3)
    f = np.fft.fftfreq(n, 1 / n)
    k = 2 * np.pi / box * np.sqrt(f[:, None, None] ** 2 + f[None, :, None] ** 2 + f[None, None, :] ** 2)
    expected = power(k[k > 0]).sum() / box ** 3
    assert float(delta.var()) == pytest.approx(expected, rel=0.05)
    assert abs(float(delta.mean())) < 1e-4  # no mean mode


def test_the_displacement_is_minus_the_density_gradients_potential() -> None:
    """Zel'dovich: delta = -div Psi, checked in Fourier space on the grid's own modes."""
    _, _, power = _power(SMALL, 1)
    modes = cos.density_modes(SMALL, 1, power)
    psi = cos.displacement(SMALL, modes)  # in cells
    n = SMALL.cells
    div = sum(torch.fft.rfftn(psi[a]) * (1j * 2 * math.pi * k / n) for a, k in
              enumerate((torch.fft.fftfreq(n, 1 / n).view(-1, 1, 1), torch.fft.fftfreq(n, 1 / n).view(1, -1, 1),
                         torch.fft.rfftfreq(n, 1 / n).view(1, 1, -1))))
    nyq = torch.ones_like(modes.real, dtype=torch.bool)  # Nyquist planes: the derivative's sign is ambiguous there
    nyq[n // 2], nyq[:, n // 2], nyq[:, :, n // 2] = False, False, False
    torch.testing.assert_close((-div)[nyq], modes[nyq], rtol=1e-3, atol=1e-3 * float(modes.abs().max()))


def test_cloud_in_cell_keeps_every_particle_and_an_unmoved_lattice_is_one_a_cell() -> None:
    n = 16
    first, grid = cos.deposit(torch.zeros(3, n, n, n), 0, n, [1.0])
    assert first == 0 and torch.equal(grid, torch.ones(1, n, n, n))
    psi = torch.randn(3, n, n, n) * 3  # far moves wrap around the periodic box
    _, grid = cos.deposit(psi, 0, n, [0.3, 1.0])
    assert grid.sum(dim=(1, 2, 3)).tolist() == pytest.approx([n ** 3, n ** 3], rel=1e-5)
    # a particle half way between two cells along x puts half its weight in each
    psi = torch.zeros(3, n, n, n)
    psi[0, 2, 3, 4] = 0.5
    _, grid = cos.deposit(psi, 0, n, [1.0])
    assert grid[0, 2, 3, 4] == pytest.approx(0.5) and grid[0, 3, 3, 4] == pytest.approx(1.5)


def test_a_universe_is_the_same_however_its_deposit_is_split() -> None:
    whole, unit, physical = cos.make_universe(SMALL, 5)
    again, unit2, _ = cos.make_universe(SMALL, 5)
    split, unit3, _ = cos.make_universe(SMALL, 5, parts=3)
    assert np.array_equal(whole, again) and np.array_equal(unit, unit2) and np.array_equal(unit, unit3)
    # the slabs' float sums add in another order: a count may round the other way where it sits on .5
    assert np.mean(whole != split) < 1e-4 and np.abs(whole.astype(int) - split).max() <= 1
    assert whole.dtype == np.int16 and whole.shape == (4, 32, 32, 32)
    assert whole.mean() == pytest.approx(SMALL.mean_count, rel=0.01)
    assert set(physical) == set(cos.PARAMETERS)


def test_structure_grows_with_time_and_with_sigma_8() -> None:
    """The channels run from z = 3 to today: the counts' contrast grows; and across universes the contrast
    today follows sigma_8 (the physics a network can learn from)."""
    counts, _, _ = cos.make_universe(SMALL, 2)
    contrast = [float(np.log1p(c.astype(np.float64)).std()) for c in counts]
    assert contrast == sorted(contrast) and contrast[-1] > 1.5 * contrast[0]
    sig, spread = [], []
    for i in range(8):
        c, _, phys = cos.make_universe(SMALL, 10 + i)
        sig.append(phys["sigma_8"])
        spread.append(np.log1p(c[1].astype(np.float64)).std())  # z = 1.5: before the smallest scales saturate
    rank = np.corrcoef(np.argsort(np.argsort(sig)), np.argsort(np.argsort(spread)))[0, 1]
    assert rank > 0.6, (sig, spread)


@pytest.mark.parametrize("parts", [1, 4])
def test_memory_bound_covers_what_a_universe_takes(parts: int) -> None:
    """The peak resident memory of a process that makes a 128^3 universe, less that of one that makes an 8^3 one
    (the same imports), stays within memory_bytes, and the bound is not far above it (glibc's reuse of freed
    memory makes the peak itself vary from run to run). The peak is the process's own (VmHWM): getrusage's
    ru_maxrss carries over the parent's peak through fork and exec, which a large pytest process then sets."""
    import subprocess
    import sys

    def peak(cells: int) -> int:
        code = ("import torch; torch.set_num_threads(1)\n"
                "from gems.data import cosmology as cos\n"
                f"cos.make_universe(cos.Universes(cells={cells}, box_mpc=512.0), 0, parts={parts})\n"
                "print(next(int(line.split()[1]) * 1024 for line in open('/proc/self/status')\n"
                "           if line.startswith('VmHWM:')))")
        return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)

    grown, bound = peak(128) - peak(8), cos.memory_bytes(128, parts=parts)
    assert bound / 3 <= grown <= bound, (grown, bound)  # 0.73-0.81 of the bound, measured
    assert cos.memory_bytes(512, parts=16) < 32 * 2**30  # a 512^3 universe on one node (docs/science.md)


# ---- gems data synth data.kind=cosmology ------------------------------------------------------------------------
def _synth(tmp: Path, *args: str):
    return gems_here("data", "synth", "data.kind=cosmology", f"data.path={tmp / 'train'}",
                     f"data.val_path={tmp / 'val'}", "data.box_cells=32", "data.box_mpc=128", "data.workers=2", *args)


def test_synth_writes_train_and_val_universes_resumably(tmp_path: Path) -> None:
    out = _synth(tmp_path, "data.universes=3", "data.val_universes=2")
    assert out.returncode == 0, out.stderr
    train, val = sorted((tmp_path / "train").glob("*.hdf5")), sorted((tmp_path / "val").glob("*.hdf5"))
    assert [p.name for p in train] == ["universe_00000.hdf5", "universe_00001.hdf5", "universe_00002.hdf5"]
    assert len(val) == 2
    with h5py.File(train[1]) as f:
        full, par, index = f["full"][()], f["unitPar"][()], int(f.attrs["index"])
    with h5py.File(val[0]) as f:
        assert int(f.attrs["index"]) == VAL_BASE  # validation universes are others, whatever the training count
    u = cos.Universes(cells=32, box_mpc=128.0)
    counts, unit, _ = cos.make_universe(u, index)
    assert index == 1 and np.array_equal(par, unit)  # a pure function of (seed, index)
    assert full.shape == (32, 32, 32, 4) and np.array_equal(full, np.moveaxis(counts, 0, -1))  # ExaLearn's: channels last
    # each file carries its log counts' figures; the summary pools them for data.standardize
    logs = np.log1p(counts.astype(np.float64))
    with h5py.File(train[1]) as f:
        assert f.attrs["log1p_mean"] == pytest.approx(logs.mean(), rel=1e-5)
    mean, std = (float(v) for v in out.stdout.split("data.standardize=[")[1].split("]")[0].split(","))
    every = np.concatenate([np.log1p(h5py.File(p)["full"][()].astype(np.float64)).ravel() for p in train])
    assert mean == pytest.approx(every.mean(), abs=1e-3) and std == pytest.approx(every.std(), abs=1e-3)
    # resumed: a missing universe is written, the others are kept as they are (not rewritten)
    train[2].unlink()
    kept = train[0].stat().st_mtime_ns
    out = _synth(tmp_path, "data.universes=4", "data.val_universes=2")
    assert out.returncode == 0, out.stderr
    assert "4 already there" in out.stdout and train[0].stat().st_mtime_ns == kept  # 2 training, 2 validation
    assert len(list((tmp_path / "train").glob("*.hdf5"))) == 4


@pytest.mark.parametrize("args, key", [
    (["data.kind=galaxies"], "data.kind"),
    (["data.param_ranges={sigma_8:[0.9,0.8]}"], "data.param_ranges.sigma_8"),
    (["data.param_ranges={w0:[-1,0]}"], "data.param_ranges"),
    (["data.val_universes=0"], "data.val_universes"),
    (["data.redshifts=[0,1]"], "data.redshifts"),
    (["data.box_cells=33"], "data.box_cells"),
    (["data.box_cells=4096"], "data.box_cells"),
])
def test_bad_input_is_refused_before_anything_is_written(tmp_path: Path, args: list[str], key: str) -> None:
    out = _synth(tmp_path, *args)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().startswith(f"gems: error: {key}=") and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "train").exists()


def test_nothing_is_overwritten(tmp_path: Path) -> None:
    assert _synth(tmp_path, "data.universes=2", "data.val_universes=1").returncode == 0
    before = {p: p.read_bytes() for p in (tmp_path / "train").glob("*.hdf5")}
    other = _synth(tmp_path, "data.universes=2", "data.val_universes=1", "data.box_mpc=200")
    assert other.returncode == 2 and "written with other ones" in other.stderr
    same = gems_here("data", "synth", "data.kind=cosmology", f"data.path={tmp_path / 'train'}",
                     f"data.val_path={tmp_path / 'train'}")
    assert same.returncode == 2 and "data.val_path" in same.stderr
    (tmp_path / "val" / "mine.h5").write_bytes(b"x")
    foreign = _synth(tmp_path, "data.universes=2", "data.val_universes=1")
    assert foreign.returncode == 2 and "mine.h5" in foreign.stderr
    assert before == {p: p.read_bytes() for p in (tmp_path / "train").glob("*.hdf5")}


@pytest.mark.slurm
def test_synth_as_a_slurm_job_splits_the_universes_over_its_tasks(tmp_path: Path) -> None:
    out = _synth(tmp_path, "data.universes=3", "data.val_universes=1", "cluster=local_slurm", "cluster.nodes=2",
                 "cluster.tasks_per_node=1", f"results.dir={tmp_path / 'res'}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "Slurm job" in out.stdout and "over 2 task(s)" in out.stdout
    files = sorted((tmp_path / "train").glob("*.hdf5")) + sorted((tmp_path / "val").glob("*.hdf5"))
    assert len(files) == 4
    with h5py.File(files[2]) as f:
        counts, unit, _ = cos.make_universe(cos.Universes(cells=32, box_mpc=128.0), 2)
        assert np.array_equal(f["full"][()], np.moveaxis(counts, 0, -1)) and np.array_equal(f["unitPar"][()], unit)


def test_a_slurm_tasks_share_of_the_universes_is_cut_from_the_whole_set(tmp_path: Path) -> None:
    """Tasks start at different moments: a task that starts after another has written some universes takes the
    same share as if it had started first (every k-th of the whole set, less what is written), so no universe is
    skipped and none is written by two tasks."""
    from omegaconf import OmegaConf

    from gems.config import compose
    from gems.data.universes import plan_of, share, write_universe

    cfg = compose(["data=hdf5", "data.kind=cosmology", f"data.path={tmp_path / 'train'}",
                   f"data.val_path={tmp_path / 'val'}", "data.box_cells=32", "data.box_mpc=128",
                   "data.universes=4", "data.val_universes=1"], check=False)
    plan = plan_of(OmegaConf.create(OmegaConf.to_container(cfg)))
    first = share(plan, 0, 2)
    write_universe(plan.universes, *first[0])  # task 0 has written one when task 1 starts
    second = share(plan, 1, 2)
    assert set(first).isdisjoint(second) and set(first) | set(second) == set(plan.targets())
    assert share(plan, 0, 2) == first[1:]  # and task 0 resumed takes the rest of its own
