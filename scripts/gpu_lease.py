"""Everything a session checks on a lent GPU, in one command that ends inside one device call.

    python scripts/gpu_lease.py [--out DIR] [--seconds S]   # on the GPU machine, from the project's root
    python scripts/gpu_lease.py --dry --out DIR              # the plumbing on CPU (small, few runs)

A lease is short (15 minutes of device time a session, the machine's start included), so the phases share one
deadline (``--seconds``, default 530) and each gets what is left of it, in this order:

- ``graphed`` (issue 83): the rig's graphed multi-rank points first (``graphed-R2``, ``graphed-S2``,
  ``graphed-R2xS2``: graphs holding NCCL work, train.graph_collectives), each run to its processes' end (a rank
  whose teardown passes its limit says so, and the rig calls that a teardown hang), with their one-rank reference
  and the deterministic pair (graphed against eager, bit for bit); then each graphed point's pool against its plan
  (the record's ``cuda_reserved_max`` beside ``gems plan``'s peak for the same configuration): ``graphed.md``, and
  ``graphed.json`` with the rig's summary in lease.tgz;
0. ``gems bench step`` (issue 59: gems's step graphed and eager, from HDF5 files, beside a plain loop and that loop
   captured whole as one CUDA graph; the science configuration), its table and every gems record back;
1. the rig (``gems.gpucheck``): the one-rank run graphed against eager first, the strict mode, then the hybrids,
   the precisions, torch's pipelining as the control and every schedule's grid, ranks sharing the GPU; no run
   starts after its share of the time;
2. one-rank rows, the GPU alone: five of the six configurations of ``results/gpu/h200-2026-11-26.json`` (fp16
   left out) and models that file never saw (U-Net, ResNet, other batches), each a real ``gems run``: its median
   step, what CUDA allocated at most, its breakdown and losses, in the H200 file's schema (``rows.json``), so
   ``tests/test_plan_gpu.py`` holds the planner to them;
3. ``gems bench overhead`` in its GPU mode (gems's loop against a plain one, fp32 and bf16);
4. ``gems bench calibrate`` (the model's own convolutions timed, for ``cluster.gpu_calibration``);
5. ``science`` (asked for by name): the sample-size study's 128^3 point (docs/science.md) trained for many more
   epochs than a CPU allows. Its universes are written at the lease's start and it trains beside the rig (the rig's
   timings mean nothing anyway), so it ends before the one-rank rows, which have the GPU alone.
6. ``telemetry`` (asked for by name; issue 80): ``gems nodes check`` on the lent GPU (every check passes on a good
   one), ``gems bench telemetry`` (the sampler's cost beside a plain loop; the energy it read, greater than 0; the
   mean power against the GPU's limit; NVML's peak memory beside torch's peak reserved), and one ``gems run`` with
   ``health.check=always`` whose record goes into lease.tgz; both tables in ``telemetry-gpu.md``.

At most 8 files come back from a device call; it writes these (``large-tensors.json`` too with ``probe``: name no
more than seven of the phases that write one, or one comes back missing): ``graphed.md`` (the graphed phase),
``step.md`` and ``step-records.json``
(gems bench step), ``summary.json``, ``summary.md`` (the rig), ``rows.json``, ``overhead-gpu.md``, ``search-gpu.md``
(gems bench search's GPU half, phase ``search``: issue 72) and ``lease.tgz`` (every log, record and calibration, and
the environment); ``telemetry-gpu.md`` with ``telemetry`` (name it with at most six of the others that write one).
The one-rank rows run eager (``train.cuda_graphs=false``, as every earlier file's), and a few graphed beside them
(``GRAPHED_ROWS``).
The machine lacks gems's pure-Python dependencies: run ``bash scripts/gpu_check.sh --prepare`` here first and
carry ``.gpu`` (the script puts ``.gpu/site`` on the path).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: gems from this checkout, then the carried pure-Python packages where there are some (a GPU machine's image has
#: neither installed): for this process, and for the runs it starts (_env)
PATHS = [str(p) for p in (ROOT, ROOT / ".gpu" / "site") if p.is_dir()]
sys.path[:0] = [p for p in PATHS if p not in sys.path]

#: (label, overrides): rows no GPU file held when the planner's GPU model was last fit (sizes, batches and a model
#: of its own beyond results/gpu/h100-2026-11-26.json), which test it out of sample, first; then the H200 file's
#: one-rank rows under its labels and the rows the first H100 lease measured
NEW_ROWS: list[tuple[str, list[str]]] = [
    ("c512_b1_bf16", ["model=cosmoflow", "model.size=512", "train.batch_size=1", "train.precision=bf16",
                      "train.steps=6", "train.warmup_steps=2"]),
    ("unet128_b1", ["model=unet3d", "model.size=128", "train.batch_size=1", "train.steps=10", "train.warmup_steps=3"]),
    ("resnet1024_b2_bf16", ["model=resnet", "model.size=1024", "train.batch_size=2", "train.precision=bf16",
                            "train.steps=10", "train.warmup_steps=3"]),
    ("mlperf128_b8", ["model=cosmoflow_mlperf", "model.size=128", "train.batch_size=8", "train.steps=12",
                      "train.warmup_steps=3"]),
    ("c64_b64_bf16", ["model=cosmoflow", "model.size=64", "train.batch_size=64", "train.precision=bf16",
                      "train.steps=12", "train.warmup_steps=3"]),
    # 16 x 256^3 x 8 = 2^31 elements out of the first convolution, as at 512^3 and a batch of 1
    ("c256_b8_bf16", ["model=cosmoflow", "model.size=256", "train.batch_size=8", "train.precision=bf16",
                      "train.steps=8", "train.warmup_steps=2"]),
]
ROWS: list[tuple[str, list[str]]] = NEW_ROWS + [
    ("one_default", []),
    ("one_bf16", ["train.precision=bf16"]),
    ("p128_fp32", ["model=cosmoflow", "model.size=128", "train.batch_size=8", "train.steps=20",
                   "train.warmup_steps=5"]),
    ("p128_bf16", ["model=cosmoflow", "model.size=128", "train.batch_size=8", "train.steps=20",
                   "train.warmup_steps=5", "train.precision=bf16"]),
    ("m256", ["model=cosmoflow", "model.size=256", "train.batch_size=4", "train.steps=4", "train.warmup_steps=1"]),
    ("b16_64", ["model=cosmoflow", "model.size=64", "train.batch_size=16", "train.steps=12", "train.warmup_steps=3"]),
    ("unet64", ["model=unet3d", "train.batch_size=2", "train.steps=12", "train.warmup_steps=3"]),
    ("resnet512_bf16", ["model=resnet", "train.batch_size=8", "train.steps=12", "train.warmup_steps=3",
                        "train.precision=bf16"]),
    ("resnet512_fp32", ["model=resnet", "train.batch_size=8", "train.steps=12", "train.warmup_steps=3"]),
    ("resnet256_b16_bf16", ["model=resnet", "model.size=256", "train.batch_size=16", "train.steps=12",
                            "train.warmup_steps=3", "train.precision=bf16"]),
    ("unet64_bf16", ["model=unet3d", "train.batch_size=2", "train.steps=12", "train.warmup_steps=3",
                     "train.precision=bf16"]),
    ("c128_b2", ["model=cosmoflow", "model.size=128", "train.batch_size=2", "train.steps=12",
                 "train.warmup_steps=3"]),
]
#: rows of the model replayed from CUDA graphs (train.cuda_graphs, the default since 2026-11-28): the rows above are
#: run eager, as every GPU file before held them, and these beside them hold the planner's graphed model
GRAPHED_ROWS: list[tuple[str, list[str]]] = [
    ("mlperf128_b1_bf16_graphed", ["model=cosmoflow_mlperf", "model.dropout=0", "train.batch_size=1",
                                   "train.precision=bf16", "train.steps=40", "train.warmup_steps=10",
                                   "train.cuda_graphs=true"]),
    # dropout as MLPerf's recipe has it (the step benchmark sets it to 0): the masks drawn inside the graph
    ("mlperf128_b1_bf16_dropout_graphed", ["model=cosmoflow_mlperf", "train.batch_size=1", "train.precision=bf16",
                                           "train.steps=40", "train.warmup_steps=10", "train.cuda_graphs=true"]),
    # the whole step in the graph, the optimizer's update too (train.graph_optimizer: the default once faster)
    ("mlperf128_b1_bf16_whole_step", ["model=cosmoflow_mlperf", "model.dropout=0", "train.batch_size=1",
                                      "train.precision=bf16", "train.steps=40", "train.warmup_steps=10",
                                      "train.cuda_graphs=true", "train.graph_optimizer=true"]),
    ("one_default_graphed", ["train.cuda_graphs=true"]),
    ("p128_bf16_graphed", ["model=cosmoflow", "model.size=128", "train.batch_size=8", "train.steps=20",
                           "train.warmup_steps=5", "train.precision=bf16", "train.cuda_graphs=true"]),
    # the rest of the H200 file's five rows graphed (issue 74: the five measured again, eager and graphed)
    ("one_bf16_graphed", ["train.precision=bf16", "train.cuda_graphs=true"]),
    ("p128_fp32_graphed", ["model=cosmoflow", "model.size=128", "train.batch_size=8", "train.steps=20",
                           "train.warmup_steps=5", "train.cuda_graphs=true"]),
    ("m256_graphed", ["model=cosmoflow", "model.size=256", "train.batch_size=4", "train.steps=4",
                      "train.warmup_steps=1", "train.cuda_graphs=true"]),
]
#: the phases, in the order a lease runs them by default (science and search only when named); step: gems bench
#: step; search: gems bench search's GPU half (issue 72: the search's choice on one GPU, as it is and under a cap)
PHASES = ("graphed", "step", "rig", "rows", "bench", "science", "probe", "search", "telemetry")
#: the most gems bench search's GPU half may take (two models, each searched twice, its picks in two rounds)
SEARCH_S = 240.0
#: the most gems bench step may take (4 contenders x 2 batches x 3 rounds of 40 steps, and the science point)
STEP_S = 240.0
#: the file that marks a folder as a lease's scratch, which the next lease clears
MARK = ".gems-gpu-lease"
#: the most one command of each phase may take, in seconds (measured on an H100: a rig run 20-60 s, a row 13-22 s,
#: the overhead benchmark 22 s, a calibration 5-12 s); the phases after one keep what they need of the deadline
RUN_S, ROW_S, OVERHEAD_S, CALIBRATE_S, PROBE_S, PLAN_S = 100.0, 40.0, 60.0, 40.0, 90.0, 120.0
#: the telemetry phase: the nodes' check, gems bench telemetry (3 contenders x 3 rounds of 30 steps) and one run
NODES_S, TELEMETRY_S = 60.0, 120.0
#: the models whose convolutions ``gems bench calibrate`` times (each its own file, in lease.tgz)
CALIBRATE: list[tuple[str, list[str]]] = [
    ("cosmoflow128", ["model=cosmoflow", "model.size=128", "train.batch_size=8"]),
    ("resnet512", ["model=resnet", "train.batch_size=8"]),
]
DRY_ROWS: list[tuple[str, list[str]]] = [("dry_small", ["model.size=32", "model.width=0.25", "train.steps=3",
                                                          "train.warmup_steps=1"])]
#: the science phase: universes as the study writes them (a pure function of the seed: the same universes as every
#: CPU run of docs/science.md), then the study's 128^3 point on one GPU, its recipe unchanged but for the epochs and
#: the rate's decays at 70% and 90% of them; dry: a few small universes, two epochs, on CPU
SCIENCE_EPOCHS = 32
SCIENCE_UNIVERSES = (256, 32, 128)  # training, validation, cells a side
DRY_SCIENCE_UNIVERSES = (8, 4, 32)


def science_commands(work: Path, dry: bool, workers: int, epochs: int = SCIENCE_EPOCHS) -> list[list[str]]:
    """The writing of the universes and the training run, in order."""
    py = sys.executable
    train, val, cells = DRY_SCIENCE_UNIVERSES if dry else SCIENCE_UNIVERSES
    epochs = 2 if dry else epochs
    data = work / "science" / "universes"
    synth = [py, "-m", "gems.cli", "data", "synth", "data.kind=cosmology", f"data.path={data / 'train'}",
             f"data.val_path={data / 'val'}", f"data.universes={train}", f"data.val_universes={val}",
             f"data.box_cells={cells}", "data.box_mpc=1024", f"data.workers={workers}"]
    point = [py, "-m", "gems.cli", "run", "+experiment=cosmoflow_sample_size", f"data.path={data / 'train'}",
             f"data.val_path={data / 'val'}", f"data.box_cells={cells}", f"data.crop={cells}", "parallel.spatial=1",
             f"train.epochs={epochs}", f"train.lr_decay_boundaries=[{0.7 * epochs:.1f},{0.9 * epochs:.1f}]",
             f"train.eval_every={2 if dry else 16 * 64}", "train.check_fit=false",
             f"results.dir={work / 'science' / 'run'}", "run_id=lease-science-128"]
    point += (["train.device=cpu", "train.threads=1", "model.width=0.25"] if dry else
              ["train.device=cuda", f"train.threads={workers}"])
    return [synth, point]


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(PATHS + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("GEMS_CACHE_DIR", "/tmp/gems-gpu-lease-cache")
    return env


class Lease:
    def __init__(self, out: Path, work: Path, seconds: float, dry: bool) -> None:
        self.out, self.work, self.dry = out, work, dry
        self.t0, self.deadline = time.monotonic(), time.monotonic() + seconds
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.phases: list[dict[str, Any]] = []
        self.background: dict[str, tuple[subprocess.Popen[bytes], float, Any]] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def start(self, label: str, cmds: list[list[str]]) -> subprocess.Popen[bytes]:
        """``cmds`` one after the other in the background (each only if the one before succeeded), output to
        logs/LABEL.txt; :meth:`finish` waits for them."""
        import shlex

        chain = " && ".join(shlex.join(c) for c in cmds)
        log = open(self.logs / f"{label}.txt", "wb")
        proc = subprocess.Popen(["bash", "-c", chain], stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT,
                                start_new_session=True)
        self.background[label] = (proc, time.monotonic(), log)
        print(f"[{time.monotonic() - self.t0:6.1f}s] {label}: started", flush=True)
        return proc

    def finish(self, label: str, by_s: float) -> int:
        """Wait for the background ``label`` until ``by_s`` seconds before the deadline, then end it."""
        proc, t, log = self.background.pop(label)
        try:
            rc = proc.wait(timeout=max(0.0, self.left() - by_s))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        log.close()
        self.phases.append({"label": label, "rc": rc, "wall_s": round(time.monotonic() - t, 1), "background": True})
        print(f"[{time.monotonic() - self.t0:6.1f}s] {label}: rc={rc}", flush=True)
        return rc

    def run(self, label: str, cmd: list[str], cap_s: float) -> int:
        """``cmd`` bounded by ``cap_s`` and by the deadline; its output to logs/LABEL.txt."""
        limit = max(1.0, min(cap_s, self.left()))
        t = time.monotonic()
        with open(self.logs / f"{label}.txt", "wb") as log:
            # a session of its own: at its limit the command goes with everything it started (the rig's ranks),
            # so nothing left over shares the GPU with the phases after it
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = 124
        self.phases.append({"label": label, "rc": rc, "wall_s": round(time.monotonic() - t, 1), "limit_s": limit})
        print(f"[{time.monotonic() - self.t0:6.1f}s] {label}: rc={rc}", flush=True)
        return rc


def environment() -> dict[str, Any]:
    import torch

    from gems.results.record import git_commit

    info: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                            "cpus": os.cpu_count(), "commit": git_commit()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, sms=p.multi_processor_count,
                    nccl=".".join(map(str, torch.cuda.nccl.version())))
    return info


def row_of(record: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A record in the schema of results/gpu/h200-2026-11-26.json's runs."""
    cfg = record.get("config") or {}
    model, train = cfg.get("model") or {}, cfg.get("train") or {}
    peak = record.get("peak_memory_bytes") or {}
    st = record.get("step_time_s") or {}
    return {"overrides": {"model": model.get("name"), "size": model.get("size"), "batch": record.get("global_batch"),
                          "precision": train.get("precision"), "mesh": record.get("mesh"), "given": overrides},
            "status": record.get("status"), "step_time_s_median": st.get("median"),
            "samples_per_s": record.get("throughput_samples_per_s"),
            "cuda_max_allocated_bytes": peak.get("max") if peak.get("kind") == "cuda_max_allocated" else None,
            # the most the tensors asked for (before the allocator's rounding and unsplit blocks): gems.memory
            "cuda_max_requested_bytes": peak.get("cuda_requested_max"),
            # what the allocator held from the device, a graph's pool too (docs/gpu.md, "Graphs and NCCL")
            "cuda_max_reserved_bytes": peak.get("cuda_reserved_max"),
            "peak_kind": peak.get("kind"), "time_breakdown_s": record.get("time_breakdown_s"),
            "loss": record.get("loss"), "error": record.get("error")}


