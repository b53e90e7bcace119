"""What runs before anything is launched, for every command that launches (gems run, sweep, render): the run id,
the files it reads and folders it writes, and every check that needs the model but not the world, so that bad
input stops with exit 2 before a job is written or queued (not on every rank of a 1024-GPU job).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, open_dict

from gems import checkpoint as ckpt
from gems.bootstrap import check_launch
from gems.config import FILES, reads_files, section
from gems.data.check import unchecked_note
from gems.data.task import from_the_data
from gems.errors import ConfigError
from gems.layers import keeps_running_statistics
from gems.models import build_model, check_shapes
from gems.models.registry import saved_section
from gems.parallel import resolve, spatial_model
from gems.paths import readable_dir, writable_dir
from gems.plan.fit import check_fit
from gems.rank.data import Sampler, dataset_size, make_data
from gems.results.record import default_name, new_run_id, record_path

__all__ = ["prepare", "preflight", "one_value_per_key", "run_steps", "check_data"]


def one_value_per_key(overrides: list[str]) -> None:
    """A key given twice (``cluster=a cluster=b``) is bad input: Hydra would take the last one silently."""

    seen: dict[str, str] = {}
    for o in overrides:
        if "=" not in o or o.startswith("-"):
            continue
        key, val = o.split("=", 1)
        key = key.lstrip("+~")
        if key in seen:
            raise ConfigError(key, f"{seen[key]} and {val}", f"one value (the command line gives {key} twice; for "
                              f"several, gems sweep takes {key}={seen[key]},{val})")
        seen[key] = val


def prepare(cfg: Any) -> Any:
    """Fill in the run id and check everything the run needs (the model, the mesh, the files it reads and
    the folders it writes), so that bad input stops here with exit 2, before anything is written."""
    given = cfg.get("run_id")
    if cfg.parallel.get("auto"):  # the mesh chosen first: the run's name and everything after are of that mesh
        choose_mesh(cfg)
    with open_dict(cfg):
        if not given:
            cfg.run_id = new_run_id(default_name(cfg))
    if reads_files(cfg.data):
        readable_dir("data.path", cfg.data.path, "a folder of sample files (docs/data.md; write one with "
                     "`gems data synth data.path=...`)")
        for note in from_the_data(cfg, TRAINED if cfg.eval.path else ()):  # a task's classes and channels
            print(f"gems: note: {note}", file=sys.stderr, flush=True)
    if given:  # a run id of the user's: resume its checkpoint, never replace its record
        if record_path(cfg).exists():
            raise ConfigError("run_id", given, f"a new run id (the record {record_path(cfg)} exists, and records "
                              "are never replaced)")
        if ckpt.has_checkpoint(cfg):
            ckpt.check_fingerprint(cfg)
    asked = cfg.train.resume_from
    resume_stopped(cfg)
    if cfg.train.resume_from and not asked:  # a stopped run's checkpoint: gone on from on the files it trained on
        check_files(cfg, ckpt.find(str(cfg.train.resume_from), "train.resume_from"))
    check_starting_point(cfg)
    preflight(cfg)  # model, spatial cut and schedule: bad input fails here, before launching
    if cfg.train.check_fit:
        check_fit(cfg)  # memory: a point the planner says cannot fit is bad input (gems/plan/fit.py)
    writable_dir("results.dir", cfg.results.dir, "a folder for the run's records")
    check_room(cfg)
    return cfg


def check_room(cfg: Any) -> None:
    """What the run will write against the room its folders have: ``results.dir`` (gems.plan.disk), and, for
    a job here with ``data.stage=node``, the folder its data is copied to."""
    from gems.plan.disk import check_space
    from gems.rank.data import stage_root
    from gems.storage import free_bytes, size

    if cfg.results.check_space and not cfg.eval.path:  # (gems eval writes its record and predictions alone)
        check_space(cfg)
    if str(cfg.data.stage) != "node" or str(cfg.cluster.launcher) != "local" or not reads_files(cfg.data):
        return  # (a Slurm job stages on its nodes: their folders are not this machine's)
    need = sum(f.stat().st_size for d in (cfg.data.path, cfg.data.get("val_path")) if d
               for f in Path(str(d)).rglob("*") if f.is_file())
    folder = stage_root(cfg, str(cfg.run_id)).parent
    free = free_bytes(folder)
    if free is not None and free < need:
        raise ConfigError("data.stage_dir", str(folder), f"a folder with room for the data set's copy ({size(need)}; "
                          f"{size(free)} is free there), or data.stage=none to read the files where they are")


#: the model's keys a model file fixes (gems eval): the data set's classes and channels must agree with them
TRAINED = ("model.num_classes", "model.in_channels")


def choose_mesh(cfg: Any) -> None:
    """``parallel=auto``: the best candidate of gems plan's search set on ``cfg`` (gems.plan.search.apply_choice:
    placed on nodes as any run of its size, the choice kept for the record), said in one line."""
    from gems.plan.search import apply_choice, said

    print(f"gems: note: {said(apply_choice(cfg))}", file=sys.stderr, flush=True)


def model_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the configured model's ``state_dict``, built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return {n: tuple(t.shape) for n, t in build_model(section(cfg, "model")).module.state_dict().items()}


#: what a run's training does not depend on: a run stopped under other values of these is the same run (the mesh is
#: not among them: BatchNorm's statistics and a spatial cut's rounding follow it)
NOT_TRAINING = ("run_id", "results", "cluster", "fault", "plan", "comm", "health", "telemetry", "eval",
                "train.resume_from", "train.resume_stopped", "train.check_fit", "train.profile", "train.threads",
                "train.host_memory", "train.checkpoint_every", "train.checkpoint_async", "train.checkpoint_writers",
                "train.warmup_steps", "train.eval_every", "train.cuda_graphs", "train.graph_pieces",
                "train.graph_spatial", "train.graph_collectives", "train.graph_optimizer",
                "data.readers", "data.prefetch", "data.stage", "data.stage_dir", "data.workers")


def training_keys(config: dict[str, Any]) -> dict[str, Any]:
    """A resolved configuration's keys that change what the run trains, flattened (``train.lr``: value)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if prefix in NOT_TRAINING:
            return
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            out[prefix] = node

    walk("", config)
    return out


