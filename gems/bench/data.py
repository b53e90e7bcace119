"""``gems bench data``: does the data path stay off the step's critical path?

For CosmoFlow at 64^3 and 128^3, on S = 1 and 2 spatial ranks, with synthetic samples and with HDF5 files
(``gems data synth``'s ExaLearn layout), three contenders run side by side, alternated in rounds so that each
sees the same machine noise:

* **off**: ``data.prefetch=0``, every step reads (or generates) its samples first, as gems did before;
* **on**: ``data.prefetch=2``, a background reader works two steps ahead (gems.rank.data.Prefetcher);
* **bound**: the same run with no data path at all: every step trains on the batch read once before the
  first step (the no-data step time, the best any reader can give).

Each row gives the exposed data time per step (what the step waited for), the reader's own time per step, the
step times, and on / bound. Goal: with prefetch on, the step within 5% of its bound wherever the reader alone
is faster than the compute (reader time < bound). The runs are gems's own training loop (gems.rank.loop.Run)
on real gloo ranks, one compute thread per rank; on this 2-core machine an S = 2 run's ranks take both cores,
so the reader's thread there competes with the compute instead of using an idle core, and the table says so.
"""
from __future__ import annotations

import contextlib
import io
import sys
import tempfile
from pathlib import Path
from typing import Any

from gems.bench.common import env_block, md_table, median, write

CONTENDERS = ("off", "on", "bound")
STEPS, WARM, BATCH = 6, 2, 2


def _cfg(size: int, spatial: int, data: str, path: str | None, contender: str) -> Any:
    from omegaconf import open_dict

    from gems.config import compose

    over = [f"model.size={size}", "model.width=1.0", f"parallel.spatial={spatial}", f"train.batch_size={BATCH}",
            f"train.steps={STEPS}", f"train.warmup_steps={WARM}", "train.profile=false",
            f"data.prefetch={2 if contender == 'on' else 0}"]
    over += ["data=hdf5", f"data.path={path}"] if data == "hdf5" else ["data.num_samples=64"]
    cfg = compose(over)
    with open_dict(cfg):
        cfg.run_id = f"bench-data-{size}-{spatial}-{data}-{contender}"
    return cfg


def bench_rank(rank: int, world_size: int, size: int, spatial: int, data: str, path: str | None,
               contender: str) -> dict[str, float]:
    """One run on this rank of a gloo world (gems.launch.world.run_world); rank 0's figures."""
    import torch

    from gems.bootstrap import World
    from gems.rank.loop import Run

    cfg = _cfg(size, spatial, data, path, contender)
    world = World(rank, world_size, rank, "127.0.0.1", 0, "single", torch.device("cpu"), "gloo", "torch", None,
                  "localhost")

    class Bound(Run):
        """The run without a data path: the first batch, read before the first step, every step."""

        def finisher(self) -> None:  # the batch read once, finished once: nothing of the data path in the step
            return None

        def fetch(self, step: int) -> tuple[list[int], Any, Any]:
            if not hasattr(self, "_once"):
                self._once = super().fetch(0)
            return self._once

    run = (Bound if contender == "bound" else Run)(cfg, world, None)
    if contender == "bound":
        run.fetch(0)  # read before the clock starts
    with contextlib.redirect_stdout(io.StringIO()):  # the per-step lines
        record = run.run()
    return {"step": float(record["step_time_s"]["median"]),
            "exposed": float(record["time_breakdown_s"]["data"]),
            "reader": float(record["data_reader_s"])}


def _files(root: Path, size: int) -> str:
    from gems.data.synth import write_synthetic

    path = root / f"cosmo{size}"
    if not path.exists():
        write_synthetic(path, 16, (4, size, size, size))
    return str(path)


def bench_data(out_dir: Path, sizes: tuple[int, ...] = (64, 128), spatials: tuple[int, ...] = (1, 2),
               rounds: int = 2) -> str:
    from gems.launch.world import run_world

    rows = []
    with tempfile.TemporaryDirectory(prefix="gems-bench-data-") as tmp:
        for size in sizes:
            for spatial in spatials:
                for data in ("synthetic", "hdf5"):
                    path = _files(Path(tmp), size) if data == "hdf5" else None
                    got: dict[str, list[dict[str, float]]] = {c: [] for c in CONTENDERS}
                    for _ in range(rounds):  # alternated: every contender sees the same noise
                        for c in CONTENDERS:
                            got[c].append(run_world(bench_rank, spatial, size, spatial, data, path, c,
                                                    timeout=1800)[0])
                    fig = {c: {k: median([g[k] for g in got[c]]) for k in ("step", "exposed", "reader")}
                           for c in CONTENDERS}
                    reader = fig["off"]["reader"]
                    bound = fig["bound"]["step"]
                    ratio = fig["on"]["step"] / bound
                    applies = reader < bound
                    met = ("yes" if ratio <= 1.05 else "no") if applies else "n/a (reader slower than compute)"
                    rows.append([f"{size}^3", spatial, data, f"{reader:.3f}", f"{bound:.3f}",
                                 f"{fig['off']['step']:.3f}", f"{fig['off']['exposed']:.3f}",
                                 f"{fig['on']['step']:.3f}", f"{fig['on']['exposed']:.3f}",
                                 f"{fig['on']['exposed'] / bound:.4f}", f"{fig['off']['step'] / bound:.3f}",
                                 f"{ratio:.3f}", met])
    text = "## gems bench data\n\n"
    text += (f"CosmoFlow (paper layers), global batch {BATCH}, fp32, Adam, one compute thread per rank, S spatial "
             f"ranks over gloo; median step time of {STEPS - WARM} measured steps, median of {rounds} alternated "
             "rounds. Synthetic: gems's generator (on the host here; on GPU ranks it draws on the GPU). HDF5: 16 "
             "files of `gems data synth` (int16 counts, 4 channels), each rank reading its hyperslab. "
             "*reader*: the reader's own seconds per step (prefetch off: all of it is exposed); *bound*: the same "
             "run training every step on one batch read before the first (no data path). Goal: with prefetch, "
             "the step within 5% of its bound where the reader alone is faster than the compute. *exposed / bound*: "
             "what the step still waits for with prefetch, as a share of the bound (the part of the goal machine "
             "noise cannot blur: the step times of separate runs move by several percent here). On this 2-core "
             "machine an S=2 run's two ranks take both cores, so its reader thread competes with the compute "
             "rather than using an idle core: on a GPU node the compute is on the GPU and the reader has the "
             "host.\n\n")
    text += md_table(["sample", "S", "data", "reader s/step", "bound s/step", "off: step", "off: exposed data",
                      "on: step", "on: exposed data", "on: exposed / bound", "off / bound", "on / bound", "within 5%"],
                     rows)
    text += "\n" + env_block("gems bench data")
    write(out_dir, "data", text)
    return text


if __name__ == "__main__":
    from gems.bench.common import out_dir_from_argv

    print(bench_data(Path(out_dir_from_argv(sys.argv, "python -m gems.bench.data [OUT_DIR]"))))
