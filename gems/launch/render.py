"""``gems render``: the sbatch script a configuration would submit, for people who submit by hand, rendered from a Jinja2
template in ``sbatch_templates/`` (``<cluster.name>.sbatch.j2`` where there is one) with the same options, setup and
srun line as the submitit launcher (gems.launch.options.sbatch_parameters); only the command differs
(``python -m gems.worker --config <resolved.yaml>``). ``tests/test_render.py`` keeps the two in step.
"""
from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from gems.config import idle_gpus, job_tasks, to_yaml
from gems.errors import ConfigError
from gems.launch.options import default_job_dir, job_config, job_name, python_command, sbatch_parameters
from gems.results.record import private_dir

# submitit's sbatch parameters that are not #SBATCH options
_NOT_SBATCH = ("setup", "srun_args", "additional_parameters", "teardown", "signal_delay_s",
               "stderr_to_stdout", "use_srun", "array_parallelism", "map_count")


def templates_dir() -> Path:
    """``sbatch_templates/``: $GEMS_TEMPLATES, else the one beside the package."""
    env = os.environ.get("GEMS_TEMPLATES")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parents[1]
    for cand in (here.parent / "sbatch_templates", here / "sbatch_templates"):
        if (cand / "gems.sbatch.j2").is_file():
            return cand
    raise ConfigError("GEMS_TEMPLATES", env, "a folder holding gems.sbatch.j2 (the sbatch_templates/ of a gems checkout)")


def _flag(key: str, value: Any) -> str:
    key = key.replace("_", "-")
    if value is True:
        return f"--{key}"
    return f"--{key}={shlex.quote(str(value))}"


def sbatch_options(cfg: DictConfig, job_dir: str | Path) -> list[str]:
    """The #SBATCH options, sorted by name, as submitit writes them for this cfg and folder."""
    params = sbatch_parameters(cfg)
    job_dir = str(job_dir)
    opts: dict[str, Any] = {k: v for k, v in params.items() if k not in _NOT_SBATCH}
    opts["signal"] = f"USR2@{params['signal_delay_s']}"  # as submitit writes it: gems checkpoints and requeues
    opts["output"] = f"{job_dir}/%j_0_log.out"
    opts["error"] = f"{job_dir}/%j_0_log.err"
    opts["open-mode"] = "append"
    opts.update(params.get("additional_parameters") or {})
    return [_flag(k, opts[k]) for k in sorted(opts)]


def srun_command(cfg: DictConfig, job_dir: str | Path) -> str:
    params = sbatch_parameters(cfg)
    job_dir = str(job_dir)
    words = ["srun", "--unbuffered", "--output", f"{job_dir}/%j_%t_log.out",
             "--error", f"{job_dir}/%j_%t_log.err", *params.get("srun_args", [])]
    return " ".join(shlex.quote(w) for w in words)


def render(cfg: DictConfig, job_dir: str | Path | None = None, config_path: str | Path | None = None) -> str:
    """The sbatch script for ``cfg``; logs go to ``job_dir``, ranks read ``config_path``.

    Defaults: ``job_dir`` = ``{results.dir}/.jobs/{run_id}`` (as the launcher uses), and
    ``config_path`` = ``{job_dir}/config.yaml`` (write it with :func:`write_job`).
    """
    import jinja2

    jd = Path(job_dir) if job_dir is not None else default_job_dir(cfg)
    cp = Path(config_path) if config_path is not None else jd / "config.yaml"
    c = cfg.cluster
    tdir = templates_dir()
    name = f"{c.name}.sbatch.j2" if (tdir / f"{c.name}.sbatch.j2").is_file() else "gems.sbatch.j2"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(tdir)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    params = sbatch_parameters(cfg)
    return env.get_template(name).render(
        job_name=params["job_name"], cluster_name=c.name, nodes=int(c.nodes), tasks_per_node=int(c.tasks_per_node),
        world=job_tasks(c), idle_gpus=idle_gpus(c), script_name=f"{params['job_name']}.sbatch",
        options=sbatch_options(cfg, jd), setup=list(params.get("setup", [])), srun=srun_command(cfg, jd),
        python=python_command(cfg), config=shlex.quote(str(cp)),
    )


def write_job(cfg: DictConfig, job_dir: str | Path | None = None) -> Path:
    """Write ``config.yaml`` and ``<job name>.sbatch`` into the job folder; return the script's path."""
    cfg = job_config(cfg)
    jd = Path(job_dir).resolve() if job_dir is not None else default_job_dir(cfg)
    cp = jd / "config.yaml"
    text = render(cfg, jd, cp)  # first: a value the script cannot take is bad input, and nothing is written
    private_dir(jd)
    cp.write_text(to_yaml(cfg))
    script = jd / f"{job_name(cfg)}.sbatch"
    script.write_text(text)
    return script


__all__ = ["render", "write_job", "sbatch_options", "srun_command", "templates_dir"]
