"""Work spread over the tasks of one Slurm job, for the commands that are not training runs (``gems data synth``,
``convert`` and ``check``, ``gems nodes check``): every task calls the same function, which picks its share by its
``global_rank`` of ``num_tasks``. Those commands lie below the launchers: the command line hands them
:func:`run_tasks` (``job=``).
"""
from __future__ import annotations

from typing import Any, Callable

from gems.errors import RunError


def run_tasks(cfg: Any, fn: Callable[[str], Any], command: str, work: str,
              on_update: Callable[..., None] | None = None, prefix: str = "gems data") -> int:
    """Submit ``fn(cfg_yaml)`` to every task of one Slurm job of ``cfg`` for ``gems data COMMAND`` (``prefix``: the
    command's first words, ``gems nodes`` for its check; ``work``: what the tasks share, as the command says it), wait
    for it, calling ``on_update`` at each poll, and return its tasks' count. A job that does not complete is a
    :class:`~gems.errors.RunError` that says what ended it; what its tasks wrote stays (the commands resume)."""
    from omegaconf import open_dict

    from gems.launch.slurm import submit
    from gems.launch.watch import wait

    with open_dict(cfg):
        cfg.cluster.nodes = int(cfg.cluster.nodes or 1)
        cfg.cluster.tasks_per_node = int(cfg.cluster.tasks_per_node or 1)
        cfg.results.name = command
    run = submit(cfg, fn=fn)
    tasks = int(cfg.cluster.nodes) * int(cfg.cluster.tasks_per_node)
    print(f"{prefix} {command}: Slurm job {run.job_id}: {work} over {tasks} task(s)", flush=True)
    (out,) = wait(run, progress=False, on_update=on_update)
    if out.state != "COMPLETED":
        raise RunError(f"the {prefix.split()[-1]} job {run.job_id} ended {out.state}: {out.error or 'no message'} (what "
                       "it wrote is kept; run the same command again to do the rest)")
    return tasks
