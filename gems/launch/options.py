"""The Slurm options of a job from the typed ``cfg.cluster``, under sbatch's own names (:func:`sbatch_parameters`), the
interpreter on the compute nodes, and where a job keeps its files: one place, so that the submitit launcher, the
check before submitting and a hand-submitted script ask Slurm for the same thing.
"""
from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from gems.config import job_tasks
from gems.errors import ConfigError
from gems.results import record as rec

_WHAT = {"account": "your project/budget account", "partition": "a partition (sinfo -s)",
         "qos": "a QOS (sacctmgr show qos)", "constraint": "a node feature (sinfo -o %f)"}


def _cluster_value(cfg: DictConfig, key: str) -> Any:
    """``cluster.<key>``; a placeholder (``???`` or ``<...>`` in a preset) is a ConfigError."""
    try:
        val = OmegaConf.select(cfg, f"cluster.{key}", throw_on_missing=True)
    except MissingMandatoryValue:
        val = "???"
    if isinstance(val, str) and (val == "???" or (val.startswith("<") and val.endswith(">"))):
        raise ConfigError(f"cluster.{key}", val, f"{_WHAT.get(key, 'a value')}: add cluster.{key}=NAME")
    return val


def _mem(gb: float) -> str:
    return f"{int(gb)}GB" if float(gb) == int(gb) else f"{int(float(gb) * 1024)}MB"


def job_name(cfg: DictConfig) -> str:
    return str(cfg.get("run_id") or cfg.results.get("name") or "gems")


def python_command(cfg: DictConfig) -> str:
    """The interpreter on the compute nodes: ``cluster.python``, else this one."""
    py = _cluster_value(cfg, "python")
    return str(py) if py else shlex.quote(sys.executable)


def sbatch_parameters(cfg: DictConfig) -> dict[str, Any]:
    """submitit ``SlurmExecutor`` parameters (sbatch names) for ``cfg.cluster``."""
    c = cfg.cluster
    params: dict[str, Any] = {
        "job_name": job_name(cfg),
        "time": int(c.time_min),
        "nodes": int(c.nodes),
        "ntasks_per_node": int(c.tasks_per_node),
        "cpus_per_task": int(c.cpus_per_task),
        "wckey": "gems",
        # SIGUSR2 this long before the time limit: every rank checkpoints and the job is requeued
        "signal_delay_s": int(c.signal_margin_s),
    }
    additional = OmegaConf.to_container(c.additional, resolve=True) if c.additional else {}
    # sites that count GPUs as a generic resource (--gres=gpu:4) get that instead of --gpus-per-node
    if int(c.gpus_per_node or 0) > 0 and "gres" not in additional:  # type: ignore[operator]
        params["gpus_per_node"] = int(c.gpus_per_node)
    if c.mem_gb is not None:
        params["mem"] = _mem(c.mem_gb)
    for key in ("partition", "account", "qos", "constraint"):
        val = _cluster_value(cfg, key)
        if val not in (None, ""):
            params[key] = str(val)
    exclude = [str(n) for n in (c.get("exclude") or [])]  # nodes kept out (cluster.exclude_bad_nodes adds to them)
    if exclude:
        params["exclude"] = ",".join(exclude)
    setup = [str(s) for s in (c.setup or [])]
    if setup:
        params["setup"] = setup
    srun_args = [str(a) for a in (c.srun_args or [])]
    if int(c.cpus_per_task) > 1 and not any(_sets_cpus(a) for a in srun_args):
        # since Slurm 22.05 srun no longer takes --cpus-per-task from sbatch: without it every rank is pinned to
        # one core with its threads, the data reader and NCCL's proxy thread (slurm.schedmd.com/srun.html,
        # --cpus-per-task: "Beginning with 22.05, srun will not inherit the --cpus-per-task value requested by
        # salloc or sbatch"); given here for every preset, cluster.srun_args's own value wins
        srun_args = [f"--cpus-per-task={int(c.cpus_per_task)}", *srun_args]
    if srun_args:
        params["srun_args"] = srun_args
    tasks = job_tasks(c)
    if tasks < int(c.nodes) * int(c.tasks_per_node) and "ntasks" not in additional:  # type: ignore[operator]
        # the last node partly used (gems.config.place): Slurm takes tasks_per_node as the most a node runs
        additional = {**additional, "ntasks": tasks}  # type: ignore[dict-item]
    if additional:
        params["additional_parameters"] = {str(k): v for k, v in additional.items()}  # type: ignore[union-attr]
    return params


def _sets_cpus(arg: str) -> bool:
    """Whether an srun argument sets the CPUs per task (``--cpus-per-task=N``, ``-c N``, ``-cN``)."""
    return arg.startswith("--cpus-per-task") or arg == "-c" or (arg.startswith("-c") and arg[2:].isdigit())


def default_job_dir(cfg: DictConfig) -> Path:
    """Where submitit keeps a run's pickles and logs: ``{results.dir}/.jobs/{run_id}``."""
    return Path(cfg.results.dir).resolve() / ".jobs" / str(cfg.run_id or "gems")


def job_config(cfg: DictConfig) -> DictConfig:
    """The configuration a job is submitted with: a copy of ``cfg`` with a run id and an absolute ``results.dir``
    (ranks may start elsewhere). Not :func:`gems.prepare.prepare`, which checks a run before launch."""
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[assignment]  # a mapping
    if not cfg.get("run_id"):
        cfg.run_id = rec.new_run_id(rec.default_name(cfg))
    cfg.results.dir = str(Path(cfg.results.dir).resolve())
    return cfg


__all__ = ["job_name", "python_command", "sbatch_parameters", "default_job_dir", "job_config"]
