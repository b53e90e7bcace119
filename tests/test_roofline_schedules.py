"""The step's distance to the device (gems.plan.roofline) for every registered schedule with the options it takes.

The model's work is counted on the serial configuration (gems.config.serial: every parallel key at its one-rank
value), whatever the schedule's options: micro-batches, replica passes (GEMS-MASTER's parallel.gems_replicas),
virtual stages, a split backward. A MASTER plan once exited 2 because the serial configuration kept the replica
passes with schedule=lp. Here every schedule's `gems plan` (in this process) and the hardware section the worker
adds to a run's record are filled in, and one real MASTER run writes it into its record.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from _cli import gems_here, records

from gems.config import compose, serial
from gems.pipeline.schedules import registered
from gems.plan import roofline

MODEL = ["model.size=32", "model.width=0.25"]


def options(name: str) -> list[str]:
    """``name``'s schedule at D = 2 with every option it takes (from its registration, not its name)."""
    kind = registered()[name]
    out = [f"parallel.schedule={name}", "parallel.pipeline=2", "parallel.micro_batches=2", "train.batch_size=8"]
    if kind.passes == "eta":
        out.append("parallel.gems_replicas=4")
    if kind.virtual:
        out.append("parallel.virtual_stages=2")
    if kind.split == "optional":
        out.append("parallel.split_backward=true")
    return out


SCHEDULES = sorted(registered())


def test_the_serial_configuration_is_every_parallel_key_at_its_one_rank_value() -> None:
    cfg = compose([*MODEL, *options("master"), "parallel.replicas=2", "parallel.spatial=2", "parallel.checkpoint=true",
                   "train.batch_size=16"])
    one = serial(cfg)
    p = one.parallel
    assert (p.replicas, p.pipeline, p.spatial, p.schedule, p.micro_batches) == (1, 1, 1, "lp", 1)
    assert p.gems_replicas is None and p.virtual_stages is None and not p.split_backward and not p.checkpoint
    assert one.model == cfg.model and one.train == cfg.train  # the model and its training as they are
    assert cfg.parallel.schedule == "master"  # the run's own configuration untouched


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedules_plan_gives_the_step_s_distance_to_the_device(name: str) -> None:
    out = gems_here("plan", *MODEL, *options(name), "cluster.gpu=h100", "plan.format=json")
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    hw = plan["predicted_hardware"]
    assert "error" not in hw, hw
    work = roofline.model_work(compose([*MODEL, *options(name)]))
    step = plan["predicted_step_time_s"]["total"]
    assert hw["model_flops_per_step"] == pytest.approx(work.flops) and hw["device"] == "h100"
    peak = roofline.peak("h100", "fp32")
    assert peak is not None and hw["peak_flops_per_s"] == peak[0]
    assert hw["flops_fraction"] == pytest.approx(work.flops / plan["world_size"] / step / peak[0])


def test_the_work_is_the_models_whatever_the_schedule() -> None:
    """The same model and global batch: the same work under every schedule and its options (and serially)."""
    base = roofline.model_work(compose([*MODEL, "train.batch_size=8"]))
    for name in SCHEDULES:
        w = roofline.model_work(compose([*MODEL, *options(name)]))
        assert w.flops == pytest.approx(base.flops) and w.bytes == pytest.approx(base.bytes), name


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_schedules_record_gets_its_hardware_section(name: str) -> None:
    """What the worker adds to a finished run's record (gems.worker.hardware), for every schedule's
    configuration: filled in, never an error."""
    from types import SimpleNamespace

    import torch

    from gems.worker import hardware

    cfg = compose([*MODEL, *options(name)])
    record = {"step_time_s": {"median": 0.5}}
    hardware(cfg, SimpleNamespace(size=2, device=torch.device("cpu")), record)
    hw = record["hardware"]
    assert "error" not in hw and hw["device"] == "cpu", hw
    assert hw["flops_per_s_per_rank"] == pytest.approx(roofline.model_work(cfg).flops / 2 / 0.5)


def test_a_gems_master_run_writes_its_hardware_section(tmp_path: Path) -> None:
    """The regression a user met: a GEMS-MASTER run with parallel.gems_replicas above 1 (its record's hardware held
    an error, its table no TFLOP/s)."""
    out = gems_here("run", f"results.dir={tmp_path}", *MODEL, *options("master"), "train.steps=2",
                    "train.warmup_steps=1")
    assert out.returncode == 0, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    hw = r["hardware"]
    assert "error" not in hw and hw["flops_per_s_per_rank"] > 0, hw
    assert "TFLOP/s/gpu" in out.stdout
