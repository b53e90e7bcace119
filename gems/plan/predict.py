"""The step-time prediction of a plan: the device's rates (a named GPU's data sheet, or this machine's CPU
timed on the spot), the job's placement, the synthetic data's cost, then :func:`gems.plan.timing.predict` on
the planner's profile."""
from __future__ import annotations

import math
import os
from dataclasses import replace
from typing import Any

import numpy as np

from gems.config import reads_files
from gems.pipeline.schedules import simulate
from gems.plan.cpu import cpu_rates, synthetic_seconds
from gems.plan.devices import efficiency, gpu_rates
from gems.plan.memory import Planner, rank_threads
from gems.plan.timing import Prediction, predict, staging

__all__ = ["predict_step", "computing_at_once", "placement"]


def placement(cfg: Any, world: int) -> tuple[int, int]:
    """(nodes, ranks per node) of the job as it would be placed."""
    c = cfg.cluster
    if c.launcher == "local" and c.name == "local":
        return 1, world
    nodes = int(c.nodes or 1)
    return nodes, int(c.tasks_per_node or math.ceil(world / nodes))


def computing_at_once(pl: Planner, tasks_per_node: int) -> int:
    """How many of a node's ``tasks_per_node`` ranks compute at the same time, on average: all of them, but
    the stages of a pipeline line compute at once only as much as its schedule lets them (lp's take turns;
    1F1B's overlap in the steady state), from the schedule simulated with unit action times (its busy time
    over its span, summed over the line's ranks)."""
    if not pl.pipelined:
        return max(1, tasks_per_node)
    sched = pl.sched()
    got = _BUSY.get(id(sched))
    if got is None or got[0] is not sched:  # (a schedule's unit-clock share, once: it is a value made once)
        spans = simulate(sched, cost=lambda a: float(a.kind.unit_cost), transfer=lambda a: 0.0)
        busy = sum(e - b for b, e in spans.values())
        span = max(e for _, e in spans.values()) - min(b for b, _ in spans.values())
        got = (sched, busy / span if span > 0 else 1.0)  # of the line's ranks, how many are busy at a time
        _BUSY[id(sched)] = got
    return max(1, round(tasks_per_node * got[1] / sched.ranks))


#: each schedule's share of its line's ranks busy at a time on the unit clock, by its identity (held with it)
_BUSY: dict[int, tuple[Any, float]] = {}


