"""``gems bench checkpoint``: does a checkpoint's stall fall as more copies write it? R = 4 replicas save after every step
with 1, 2 and 4 writers, each writing its share (:func:`bench_checkpoint`).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gems.bench.common import env_block, md_table, median, write

WRITERS = (1, 2, 4)
RUN = ["model=cosmoflow_mlperf", "model.size=32", "parallel.replicas=4", "train.batch_size=4", "train.steps=6",
       "train.warmup_steps=1", "train.checkpoint_every=1", "train.check_fit=false"]


def _run_with_writers(folder: Path, writers: int) -> dict[str, Any]:
    """One real run; its record's save figures and the last checkpoint's files."""
    out = subprocess.run([sys.executable, "-m", "gems.cli", "run", f"results.dir={folder}", *RUN,
                          f"train.checkpoint_writers={writers}"], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"gems run failed ({out.returncode}): {out.stderr[-2000:]}")
    (path,) = [p for p in folder.glob("*.json")]
    r = json.loads(path.read_text())
    (ck,) = list(folder.glob(".jobs/*/ckpt/step*"))
    sizes = [f.stat().st_size for f in ck.glob("*.distcp")]
    return {"held": float(r["checkpoint"]["held_s_per_save"]), "step": float(r["step_time_s"]["median"]),
            "files": len(list(ck.iterdir())), "data_files": len(sizes), "largest": max(sizes) / sum(sizes),
            "bytes": sum(sizes)}


def bench_checkpoint(out_dir: Path, rounds: int = 3) -> str:
    """Real ``gems run`` processes of R = 4 replicas (MLPerf's CosmoFlow at 32³: 37 MB of weights and Adam's
    moments, a sample a rank), a synchronous checkpoint after every step, ``train.checkpoint_writers`` 1, 2 and 4,
    alternated in ``rounds`` rounds. A row: the median of the record's ``checkpoint.held_s_per_save`` (what the saves
    held rank 0's steps), the last checkpoint's files and its largest file's share, the ratio to one writer in the
    same rounds, and the step time beside it. Here every writer shares one page cache, one disk and two cores; on a
    cluster each writer is a replica on its own node, so the gain here is a floor. Returns the table."""
    got: dict[int, list[dict[str, Any]]] = {w: [] for w in WRITERS}
    with tempfile.TemporaryDirectory(prefix="gems-bench-checkpoint-") as tmp:
        for k in range(rounds):  # alternated: every contender sees the same noise
            for w in WRITERS:
                got[w].append(_run_with_writers(Path(tmp) / f"r{k}-w{w}", w))
    one = median([g["held"] for g in got[1]])
    rows = []
    for w in WRITERS:
        held = median([g["held"] for g in got[w]])
        last = got[w][-1]
        rows.append([w, f"{held:.3f}", f"{held / one:.2f}", f"{median([g['step'] for g in got[w]]):.3f}",
                     f"{last['bytes'] / 2**20:.1f}", f"{last['bytes'] / held / 2**20:.0f}", last["files"],
                     last["data_files"], f"{last['largest']:.2f}"])
    text = "## gems bench checkpoint\n\n"
    text += ("MLPerf's CosmoFlow at 32³ on R = 4 replicas (one sample a rank, Adam), a synchronous checkpoint after "
             f"every step, `train.checkpoint_writers` = {', '.join(map(str, WRITERS))}; real `gems run` processes "
             f"alternated over {rounds} rounds, medians. *held s/save*: what the saves held rank 0's steps "
             "(the record's `checkpoint.held_s_per_save`: the history's all-reduces, the writers' plan and their "
             "files, synced); */ 1 writer*: against one writer in the same rounds; *step s*: the median step "
             "without its save. *files*: the last checkpoint's, *largest*: its largest data file's share of the "
             "data. Here every writer shares one page cache, one disk and two cores; on a cluster each writer is "
             "a node of its own.\n\n")
    text += md_table(["writers", "held s/save", "/ 1 writer", "step s", "data MiB", "MiB/s", "files", "data files",
                      "largest"], rows)
    text += "\n" + env_block("gems bench checkpoint")
    write(out_dir, "checkpoint", text)
    return text


if __name__ == "__main__":
    from gems.bench.common import out_dir_from_argv

    print(bench_checkpoint(Path(out_dir_from_argv(sys.argv, "python -m gems.bench.checkpoint [OUT_DIR]"))))
