"""The ``gems`` command: run, sweep, results, render, plan, data, nodes, bench, each composing ``conf/config.yaml`` with
the Hydra overrides given. Exit status: 0 done; 2 bad input (one line naming the key, the value and what would work,
before anything is submitted or written); 1 a run that failed after it started.
"""
from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path
from typing import Any, Callable

USAGE = """usage: gems COMMAND [OVERRIDES...]

commands:
  run [OVERRIDES]        one training job (default: small CosmoFlow on this machine)
  sweep [OVERRIDES]      one job per combination of comma-separated values (a=1,2 b=x,y),
                         or the sweep of +experiment=NAME; then the table and plot
  sweep ... --detach     on Slurm: submit every point, write the manifest, return at once
  status [SWEEP]         each point's state (done, failed and why, pending, running)
  cancel SWEEP           cancel the points of a study that have not finished
  results [DIR]          aggregate records under DIR (default results/) into table.md,
                         table.csv and scaling.png per study, beside the records
  results --compare A B  two studies side by side, matched by world size, with ratios
  render [OVERRIDES]     print the sbatch script this configuration would submit
  eval PATH [OVERRIDES]  evaluate a trained model (results/<run_id>.model.pt or a checkpoint) on a dataset,
                         on any mesh: a record, each sample's prediction, one line of figures
  plan [OVERRIDES]       memory plan per rank without starting the world
  data synth [OVERRIDES] write a synthetic HDF5 dataset (data.path, data.num_samples; data.kind=cosmology:
                         universes, data.path and data.val_path; data.kind=segmentation: CT volumes with labels)
  data convert [OVERRIDES] write MLPerf's TFRecords (or LiTS's .nii.gz, a Decathlon task) at data.path into a
                         layout read by position, at data.out (resumable; data.workers processes or a Slurm job)
  data check [OVERRIDES] read every file of data.path (and data.val_path) whole, as a run would: each bad one
                         named (exit 2); data.workers processes or a Slurm job
  nodes check [OVERRIDES] every GPU of this node (or of an allocation's nodes: cluster=..., one task a node)
                         checked through NVML: ECC, retired pages, row remaps, other jobs' memory, throttling
                         at idle, PCIe, the driver; each failure named (exit 2)
  bench NAME             side-by-side benchmark: overhead, spatial, pipeline, plan, data, checkpoint, step, search,
                         telemetry; calibrate (the GPU's rates for gems plan)

overrides: key=value (train.steps=10), group=option (model=unet3d cluster=local_slurm),
           +experiment=NAME (see conf/experiment/). `gems run --help` lists every key with its default
           and meaning; `gems run [OVERRIDES] --cfg job` prints the composed configuration.
"""


def _err(msg: str) -> None:
    print(f"gems: error: {msg}", file=sys.stderr, flush=True)


#: the commands that take a configuration (Hydra overrides)
CONFIGURED = ("run", "sweep", "plan", "render")


#: the commands that compose a configuration: the registries that own keys' values and group options are loaded
#: first (gems.config.owned, gems.config.offered)
COMPOSING = (*CONFIGURED, "eval", "data", "nodes", "bench")


def load_registries() -> None:
    """Import the registries above the configuration that hand it keys' values and group options: the schedules,
    the data's symmetries, the models (a model registered without a YAML is composed from its registration)."""
    import gems.data.augment  # noqa: F401
    import gems.pipeline.schedules  # noqa: F401
    from gems.data.layouts import registered as layouts
    from gems.models.registry import registered as models

    layouts()
    models()


def _print_help(cmd: str, rest: list[str]) -> None:
    if cmd in CONFIGURED:
        from gems.config import help_text

        load_registries()

        print(help_text(cmd, [a for a in rest if a not in ("-h", "--help")]))
    else:
        print(USAGE)