#: how the note says why a run stopped, by its record's failure kind
STOPPED_BY = {"bad_data": "on a bad file", "storage": "when its storage failed", "nonfinite": "on a non-finite loss",
              "stall": "when a rank stalled", "timeout": "at the launcher's time limit", "memory": "past its memory cap",
              "node_fail": "when a node failed", "cancelled": "when it was cancelled"}


def stopped_runs(folder: Path, name: str) -> list[tuple[Path, dict[str, Any]]]:
    """The failed records of runs named ``name`` in ``folder`` (not a sweep's) that no other run went on from yet (its
    configuration's train.resume_from names their checkpoint, failed or not, however often it was requeued since)
    and that did not finish their training."""
    import json

    records = []
    for path in folder.glob("*.json"):
        try:
            r = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(r, dict) and "run_id" in r and isinstance(r.get("config"), dict):
            records.append((path, r))
    continued = {_run_of(str(((r["config"].get("train") or {}).get("resume_from")) or "")) for _, r in records}
    return [(path, r) for path, r in records if r.get("status") == "failed" and str(r["run_id"]) not in continued
            and not (r.get("failure") or {}).get("finished") and r.get("name") == name and not r.get("sweep")]


def _run_of(checkpoint: str) -> str | None:
    """The run id whose folder holds ``checkpoint`` (``.../.jobs/RUN_ID/ckpt/stepN``), or None."""
    parts = Path(checkpoint).parts
    return parts[parts.index(".jobs") + 1] if ".jobs" in parts[:-1] else None


