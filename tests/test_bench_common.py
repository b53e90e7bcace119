"""The memory measures the benchmarks and CPU records report (gems.memory): peak tensor bytes of a step,
bytes held across steps."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from gems.memory import persistent_bytes, step_peak_bytes, tensor_bytes

MiB = 1 << 20


def test_step_peak_follows_allocations_and_frees():
    def step():
        a = torch.ones(MiB)  # 4 MiB
        b = torch.ones(MiB // 2)  # 2 MiB: 6 MiB live
        del a
        c = torch.ones(MiB // 4)  # 1 MiB: 3 MiB live
        return float(b.sum() + c.sum())

    peak = step_peak_bytes(step)
    assert 6 * MiB <= peak < 6 * MiB + 64 * 1024, peak


def test_step_peak_counts_a_backward_and_not_what_lived_before():
    w = nn.Linear(512, 512)
    x = torch.randn(256, 512)
    before = step_peak_bytes(lambda: None)
    peak = step_peak_bytes(lambda: w(x).relu().sum().backward())
    out = 256 * 512 * 4
    # at least an activation-sized gradient beside the weight gradient; the weights themselves not
    assert before < 64 * 1024
    assert out + 512 * 512 * 4 <= peak < 6 * out + 2 * 512 * 512 * 4, peak


def test_persistent_bytes_counts_parameters_gradients_and_optimizer_state_once():
    net = nn.Linear(100, 50)
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(3, 100)).sum().backward()
    opt.step()
    p = (100 * 50 + 50) * 4
    assert persistent_bytes(net.parameters()) == 2 * p  # parameters and gradients
    assert persistent_bytes(net.parameters(), opt) == 4 * p  # + Adam's two moments
    v = torch.zeros(1000)
    assert tensor_bytes([v, v[:10], v.view(10, 100)]) == 4000  # views of one storage count once


def _module(name: str, *argv: str) -> tuple[int, str, str]:
    """``python -m NAME ARGV`` in this process (runpy, as ``-m`` runs it): exit status, stdout, stderr."""
    import contextlib
    import io
    import runpy
    import sys
    import warnings

    out, err, code = io.StringIO(), io.StringIO(), 0
    saved = sys.argv
    sys.argv = [name, *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # (runpy: the module was imported before, as a package's)
            try:
                runpy.run_module(name, run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved
    return code, out.getvalue(), err.getvalue()


def test_bench_modules_answer_help_and_reject_options_without_running():
    for name in ("overhead", "spatial", "pipeline", "data", "checkpoint", "step"):
        code, out, _ = _module(f"gems.bench.{name}", "--help")
        assert code == 0 and f"gems.bench.{name} [OUT_DIR]" in out
        code, _, err = _module(f"gems.bench.{name}", "--steps=3")
        assert code == 2 and "--steps=3" in err and "Traceback" not in err


def _results_files() -> dict[Path, int]:
    """Every path under the repository's results/ and under results/ of the working directory (a run's default
    results.dir), with the time it was last written."""
    roots = {Path(__file__).resolve().parents[1] / "results", Path.cwd() / "results"}
    return {p: p.stat().st_mtime_ns for root in roots if root.exists() for p in root.rglob("*")}


def test_bench_data_writes_its_table_with_every_contender(tmp_path, monkeypatch):
    """A small `gems bench data` (32^3, S=1): the table and its environment written, the reader alone at each
    thread count beside its bound, both data kinds measured with every contender (the times themselves are the
    benchmark's business, not a test's); GEMS_BENCH_DATA=reader writes the reader's part alone. The runs' records
    and trained models stay in the bench's own temporary folder: nothing is written under the repository's results/
    (they once left results/bench-data-32-1-*.model.pt there)."""
    from gems.bench.data import GOAL_ROWS, bench_data, inplane_rows
    from gems.errors import ConfigError

    before = _results_files()
    text = bench_data(tmp_path, sizes=(32,), spatials=(1,), rounds=1, reader_size=32, reader_rounds=1, quiet_s=0)
    assert sorted(str(p) for p, t in _results_files().items() if before.get(p) != t) == []
    assert (tmp_path / "data.md").read_text() == text
    reader = [[c.strip() for c in line.split("|")[1:-1]] for line in text.split("### The step")[0].splitlines()
              if line.startswith("| ")][1:]
    by = {(r[0], r[2]): r for r in reader}  # a row a layout and thread count (issue 65): the HDF5 layouts at least
    assert {("gems", "1"), ("gems", "2"), ("exalearn", "1"), ("exalearn", "2"), ("lbann", "1"), ("nifti", "1"),
            ("tfrecord", "1"), ("tfrecord, converted", "1")} <= set(by), sorted(by)
    assert "uint8 labels" in by[("nifti", "1")][1] and "Not measured" not in text
    assert "Converted TFRecords against `gems data synth`'s files" in text
    # crops of a larger universe, the path MLPerf's crops of ExaLearn's universes take, beside the planner's rule
    assert ("exalearn, 16^3 crops of 64^3", "1") in by and by[("exalearn, 16^3 crops of 64^3", "1")][3] == "-"
    assert "crops, whose rows are 128 B runs 512 B apart; the reader reads" in text, text
    assert "measured / rule" in text and "the plan takes 1.11 GB/s a thread from 4.4" in text, text
    inplane = set(inplane_rows(32))  # tiles of a volume: no mapped copy (a volume is many samples)
    assert inplane <= {r[0] for r in by.values()}, sorted(by)
    for r in by.values():  # the bound is the best of the positional reads; every figure measured, the mapped copy too
        reads = [float(v) for v in r[3:5] if v != "-"]
        assert float(r[6].split()[0]) == max(reads) and min(reads) > 0
        measured = (7, 8, 9, 11, 13) if r[0] in inplane else (5, 7, 8, 9, 10, 11, 13)
        assert "-" not in [r[i] for i in measured] and min(float(r[i]) for i in measured) > 0, r
        assert r[0] not in inplane or r[5] == r[10] == "-", r
        assert ("reader >= 0.7 of the bound" in r[12]) == (r[2] == "1" and r[0] in GOAL_ROWS), r
    monkeypatch.setenv("GEMS_BENCH_DATA", "reader")
    alone = bench_data(tmp_path, reader_size=32, reader_rounds=1, quiet_s=0)
    assert (tmp_path / "data-reader.md").read_text() == alone and "### The step" not in alone
    with pytest.raises(ConfigError, match="^GEMS_BENCH_DATA=steps: expected reader"):
        bench_data(tmp_path, parts="steps")
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| 32^3")]
    assert [r[2].strip() for r in rows] == ["synthetic", "hdf5"]
    for r in rows:
        reader, bound, off_step, off_exposed, on_step = (float(r[i]) for i in (3, 4, 5, 6, 7))
        assert min(reader, bound, off_step, off_exposed, on_step) > 0
    assert "To reproduce: `gems bench data`" in text


def test_bench_step_runs_every_contender_it_can_here_and_keeps_each_gems_record(tmp_path):
    """`gems bench step` on a CPU: its plumbing at a small size (the GPU's figures are the lease's): gems graphed and
    eager from HDF5 files and the plain loop, each gems record kept beside the table."""
    import json

    from gems.bench.step import bench_step

    text = bench_step(tmp_path)
    assert (tmp_path / "step-cpu.md").read_text() == text
    names = [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ") and "batch" in line]
    cpu = " (eager: a CPU has no CUDA graphs)"
    assert names == [f"gems, batch 1{cpu}", "gems eager, batch 1", "plain, batch 1"]
    records = json.loads((tmp_path / "step-records.json").read_text())
    assert [(r["contender"], r["batch"]) for r in records] == [("gems", 1), ("gems eager", 1)]
    assert all(r["record"]["status"] == "ok" and r["record"]["config"]["data"]["name"] == "files" for r in records)
    assert "To reproduce: `gems bench step`" in text
