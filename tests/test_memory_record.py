"""CPU records carry the tensor memory a GPU would count, and it falls with the spatial parts."""
from __future__ import annotations

from _cli import gems, records

RUN = ["model.size=64", "model.width=0.5", "train.steps=3", "train.warmup_steps=1"]


def _record(tmp, *args):
    out = gems("run", f"results.dir={tmp}", *RUN, *args, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (r,) = records(str(tmp))
    return r["peak_memory_bytes"]


def test_cpu_records_carry_tensor_memory_that_halves_with_two_parts(tmp_path):
    one = _record(tmp_path / "s1")
    two = _record(tmp_path / "s2", "parallel.spatial=2")
    assert one["kind"] == two["kind"] == "rss_growth"
    assert len(two["tensor_per_rank"]) == 2 and two["tensor_max"] == max(two["tensor_per_rank"])
    # activations dominate this model: each part holds about half, plus the weights every rank keeps
    assert 0.4 * one["tensor_max"] < two["tensor_max"] < 0.75 * one["tensor_max"], (one, two)


def test_no_warmup_step_no_tensor_memory(tmp_path):
    # the tensor memory is measured on the last warm-up step (profiled), never on a timed one
    got = _record(tmp_path, "train.warmup_steps=0")
    assert "tensor_max" not in got and got["max"] > 0
