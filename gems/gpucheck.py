"""The GPU rig: gems's whole multi-rank matrix on one GPU, with one command (``bash scripts/gpu_check.sh``).

A test aid, not a benchmark: several ranks share the GPU (``GEMS_TEST_SHARE_GPU=1``), each an NCCL host of its own,
so NCCL's real matching, stream and connection rules apply and an order it cannot complete hangs here as on many
GPUs. Each point is a real ``gems run`` compared step by step with its one-rank run (docs/gpu.md, "The GPU rig").

    python -m gems.gpucheck [--dry] [--out DIR] [--budget S] [--limit S] [--ranks N] [--only TEXT[,TEXT...]]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: the largest relative difference of any step's loss from the one-rank run's that counts as equal: fp32 without
#: TF32 differs in the order of its sums only; bf16 and fp16 round each micro-batch's activations
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "fp16": 3e-2}


@dataclass
class Run:
    """One point of the matrix: a ``gems run`` (or a control) and the one-rank run it is compared with."""

    label: str
    args: list[str]
    ranks: int
    precision: str = "fp32"
    control: str = ""  # a torch.distributed.pipelining schedule: the control, not gems
    skipped: str = ""  # why the point is not run (a combination the schedule refuses)
    env: dict[str, str] = field(default_factory=dict)  # what the run's environment adds (the strict mode's NCCL)
    family: str = ""  # another model than the default job's, with a one-rank reference of its own ("unet")
    #: the run's own time limit (the graphed multi-rank points: a hang must not eat the lease), else the rig's
    limit_s: float | None = None
    #: where the run hit its limit (a hang), it runs once more with these added to its environment
    retry_env: dict[str, str] = field(default_factory=dict)
    #: the one-rank run it is compared with, where not the one of its precision and family
    reference_run: str = ""
    #: equal means bit for bit (train.deterministic on both sides), not within the precision's tolerance
    exact: bool = False
    # filled in when it ran
    status: str = "not run"
    wall_s: float | None = None
    losses: list[float] = field(default_factory=list)
    reference: list[float] = field(default_factory=list)
    max_rel_diff: float | None = None
    equal: bool | None = None
    error: str = ""
    #: which environment the result is from: "as set" or the retry's (NCCL_GRAPH_MIXING_SUPPORT=0 after a hang)
    setting: str = "as set"
    #: what the first try ended with, where it was retried
    first_try: str = ""

    @property
    def reference_label(self) -> str:
        if self.reference_run:
            return self.reference_run
        if self.control:
            return f"control-{self.control}-1rank"
        return f"1rank-{self.precision}" + (f"-{self.family}" if self.family else "")


#: the strict mode: NCCL's buffers far below a halo plane or a cut's activation (NCCL_BUFFSIZE, 4 MiB by default),
#: so a send completes only with its receive, as it does on any GPU once messages outgrow the buffers (a 512^3
#: sample's halos are 16-32 MB), and one hardware queue a GPU (CUDA_DEVICE_MAX_CONNECTIONS=1), so what a rank
#: issued first holds what it issued after: an order NCCL's buffers forgave on a small model hangs here
STRICT_NCCL = {"NCCL_BUFFSIZE": "65536", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
STRICT_POINTS = [("S2", ["parallel.spatial=2"], 2),
                 ("R2xS2", ["parallel.replicas=2", "parallel.spatial=2"], 4),
                 ("D2xS2-1f1b-m2", ["parallel.pipeline=2", "parallel.spatial=2", "parallel.schedule=1f1b",
                                    "parallel.micro_batches=2"], 4),
                 ("D2xS2-gpipe-m2", ["parallel.pipeline=2", "parallel.spatial=2", "parallel.schedule=gpipe",
                                     "parallel.micro_batches=2"], 4),
                 # the pipelines' exchange rounds with what each schedule adds to them: GEMS's mirrored gradient
                 # sums between rounds (mast, master, and with replicas and parts), split backwards (zbh1),
                 # interleaved chunks, and rounds placed by measured times (parallel.rounds_by=time)
                 ("mast-D2-m2", ["parallel.pipeline=2", "parallel.schedule=mast", "parallel.micro_batches=2"], 2),
                 ("master-D2-m2", ["parallel.pipeline=2", "parallel.schedule=master", "parallel.micro_batches=2"], 2),
                 ("R2xD2xS2-mast", ["parallel.replicas=2", "parallel.pipeline=2", "parallel.spatial=2",
                                    "parallel.schedule=mast"], 8),
                 ("zbh1-D2-m2", ["parallel.pipeline=2", "parallel.schedule=zbh1", "parallel.micro_batches=2"], 2),
                 ("interleaved1f1b-D2-m2", ["parallel.pipeline=2", "parallel.schedule=interleaved1f1b",
                                            "parallel.micro_batches=2"], 2),
                 ("mast-D2-m2-timed", ["parallel.pipeline=2", "parallel.schedule=mast", "parallel.micro_batches=2",
                                       "parallel.rounds_by=time"], 2)]


#: the U-Net (without norms: mast's passes and micro-batches normalise their own samples, which its one-rank
#: reference does not), whose skips cross its pipeline cuts packed with the activation (gems.models.skips.Carried:
#: channels-last pieces flattened in their own memory order on GPUs) and whose checkpointed pieces recompute with
#: the GPU's random state (gems.models.skips._Recomputed)
UNET = ["model=unet3d", "model.size=32", "model.width=0.25", "model.norm=none"]
UNET_POINTS = [("unet-D2", ["parallel.pipeline=2"], 2, {}),
               ("unet-D2xS2", ["parallel.pipeline=2", "parallel.spatial=2"], 4, STRICT_NCCL),
               ("unet-S2-checkpoint", ["parallel.spatial=2", "parallel.checkpoint=true"], 2, STRICT_NCCL),
               ("unet-D2-mast-checkpoint", ["parallel.pipeline=2", "parallel.schedule=mast",
                                            "parallel.checkpoint=true"], 2, {})]


#: gems's own allowances in every run of the matrix (fault.warmup_timeout_s: set-up, warm-up and the first steps,
#: the capture's and the first replay's among them; fault.stall_timeout_s: a later step, and a rank's teardown)
WARMUP_S, STALL_S = 90.0, 30.0


def _base(dry: bool) -> list[str]:
    """What every run of the matrix shares: the default CosmoFlow job on 8 samples a step, TF32 off, gems's own
    watchdog bounding a hang (a run that makes no progress ends with a record naming the stuck ranks)."""
    common = ["train.batch_size=8", "train.warmup_steps=1", "train.check_fit=false", f"fault.warmup_timeout_s={WARMUP_S:g}",
              f"fault.stall_timeout_s={STALL_S:g}"]
    if dry:
        return common + ["model.size=32", "model.width=0.25", "train.steps=2", "train.device=cpu"]
    return common + ["train.steps=4", "train.device=cuda", "train.tf32=false"]


def matrix(dry: bool = False) -> list[Run]:
    """The runs of the rig, the one-rank references first (``dry``: a few, on CPU): the one-rank run eager against
    its CUDA graphs (within fp32's tolerance, bit for bit where both are deterministic), every registered schedule x
    D in {2, 4} x m in {1, 2, 4} (a combination a schedule refuses listed as skipped, with its reason), GEMS-MAST and
    -MASTER at R2 x D2 x S2, S = 2, R = 2, pipelines at fp16 and bf16, the strict mode (:data:`STRICT_NCCL`), the
    U-Net (:data:`UNET_POINTS`), torch's ``Schedule1F1B`` and ``ScheduleGPipe`` as controls (if they hang too, the
    rig is at fault, not gems), and last the graphs that hold NCCL work (:func:`graphed_points`)."""
    from gems.errors import ConfigError
    from gems.pipeline.schedules import make_schedule, registered

    precisions = ["fp32"] if dry else ["fp32", "bf16", "fp16"]
    # fp16's reference sums its gradient over two micro-batches of 4, as every fp16 pipeline of the matrix does: a
    # convolution's fp16 weight gradient over 8 samples overflowed where over 4 it did not, so a one-pass reference
    # skipped a step the pipelines took (H100, results/gpu/h100-2026-11-26-rig.md); both obey the loss scaler's rule
    mb4 = ["parallel.schedule=gpipe", "parallel.micro_batches=2"]
    runs = [Run(f"1rank-{p}", [f"train.precision={p}"] + (mb4 if p == "fp16" else []), 1, p) for p in precisions]
    # CUDA graphs (gems.rank.graphs): the one-rank references replay their model (the default); the same runs eager
    # must give their losses (the graphs' exactness), alone and as two replicas (R2 below runs graphed)
    runs.append(Run("1rank-eager", ["train.cuda_graphs=false"], 1))
    if not dry:  # the whole step in the graph (the optimizer's update too: train.graph_optimizer), against the same
        runs.append(Run("1rank-whole-step", ["train.graph_optimizer=true"], 1))  # reference (Adam's rate a tensor)
        # a pipeline's partitions replayed from graphs between its rounds (train.graph_pieces: gems.rank.pieces)
        runs += [Run(f"pieces-{s}-D2-m2", ["parallel.pipeline=2", f"parallel.schedule={s}", "parallel.micro_batches=2",
                                           "train.graph_pieces=true"], 2) for s in ("1f1b", "mast")]
    # graphed against eager bit for bit where every op is deterministic (train.deterministic on both: CosmoFlow's
    # pools take gems's deterministic backward, gems.layers.AvgPool3d); dry, the graph is the CPU's stand-in
    runs += [Run("1rank-deterministic-eager", ["train.deterministic=true", "train.cuda_graphs=false"], 1),
             Run("1rank-deterministic-graphed", ["train.deterministic=true"], 1, env=_stand_in(dry),
                 reference_run="1rank-deterministic-eager", exact=True)]
    # a short lease starts what matters most first (run_matrix starts in this order, none after its budget):
    # the strict mode, the hybrids, the precisions and the controls, then every schedule's grid
    if not dry:  # the strict mode: messages that do not fit NCCL's buffers, one connection a GPU
        runs += [Run(f"strict-{label}", args, n, env=dict(STRICT_NCCL)) for label, args, n in STRICT_POINTS]
    runs.append(Run("1rank-fp32-unet", list(UNET), 1, family="unet"))
    runs += [Run(label, [*UNET, *args], n, env=dict(env), family="unet")
             for label, args, n, env in (UNET_POINTS[:1] if dry else UNET_POINTS)]
    hybrids = [("R2xD2xS2-mast", ["parallel.replicas=2", "parallel.pipeline=2", "parallel.spatial=2",
                                  "parallel.schedule=mast"], 8),
               ("R2xD2xS2-master", ["parallel.replicas=2", "parallel.pipeline=2", "parallel.spatial=2",
                                    "parallel.schedule=master"], 8),
               ("S2", ["parallel.spatial=2"], 2), ("R2", ["parallel.replicas=2"], 2)]
    if dry:
        hybrids = hybrids[2:]
    runs += [Run(label, args, n) for label, args, n in hybrids]
    if not dry:
        for p in ("bf16", "fp16"):
            for name, m in (("1f1b", 2), ("mast", 1)):
                runs.append(Run(f"{name}-D2-m{m}-{p}", ["parallel.pipeline=2", f"parallel.schedule={name}",
                                                        f"parallel.micro_batches={m}", f"train.precision={p}"], 2, p))
    for sched_name in (["1f1b"] if dry else ["1f1b", "gpipe"]):
        runs.append(Run(f"control-{sched_name}-1rank", [], 1, control=sched_name))
        runs.append(Run(f"control-{sched_name}", [], 2, control=sched_name))
    points: list[tuple[str, int, int]] = []
    if dry:
        points = [("1f1b", 2, 2), ("mast", 2, 1)]
    else:  # each schedule's m = 2 first, then the rest of the grid
        grid = [(D, m) for D in (2, 4) for m in (1, 2, 4)]
        grid.sort(key=lambda dm: dm[1] != 2)
        points = [(name, D, m) for D, m in grid for name in registered()]
    for name, D, m in points:
        label, args = f"{name}-D{D}-m{m}", [f"parallel.pipeline={D}", f"parallel.schedule={name}",
                                           f"parallel.micro_batches={m}"]
        try:
            sched = make_schedule(name, D, m)
            if 8 % sched.chunks:
                raise ConfigError("parallel.micro_batches", m, f"a divisor of the batch's 8 samples over {sched.chunks}"
                                  " chunks")
            why = ""
        except ConfigError as e:
            why = str(e)
        runs.append(Run(label, args, D, skipped=why))
    return runs + graphed_points(dry)


#: graphs holding NCCL work (train.graph_collectives, off by default until these run to their end), NCCL's warnings
#: on, each under a limit of its own past gems's: a hang at the capture or the first replay is named by gems's
#: watchdog after the warm-up allowance (its record names the stuck ranks), a teardown's by the rank after the stall
#: allowance; 45 s more for the run's start and the monitor's ticks. One that hangs runs once more with NCCL's graph
#: mixing off, which tells whether eager NCCL calls beside a launched graph are what hangs; gems issues exactly those
#: (eager collectives follow each replay), so a pass there is a pass of that setting only, never of the default
GRAPHED_LIMIT_S = WARMUP_S + STALL_S + 45.0
GRAPHED_ENV = {"NCCL_DEBUG": "WARN"}
GRAPHED_RETRY = {"NCCL_GRAPH_MIXING_SUPPORT": "0"}
#: a graphed point's key: its records are what turn it on by default (summary.json's graph_collectives)
GRAPHED_KEY = "train.graph_collectives=true"


def graphed_points(dry: bool = False) -> list[Run]:
    """The graphed multi-rank points, last in the matrix (a hang there costs no other point its run): R = 2, S = 2
    (its halos in the graph) and R2 x S2, each against the one-rank run; dry, R = 2 through the CPU's stand-in."""
    on = [GRAPHED_KEY]
    points = [("graphed-R2", ["parallel.replicas=2", *on], 2),
              ("graphed-S2", ["parallel.spatial=2", "train.graph_spatial=true", *on], 2),
              ("graphed-R2xS2", ["parallel.replicas=2", "parallel.spatial=2", "train.graph_spatial=true", *on], 4)]
    return [Run(label, args, n, env={**GRAPHED_ENV, **_stand_in(dry)}, limit_s=GRAPHED_LIMIT_S,
                retry_env=dict(GRAPHED_RETRY)) for label, args, n in (points[:1] if dry else points)]