def stopped_checkpoint(folder: Path, record: dict[str, Any]) -> tuple[Path, int] | None:
    """The last whole checkpoint a stopped run kept in its own folder (and its step), or None."""
    root = folder / ".jobs" / str(record.get("run_id")) / "ckpt"
    step = ckpt.latest_step(root)
    if step is None:
        return None
    where = root / f"step{step:08d}"
    return (where, step) if ckpt.complete(where) else None


def resume_stopped(cfg: Any) -> None:
    """The same command as a run that stopped before its end with a whole checkpoint kept (a bad file, a full disk or
    quota, a dead or stalled rank, a non-finite loss, the time limit, a lost node: its failed record in
    ``results.dir``) goes on from that checkpoint, the latest such, and says so (``train.resume_stopped=false``
    starts over; the record's ``resumed_from`` names it). The same command: the same keys that change the training
    (:data:`NOT_TRAINING` are not); a stopped run of this name that differs in one is said and not continued. A run
    already continued by another is not continued again (the continuation's own checkpoint is)."""
    import json

    from omegaconf import OmegaConf

    t = cfg.train
    if not t.get("resume_stopped", True) or t.resume_from or t.init_from or ckpt.has_checkpoint(cfg):
        return
    if cfg.eval.path or cfg.results.sweep:  # gems eval evaluates its file; a sweep runs its failed points again
        return
    folder = Path(str(cfg.results.dir))
    if not folder.is_dir():
        return
    now = training_keys(json.loads(json.dumps(OmegaConf.to_container(cfg, resolve=True))))
    best: tuple[int, float, Path, dict[str, Any]] | None = None
    other: tuple[float, dict[str, Any], str] | None = None
    for path, r in stopped_runs(folder, default_name(cfg)):
        kept = stopped_checkpoint(folder, r)
        if kept is None:
            continue
        then = training_keys(r["config"])
        key = next((k for k in sorted(set(then) | set(now)) if then.get(k) != now.get(k)), None)
        mtime = path.stat().st_mtime
        if key is not None:
            if other is None or mtime > other[0]:
                other = (mtime, r, key)
            continue
        if best is None or (kept[1], mtime) > best[:2]:
            best = (kept[1], mtime, kept[0], r)
    if best is not None:
        step, _, where, r = best
        why = STOPPED_BY.get(str((r.get("failure") or {}).get("kind")), "when a rank failed")
        with open_dict(cfg):
            t.resume_from = str(where)
        print(f"gems: note: run {r['run_id']} of this configuration stopped {why} after step {step}; resuming from its "
              f"checkpoint ({where}; train.resume_stopped=false starts over)", file=sys.stderr, flush=True)
    elif other is not None:
        _, r, key = other
        was = training_keys(r["config"]).get(key)
        print(f"gems: note: run {r['run_id']} of this name stopped with a checkpoint kept, but {key} was {was} there "
              f"and is {now.get(key)} here: starting over (train.resume_from=PATH goes on from its checkpoint anyway)",
              file=sys.stderr, flush=True)


def check_files(cfg: Any, folder: Path) -> None:
    """The data sets as the run whose checkpoint (``folder``) a stopped run's command goes on from trained on them
    (gems.checkpoint.files), else bad input naming the files gone or added."""
    from gems.checkpoint.files import check_files as same_files

    same_files(cfg, ckpt.read_meta(folder), folder, f"mend the set, or train.resume_stopped=false starts over; "
               f"train.resume_from={folder} goes on from it on the set as it is")


