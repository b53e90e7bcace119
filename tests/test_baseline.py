"""The sample-size study's classical reference (gems/data/spectrum.py, `gems data baseline`): power-spectrum
features measured right, a ridge regression that recovers what it can and chooses its strength by universe, and
the command's table beside the network's in `gems results`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _cli import gems_here

from gems.data import spectrum as ps
from gems.results.table import write_studies


def test_a_plane_wave_puts_its_power_in_its_own_shell_and_the_mean_is_read() -> None:
    n = 32
    i = np.arange(n)
    wave = 5.0 * (1.0 + 0.5 * np.cos(2 * np.pi * 3 * i / n))[:, None, None] * np.ones((n, n, n))
    flat = np.full((n, n, n), 2.0)
    f = ps.spectrum_features(np.stack([wave, flat])).reshape(2, n // 2 + 1)
    assert f[0, 0] == pytest.approx(np.log(5.0)) and f[1, 0] == pytest.approx(np.log(2.0))
    assert int(np.argmax(f[0, 1:])) + 1 == 3  # shell |k| = 3
    # |delta_k|^2 / n^3 of 0.5 cos along the first axis: modes k = (+-3, 0, 0), both in the rfft's half (it halves
    # the last axis), each (0.25 n^3)^2 / n^3, averaged over shell 3's modes
    _, count = ps._shells(n)
    assert np.exp(f[0, 3]) == pytest.approx(2 * (0.25 * n ** 3) ** 2 / n ** 3 / count[2], rel=1e-9)
    assert np.all(f[1, 1:] < -60)  # a flat field has no power


def test_crops_tile_the_box_and_edges_halve_down_to_16() -> None:
    x = np.arange(2 * 8 ** 3).reshape(2, 8, 8, 8)
    got = list(ps.crops(x, 4))
    assert len(got) == 8 and all(c.shape == (2, 4, 4, 4) for c in got)
    assert sorted(int(v) for c in got for v in c.ravel()) == list(range(2 * 8 ** 3))
    assert ps.edges_of(128) == [16, 32, 64, 128] and ps.edges_of(48) == [24, 48] and ps.edges_of(20) == [20]


def test_the_ridge_recovers_a_linear_law_and_is_scored_by_universe() -> None:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(6, 4))
    groups = np.repeat(np.arange(40), 4)
    x = rng.normal(size=(160, 6))
    y = x @ w * 0.1
    model = ps.fit_ridge(x, y + rng.normal(scale=0.001, size=y.shape), groups)
    pred = ps._predict(model["w"], (x - model["mu"]) / model["sd"])
    assert np.abs(pred - y).mean() < 0.005 and model["alpha"] <= ps.ALPHAS[4] and model["cv_mae"] < 0.005
    noise = ps.fit_ridge(x, rng.normal(size=(160, 4)), groups)  # nothing to learn: the strongest ridge wins
    assert noise["alpha"] >= ps.ALPHAS[-4]


def test_the_information_table_finds_each_target_in_its_own_channel_and_scales() -> None:
    """ps.information refits the ridge on one channel or all, and on bands of shells: a target that a channel's
    smallest scale carries is read only where that shell is in, one the largest scale carries only from its
    channel's first shell on."""
    n, per = 16, 9  # shells 1..8 and the log mean, per channel
    assert ps.bands_of(n) == [(1, 1), (1, 2), (1, 4), (1, 8), (5, 8)]
    rng = np.random.default_rng(1)
    x = rng.normal(size=(240, 2 * per))
    y = np.stack([0.5 * x[:, per + 8], 0.5 * x[:, 1]], 1)  # channel 1's shell 8; channel 0's shell 1
    rows = ps.information(x[:200], y[:200], np.arange(200) // 2, x[200:], y[200:], 2, n)  # two rows a universe
    assert [(r["channels"], tuple(r["shells"])) for r in rows[:6]] == [([0, 1], b) for b in ps.bands_of(n)] + \
        [([0], (1, 1))]
    err = {(tuple(r["channels"]), tuple(r["shells"])): r["mae_per_target"] for r in rows}
    for band in ps.bands_of(n):
        has8, has1 = band[1] == 8, band[0] == 1
        assert (err[(0, 1), band][0] < 0.05) == has8 and (err[(1,), band][0] < 0.05) == has8
        assert err[(0,), band][0] > 0.2  # channel 0 never holds target 0
        assert (err[(0, 1), band][1] < 0.05) == has1 and (err[(0,), band][1] < 0.05) == has1
        assert err[(1,), band][1] > 0.2


def test_the_command_writes_the_study_s_baseline_and_gems_results_sets_it_beside_the_runs(tmp_path: Path) -> None:
    out = gems_here("data", "synth", "data.kind=cosmology", f"data.path={tmp_path / 'train'}",
               f"data.val_path={tmp_path / 'val'}", "data.box_cells=32", "data.box_mpc=128", "data.universes=12",
               "data.val_universes=3", "data.workers=2")
    assert out.returncode == 0, out.stderr[-2000:]
    res = tmp_path / "results"
    out = gems_here("data", "baseline", f"data.path={tmp_path / 'train'}", f"data.val_path={tmp_path / 'val'}",
               f"results.dir={res}", "results.sweep=sizes")
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads((res / "sizes" / "baseline.json").read_text())
    assert got["schema"] == "gems.baseline/1" and got["box"] == 32 and got["train_universes"] == 12
    assert [e["edge"] for e in got["edges"]] == [16, 32]
    small, whole = got["edges"]
    assert (small["train_crops"], small["val_crops"], whole["train_crops"]) == (96, 24, 12)
    assert small["features"] == 4 * 9 and whole["features"] == 4 * 17
    assert all(0 < e["mae"] < 1 and len(e["mae_per_target"]) == 4 for e in got["edges"])
    assert small["zero_mae"] == pytest.approx(whole["zero_mae"])  # the same validation targets
    info = got["information"]  # where in the whole box: every channel and each alone, five bands of shells
    assert info["edge"] == 32 and len(info["rows"]) == 5 * 5
    assert [r["shells"] for r in info["rows"][:5]] == [[1, 2], [1, 4], [1, 8], [1, 16], [9, 16]]
    assert all(0 < r["mae"] < 1.5 and len(r["mae_per_target"]) == 4 for r in info["rows"])
    assert "where the targets are" in out.stdout
    assert "baseline:" in out.stdout and " 16 " in out.stdout
    written = (res / "sizes" / "baseline.json").stat().st_mtime_ns
    again = gems_here("data", "baseline", f"data.path={tmp_path / 'train'}", f"data.val_path={tmp_path / 'val'}",
                 f"results.dir={res}", "results.sweep=sizes")
    assert again.returncode == 0 and "up to date" in again.stdout
    assert (res / "sizes" / "baseline.json").stat().st_mtime_ns == written  # the same universes: not recomputed
    # bad input: exit 2, one line naming the key, nothing written
    bad = gems_here("data", "baseline", f"data.path={tmp_path / 'nowhere'}", f"data.val_path={tmp_path / 'val'}",
               f"results.dir={tmp_path / 'other'}")
    assert bad.returncode == 2 and "data.path" in bad.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "other").exists()
    import h5py

    odd = tmp_path / "odd"  # validation universes of another box, then a foreign file among the training ones
    odd.mkdir()
    for i in range(2):
        with h5py.File(odd / f"u{i}.h5", "w") as f:
            f["full"], f["unitPar"] = np.ones((4, 16, 16, 16), dtype=np.int16), np.zeros(4, dtype=np.float32)
    for args, key in (([f"data.path={tmp_path / 'train'}", f"data.val_path={odd}"], "data.val_path"),
                      ([f"data.path={odd}", f"data.val_path={tmp_path / 'val'}"], "data.val_path")):
        bad = gems_here("data", "baseline", *args, f"results.dir={tmp_path / 'other'}")
        line = bad.stderr.strip().splitlines()[-1]
        assert bad.returncode == 2 and line.startswith(f"gems: error: {key}="), line
    (odd / "u1.h5").write_text("not HDF5")
    bad = gems_here("data", "baseline", f"data.path={odd}", f"data.val_path={tmp_path / 'val'}",
               f"results.dir={tmp_path / 'other'}")
    line = bad.stderr.strip().splitlines()[-1]
    assert bad.returncode == 2 and line.startswith("gems: error: data.path=") and "u1.h5" in line, line
    assert not (tmp_path / "other").exists()
    # gems results: the baseline's errors beside the network's rows at each edge
    from test_accuracy import _rec

    for r in (_rec(16, [0.4, 0.2, 0.5, 0.5], None), _rec(32, [0.3, 0.1, 0.5, 0.4], None)):
        (res / "sizes" / f"{r['run_id']}.json").write_text(json.dumps(r))
    write_studies(res)
    text = (res / "sizes" / "accuracy.md").read_text()
    assert "ps_ridge_mae_crop" in text and f"{small['mae']:.4f}" in text and f"{whole['mae_avg_crops']:.4f}" in text
    # runs that read other universes: the baseline is left out, and a warning says why
    for r in (_rec(16, [0.4, 0.2, 0.5, 0.5], None), _rec(32, [0.3, 0.1, 0.5, 0.4], None)):
        r["config"]["data"]["path"] = str(tmp_path / "elsewhere")
        (res / "sizes" / f"{r['run_id']}.json").write_text(json.dumps(r))
    write_studies(res)
    assert "ps_ridge" not in (res / "sizes" / "accuracy.md").read_text()


def test_universes_too_small_for_any_crop_are_bad_input(tmp_path: Path) -> None:
    out = gems_here("data", "synth", "data.kind=cosmology", f"data.path={tmp_path / 'train'}",
               f"data.val_path={tmp_path / 'val'}", "data.box_cells=8", "data.box_mpc=64", "data.universes=3",
               "data.val_universes=2", "data.workers=1")
    assert out.returncode == 0, out.stderr[-2000:]
    bad = gems_here("data", "baseline", f"data.path={tmp_path / 'train'}", f"data.val_path={tmp_path / 'val'}",
               f"results.dir={tmp_path / 'results'}")
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.strip().splitlines()[-1].startswith("gems: error: data.path=") and "at least 16 cells" in bad.stderr
    assert not (tmp_path / "results").exists()