def _print_job(rest: list[str]) -> int:
    """``--cfg job``: the composed configuration, as Hydra prints it."""
    from gems.config import compose, to_yaml
    from gems.errors import ConfigError

    i = rest.index("--cfg")
    what = rest[i + 1] if i + 1 < len(rest) else "job"
    if what != "job":
        _err(f"--cfg={what}: expected --cfg job")
        return 2
    try:
        print(to_yaml(compose([a for a in rest[:i] + rest[i + 2:]], check=False)), end="")
    except ConfigError as e:
        _err(str(e))
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    from gems.errors import Cancelled, ConfigError, RunError

    if argv is None:  # the command line's own process (the console script, python -m gems.cli)
        import gems.launch

        gems.launch.COMMAND_LINE = True
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if "-h" in rest or "--help" in rest:
        _print_help(cmd, rest)
        return 0
    if cmd in COMPOSING:
        load_registries()
    if cmd in CONFIGURED and "--cfg" in rest:  # as Hydra users expect: the composed job
        return _print_job(rest)
    if cmd in CONFIGURED:
        try:
            from gems.prepare import one_value_per_key

            one_value_per_key(rest)
        except ConfigError as e:
            _err(str(e))
            return 2
    commands: dict[str, Callable[[list[str]], int]] = {
        "run": cmd_run, "eval": cmd_eval, "sweep": cmd_sweep, "results": cmd_results, "render": cmd_render,
        "plan": cmd_plan, "data": cmd_data, "nodes": cmd_nodes, "bench": cmd_bench, "status": cmd_status,
        "cancel": cmd_cancel,
    }
    if cmd not in commands:
        _err(f"command={cmd}: expected one of {', '.join(commands)}")
        return 2
    try:
        return commands[cmd](rest)
    except ConfigError as e:
        _err(str(e))
        return 2
    except Cancelled as e:
        _err(f"{e}{': ' + e.detail if e.detail else ''}")
        return 128 + e.signum
    except RunError as e:
        _err(str(e))
        return 1
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except Exception as e:  # a bug, not bad input: one line, the traceback on request
        import os
        import traceback

        if os.environ.get("GEMS_DEBUG"):
            traceback.print_exc()
        _err(f"internal error in `gems {cmd}`: {type(e).__name__}: {e} (GEMS_DEBUG=1 shows the traceback)")
        return 1


# ---------------------------------------------------------------------------- run
def launch_one(cfg: Any, quiet: bool = False) -> dict[str, Any]:
    from gems.launch.base import launcher_for

    launcher = launcher_for(cfg)
    if quiet or launcher.shows_progress:
        return launcher.launch(cfg)
    from rich.console import Console

    console = Console(stderr=True)
    from gems.config import section
    from gems.prepare import run_steps

    steps = StepProgress(run_steps(cfg), section(cfg, "cluster"))
    if not console.is_terminal:  # a log or a pipe: a plain line now and then, so a long run is never silent
        return launcher.launch(cfg, on_progress=lambda s: steps.line(
            s, lambda t: print(f"gems: {cfg.run_id}: {t}", file=sys.stderr, flush=True)))
    with console.status(f"[bold]{cfg.run_id}[/]: starting") as status:
        return launcher.launch(cfg, on_progress=lambda s: steps.line(
            s, lambda t: status.update(f"[bold]{cfg.run_id}[/]: {t}"), every_s=0.0,
            warn=lambda t: console.print(f"gems: warning: {t}", markup=False, highlight=False)))