def predict_step(cfg: Any, pl: Planner, prof: Any, batch: int, dev: dict[str, Any], world: int) -> Prediction | None:
    """The step-time prediction (:mod:`gems.plan.timing`), or None with a note when the device has no figures."""
    c = cfg.cluster
    eff = efficiency(cfg.plan.efficiency, c.gpu, pl.st.precision)
    if dev["kind"] == "gpu":
        name = c.gpu
        if not name:
            pl.notes.append("no step-time prediction: set cluster.gpu to the GPU model (e.g. cluster.gpu=a100-40gb)")
            return None
        rates = gpu_rates(str(name), pl.st.precision, eff, pl.st.calibration)
    nodes, tpn = placement(cfg, world)
    if dev["kind"] != "gpu":
        threads = rank_threads(cfg)
        cores = int(c.cpus_per_node or 0) if not (c.launcher == "local" and c.name == "local") else 0
        cores = cores or (os.cpu_count() or 1)
        rates = cpu_rates(threads, min(max(1, cores // threads), computing_at_once(pl, tpn)))
        if tpn * threads > cores:
            rates = rates.shared(tpn * threads / cores)
        if tpn * threads >= cores and world > 1:
            rates = replace(rates, spare=False, about=rates.about + "; every core of a node computes, so gloo's "
                            "transfers take their time from the compute (the gradient all-reduce is not hidden "
                            "behind the backward)")
    if prof is None:
        prof = pl.profile(max(1, pl.chunk_of(batch)))
    data, made, on_device = None, "data copied once in memory", False  # (every data kind sets its own below)
    if str(cfg.data.name) == "synthetic" and dev["kind"] == "gpu":
        ahead = int(cfg.data.prefetch) > 0
        data, made, on_device = gpu_synthetic(rates, pl.st.spec.input_shape, ahead), (
            "synthetic samples drawn on the GPU " + ("by the reader a step ahead, on a side stream beside the step's "
                                                     "kernels: the step waits for none of it" if ahead else
                                                     "in the step (data.prefetch=0): memory-bound, a kernel a "
                                                     "block of planes")), True
    elif str(cfg.data.name) == "synthetic":  # made on the host: this machine's CPU, timed
        share, threads, kept = rates.share, rank_threads(cfg), getattr(rates, "kept", None)

        def data(part: Any, n: int, inp: bool, tgt: bool) -> float:
            return share * n * synthetic_seconds(pl.st.spec, list(part), inp, tgt, threads, kept)

        made = f"synthetic samples generated on the host as fast as here ({threads} thread(s))"
    elif reads_files(cfg.data):  # read by the rank's reader threads (gems.data.reader), at their rate
        sctx = pl._layers(pl.st.mesh.spatial // 2)[1]  # the middle part's, which the quick plan traces
        rate, itemsize, how = reader_rate(cfg, pl.st.spec, sctx.local_slices(pl.st.spec.input_shape[1:])
                                          if sctx is not None else None)
        data, made = read_files(itemsize, rate), f"data read by {how}"
    pred = predict(pl, prof, batch, rates, c, nodes, tpn, data, int(cfg.data.prefetch), on_device,
                   graphed=pl.st.graphed)
    pred.assumptions.append(made)
    if reads_files(cfg.data) and cfg.data.stage == "node":
        from gems.errors import ConfigError
        from gems.plan.devices import links

        try:  # the files come over the network, whatever the job's size
            network = links(c, 2)[1]
        except ConfigError:  # a preset without between-node figures
            network = None
        files, nbytes = data_set_files(cfg)
        pred.staging_s, said = staging(nbytes, tpn, network, files)
        pred.assumptions.append(said)
    return pred


def data_set_files(cfg: Any) -> tuple[int, int]:
    """(files, bytes) of the training and validation folders as they are here (0, 0 where they are not)."""
    from pathlib import Path

    files, nbytes = 0, 0
    for path in (cfg.data.path, cfg.data.val_path):
        p = Path(str(path)) if path else None
        if p is None or not p.exists():
            continue
        from gems.data import layouts

        found = layouts.detect(str(path), cfg.data.get("layout")).files(str(path))
        files += len(found)
        nbytes += sum(f.stat().st_size for f in found)
    return files, nbytes


def gpu_synthetic(rates: Any, sample: Any, ahead: bool = True) -> Any:
    """Seconds a GPU rank's step waits for ``n`` samples of its ``part`` (C, *spatial) of a ``sample`` (C, *spatial)
    drawn on its GPU (:func:`gems.data.synthetic.sample_input`). With a reader ahead (``ahead``: ``data.prefetch`` >
    0) nothing: its thread launches the draws on a side stream a step early, a few dozen a batch, and they run beside
    the step's kernels (measured on an H100: results/gpu/h100-2026-11-26.json; drawn a plane at a time, 1024
    launches a 128^3 batch of 8 kept that step waiting 19 ms of 51). In the step itself: the blocks of planes the
    part touches drawn whole, over the sample's whole planes (:func:`gems.data.synthetic.most_drawn`), each value
    written once and its uniform sources read once, memory-bound, a kernel launched per block, and the part copied
    out of them where it is not all of them."""
    from gems.data.synthetic import most_drawn

    full = [int(v) for v in sample]

    def data(part: Any, n: int, inp: bool, tgt: bool) -> float:
        if not inp or ahead:
            return 0.0
        dims = [int(v) for v in part]
        blocks, planes = most_drawn(full, dims[1])
        drawn = full[0] * planes * math.prod(full[2:])
        mine = math.prod(dims)
        moved = 2 * 4 * (drawn + (mine if mine != drawn else 0))
        return n * (moved / rates.bandwidth + blocks * rates.op_overhead_s)
    return data


#: (tests/test_plan_timing.py's name for gems.data.layouts.THREAD_RATE, the one figure: to go with its next change)
from gems.data.layouts import THREAD_RATE as READER_BYTES_PER_S  # noqa: E402,F401

_READ_RATES: dict[tuple, tuple[float, int, str]] = {}


def reader_rate(cfg: Any, spec: Any, slices: Any = None) -> tuple[float, int, str]:
    """(bytes a second a rank's reader moves into its batches, bytes a value of the files' counts as it holds them,
    how that was found, the files' layout named): the layout of the files of ``data.path`` where they are here
    (gems.data.layouts: detected, or ``data.layout``) timed by its own ``rate`` (its samples read with the rank's
    reader threads, part ``slices`` and ``data.augment``'s symmetries: the second read, from the page cache into
    the first's buffer), with what it says of them (a slow path); else the reader threads x the layout's
    ``fallback_rate`` (``data.layout``'s: its ``thread_rate``, scaled by the share of the bytes read that a crop of
    a larger published file holds, ExaLearn's 512^3 universes; else gems bench data's one thread here,
    gems.data.layouts.THREAD_RATE, a file a sample), of int16 counts. The threads are ``data.readers`` capped by a
    task's CPUs (``cluster.cpus_per_task`` on Slurm, this machine's here)."""
    from pathlib import Path

    import torch

    from gems.data import layouts

    slurm = str(cfg.cluster.launcher) == "slurm"
    readers, capped = layouts.reader_threads(int(cfg.data.readers), int(cfg.cluster.cpus_per_task or 1) if slurm
                                             else None)
    cap = f" ({capped})" if capped else ""
    path, name = cfg.data.path, cfg.data.get("layout")
    if not path or not Path(str(path)).exists():
        layout = layouts.get(str(name)) if name else None
        if layout is not None:
            per, assumed = layout.fallback_rate(spec.input_shape, slices)
            what = f"layout {layout.name}, {assumed}"
        else:
            per, what = layouts.THREAD_RATE, ("no file at data.path to time or detect: a file a sample (data.layout="
                                              "exalearn takes crops of its published universes)")
        return readers * per, 2, (f"{readers} reader thread(s){cap} at {per / 1e9:.2g} GB/s each ({what}; "
                                  "gems bench data's one thread here)")
    key = (str(path), name, readers, str(slices), str(cfg.data.augment), tuple(spec.input_shape), str(cfg.data.crop))
    if key not in _READ_RATES:
        from gems.data.augment import count, draw

        layout = layouts.detect(str(path), name)
        data = layout.open(str(path), spec.input_shape, slices=slices, crop=cfg.data.crop,
                           augment=str(cfg.data.augment), readers=readers, target=spec.target)
        try:
            n = min(len(data), 8)
            syms = draw(count(str(cfg.data.augment), len(spec.input_shape) - 1), n, torch.Generator().manual_seed(0))
            rate = layout.rate(data, list(range(n)), syms)
            said = "; ".join(data.notes())
        finally:
            data.close()
        itemsize = int(np.dtype(data.dtype).itemsize)
        _READ_RATES[key] = (rate, itemsize, f"{readers} reader thread(s){cap} timed here on {n} sample(s) of "
                                            f"data.path, layout {layout.name}, from the page cache"
                                            + (f" ({said})" if said else ""))
    rate, itemsize, how = _READ_RATES[key]
    return rate, itemsize, f"{how}: {rate / 1e9:.3g} GB/s"


def read_files(itemsize: int, rate: float) -> Any:
    """Seconds a rank's reader takes for ``n`` samples of its ``part`` (C, *spatial) of counts of ``itemsize`` bytes
    (the files' type: int16 in ExaLearn's universes) at ``rate`` bytes a second (:func:`reader_rate`); targets are
    small. The copy to a GPU runs on the reader's side stream, beside the step."""

    def data(part: Any, n: int, inp: bool, tgt: bool) -> float:
        return n * math.prod(int(v) for v in part) * itemsize / rate if inp else 0.0
    return data