def _stand_in(dry: bool) -> dict[str, str]:
    """A dry run's graphs: the CPU's stand-in for the capture (gems.rank.graphs), where a GPU captures."""
    from gems.rank.graphs import STAND_IN_ENV

    return {STAND_IN_ENV: "1"} if dry else {}


def _command(run: Run, out: Path, dry: bool) -> list[str]:
    if run.control:
        result = out / "runs" / run.label / "losses.json"
        inner = [sys.executable, "-m", "gems.gpucheck", "control", run.control, "--result", str(result)] + \
                (["--dry"] if dry else [])
        if run.ranks == 1:
            return inner
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={run.ranks}",
                f"--master_port={_free_port()}", *inner[1:]]
    return [sys.executable, "-m", "gems.cli", "run", *overrides(run, dry), f"results.dir={out / 'runs' / run.label}",
            f"run_id=gpucheck-{run.label}"]


def overrides(run: Run, dry: bool) -> list[str]:
    """A gems run's configuration: the base's keys, and the run's own (a key the base sets too, the U-Net's
    model.size, takes the run's value)."""
    args: dict[str, str] = {}
    for a in [*_base(dry), *run.args]:
        args[a.split("=", 1)[0]] = a
    return list(args.values())


def _free_port() -> int:
    from gems.bootstrap import free_port

    return free_port()