class StepProgress:
    """Turns rank 0's step lines ("step 3/6 0.812 s loss 0.29") into progress with an estimate of the time
    left; ``line`` passes a new text on at most every ``every_s`` seconds (a new step, or the first line).
    Given the ``cluster`` section, it warns once, as soon as five steps give a pace, when the run would end
    after the launcher stops waiting for it (``cluster.wait_s``), and says what gives it room."""

    def __init__(self, total: int, cluster: Any = None) -> None:
        self.total, self.last, self.shown_at = total, "", 0.0
        self.times: list[float] = []
        self.cluster, self.started, self.warned = cluster, time.monotonic(), False
        self.seen: tuple[float, int] | None = None  # (when, step) of the first step line

    def line(self, text: str, show: Callable[[str], None], every_s: float = 10.0,
             warn: Callable[[str], None] | None = None) -> None:
        import re

        if text == self.last:
            return
        self.last = text
        m = re.match(r"step (\d+)/(\d+) ([0-9.]+) s", text)
        out, now = text, time.monotonic()
        if m:
            done, total, dt = int(m.group(1)), int(m.group(2)), float(m.group(3))
            self.times.append(dt)
            recent = sorted(self.times[-5:])[len(self.times[-5:]) // 2]
            left = (total - done) * recent
            out = f"{text}; about {_duration(left)} left" if done < total else text
            self.seen = self.seen or (now, done)  # the pace by the wall clock: evaluations and waits included
            t0, done0 = self.seen
            if self.cluster is not None and not self.warned and len(self.times) >= 5 and done - done0 >= 3:
                need = now - self.started + (total - done) * (now - t0) / (done - done0)
                if need > self.cluster.wait_s():
                    self.warned = True
                    say = warn or (lambda t: print(f"gems: warning: {t}", file=sys.stderr, flush=True))
                    say(f"at this pace the run takes about {_duration(need)}, longer than the "
                        f"{_duration(self.cluster.wait_s())} the launcher waits ({self.cluster.wait_key()}): it "
                        f"will be ended unfinished; {self.cluster.room_for(need)} gives it room")
        if now - self.shown_at >= every_s or not m:
            self.shown_at = now
            show(out)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def print_rows(records: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from gems.results.table import ENERGY_COLUMNS, columns, rows_for

    cols: tuple[str, ...] = ("name", "status", "world", "mesh", "schedule", "batch", "samples/s", "samples/s/gpu",
                             "step_s", "TFLOP/s/gpu", "peak_mem_MiB", "final_loss")
    if any((r.get("hardware") or {}).get("flops_fraction") is not None for r in records):
        cols += ("flops_frac", "bytes_frac")
    rows = rows_for(records, sweep=False)
    cols += tuple(c for c in ENERGY_COLUMNS if any(isinstance(row.get(c), float) for row in rows))  # telemetry
    if any(isinstance(row.get("val_mae"), float) for row in rows):  # a regression's error; a segmentation's Dice
        cols += ("val_mae",)
    cols += tuple(c for c in columns(rows) if c.startswith("dice_"))
    if any(r.get("target") for r in records):
        cols += ("time_to_target_s", "target_reached")
    cols += ("note",)
    t = Table(show_header=True, header_style="bold")
    for c in cols:
        t.add_column(c, min_width=len(c) if c.startswith("dice_") else None)  # a class's name whole
    for row in rows:
        if row.get("error"):  # a failed run says why where the notes go, not in the loss's column
            row["note"] = f"{row['note']}; {row['error']}" if row["note"] else row["error"]
        t.add_row(*[f"{row.get(c, ''):.4g}" if isinstance(row.get(c), float) else str(row.get(c, "")) for c in cols])
    Console(width=None if sys.stdout.isatty() else 200).print(t)


def failed_status(record: dict[str, Any]) -> int:
    """The exit status of a failed run: 2 where a rank met bad input after the start (a ConfigError: a data file
    that changed under the run, or one whose headers no check reads before the launch) or a node failed its health
    check before it (gems/telemetry/health.py), else 1."""
    failure = record.get("failure") or {}
    return 2 if failure.get("exception") == "ConfigError" or failure.get("kind") == "bad_node" else 1


def cmd_run(overrides: list[str]) -> int:
    from gems.config import compose
    from gems.launch.base import prestart
    from gems.prepare import prepare

    cfg = compose(overrides)
    prestart(cfg)  # the ranks' server, before the checks run torch
    cfg = prepare(cfg)
    record = launch_one(cfg)
    print_rows([record])
    from gems.results.record import record_path

    print(f"record: {record_path(cfg)}")
    if record.get("status") != "ok":
        _err(f"run {cfg.run_id} failed: {record.get('error')}")
        return failed_status(record)
    for note in record.get("notes") or []:  # what the run decided or measured thinly (the record keeps them too)
        print(f"gems: note: {note}", file=sys.stderr, flush=True)
    if record.get("diverged"):
        steps = ", ".join(str(s) for s in record.get("nonfinite_steps", [])[:8])
        print(f"gems: warning: run {cfg.run_id} diverged (non-finite loss at step {steps}; train.on_nonfinite=warn): "
              "its throughput is no data point", file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------------------- eval
def cmd_eval(args: list[str]) -> int:
    """``gems eval PATH [OVERRIDES]``: the model of a model file or checkpoint, launched like ``gems run`` (any mesh,
    ``cluster=`` Slurm included), evaluated once (gems.rank.evaluate)."""
    from gems.config import compose
    from gems.errors import ConfigError
    from gems.prepare import eval_config, prepare

    if not args or "=" in args[0]:
        raise ConfigError("eval", args[0] if args else "", "gems eval PATH [OVERRIDES]: a model file "
                          "(results/<run_id>.model.pt) or a checkpoint folder first")
    path, overrides = args[0], args[1:]
    from gems.prepare import one_value_per_key

    one_value_per_key(overrides)
    given = compose(overrides)
    from gems.launch.base import prestart

    prestart(given)  # the ranks' server, before the checks run torch
    cfg = prepare(eval_config(path, overrides, given))
    record = launch_one(cfg)
    from gems.results.record import record_path

    if record.get("status") != "ok":
        _err(f"eval {cfg.run_id} failed: {record.get('error')}")
        return 1
    from gems.rank.loss import described

    figures = record.get("evaluation") or {}
    shown = described({k: v for k, v in figures.items() if k != "seconds"}, record.get("classes"))
    count = figures.get("samples", figures.get("cells"))
    print(f"gems eval: {path}: {shown} over {count} {'cells' if 'cells' in figures else 'samples'} on "
          f"{record['world_size']} rank(s); record: {record_path(cfg)}", flush=True)
    return 0


# ---------------------------------------------------------------------------- sweep
def expand_sweep(overrides: list[str]) -> tuple[list[list[str]], dict[str, Any]]:
    """Split overrides into fixed ones and sweeps; return every combination (Hydra syntax)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from gems.config import compose
    from gems.errors import ConfigError

    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(overrides)
    except Exception as e:
        raise ConfigError("override", " ".join(overrides), f"Hydra override syntax ({str(e).splitlines()[0]})") from None
    # sweeps defined by an experiment: hydra.sweeper.params
    base = [str(o.input_line) for o in parsed if not o.is_sweep_override()]
    hcfg = compose(base, return_hydra_config=True, check=False)  # each combination is checked below
    exp_params = dict(hcfg.hydra.sweeper.get("params") or {})
    given = {o.get_key_element(): o for o in parsed}
    axes: list[list[str]] = []
    for key, spec in exp_params.items():
        if key in given:
            continue
        ov = parser.parse_override(f"{key}={spec}")
        axes.append([f"{key}={v}" for v in ov.sweep_string_iterator()] if ov.is_sweep_override() else [f"{key}={spec}"])
    for o in parsed:
        if o.is_sweep_override():
            axes.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
    combos = [base + list(c) for c in itertools.product(*axes)] if axes else [base]
    meta = {"experiment": next((o.value() for o in parsed if o.get_key_element() in ("+experiment", "experiment")), None),
            "base": base}
    return combos, meta


def cmd_sweep(args: list[str]) -> int:
    """Every point of a study (gems/study.py): checked first, the done ones skipped, run here or submitted."""
    from gems import study
    from gems.errors import Cancelled

    detach = "--detach" in args
    combos, meta = expand_sweep([a for a in args if a != "--detach"])
    plan = study.plan(combos, meta["base"], meta["experiment"], detach)
    print(study.describe(plan), flush=True)
    results_dir = str(plan.folder.parent)
    to_run = plan.to_run
    records: list[dict[str, Any]] = []
    study.save(plan)  # the manifest before the first job: a study interrupted now is still found
    if to_run and to_run[0].cfg.cluster.launcher == "slurm":
        from gems.launch import slurm, watch
        from gems.launch.resubmit import retry_bad_nodes

        runs = slurm.submit_all([q.cfg for q in to_run])

        def submitted(*_: Any) -> dict[tuple[str, int], dict[str, Any]]:
            return {(q.point, q.repeat): {"job_id": r.job_id, "job_dir": str(r.job_dir), "run_id": r.run_id,
                                          "resubmitted": r.resubmitted} for q, r in zip(to_run, runs)}

        saved = submitted()
        study.save(plan, saved)

        def resaved(*_: Any) -> None:  # a job submitted again (cluster.exclude_bad_nodes): the manifest follows it
            nonlocal saved
            if submitted() != saved:
                saved = submitted()
                study.save(plan, saved)
        shares = _shared_cores_note(to_run)
        if shares:
            print(f"gems: note: {shares}", file=sys.stderr, flush=True)
        if plan.detach:
            print(f"submitted {len(runs)} job(s) ({', '.join(r.job_id for r in runs)}); "
                  + study.follow_text(plan.sweep, results_dir), flush=True)
            return 0
        try:
            outcomes = watch.wait(runs, on_cancel="leave", retry=retry_bad_nodes, on_update=resaved)
        except Cancelled as c:
            c.detail = f"{c.detail}; {study.follow_text(plan.sweep, results_dir)}"
            raise
        records = [slurm.record_of(r, o) for r, o in zip(runs, outcomes)]
    else:
        for i, q in enumerate(to_run):
            print(f"[{i + 1}/{len(to_run)}] {q.cfg.run_id} ({q.point}{f', repeat {q.repeat}' if q.repeat else ''})",
                  flush=True)
            records.append(launch_one(q.cfg))
    if records:
        print_rows(records)
    return _collect(plan.folder, only=plan.sweep, ran=records)


def _shared_cores_note(points: list[Any]) -> str:
    """On the Slurm test cluster every point runs at once on the same host's cores: say so."""
    cfg = points[0].cfg
    if cfg.cluster.name != "local_slurm" or len(points) < 2:
        return ""
    return ("the points of this study run at once on the test cluster, whose nodes share this host's cores: "
            "their timings measure contention, not scaling (run the points one by one for timings)")


def _collect(root: Path, only: str | None = None, ran: list[dict[str, Any]] | None = None) -> int:
    """Write and print the tables of ``root``; exit 1 when a reference was missed, or (a sweep, ``ran`` given)
    when a run failed or a point of the study is failed (also one results.rerun=none left alone)."""
    from gems.results.table import markdown, write_studies

    studies, skipped = write_studies(root, only_sweep=only)
    for path, why in skipped[:5]:
        print(f"gems: warning: skipped {path}: {why}", file=sys.stderr)
    if len(skipped) > 5:
        print(f"gems: warning: skipped {len(skipped) - 5} more unreadable record(s)", file=sys.stderr)
    bad_refs = []
    for s in studies:
        if ran is None:
            print(markdown(s.rows, s.title))
        print(f"table: {s.folder / 'table.md'}" + (f"\nplot: {s.folder / 'scaling.png'}" if s.sweep else ""))
        bad_refs += s.failed_references()
    failed = [r for r in (ran or []) if r.get("status") != "ok"]
    if failed:
        _err(f"{len(failed)} of {len(ran or [])} job(s) failed: " +
             "; ".join(f"{r['run_id']}: {r.get('error')}" for r in failed))
    holes = [f"{row['name']} ({row['status']})" for s in studies for row in s.rows
             if ran is not None and s.sweep is not None and row["status"] in ("failed", "diverged")] if not failed else []
    if holes:
        _err(f"the study has {len(holes)} failed point(s) that were not run again: {', '.join(holes)} "
             "(results.rerun=failed runs them)")
    if bad_refs:
        _err(f"{len(bad_refs)} point(s) missed their reference: " + "; ".join(bad_refs))
    return 1 if failed or holes or bad_refs else 0


# ---------------------------------------------------------------------------- results, render, plan, data, bench
def cmd_results(args: list[str]) -> int:
    """``gems results [DIR]`` (tables beside the records) or ``gems results --compare A B`` (two studies)."""
    from gems.errors import ConfigError
    from gems.paths import readable_dir, writable_dir

    if args and args[0] == "--compare":
        if len(args) != 3:
            raise ConfigError("results --compare", " ".join(args[1:]), "two studies: `gems results --compare A B` "
                              "(sweep folders, or sweep names under results/)")
        from gems.results.compare import compare

        return compare(args[1], args[2])
    if len(args) > 1:
        raise ConfigError("results", " ".join(args), "at most one folder: `gems results [DIR]`")
    if args and ("=" in args[0] or args[0].startswith("-")):
        raise ConfigError("results", args[0], "a folder of records, e.g. `gems results results/` (no overrides)")
    root = readable_dir("results DIR", args[0] if args else "results", "a folder holding gems records")
    writable_dir("results DIR", root, "a folder gems can write the tables into")
    return _collect(root)


def cmd_status(args: list[str]) -> int:
    """``gems status [SWEEP] [results.dir=DIR]``: each point's state."""
    from gems import study

    name, results_dir = _study_args("status", args)
    for folder in study.find(name, results_dir):
        study.print_status(folder)
    return 0


def cmd_cancel(args: list[str]) -> int:
    """``gems cancel SWEEP [results.dir=DIR]``: cancel the jobs of the study that have not finished."""
    from gems import study
    from gems.errors import ConfigError

    name, results_dir = _study_args("cancel", args)
    if not name:
        raise ConfigError("cancel", "", "a sweep: `gems cancel SWEEP` (see `gems status`)")
    (folder,) = study.find(name, results_dir)
    ids = study.cancel(folder)
    print(f"cancelled Slurm job(s) {', '.join(ids)} of {folder.name}" if ids
          else f"{folder.name}: no job left to cancel")
    return 0


def _study_args(cmd: str, args: list[str]) -> tuple[str | None, str]:
    from gems.errors import ConfigError

    name, results_dir = None, "results"
    for a in args:
        if a.startswith("results.dir="):
            results_dir = a.split("=", 1)[1]
        elif "=" in a or a.startswith("-") or name is not None:
            raise ConfigError(cmd, a, f"`gems {cmd} [SWEEP] [results.dir=DIR]`")
        else:
            name = a
    return name, results_dir


def cmd_render(overrides: list[str]) -> int:
    """The sbatch script of a run; of every point when the overrides or the experiment sweep (one each, named)."""
    from gems.config import compose
    from gems.launch.render import write_job
    from gems.results.manifest import point_name

    combos, meta = expand_sweep(overrides)
    from gems.prepare import prepare

    cfgs = [prepare(compose(c)) for c in combos]  # every point checked before any script is written
    if len(cfgs) == 1:
        script = write_job(cfgs[0])
        print(script.read_text(), end="")
        print(f"# written: {script} (submit it with: sbatch {script})", file=sys.stderr)
        return 0
    print(f"# {len(cfgs)} points{' of ' + meta['experiment'] if meta['experiment'] else ''}: one script each "
          "(gems sweep submits them all and collects the study)", file=sys.stderr)
    for combo, cfg in zip(combos, cfgs):
        script = write_job(cfg)
        print(f"{point_name(combo, meta['base'])}: {script}")
    return 0


def cmd_plan(overrides: list[str]) -> int:
    from gems.errors import ConfigError

    try:
        from gems.plan import plan_main
    except ImportError:
        raise ConfigError("command", "plan",
                          "run, sweep, results, render, data synth or bench (the memory planner is not built yet)") from None
    from gems.config import compose

    combos, meta = expand_sweep(overrides)
    if len(combos) > 1 or meta["experiment"]:  # a study: every point predicted, one table and plot
        from gems.plan.curves import predict_study

        return predict_study(combos, meta["experiment"])
    cfg = compose(overrides)
    from gems.config import reads_files

    if reads_files(cfg.data):  # a task's classes and channels, as gems run takes them (gems.data.task)
        from gems.data.task import from_the_data

        for note in from_the_data(cfg):
            print(f"gems: note: {note}", file=sys.stderr, flush=True)
    return int(plan_main(cfg, overrides) or 0)


def cmd_data(args: list[str]) -> int:
    from gems.errors import ConfigError

    if not args or args[0] not in ("synth", "baseline", "convert", "check"):
        raise ConfigError("data", args[0] if args else "", "`gems data synth data.path=DIR [data.num_samples=N] "
                          "[model.size=N]`, `gems data convert data.path=DIR data.out=DIR`, `gems data check "
                          "data.path=DIR [data.val_path=DIR]` or `gems data baseline data.path=DIR data.val_path=DIR "
                          "results.dir=DIR`")
    from gems.config import compose
    from gems.data.synth import synth_main

    overrides = args[1:] if any(a.startswith("data=") for a in args[1:]) else ["data=files", *args[1:]]
    cfg = compose(overrides, check=False)  # a dataset needs no mesh
    if args[0] == "baseline":  # the power-spectrum reference of the sample-size study (gems/data/spectrum.py)
        from gems.data.spectrum import write_baseline

        write_baseline(cfg)
        return 0
    if args[0] == "convert":  # a published layout read by position after it (gems/data/convert.py)
        from gems.data.convert import convert_main
        from gems.launch.tasks import run_tasks as convert_tasks

        convert_main(cfg, job=convert_tasks)
        return 0
    if args[0] == "check":  # every file read whole before a long run (gems/data/check.py)
        from gems.data.check import check_main
        from gems.launch.tasks import run_tasks as check_tasks

        return check_main(cfg, job=check_tasks, classes=_model(cfg).classes)
    if cfg.data.kind == "segmentation":  # CT volumes with labels in LiTS's layout (gems/data/segmentation.py)
        from gems.data.segmentation import synth_segmentation

        synth_segmentation(cfg)
        return 0
    if cfg.data.kind == "cosmology":
        from gems.data.universes import synth_universes
        from gems.launch.tasks import run_tasks

        synth_universes(cfg, job=run_tasks)
    else:
        synth_main(cfg, _model(cfg).input_shape)  # the samples the model takes
    return 0


def cmd_nodes(args: list[str]) -> int:
    """``gems nodes check [OVERRIDES]``: this node's GPUs, or every node of a Slurm job's (gems/telemetry/health.py)."""
    from gems.config import compose
    from gems.errors import ConfigError

    if not args or args[0] != "check":
        raise ConfigError("nodes", args[0] if args else "", "`gems nodes check [OVERRIDES]` (cluster=... checks the "
                          "nodes of a Slurm job, one task a node; health.KEY=false skips a check)")
    from gems.launch.tasks import run_tasks
    from gems.telemetry.health import nodes_main

    return nodes_main(compose(args[1:], check=False), job=run_tasks)  # a check needs no mesh


def _model(cfg: Any) -> Any:
    """The configured model's spec (gems.models.build_model)."""
    from gems.config import section
    from gems.models import build_model

    return build_model(section(cfg, "model"))


BENCHES = {
    "overhead": ("gems.bench.overhead", "bench_overhead"),
    "spatial": ("gems.bench.spatial", "bench_spatial"),
    "pipeline": ("gems.bench.pipeline", "bench_pipeline"),
    "plan": ("gems.bench.plan", "bench_plan"),
    "data": ("gems.bench.data", "bench_data"),
    "checkpoint": ("gems.bench.checkpoint", "bench_checkpoint"),
    "step": ("gems.bench.step", "bench_step"),
    "calibrate": ("gems.bench.calibrate", "bench_calibrate"),
    "search": ("gems.bench.search", "bench_search"),
    "telemetry": ("gems.bench.telemetry", "bench_telemetry"),
}
#: the benchmarks that take Hydra overrides (the model, the batch, the precision ...) beside out=DIR
BENCH_OVERRIDES = {"calibrate", "overhead", "step"}


def _has_gpu() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def cmd_bench(args: list[str]) -> int:
    import importlib

    from gems.errors import ConfigError

    if not args or args[0] not in BENCHES:
        raise ConfigError("bench", args[0] if args else "", "one of " + ", ".join(BENCHES))
    mod, fn = BENCHES[args[0]]
    from gems.paths import writable_dir

    out_dir = Path("results") / ("gpu" if args[0] == "calibrate" or (args[0] in ("step", "telemetry") and _has_gpu())
                                 else "bench")
    overrides: list[str] = []
    for a in args[1:]:
        if a.startswith("out="):
            out_dir = Path(a.split("=", 1)[1])
        elif args[0] in BENCH_OVERRIDES and "=" in a:
            overrides.append(a)
        else:
            raise ConfigError("bench option", a, "out=DIR" + (" or overrides such as model.size=128"
                                                              if args[0] in BENCH_OVERRIDES else ""))
    writable_dir("out", out_dir, "a folder for the benchmark's table")
    module = importlib.import_module(mod)
    if hasattr(module, "check_overrides"):  # refused before anything is written
        module.check_overrides(overrides)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = getattr(module, fn)
    table = run(out_dir, overrides) if args[0] in BENCH_OVERRIDES else run(out_dir)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
