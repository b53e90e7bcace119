"""Whole `gems run`s, every message and collective of every rank logged (GEMS_COMM_LOG) and replayed under
NCCL's rules (gems.commlog): set-up, the links' start, every step, the gradient sums, the step sync and the
record's own collectives. Also: under bf16 the pipeline's activations cross at bf16 (traced under the run's
autocast; they went as fp32, twice the bytes)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from _cli import gems, records

from gems.commlog import load, replay

SMALL_RESNET = ["model=resnet", "model.depth=11", "model.size=16", "model.width=0.25"]


@pytest.mark.parametrize("args", [
    ["parallel.pipeline=2", "parallel.schedule=gpipe", "parallel.micro_batches=2", "train.precision=bf16",
     *SMALL_RESNET],
    ["parallel.pipeline=2", "parallel.spatial=2", "parallel.schedule=mast", "model=cosmoflow_small",
     "model.size=32"],
], ids=["gpipe-bf16", "mast-x-spatial"])
def test_a_run_replays_under_nccl_rules(tmp_path: Path, args: list[str]) -> None:
    logs_dir = tmp_path / "comm"
    env_before = os.environ.get("GEMS_COMM_LOG")
    os.environ["GEMS_COMM_LOG"] = str(logs_dir)
    try:
        r = gems("run", *args, "train.steps=3", "train.warmup_steps=1", f"results.dir={tmp_path}", timeout=600)
    finally:
        if env_before is None:
            os.environ.pop("GEMS_COMM_LOG")
        else:
            os.environ["GEMS_COMM_LOG"] = env_before
    assert r.returncode == 0, r.stderr[-2000:]
    (rec,) = records(str(tmp_path))
    logs = load(logs_dir)
    assert sorted(logs) == list(range(rec["world_size"]))
    for strict in (False, True):
        ran = replay(logs, strict_sends=strict)
        assert ran["messages"] > 0 and ran["collectives"] > 0
    if "train.precision=bf16" in args:
        sends = [e for e in logs[0] if e.get("e") == "post" and e["kind"] == "send" and e["bytes"] > 4]
        assert sends and all(e["dtype"] == "bfloat16" for e in sends), {e["dtype"] for e in sends}
