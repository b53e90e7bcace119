"""``gems data baseline``: how well a classical estimator reads the cosmological parameters from crops of each edge,
the reference the sample-size study's network is held against (docs/science.md, "What the data holds").

Each crop is reduced to its power spectrum per redshift channel and its log mean count; a ridge regression to the
four targets is fitted on the training universes' crops (five-fold cross-validation by universe) and scored on the
validation universes as the study scores the network, into the study's ``baseline.json``.
"""
from __future__ import annotations

import functools
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from gems.errors import ConfigError

__all__ = ["spectrum_features", "crops", "edges_of", "fit_ridge", "bands_of", "information", "baseline",
           "write_baseline", "ALPHAS", "FOLDS", "MIN_EDGE"]

#: the ridge strengths the cross-validation chooses from (on standardized features)
ALPHAS = tuple(float(a) for a in np.logspace(-3, 4, 15))
#: cross-validation folds, every universe's crops in one
FOLDS = 5
#: the smallest crop edge the baseline is computed for
MIN_EDGE = 16


@functools.lru_cache(maxsize=8)
def _shells(n: int) -> tuple[np.ndarray, np.ndarray]:
    """For an rfftn of edge ``n``: each mode's shell (integer |k|, 0 for k = 0 and beyond n/2) and the modes per
    shell 1 .. n/2."""
    k = np.fft.fftfreq(n, 1.0 / n)
    kz = np.fft.rfftfreq(n, 1.0 / n)
    mag = np.sqrt(k[:, None, None] ** 2 + k[None, :, None] ** 2 + kz[None, None, :] ** 2)
    shell = np.rint(mag).astype(np.int64)
    shell[shell > n // 2] = 0
    count = np.bincount(shell.ravel(), minlength=n // 2 + 1)[1:]
    return shell, count


def spectrum_features(x: np.ndarray) -> np.ndarray:
    """``x`` (channels, n, n, n) of counts -> per channel the log of the mean count and the log power in shells
    1 .. n/2 of its overdensity: ``channels * (n/2 + 1)`` features."""
    c, n = x.shape[0], x.shape[1]
    shell, count = _shells(n)
    out = np.empty((c, n // 2 + 1), dtype=np.float64)
    for i in range(c):
        field = x[i].astype(np.float64)
        mean = max(float(field.mean()), 1e-12)
        power = np.abs(np.fft.rfftn(field / mean - 1.0)) ** 2 / n ** 3
        sums = np.bincount(shell.ravel(), weights=power.ravel(), minlength=n // 2 + 1)[1:]
        out[i, 0] = np.log(mean)
        out[i, 1:] = np.log(np.maximum(sums / np.maximum(count, 1), 1e-30))
    return out.ravel()


def crops(x: np.ndarray, edge: int) -> Iterator[np.ndarray]:
    """The crops of edge ``edge`` that tile ``x`` (channels, n, n, n), in C order (as ``data.crop`` reads them)."""
    n = x.shape[1]
    for i in range(0, n, edge):
        for j in range(0, n, edge):
            for k in range(0, n, edge):
                yield x[:, i:i + edge, j:j + edge, k:k + edge]


def edges_of(box: int) -> list[int]:
    """The crop edges the baseline is computed for: the box, halved down to :data:`MIN_EDGE`."""
    out, e = [], box
    while e >= MIN_EDGE and box % e == 0:
        out.append(e)
        if e % 2:
            break
        e //= 2
    return sorted(out)


def _solve(x: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    """Ridge weights (with an unpenalised intercept, as the last row) of standardized ``x`` onto ``y``."""
    xm, ym = x.mean(0), y.mean(0)
    xc = x - xm
    w = np.linalg.solve(xc.T @ xc + alpha * np.eye(x.shape[1]), xc.T @ (y - ym))
    return np.vstack([w, ym - xm @ w])


def _predict(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return x @ w[:-1] + w[-1]


def fit_ridge(x: np.ndarray, y: np.ndarray, groups: np.ndarray) -> dict[str, Any]:
    """Standardize ``x``, choose the ridge strength by :data:`FOLDS`-fold cross-validation over ``groups``
    (a universe's crops stay in one fold) on the mean absolute error, refit on all: the model's arrays."""
    mu, sd = x.mean(0), x.std(0)
    sd[sd == 0] = 1.0
    z = (x - mu) / sd
    uniq = np.unique(groups)
    fold = {g: i % FOLDS for i, g in enumerate(uniq)}
    f = np.array([fold[g] for g in groups])
    scores = []
    for a in ALPHAS:
        err = []
        for k in range(min(FOLDS, len(uniq))):
            tr, te = f != k, f == k
            if not tr.any() or not te.any():
                continue
            err.append(np.abs(_predict(_solve(z[tr], y[tr], a), z[te]) - y[te]).mean())
        scores.append(float(np.mean(err)) if err else float("inf"))
    alpha = ALPHAS[int(np.argmin(scores))]
    return {"mu": mu, "sd": sd, "w": _solve(z, y, alpha), "alpha": alpha, "cv_mae": min(scores)}


def _features_of(files: Sequence[Path], edges: Sequence[int]) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per edge: (features of every crop, its universe's targets, its universe's index in ``files``)."""
    from gems.data import layouts
    from gems.data.hdf5 import read_sample

    got: dict[int, tuple[list[np.ndarray], list[np.ndarray], list[int]]] = {e: ([], [], []) for e in edges}
    for u, path in enumerate(files):
        channels = str(getattr(layouts.detect(path), "channels", "first"))  # (C, n, n, n) whatever the layout
        xt, yt = read_sample(path, raw=True, channels=channels)
        x, y = xt.numpy(), yt.numpy().astype(np.float64)
        for e in edges:
            feats, ys, us = got[e]
            for c in crops(x, e):
                feats.append(spectrum_features(c))
                ys.append(y)
                us.append(u)
    return {e: (np.array(a), np.array(b), np.array(c)) for e, (a, b, c) in got.items()}


def _files(key: str, folder: Any, shape: Sequence[int] | None = None) -> tuple[list[Path], tuple[int, ...]]:
    """The universes of ``folder`` and their (C, n, n, n), every file's layout checked as a run checks it
    (:meth:`gems.data.hdf5.HDF5Samples.check_all`: headers only; ``shape``: the one each file must have)."""
    from gems.data.hdf5 import HDF5Samples

    if folder is None or not Path(str(folder)).is_dir():
        raise ConfigError(key, folder, "a folder of universes (write them with `gems data synth data.kind=cosmology`)")
    samples = HDF5Samples(str(folder), shape, key=key)
    samples.check_all()
    got = tuple(int(n) for n in samples.file_shape or ())
    if shape is not None and got != tuple(shape):  # (a whole multiple of it passes the check: crops)
        raise ConfigError(key, folder, f"universes shaped {list(shape)} as data.path's; these are {list(got)}")
    if len(got) != 4 or len(set(got[1:])) != 1:
        raise ConfigError(key, folder, f"universes of cubes: `full` shaped (channels, n, n, n), not {list(got)}")
    if len(samples.files) < 2:
        raise ConfigError(key, folder, "a folder of at least 2 universes (HDF5 files with `full` and `unitPar`)")
    return samples.files, got


def bands_of(n: int) -> list[tuple[int, int]]:
    """The wavenumber shells :func:`information` restricts the whole box's spectrum to: the largest scales up
    to an eighth, a quarter and half of the Nyquist shell ``n/2``, all of them, and the smallest half alone."""
    h = n // 2
    return sorted({(1, max(1, h // 8)), (1, max(1, h // 4)), (1, max(1, h // 2)), (1, h), (h // 2 + 1, h)})


def information(x: np.ndarray, y: np.ndarray, groups: np.ndarray, xv: np.ndarray, yv: np.ndarray, channels: int,
                n: int) -> list[dict[str, Any]]:
    """Where the targets are in a sample of edge ``n``: the ridge of :func:`fit_ridge` refitted on part of each
    crop's spectrum (``x``, ``xv``: rows of :func:`spectrum_features`; ``groups``: each training row's universe,
    for the cross-validation), every channel or one alone, each band
    of shells of :func:`bands_of` (with the log mean counts of the channels used), scored on the validation
    crops. A parameter whose error stays high until the smallest scales of one channel are in is read there
    and nowhere else."""
    per = n // 2 + 1
    rows = []
    for chans in [list(range(channels))] + ([[c] for c in range(channels)] if channels > 1 else []):
        for lo, hi in bands_of(n):
            cols = [c * per + k for c in chans for k in (0, *range(lo, hi + 1))]
            model = fit_ridge(x[:, cols], y, groups)
            err = np.abs(_predict(model["w"], (xv[:, cols] - model["mu"]) / model["sd"]) - yv).mean(0)
            rows.append({"channels": chans, "shells": [lo, hi], "mae": float(err.mean()),
                         "mae_per_target": [float(v) for v in err]})
    return rows


def baseline(train: Sequence[Path], val: Sequence[Path], shape: Sequence[int]) -> dict[str, Any]:
    """The baseline of every edge (:func:`edges_of` the universes' box ``shape``, (C, n, n, n) as :func:`_files`
    checked): fitted on ``train``, scored on ``val``."""
    edges = edges_of(shape[1])
    tr, va = _features_of(train, edges), _features_of(val, edges)
    out: dict[str, Any] = {"box": shape[1], "channels": shape[0], "train_universes": len(train),
                           "val_universes": len(val), "edges": []}
    for e in edges:
        (x, y, g), (xv, yv, gv) = tr[e], va[e]
        model = fit_ridge(x, y, g)
        pred = _predict(model["w"], (xv - model["mu"]) / model["sd"])
        per = np.abs(pred - yv).mean(0)
        avg_pred = np.array([pred[gv == u].mean(0) for u in np.unique(gv)])
        avg_true = np.array([yv[gv == u][0] for u in np.unique(gv)])
        per_avg = np.abs(avg_pred - avg_true).mean(0)
        out["edges"].append({"edge": e, "features": int(x.shape[1]), "train_crops": int(len(x)),
                             "val_crops": int(len(xv)), "alpha": model["alpha"], "cv_mae": model["cv_mae"],
                             "mae": float(per.mean()), "mae_per_target": [float(v) for v in per],
                             "mae_avg_crops": float(per_avg.mean()),
                             "mae_avg_crops_per_target": [float(v) for v in per_avg],
                             "zero_mae": float(np.abs(yv).mean())})
    (x, y, g), (xv, yv, _) = tr[edges[-1]], va[edges[-1]]  # the whole box: where in it each target is read
    out["information"] = {"edge": edges[-1], "rows": information(x, y, g, xv, yv, shape[0], edges[-1])}
    return out


def write_baseline(cfg: Any) -> Path:
    """``gems data baseline``: compute the baseline of ``data.path`` against ``data.val_path``, print it, and write
    ``{results.dir}/baseline.json`` (atomically)."""
    from gems.paths import writable_dir, write_result_json

    train, shape = _files("data.path", cfg.data.path)
    if not edges_of(shape[1]):
        raise ConfigError("data.path", cfg.data.path, f"universes of at least {MIN_EDGE} cells a side (these are "
                          f"{shape[1]})")
    val, _ = _files("data.val_path", cfg.data.val_path, shape)
    folder = writable_dir("results.dir", cfg.results.dir, "a folder for baseline.json")
    if cfg.results.sweep:  # the study's folder, where gems results reads it
        folder = writable_dir("results.sweep", folder / str(cfg.results.sweep), "a folder for baseline.json")
    data = {"path": str(Path(str(cfg.data.path)).resolve()), "val_path": str(Path(str(cfg.data.val_path)).resolve()),
            "files": _digest(train + val)}
    path = folder / "baseline.json"
    try:
        if json.loads(path.read_text()).get("data") == data:
            print(f"baseline: {path} is up to date (the same universes)")
            return path
    except (OSError, ValueError, AttributeError):
        pass
    got = {"schema": "gems.baseline/1", **baseline(train, val, shape), "data": data}
    print(f"power-spectrum ridge baseline: {got['train_universes']} training, {got['val_universes']} validation "
          f"universes of {got['box']}^3", file=sys.stderr)
    print("edge  crops(train/val)  mae(single crop)  mae(crops averaged)  predicting 0")
    for r in got["edges"]:
        print(f"{r['edge']:>4}  {r['train_crops']:>7}/{r['val_crops']:<7}  {r['mae']:.4f}            "
              f"{r['mae_avg_crops']:.4f}               {r['zero_mae']:.4f}")
    info = got["information"]
    print(f"where the targets are in a whole {info['edge']}^3 box (the ridge on part of its spectrum; mae per "
          f"target, in the universes' parameter order):")
    print("channels  shells   " + "  ".join(f"{'target ' + str(i):>8}" for i in range(len(got['edges'][0]['mae_per_target']))))
    for r in info["rows"]:
        chans = "all" if len(r["channels"]) > 1 else str(r["channels"][0])
        print(f"{chans:>8}  {r['shells'][0]:>2}-{r['shells'][1]:<4} " +
              "  ".join(f"{v:>8.3f}" for v in r["mae_per_target"]))
    write_result_json(path, got)
    print(f"baseline: {path}")
    return path


def _digest(files: Sequence[Path]) -> str:
    """The universes as files: names, sizes and modification times (a rewritten universe is another)."""

    h = hashlib.sha256()
    for p in files:
        st = p.stat()
        h.update(f"{p.name} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()