def _losses(run: Run, out: Path) -> tuple[str, list[float], str]:
    """(status, losses, error) of a finished run, from its record (or the control's losses file)."""
    folder = out / "runs" / run.label
    if run.control:
        f = folder / "losses.json"
        if not f.exists():
            return "failed", [], "no losses written"
        return "ok", [float(v) for v in json.loads(f.read_text())], ""
    from gems.results.table import load_records

    for rec in load_records(folder):
        err = str(rec.get("error") or "")
        return str(rec["status"]), [float(v) for v in rec.get("loss") or []], err.splitlines()[0] if err else ""
    return "failed", [], "no record"


def compare(losses: list[float], reference: list[float]) -> float | None:
    """The largest relative difference of a run's losses from its reference's, step by step (None where the runs
    did not make the same number of steps)."""
    if not losses or len(losses) != len(reference):
        return None
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))


def run_matrix(runs: list[Run], out: Path, dry: bool, budget_s: float, ranks: int,
               limit_s: float | None = None) -> list[Run]:
    """Start the runs in their order (references first), at most ``ranks`` ranks at once, none after ``budget_s``;
    each bounded by ``limit_s`` (default 120 s dry, 150 s on a GPU). Fills in every run's status and
    comparison."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if not dry:
        env["GEMS_TEST_SHARE_GPU"] = "1"
    (out / "logs").mkdir(parents=True, exist_ok=True)
    limit = limit_s if limit_s is not None else (120.0 if dry else 150.0)
    start = time.monotonic()
    todo = [r for r in runs if not r.skipped]
    live: list[tuple[Run, subprocess.Popen[bytes], float, Any]] = []
    while todo or live:
        for item in list(live):
            run, proc, t0, log = item
            mine = run.limit_s if run.limit_s is not None else limit
            over = time.monotonic() - t0 > mine
            if proc.poll() is None and not over:
                continue
            if over and proc.poll() is None:
                _kill(proc)
            log.close()
            live.remove(item)
            run.wall_s = round(time.monotonic() - t0, 1)
            _ended(run, out, proc.returncode, mine if over else None)
            if run.status == "timeout" and run.retry_env and run.setting == "as set":  # once more, the retry's setting
                run.first_try, run.setting = run.error, " ".join(f"{k}={v}" for k, v in run.retry_env.items())
                run.env = {**run.env, **run.retry_env}
                _clear(out / "runs" / run.label)
                todo.insert(0, run)
        busy = sum(r.ranks for r, *_ in live)
        while todo and time.monotonic() - start < budget_s:
            run = todo[0]
            if busy + run.ranks > ranks and live:
                break
            todo.pop(0)
            log = open(out / "logs" / f"{run.label}.txt", "ab")
            proc = subprocess.Popen(_command(run, out, dry), stdout=log, stderr=subprocess.STDOUT,
                                    env={**env, **run.env}, start_new_session=True)
            live.append((run, proc, time.monotonic(), log))
            busy += run.ranks
        if todo and time.monotonic() - start >= budget_s and not live:
            for run in todo:
                run.status = "not run"
                run.error = f"the rig's budget of {budget_s:.0f} s was spent"
            todo = []
        time.sleep(0.2)
    refs = {r.label: r.losses for r in runs if r.status == "ok"}
    for run in runs:
        if run.status == "ok" and run.label != run.reference_label:
            run.reference = refs.get(run.reference_label, [])
            run.max_rel_diff = compare(run.losses, run.reference)
            run.equal = run.max_rel_diff is not None and run.max_rel_diff <= (0.0 if run.exact else
                                                                              TOLERANCE[run.precision])
    return runs


def _ended(run: Run, out: Path, code: int, killed_at: float | None) -> None:
    """A run's status, losses and error once its process ended (``killed_at``: the limit it was killed at). A run
    that wrote a good record and whose ranks then did not end (a rank's teardown past its limit, which names the
    graphs it waits for, or a process the rig killed) is a teardown hang, never a step's timeout."""
    run.status, run.losses, run.error = _losses(run, out)
    hung = _teardown(out / "runs" / run.label)
    if run.status == "ok" and (hung or killed_at is not None):
        run.status = "teardown hang"
        run.error = hung or f"killed after {killed_at:.0f} s with its record written: its ranks did not end, and none " \
                            "named what its teardown waits for"
    elif killed_at is not None:
        run.status, run.error = "timeout", f"killed after {killed_at:.0f} s" + (f"; {run.error}" if run.error else "")
    elif code != 0 and run.status == "ok":
        run.status, run.error = "failed", f"exit status {code}"