def check_starting_point(cfg: Any) -> None:
    """``train.resume_from`` and ``train.init_from``: a checkpoint or model file of this model (the first entry that
    differs named), and for a resume the optimizer whose state it holds."""
    t = cfg.train
    if t.resume_from and t.init_from:
        raise ConfigError("train.init_from", t.init_from, "null with train.resume_from (a resume takes the weights "
                          "and the optimizer's state; init_from the weights alone)")
    for key in ("resume_from", "init_from"):
        path = t.get(key)
        if not path:
            continue
        if key == "resume_from":
            folder = ckpt.find(str(path), "train.resume_from")
            meta = ckpt.read_meta(folder)
            if not isinstance(meta.get("step"), int):
                raise ConfigError("train.resume_from", path, f"a checkpoint gems wrote (its {ckpt.META} names the step)")
            if meta.get("optimizer") not in (None, str(t.optimizer)):
                raise ConfigError("train.optimizer", t.optimizer, f"{meta['optimizer']}, the optimizer whose state "
                                  f"the checkpoint holds (train.init_from={path} starts a fresh one from its weights)")
        ckpt.check_model(ckpt.inspect(str(path), f"train.{key}").shapes, model_shapes(cfg), f"train.{key}", path)
        with open_dict(cfg):  # the folder now, once: every rank reads that step, whatever the run saves meanwhile
            t[key] = str(ckpt.resolve(str(path), f"train.{key}"))


#: what a model file says of the run that trained it, the defaults of ``gems eval`` unless given
_TRAINED_ON = {"seed": "train.seed", "global_batch": "train.batch_size", "bn_recalibrate": "train.bn_recalibrate",
               "eval_average_crops": "train.eval_average_crops"}


#: synthetic samples gems eval draws for a model whose run named no validation data (a whole number of batches)
EVAL_SAMPLES = 16


