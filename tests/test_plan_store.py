"""The planner's traces kept on disk between processes (gems/plan/store.py): a second process plans the same
point from the file without tracing (torch's fake-tensor machinery is never imported) and to the same figures; a
damaged file is a miss; ``GEMS_CACHE_DIR=`` keeps nothing; a custom model is never kept; a changed gems or torch
reads no old file; a convolution's workspace is measured once per CPU; CPU kernel times are kept, and measured
again by their rule."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gems.plan import store

POINT = ["model=resnet", "model.depth=11", "model.size=16", "model.width=0.25", "parallel.pipeline=2",
         "parallel.spatial=2", "parallel.schedule=mast"]

PLAN = """
import json, sys
from gems.config import compose
from gems.plan.make import make_plan
from dataclasses import asdict
plan = asdict(make_plan(compose(sys.argv[1:]), suggest=False, quick=True, available=False, workspace=False))
plan.pop("seconds", None)
print(json.dumps({"plan": plan, "traced": "torch._dynamo" in sys.modules}, sort_keys=True, default=str))
"""


def plan_in_a_process(cache: str, *extra: str, home: Path | None = None) -> dict:
    env = dict(os.environ, GEMS_CACHE_DIR=cache)
    if home is not None:  # where the default folder would be
        env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
    r = subprocess.run([sys.executable, "-c", PLAN, *POINT, *extra], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def kept(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*.pkl"))


def test_a_second_process_plans_from_the_kept_traces_to_the_same_figures(tmp_path: Path) -> None:
    first = plan_in_a_process(str(tmp_path))
    files = kept(tmp_path)
    assert first["traced"] and len(files) >= 3, files  # the trunk's shapes, the balance, a part's trace
    second = plan_in_a_process(str(tmp_path))
    assert not second["traced"], "the second process traced again"
    assert second["plan"] == first["plan"]
    for f in files:  # damaged files are misses: traced again, the same plan, the files whole again
        f.write_bytes(f.read_bytes()[:10])
    third = plan_in_a_process(str(tmp_path))
    assert third["traced"] and third["plan"] == first["plan"]
    assert plan_in_a_process(str(tmp_path))["traced"] is False


def test_an_empty_cache_dir_keeps_nothing(tmp_path: Path) -> None:
    off = plan_in_a_process("", home=tmp_path)
    assert off["traced"] and not list(tmp_path.rglob("*"))
    assert plan_in_a_process("", home=tmp_path)["traced"]
    env = {k: v for k, v in os.environ.items() if k != "GEMS_CACHE_DIR"}  # unset: the default folder
    env.update(HOME=str(tmp_path), XDG_CACHE_HOME=str(tmp_path / "xdg"))
    r = subprocess.run([sys.executable, "-c", PLAN, *POINT], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert kept(tmp_path / "xdg" / "gems" / "traces")


def test_the_folders_of_other_versions_go_when_a_new_one_starts(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))
    old, recent = tmp_path / "traces" / "old", tmp_path / "traces" / "recent"
    for d in (old, recent):
        d.mkdir(parents=True)
        (d / "x.pkl").write_bytes(b"")
    week = time.time() - store.STALE_S - 60
    os.utime(old, (week, week))
    assert store.cached(("k",), lambda: 1) == 1
    assert not old.exists() and recent.exists() and len(kept(tmp_path)) == 2  # recent's and the new one


def test_the_key_holds_gems_source_and_torch_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))
    made = []
    assert store.cached(("k", 1), lambda: made.append(1) or "v") == "v" and made == [1]
    assert store.cached(("k", 1), lambda: made.append(2) or "w") == "v" and made == [1]  # read back
    monkeypatch.setattr(store, "source_digest", lambda: "another gems or torch")
    assert store.cached(("k", 1), lambda: made.append(3) or "w") == "w" and made == [1, 3]
    assert len(kept(tmp_path)) == 2


def test_a_value_that_does_not_pickle_or_a_read_only_folder_is_not_kept(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))
    assert store.cached(("lambda",), lambda: (lambda: 1))() == 1
    assert not list(tmp_path.rglob("*.pkl")) and not list(tmp_path.rglob(".part-*"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    monkeypatch.setenv("GEMS_CACHE_DIR", str(ro / "sub"))
    try:
        if os.access(ro, os.W_OK):  # root writes anywhere: a file where the folder should be instead
            ro.chmod(0o700)
            (ro / "sub").write_text("a file, not a folder")
        assert store.cached(("k",), lambda: 7) == 7
    finally:
        ro.chmod(0o700)


def test_a_custom_model_is_never_kept(tmp_path: Path) -> None:
    env = dict(os.environ, GEMS_CACHE_DIR=str(tmp_path))
    code = ("from gems.config import compose; from gems.plan.fit import check_fit; "
            "check_fit(compose(['model=custom', 'model._target_=_custom_models.tiny_cnn', 'model.input_shape=[3,16,16]',"
            " 'model.num_outputs=4', 'parallel.pipeline=2', 'parallel.micro_batches=2']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not kept(tmp_path)


WORKSPACE = """
import json, sys
import gems.plan.cpu as dv
measured = []
real = dv._backward_workspace
dv._backward_workspace = lambda sig, grad: measured.append(sig[-1]) or real(sig, grad)
sig = ("conv", 3, 8, 16, (3, 3, 3), (1, 1, 1), 1, False, (1, 1, 1), (8, 8, 8))
got = [dv.conv_workspace(sig, b, grad) for b in (1, 2, 3) for grad in (True, False)]
print(json.dumps({"bytes": got, "measured": measured}))
"""


def test_a_convolutions_workspace_is_measured_once_per_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bytes, not time: a second process reads them from the store and plans the same; another CPU (its model
    or instruction sets: oneDNN picks its kernels by them) measures its own."""
    def run() -> dict:
        r = subprocess.run([sys.executable, "-c", WORKSPACE], capture_output=True, text=True,
                           env=dict(os.environ, GEMS_CACHE_DIR=str(tmp_path)), timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = run()
    assert first["measured"] == [1, 1, 2, 2, 4, 4] and max(first["bytes"]) > 0  # 3: between 2 and 4; each grad or not
    second = run()
    assert second == {"bytes": first["bytes"], "measured": []}
    import gems.plan.cpu as dv

    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dv, "_WORKSPACE", {})
    monkeypatch.setattr(dv, "cpu_identity", lambda: ("another CPU", "avx512f"))
    measured = []
    monkeypatch.setattr(dv, "_backward_workspace", lambda sig, grad: measured.append(sig[-1]) or 1)
    sig = ("conv", 3, 8, 16, (3, 3, 3), (1, 1, 1), 1, False, (1, 1, 1), (8, 8, 8))
    assert dv.conv_workspace(sig, 1, True) == 1 and measured == [1]