def _record(folder: Path) -> dict[str, Any] | None:
    from gems.results.table import load_records

    return next(iter(load_records(folder)), None)


def rig_phase(lease: Lease, a: argparse.Namespace, keep_s: float) -> None:
    """The rig: no run starts after its share of the time; each at most 100 s (a 64^3 step takes seconds)."""
    check = lease.work / "check"
    # gpucheck starts no run after its budget and lets each run RUN_S: it ends by budget + RUN_S (+ its summary)
    rig_s = lease.left() - keep_s - (10 if a.dry else 30)
    budget = rig_s - RUN_S
    if budget < 10:
        print(f"gpu_lease: {lease.left():.0f} s left: no time for the rig", flush=True)
        return
    rig = [sys.executable, "-m", "gems.gpucheck", "--out", str(check), "--budget", str(budget),
           "--limit", str(RUN_S)] + (["--dry"] if a.dry else []) + (["--only", a.only] if a.only else [])
    if "science" in lease.background:  # the training's reader and its threads keep half the cores
        rig += ["--ranks", str(max(2, (os.cpu_count() or 2) // 2))]
    lease.run("rig", rig, rig_s + 20)
    for name in ("summary.json", "summary.md"):
        if (check / name).exists():
            (lease.out / name).write_bytes((check / name).read_bytes())


def graphed_phase(lease: Lease, dry: bool, keep_s: float) -> None:
    """The rig's graphed points, their reference and the deterministic pair (each run to its processes' end), then
    each graphed point's pool against its plan: graphed.md back, graphed.json and the records in lease.tgz."""
    from gems import gpucheck

    folder = lease.work / "graphed"
    # gpucheck starts no run after its budget; a graphed point (or its retry) takes at most GRAPHED_LIMIT_S after
    rig_s = lease.left() - keep_s - (10 if dry else 30)
    budget = rig_s - gpucheck.GRAPHED_LIMIT_S
    if budget < 10:
        print(f"gpu_lease: {lease.left():.0f} s left: no graphed phase", flush=True)
        return
    lease.run("graphed", [sys.executable, "-m", "gems.gpucheck", "--out", str(folder), "--budget", str(budget),
                          "--limit", str(RUN_S), "--only", GRAPHED_ONLY] + (["--dry"] if dry else []), rig_s + 20)
    summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else None
    if summary is None:
        (lease.out / "graphed.md").write_text("# The graphed points\n\nThe rig wrote no summary: logs/graphed.txt\n")
        return
    points = {r.label: r for r in gpucheck.matrix(dry) if gpucheck.GRAPHED_KEY in r.args}
    pools = [pool_row(lease, folder / "runs" / label, gpucheck.overrides(run, dry), label)
             for label, run in points.items() if any(x["label"] == label for x in summary["runs"])]
    (lease.work / "graphed.json").write_text(json.dumps({"summary": summary, "pools": pools}, indent=1) + "\n")
    (lease.out / "graphed.md").write_text(graphed_table(summary, pools, (folder / "summary.md").read_text()))


#: the graphed phase's points: the rig's graphed ones (and their one-rank reference) and the deterministic pair
GRAPHED_ONLY = "graphed,deterministic"


def pool_row(lease: Lease, folder: Path, overrides: list[str], label: str) -> dict[str, Any]:
    """A graphed point's pool against its plan: what CUDA's allocator held at most (the graph's pool among it) and
    allocated at most, per the run's record, beside ``gems plan``'s peak a rank for the same configuration."""
    rec = _record(folder)
    peak = (rec or {}).get("peak_memory_bytes") or {}
    out = lease.work / "graphed" / f"plan-{label}.json"
    try:
        with open(out, "wb") as f:
            subprocess.run([sys.executable, "-m", "gems.cli", "plan", "plan.format=json", *overrides], stdout=f,
                           stderr=subprocess.DEVNULL, env=dict(_env(), GEMS_TEST_SHARE_GPU="1"), cwd=ROOT,
                           timeout=PLAN_S)
        planned = json.loads(out.read_text())["peak_memory_bytes"]["max"]
    except (subprocess.TimeoutExpired, ValueError, KeyError, TypeError):  # the row says what the plan did not
        planned = None
    reserved = peak.get("cuda_reserved_max")
    return {"label": label, "status": (rec or {}).get("status", "no record"), "planned_bytes": planned,
            "reserved_bytes": reserved, "allocated_bytes": peak.get("max") if peak.get("kind") == "cuda_max_allocated"
            else None, "reserved_over_planned": reserved / planned if reserved and planned else None}


def graphed_table(summary: dict[str, Any], pools: list[dict[str, Any]], rig: str) -> str:
    """graphed.md: the verdict on train.graph_collectives, the rig's table, and each graphed point's pool."""
    def mib(v: Any) -> str:
        return f"{v / 2**20:.0f}" if isinstance(v, (int, float)) else ""

    rows = ["| point | record | planned MiB | reserved MiB | allocated MiB | reserved / planned |",
            "| --- | --- | --- | --- | --- | --- |"]
    for p in pools:
        ratio = f"{p['reserved_over_planned']:.2f}" if p["reserved_over_planned"] is not None else ""
        rows.append(f"| {p['label']} | {p['status']} | {mib(p['planned_bytes'])} | {mib(p['reserved_bytes'])} | "
                    f"{mib(p['allocated_bytes'])} | {ratio} |")
    return (f"# The graphed points (issue 83)\n\ntrain.graph_collectives by default: "
            f"{summary['graph_collectives']['verdict']}\n\n## Each graphed point's pool against its plan\n\n"
            + "\n".join(rows) + "\n\n## The rig\n\n" + rig.split("\n\n", 1)[-1])


def rows_phase(lease: Lease, dry: bool, keep_s: float, env_info: dict[str, Any], only: str = "") -> None:
    """One-rank rows, the GPU alone, to rows.json (``only``: the labels to run, comma-separated)."""
    rows: dict[str, Any] = {}
    base = ["train.check_fit=false", "train.cuda_graphs=false"] + (["train.device=cpu"] if dry else [])
    labels = [x for x in only.split(",") if x]
    every = dict(GRAPHED_ROWS + ROWS)  # by default the graphed rows first: the planner's new model is what they hold
    for label, overrides in (DRY_ROWS if dry else [(r, every[r]) for r in labels] if labels else every.items()):
        if lease.left() < keep_s + ROW_S:  # a row may take ROW_S: it never eats what the phases after it keep
            rows[label] = {"status": "not run", "error": "the lease's deadline"}
            continue
        folder = lease.work / "rows" / label
        given = {o.split("=", 1)[0] for o in overrides}
        lease.run(f"row-{label}", [sys.executable, "-m", "gems.cli", "run",
                                   *(b for b in base if b.split("=", 1)[0] not in given), *overrides,
                                   f"results.dir={folder}", f"run_id=lease-{label}"], ROW_S)
        rec = _record(folder)
        rows[label] = row_of(rec, overrides) if rec else {"status": "failed", "error": "no record"}
    (lease.out / "rows.json").write_text(json.dumps({"machine": env_info, "date": time.strftime("%Y-%m-%d"),
                                                     "runs": rows}, indent=1) + "\n")


def step_phase(lease: Lease, dry: bool) -> None:
    """gems bench step (issue 59's side-by-side: gems graphed and eager from HDF5 files, a plain loop and that loop
    as one CUDA graph, and the science configuration); its table and every gems record come back."""
    step = lease.work / "step"
    if lease.left() < (30 if dry else STEP_S):
        print(f"gpu_lease: {lease.left():.0f} s left: no gems bench step", flush=True)
        return
    lease.run("bench-step", [sys.executable, "-m", "gems.cli", "bench", "step", f"out={step}"], STEP_S)
    for name in ("step.md", "step-cpu.md", "step-records.json"):
        if (step / name).exists():
            (lease.out / name).write_bytes((step / name).read_bytes())


def bench_phase(lease: Lease, dry: bool) -> None:
    """gems bench overhead (its GPU mode; the CPU mode is another benchmark: not on a dry lease) and calibrate."""
    bench, py = lease.work / "bench", sys.executable
    if not dry and lease.left() >= OVERHEAD_S:
        lease.run("bench-overhead", [py, "-m", "gems.cli", "bench", "overhead", f"out={bench}"], OVERHEAD_S)
    for label, overrides in CALIBRATE[:1] if dry else CALIBRATE:
        if lease.left() < CALIBRATE_S:
            print(f"gpu_lease: {lease.left():.0f} s left: no calibration of {label}", flush=True)
            continue
        job = ["model.size=32", "model.width=0.25", "train.batch_size=2"] if dry else overrides
        lease.run(f"bench-calibrate-{label}", [py, "-m", "gems.cli", "bench", "calibrate", *job,
                                               f"out={bench / label}"], CALIBRATE_S)
    if (bench / "overhead-gpu.md").exists():
        (lease.out / "overhead-gpu.md").write_bytes((bench / "overhead-gpu.md").read_bytes())


def search_phase(lease: Lease, dry: bool) -> None:
    """gems bench search's GPU half (gems.bench.search.bench_search_gpu): its table back, its JSON in lease.tgz."""
    folder = lease.work / "search"
    if lease.left() < (30 if dry else 60):
        print(f"gpu_lease: {lease.left():.0f} s left: no gems bench search", flush=True)
        return
    if dry:  # the GPU mode's plumbing on this CPU
        code = f"from pathlib import Path; from gems.bench.search import bench_search_gpu; " \
               f"bench_search_gpu(Path({str(folder)!r}), rounds=1, dry=True)"
        lease.run("bench-search", [sys.executable, "-c", code], SEARCH_S)
    else:
        lease.run("bench-search", [sys.executable, "-m", "gems.cli", "bench", "search", f"out={folder}"], SEARCH_S)
    if (folder / "search-gpu.md").exists():
        (lease.out / "search-gpu.md").write_bytes((folder / "search-gpu.md").read_bytes())


def telemetry_phase(lease: Lease, dry: bool) -> None:
    """Issue 80 on the GPU: gems nodes check, gems bench telemetry and a run with the node's check on; the check's
    lines and the benchmark's table in telemetry-gpu.md, the run's record in lease.tgz."""
    folder, py = lease.work / "telemetry", sys.executable
    folder.mkdir(parents=True, exist_ok=True)
    if lease.left() < (30 if dry else NODES_S + TELEMETRY_S):
        print(f"gpu_lease: {lease.left():.0f} s left: no telemetry phase", flush=True)
        return
    lease.run("nodes-check", [py, "-m", "gems.cli", "nodes", "check"], NODES_S)
    if dry:  # the benchmark's plumbing on this CPU: a few steps
        code = f"from pathlib import Path; from gems.bench.telemetry import bench_telemetry; " \
               f"bench_telemetry(Path({str(folder)!r}), rounds=1, steps=4)"
        lease.run("bench-telemetry", [py, "-c", code], TELEMETRY_S)
    else:
        lease.run("bench-telemetry", [py, "-m", "gems.cli", "bench", "telemetry", f"out={folder}"], TELEMETRY_S)
    run = ["model.size=32", "model.width=0.25", "train.steps=2", "train.warmup_steps=1", "train.device=cpu"] if dry \
        else ["train.steps=40", "train.warmup_steps=10", "train.device=cuda"]
    lease.run("run-health", [py, "-m", "gems.cli", "run", "health.check=always", *run, "train.check_fit=false",
                             f"results.dir={folder / 'run'}", "run_id=lease-telemetry"], ROW_S)
    check = (lease.logs / "nodes-check.txt").read_text(errors="replace") if (lease.logs / "nodes-check.txt").exists() \
        else "(no output)"
    table = (folder / "telemetry.md").read_text() if (folder / "telemetry.md").exists() else "(gems bench telemetry " \
        "wrote nothing: logs/bench-telemetry.txt)\n"
    (lease.out / "telemetry-gpu.md").write_text(f"## gems nodes check\n\n```\n{check.rstrip()}\n```\n\n{table}")


def archive(lease: Lease) -> None:
    """Every log, record and calibration in lease.tgz (no weights or checkpoints)."""
    work = lease.work
    (work / "phases.json").write_text(json.dumps(lease.phases, indent=1))

    def small(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if info.name.endswith((".pt", ".distcp", ".tmp")) or info.size > 4 << 20 else info

    runs = [work / "check" / "runs", work / "graphed" / "runs"]
    with tarfile.open(lease.out / "lease.tgz", "w:gz") as tar:
        for name in ("logs", "environment.json", "phases.json", "rows", "check/logs", "bench", "science/run",
                     "search", "telemetry", "graphed.json", "graphed/logs"):
            if (work / name).exists():
                tar.add(work / name, arcname=name, filter=small)
        for rec in sorted(r for folder in runs if folder.is_dir() for r in folder.rglob("*.json")):
            tar.add(rec, arcname=str(rec.relative_to(work)))  # the records, and the ranks' failure reports


def run_phases(lease: Lease, a: argparse.Namespace, phases: list[str], env_info: dict[str, Any]) -> None:
    """Each phase in its order, each keeping what the rows and the benchmarks after it need of the deadline."""
    for i, phase in enumerate(phases):
        later = phases[i + 1:]
        rows_kept = min(3, len([x for x in a.rows.split(",") if x]) or 3)  # the rows asked for, 3 at most
        keep_s = (rows_kept * ROW_S if "rows" in later else 0) + (OVERHEAD_S + CALIBRATE_S if "bench" in later else 0)
        if phase == "graphed":
            graphed_phase(lease, a.dry, keep_s)
        elif phase == "step":
            step_phase(lease, a.dry)
        elif phase == "rig":
            rig_phase(lease, a, keep_s)
        elif phase == "rows":
            rows_phase(lease, a.dry, keep_s, env_info, a.rows)
        elif phase == "probe":  # which layers slow down past 2^31 elements (a GPU only)
            if not a.dry:
                lease.run("probe", [sys.executable, str(ROOT / "scripts" / "gpu_large_tensors.py"), "--out",
                                    str(lease.out / "large-tensors.json")], PROBE_S)
        elif phase == "science":
            lease.finish("science", keep_s)
        elif phase == "search":
            search_phase(lease, a.dry)
        elif phase == "telemetry":
            telemetry_phase(lease, a.dry)
        else:
            bench_phase(lease, a.dry)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results/gpu/lease")))
    p.add_argument("--seconds", type=float, default=530.0, help="the whole lease's deadline")
    p.add_argument("--dry", action="store_true", help="the plumbing on CPU")
    p.add_argument("--phases", default="graphed,step,rig,rows,bench", help="which phases, in this order (graphed, "
                   "step, rig, rows, bench, probe, search, telemetry, science: it starts at once and trains beside the "
                   "phases before it)")
    p.add_argument("--rows", default="", help="the one-rank rows to run, by label, in this order (comma-separated; "
                   "default all)")
    p.add_argument("--science-epochs", type=int, default=SCIENCE_EPOCHS, help="the science point's epochs")
    p.add_argument("--only", default="", help="the rig's points whose label holds one of these texts (comma-separated)")
    a = p.parse_args(argv)
    phases = [x for x in a.phases.split(",") if x]
    bad = [x for x in phases if x not in PHASES]
    if bad or not phases:  # before anything is written
        print(f"gpu_lease: --phases={a.phases}: {', '.join(bad) or 'nothing'} is not a phase ({', '.join(PHASES)})",
              file=sys.stderr)
        return 2
    named = [r for r, _ in GRAPHED_ROWS + ROWS]
    unknown = [x for x in a.rows.split(",") if x and x not in named]
    if unknown:
        print(f"gpu_lease: --rows={a.rows}: {', '.join(unknown)} is not a row (one of {', '.join(named)})",
              file=sys.stderr)
        return 2
    if a.science_epochs < 1:
        print(f"gpu_lease: --science-epochs={a.science_epochs}: expected 1 or more", file=sys.stderr)
        return 2
    work = Path(os.environ.get("GEMS_LEASE_WORK", "/tmp/gems-gpu-lease"))
    if work.exists() and not (work / MARK).exists():
        print(f"gpu_lease: GEMS_LEASE_WORK={work}: a folder no lease made (it would be cleared): name a new one",
              file=sys.stderr)
        return 2
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)  # the lease's own scratch: no record of an earlier lease is read
    work.mkdir(parents=True)
    (work / MARK).write_text("the scratch of scripts/gpu_lease.py, cleared at each lease\n")
    lease = Lease(out, work, a.seconds, a.dry)
    env_info = environment()
    (work / "environment.json").write_text(json.dumps(env_info, indent=1))
    with open(lease.logs / "nvidia-smi.txt", "wb") as f:
        subprocess.run("nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv",
                       shell=True, stdout=f, stderr=subprocess.STDOUT)
    lease.run("imports", [sys.executable, "-c", "import gems.cli, hydra, submitit, colossus, mlperf_logging, h5py"],
              60)
    if "science" in phases:  # the universes, then the training: beside the phases listed before it
        workers = 1 if a.dry else max(1, (os.cpu_count() or 2) // (2 if "rig" in phases else 1))
        lease.start("science", science_commands(lease.work, a.dry, workers, a.science_epochs))
    run_phases(lease, a, phases, env_info)
    archive(lease)
    print(json.dumps(lease.phases), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