def eval_config(path: str, overrides: list[str], cfg: DictConfig) -> DictConfig:
    """The configuration of ``gems eval PATH OVERRIDES`` (``cfg``: the overrides composed): the model of the file or
    checkpoint, and, unless the overrides say otherwise, the data, seed and batch of the run that trained it, so the
    evaluated set is that run's validation set. ``data=files data.path=DIR`` evaluates the files in DIR."""
    from omegaconf import OmegaConf

    from gems.config import validate

    given = [o.split("=", 1)[0].lstrip("+") for o in overrides if "=" in o]
    bad = next((k for k in given if k == "model" or k.startswith("model.")), None)
    if bad is not None:
        raise ConfigError(bad, next(o.split("=", 1)[1] for o in overrides if o.lstrip("+").startswith(bad)),
                          f"no model override: gems eval takes the model of {path}")
    saved = ckpt.inspect(path, "eval")  # the file read once here (each rank reads its weights)
    trained = saved.trained_on
    with open_dict(cfg):
        try:  # the file's model, typed by its own keys (whatever model the overrides composed)
            cfg.model = OmegaConf.structured(section({"model": saved_section(saved.model)}, "model"))
        except Exception as e:  # a key this gems's model does not know
            raise ConfigError("eval", path, f"a model file of a model this gems builds ({type(e).__name__}: "
                              f"{str(e).splitlines()[0]})") from None
        evaluated = _eval_data(cfg, trained.get("data"), given)
        for what, key in _TRAINED_ON.items():
            if what in trained and key not in given:
                OmegaConf.update(cfg, key, trained[what])
        if evaluated is not None:
            cfg.data.val_path = evaluated
        cfg.eval.path = str(ckpt.resolve(path, "eval"))
        cfg.train.init_from = cfg.train.resume_from = None
        cfg.train.checkpoint_every = 0
        cfg.train.target_mae = None
        cfg.results.name = f"eval-{default_name(cfg)}"
        fresh = cfg.data.name == "synthetic" and not cfg.data.val_samples and "data.val_samples" not in given
        if fresh:  # a run without validation data: fresh samples of its kind, drawn from another seed
            B = int(cfg.train.batch_size)
            cfg.data.val_samples = -(-EVAL_SAMPLES // B) * B
            if "train.seed" not in given:
                cfg.train.seed = int(cfg.train.seed) + 1
    validate(cfg)
    if cfg.data.name == "synthetic" and not cfg.data.val_samples:
        raise ConfigError("data.val_samples", 0, "the synthetic samples to evaluate (> 0; the model file names its "
                          "run's), or data=files data.path=DIR")
    if reads_files(cfg.data) and not cfg.data.val_path:
        raise ConfigError("data.path", cfg.data.path, "a folder of sample files to evaluate")
    ckpt.check_model(saved.shapes, model_shapes(cfg), "eval", path)
    if fresh:  # (said once every check has passed: bad input is one line)
        import sys

        print(f"gems eval: {path} names no validation data: evaluating {cfg.data.val_samples} fresh synthetic "
              f"samples of its run's kind, drawn from train.seed={cfg.train.seed} (its run trained on "
              f"{trained.get('seed', 'another')}); choose them with data.val_samples=N train.seed=S, or evaluate "
              "files with data=files data.path=DIR", file=sys.stderr, flush=True)
    return cfg


def _eval_data(cfg: Any, trained: dict[str, Any] | None, given: list[str]) -> str | None:
    """``gems eval``'s data section: the training run's (its files, crops, normalisation: the model reads its
    input as it was trained to), the overrides' ``data.*`` keys on top. ``data.path=DIR`` without ``data.val_path``
    names the set to evaluate: returned, and the training set stays the run's where it still exists (what
    ``train.bn_recalibrate`` recomputes BatchNorm's statistics from)."""
    from pathlib import Path

    from omegaconf import OmegaConf

    asked = OmegaConf.select(cfg, "data.path") if "data.path" in given and "data.val_path" not in given else None
    if trained:
        base = OmegaConf.create(trained)
        for k in given:
            if k.startswith("data."):
                OmegaConf.update(base, k[len("data."):], OmegaConf.select(cfg, k), merge=False)
        if "data" in given:
            base.name = cfg.data.name
        if asked is not None and str(trained.get("name")) in FILES and trained.get("path") and Path(trained["path"]).is_dir():
            base.path = trained["path"]
        cfg.data = OmegaConf.merge(cfg.data, base)
    return None if asked is None else str(asked)


def preflight(cfg: DictConfig) -> None:
    """Every check that needs the model but not the world, run by the CLI before launching.

    A mesh the model cannot take (too many parts, a missing dim, a layer gems
    cannot partition, a schedule the batch or the layers do not divide) is bad
    input: it must stop with exit 2 before anything is submitted, not fail on
    every rank of a 1024-GPU job.
    """
    import copy

    settings = resolve(cfg)  # the mesh and the schedule; the batch over replicas, passes and micro-batches
    mesh = settings.mesh
    spec = build_model(section(cfg, "model"))
    check_shapes(spec)  # every layer takes what reaches it, the output fits the targets: on meta tensors
    p = cfg.parallel
    seq = spec.module
    check_data(cfg, spec)
    check_launch(cfg, mesh.size)  # gloo on GPUs, NCCL on CPUs, more ranks on a node than GPUs
    if mesh.spatial_enabled:
        from gems.spatial import SpatialContext, apply_spatial

        for d in mesh.spatial_dims:
            if d >= spec.spatial_ndim:
                raise ConfigError("parallel.spatial_dims", list(mesh.spatial_dims),
                                  f"dims below {spec.spatial_ndim}: {spec.name} has {spec.spatial_ndim} spatial dims")
        ctx = SpatialContext(None, list(range(mesh.spatial)), mesh.parts, mesh.spatial_dims, (0,) * len(mesh.parts))
        ctx.local_slices(spec.input_shape[1:])
        spec, note = spatial_model(spec, mesh, p.bn_stats, bool(p.gather_uncut))
        if note:
            print(f"gems: note: {note}", file=sys.stderr, flush=True)
        seq = apply_spatial(copy.deepcopy(spec.module), ctx, spec.spatial_end, bn_stats=p.bn_stats)
    settings.check_layers(len(seq))  # the partitions and the balance against the layers


def run_steps(cfg: DictConfig) -> int:
    """The optimizer steps the run will take (train.steps, or train.epochs of the training set)."""
    t = cfg.train
    return Sampler(dataset_size(cfg), int(t.batch_size), int(t.seed), t.epochs, t.steps).total


def _check_evaluated_weights(cfg: DictConfig, spec: Any, validates: bool) -> None:
    """What the evaluations run with: ``train.bn_recalibrate`` (training batches to recompute BatchNorm's
    statistics from) needs an evaluation, and ``train.ema``'s average (evaluated, and the run's trained model), on a
    model with BatchNorm, statistics of its own."""
    t = cfg.train
    if t.bn_recalibrate and not validates:
        raise ConfigError("train.bn_recalibrate", t.bn_recalibrate, "0, or a validation set to evaluate on (it "
                          "recalibrates before each evaluation)")
    if t.ema:
        if not t.bn_recalibrate and any(keeps_running_statistics(m) for m in spec.module.modules()):
            raise ConfigError("train.ema", t.ema, "0, or train.bn_recalibrate > 0 too: the model's BatchNorm "
                              "statistics follow the last steps' weights, not the average's")


def check_data(cfg: DictConfig, spec: Any) -> None:
    """The training and validation sets against the model and each other, and what the run asks of them: a file
    that does not match is named, a target needs a validation set and a metric the model reports, the warm-up
    is shorter than the run, an epoch holds a batch."""
    t, d = cfg.train, cfg.data
    steps = run_steps(cfg)  # (a batch larger than the training set with train.epochs is refused here)
    if t.warmup_steps >= steps:
        raise ConfigError("train.warmup_steps", t.warmup_steps, f"fewer than the run's {steps} steps")
    if reads_files(d):  # a file that does not match the model is named before launch
        train = make_data(cfg, spec).samples
        train.check_all(steps * int(t.batch_size), spec.num_outputs)
        sets = [("data.path", str(d.path), train.files)]
        if d.val_path is not None:
            readable_dir("data.val_path", d.val_path, "a folder of validation samples in the training set's layout")
            val = make_data(cfg, spec, validation=True).samples
            val.check_all(None, spec.num_outputs)
            sets.append(("data.val_path", str(d.val_path), val.files))
        for key, path, files in sets:  # a large set gems data check has not passed: said once
            note = unchecked_note(key, path, files)
            if note:
                print(f"gems: note: {note}", file=sys.stderr, flush=True)
    elif d.val_path is not None:
        raise ConfigError("data.val_path", d.val_path, "null with data=synthetic (data.val_samples holds samples out)")
    if t.eval_average_crops and (not reads_files(d) or d.val_path is None or spec.target != "vector"
                                 or spec.loss != "mse"):
        raise ConfigError("train.eval_average_crops", True, "false, or data=files with a validation folder "
                          "(data.val_path) whose files are cut into crops, for a model of vector targets")
    val = make_data(cfg, spec, validation=True)
    _check_evaluated_weights(cfg, spec, val is not None)
    if val is not None and len(val) < int(t.batch_size):
        key, value = ("data.val_samples", d.val_samples) if d.name == "synthetic" else ("data.val_path", d.val_path)
        raise ConfigError(key, value, f"at least train.batch_size={t.batch_size} validation samples (evaluation "
                          "runs in batches of the training batch)")
    if t.target_mae is not None:
        if val is None:
            raise ConfigError("train.target_mae", t.target_mae, "null, or a validation set to evaluate on "
                              "(data.val_path for hdf5, data.val_samples for synthetic data)")
        reports = {"mae", "loss"} if spec.loss == "mse" else {"accuracy", "loss"}
        if t.target_metric not in reports:
            raise ConfigError("train.target_metric", t.target_metric,
                              f"{' or '.join(sorted(reports))} ({spec.name} is trained with {spec.loss})")