def _teardown(folder: Path) -> str:
    """What the ranks of a run under ``folder`` said of a teardown past its limit (gems.worker.teardown_hung: their
    failure reports), or ''."""
    from gems.fault.reports import read_reports

    said = []
    for jd in sorted(folder.glob(".jobs/*")):
        said += [str(r.get("teardown") or r["error"]) for r in read_reports(jd)
                 if r.get("kind") == "teardown" or r.get("teardown")]
    return "; ".join(dict.fromkeys(said))


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """A run past its limit, with every process it started (its ranks: a session of their own)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    proc.wait()


def _clear(folder: Path) -> None:
    """A hung try's record (the launcher may have written a failed one) goes before the retry writes its own."""
    import shutil

    if folder.exists():
        shutil.rmtree(folder)


def _machine() -> dict[str, Any]:
    import torch

    from gems.results.record import git_commit

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    nccl = ".".join(str(v) for v in torch.cuda.nccl.version()) if torch.cuda.is_available() else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl, "gpu": gpu,
            "cpus": os.cpu_count(), "gems_commit": git_commit()}


def write_summary(runs: list[Run], out: Path, dry: bool, wall_s: float) -> dict[str, Any]:
    """``summary.json`` and ``summary.md`` in ``out``; returns the summary."""
    started = [r for r in runs if r.status != "not run" and not r.skipped]
    compared = [r for r in started if r.label != r.reference_label]
    summary: dict[str, Any] = {"mode": "dry (CPU, gloo)" if dry else "GPU (ranks share it: GEMS_TEST_SHARE_GPU)",
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": round(wall_s, 1), "machine": _machine(),
               "tolerance": TOLERANCE, "base": _base(dry),
               "counts": {"runs": len(runs), "skipped": sum(1 for r in runs if r.skipped),
                          "not_run": sum(1 for r in runs if r.status == "not run" and not r.skipped),
                          "ok": sum(1 for r in started if r.status == "ok"),
                          # a pass under the retry's setting is that setting's, not the run's as set
                          "equal": sum(1 for r in compared if r.equal and r.setting == "as set"),
                          "equal_other_setting": sum(1 for r in compared if r.equal and r.setting != "as set"),
                          "compared": len(compared)},
               "graph_collectives": graph_collectives(runs, dry),
               "runs": [asdict(r) for r in runs]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    rows = ["| run | ranks | precision | status | wall s | max rel. diff | equal | note |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        diff = f"{r.max_rel_diff:.1e}" if r.max_rel_diff is not None else ""
        note = (r.skipped or r.error).replace("|", "/")[:120]
        if r.first_try:  # retried after a hang: which setting the result is from
            note = f"ran with {r.setting} after a hang ({r.first_try[:60]}); {note}"[:160]
        status = "skipped" if r.skipped else r.status if r.setting == "as set" else f"{r.status} ({r.setting})"
        rows.append(f"| {r.label} | {r.ranks} | {r.precision} | {status} | "
                    f"{r.wall_s if r.wall_s is not None else ''} | {diff} | "
                    f"{'' if r.equal is None else ('yes' if r.equal else 'NO')} | {note} |")
    c = summary["counts"]
    head = (f"# gems on one GPU, every rank sharing it ({summary['mode']})\n\n{summary['date']}, "
            f"{summary['machine']}, {summary['wall_s']} s. {c['equal']} of {c['compared']} runs equal to their "
            f"one-rank reference; {c['skipped']} skipped (refused combinations), {c['not_run']} not run.\n\n"
            f"train.graph_collectives by default: {summary['graph_collectives']['verdict']}\n\n")
    (out / "summary.md").write_text(head + "\n".join(rows) + "\n")
    return summary


def graph_collectives(runs: list[Run], dry: bool = False) -> dict[str, Any]:
    """What the graphed points say of turning ``train.graph_collectives`` on by default: only a point that ran as
    set (no retry's setting), ended (no teardown hang) and equalled its reference counts; the verdict is yes where
    every one does, on a GPU (``dry``: the CPU's stand-in, gloo's rules, says nothing of NCCL's)."""
    points = [r for r in runs if GRAPHED_KEY in r.args]
    passed = [r.label for r in points if r.status == "ok" and r.equal and r.setting == "as set"]
    others = [f"{r.label} {r.status}" + (f" under {r.setting}" if r.setting != "as set" else "")
              for r in points if r.label not in passed]
    turn_on = bool(points) and not others and not dry
    verdict = ("no graphed point ran" if not points else f"no ({', '.join(others)})" if others else
               "not from a dry run (the CPU's stand-in, over gloo): every graphed point passed its plumbing" if dry else
               "yes: every graphed point ran as set to its end, equal to its reference")
    return {"turn_on": turn_on, "passed": passed, "verdict": verdict}


# ---- the control: torch.distributed.pipelining on the same rig -------------------------------------------
def control(schedule: str, result: Path, dry: bool) -> None:
    """Train gems's default CosmoFlow module (dropout off: torch's stages know no per-sample masks) with
    ``torch.distributed.pipelining``'s ``Schedule1F1B`` or ``ScheduleGPipe`` over the ranks torchrun started,
    cut in two halves, 4 micro-batches, SGD; or, as one rank, the same steps whole: the losses to ``result``."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from gems.config import compose, section
    from gems.models import build_model

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available() and not dry
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    overrides = ["model.dropout=0"] + (["model.size=32", "model.width=0.25"] if dry else [])
    torch.manual_seed(0)
    seq = build_model(section(compose(overrides), "model")).module.to(device)
    size = 32 if dry else 64
    B, steps, mbs = 8, 2 if dry else 4, 4
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(B, 4, size, size, size, generator=g), torch.randn(B, 4, generator=g)) for _ in range(steps)]
    losses: list[float] = []
    if world == 1:
        opt = torch.optim.SGD(seq.parameters(), lr=1e-3)
        for x, y in batches:
            opt.zero_grad()
            loss = F.mse_loss(seq(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
            losses.append(float(loss))
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from gems.bootstrap import SHARE_GPU_NCCL, sharing_gpu

        if cuda and sharing_gpu():
            os.environ["NCCL_HOSTID"] = f"gems-test-rank{rank}"
            for k, v in SHARE_GPU_NCCL.items():
                os.environ.setdefault(k, v)
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        half = len(seq) // 2
        part = seq[:half] if rank == 0 else seq[half:]
        stage = PipelineStage(part, rank, world, device)
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        sched = kind(stage, n_microbatches=mbs, loss_fn=lambda out, tgt: F.mse_loss(out, tgt))
        opt = torch.optim.SGD(part.parameters(), lr=1e-3)
        for x, y in batches:
            opt.zero_grad()
            mb: list[torch.Tensor] = []
            if rank == 0:
                sched.step(x.to(device))
            else:
                sched.step(target=y.to(device), losses=mb)
            opt.step()
            if rank == world - 1:
                losses.append(float(torch.stack(mb).mean()))
        dist.destroy_process_group()
        if rank != world - 1:
            return
    result.parent.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(losses))


def main(argv: list[str] | None = None) -> int:
    """The rig's command. It writes ``DIR/summary.json`` (one entry a run: status, losses, the reference's, the
    largest relative difference, the verdict), ``DIR/summary.md`` (the table) and ``DIR/logs/``. Exit status 0
    when every run of the matrix (after ``--only``) ran and finished equal to its reference, else 1: a point left
    for the budget counts, so a partial matrix never reads as a pass."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "control":
        p = argparse.ArgumentParser(prog="python -m gems.gpucheck control")
        p.add_argument("schedule", choices=("1f1b", "gpipe"))
        p.add_argument("--result", type=Path, required=True)
        p.add_argument("--dry", action="store_true")
        a = p.parse_args(argv[1:])
        control(a.schedule, a.result, a.dry)
        return 0
    p = argparse.ArgumentParser(prog="python -m gems.gpucheck", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry", action="store_true", help="check the plumbing on CPU (gloo, a few runs)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results/gpu/check")))
    p.add_argument("--budget", type=float, default=330.0, help="start no run after this many seconds")
    p.add_argument("--limit", type=float, default=None, help="seconds a run may take (default 150, dry 120)")
    p.add_argument("--ranks", type=int, default=None, help="ranks at once (default: the machine's cores, 16 at most)")
    p.add_argument("--only", default="", help="run only the points whose label contains one of these comma-separated "
                   "texts (and their references)")
    a = p.parse_args(argv)
    import torch

    if not a.dry and not torch.cuda.is_available():
        print("gems.gpucheck: --dry: no GPU on this machine (the rig runs the matrix on one GPU)", file=sys.stderr)
        return 2
    runs = matrix(a.dry)
    if a.only:
        texts = [t for t in a.only.split(",") if t]
        keep = {r.label for r in runs if any(t in r.label for t in texts)}
        if not keep:
            print(f"gems.gpucheck: --only={a.only}: no point's label holds it (labels such as 1f1b-D2-m2, "
                  "strict-S2, R2xD2xS2-mast)", file=sys.stderr)
            return 2
        keep |= {r.reference_label for r in runs if r.label in keep}
        runs = [r for r in runs if r.label in keep]
    ranks = a.ranks or min(16, os.cpu_count() or 2)
    t0 = time.monotonic()
    run_matrix(runs, a.out, a.dry, a.budget, max(ranks, max(r.ranks for r in runs)), a.limit)
    s = write_summary(runs, a.out, a.dry, time.monotonic() - t0)
    print((a.out / "summary.md").read_text())
    c = s["counts"]
    return 0 if c["equal"] == c["compared"] and c["not_run"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