def test_cpu_kernel_times_are_kept_and_measured_again_by_their_rule(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A later process reads the kept times (the same rates, nothing measured); where the reference convolution runs
    slower (a loaded moment) they stand, and a kernel new to them is scaled to the kept moment's speed; where it runs
    more than DRIFT faster, or they are older than KEPT_FOR_S, they are measured again; GEMS_CACHE_DIR= keeps none.
    The clock is the rule's input here, not a measurement: every timing is stood in for."""
    import gems.plan.cpu as cpu

    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu, "_ALONE", [False])  # (a test before may have timed its process alone)
    reference = [0.01]
    measured: list[tuple] = []
    monkeypatch.setattr(cpu, "_reference_seconds", lambda: reference[0])
    monkeypatch.setattr(cpu, "_timed", lambda fn, budget_s=0.05, least=5: 1e-4)
    monkeypatch.setattr(cpu, "_measure_op", lambda sig, pair="forward": measured.append(sig) or (2e9, 1e9))
    conv = ("conv", 2, 8, 8, (3, 3), (1, 1), 1, False, (1, 1), (32, 32), 2)

    def process() -> cpu.CpuRates:  # (a new process: nothing memoised in this one)
        monkeypatch.setattr(cpu, "_CPU", {})
        return cpu.cpu_rates(1)

    first = process()
    assert "kernel times measured now (nothing kept" in first.about and first.measured_rate(conv, False) == 2e9
    n = len(measured)
    again = process()
    assert "kernel times kept from" in again.about and again.measured_rate(conv, False) == 2e9 and len(measured) == n
    assert (again.in_step, again.op_overhead_s, again.bandwidth) == (first.in_step, first.op_overhead_s,
                                                                     first.bandwidth)
    reference[0] = 0.02  # twice as slow now: the kept times stand; a new kernel measured at half its rate is kept
    slow = process()     # at the kept moment's
    assert "kept from" in slow.about and "2.00x its time then" in slow.about
    assert slow.measured_rate((*conv[:-1], 4), False) == pytest.approx(4e9)
    assert slow.measured_rate(conv, False) == 2e9
    reference[0] = 0.01 / (1.1 * cpu.DRIFT)  # faster than DRIFT: those kept were taken in a loaded moment
    fast = process()
    assert "measured now (the reference convolution ran" in fast.about and (*conv[:-1], 4) not in fast.measured
    monkeypatch.setattr(cpu, "KEPT_FOR_S", -1.0)  # too old
    assert "days old" in process().about
    monkeypatch.setenv("GEMS_CACHE_DIR", "")
    monkeypatch.setattr(cpu, "KEPT_FOR_S", 1e9)
    before = kept(tmp_path)
    assert "nothing kept" in process().about and "nothing kept" in process().about and kept(tmp_path) == before
