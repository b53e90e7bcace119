"""Admission: ask Slurm, before anything is submitted, whether it would take a job.

:func:`check_reachable` finds the Slurm tools and a controller that answers; :func:`preflight` runs
``sbatch --test-only`` on the script submitit would write; :func:`refusal` turns sbatch's refusal into the
``cluster.*`` key the user can change. A sweep is checked whole first, so a bad point submits nothing.
"""
from __future__ import annotations

import shutil
import subprocess
from typing import Sequence

from omegaconf import DictConfig

from gems.errors import ConfigError
from gems.launch.jobs import first_line, slurm_command
from gems.launch.options import sbatch_parameters

START_HINT = "start it with scripts/slurm_cluster.sh start or use cluster=local"


def check_reachable(cfg: DictConfig) -> list[str]:
    """Slurm's partitions, or ConfigError if sbatch is absent or the controller does not answer."""
    name = str(cfg.cluster.name)
    for tool in ("sbatch", "srun", "squeue", "sinfo"):
        if shutil.which(tool) is None:
            raise ConfigError("cluster", name, f"a machine with Slurm ({tool} is not on PATH); {START_HINT}")
    try:
        out = slurm_command(["sinfo", "-h", "-o", "%R"], timeout=45)
    except subprocess.TimeoutExpired:
        raise ConfigError("cluster", name, f"a Slurm controller that answers (sinfo timed out); {START_HINT}") from None
    if out.returncode != 0:
        msg = first_line(out.stderr or out.stdout)
        raise ConfigError("cluster", name, f"a Slurm controller that answers (sinfo: {msg}); {START_HINT}")
    return sorted({p.strip() for p in out.stdout.split() if p.strip()})


def _node_limits(partition: str | None) -> tuple[int, int, int]:
    """(nodes, min CPUs per node, min memory MB per node) of a partition, 0 when unknown."""
    cmd = ["sinfo", "-h", "-N", "-o", "%N %c %m"] + (["-p", partition] if partition else [])
    try:
        out = slurm_command(cmd, timeout=30)
    except subprocess.TimeoutExpired:
        return 0, 0, 0
    rows = [ln.split() for ln in out.stdout.splitlines() if len(ln.split()) == 3]
    if not rows:
        return 0, 0, 0
    nodes = len({r[0] for r in rows})
    cpus = min(int(r[1]) for r in rows if r[1].isdigit()) if any(r[1].isdigit() for r in rows) else 0
    mem = min(int(r[2]) for r in rows if r[2].isdigit()) if any(r[2].isdigit() for r in rows) else 0
    return nodes, cpus, mem


def refusal(cfg: DictConfig, message: str) -> ConfigError:
    """Turn sbatch's refusal into the config key the user can change."""
    c = cfg.cluster
    low = message.lower()
    if "partition" in low:
        return ConfigError("cluster.partition", c.partition, f"a partition of this cluster (sbatch: {message})")
    if "account" in low or "association" in low:
        return ConfigError("cluster.account", c.account, f"an account you may charge (sbatch: {message})")
    if "qos" in low:
        return ConfigError("cluster.qos", c.qos, f"a QOS of your account (sbatch: {message})")
    if "feature" in low or "constraint" in low:
        return ConfigError("cluster.constraint", c.constraint, f"a node feature of this cluster (sbatch: {message})")
    if "gres" in low or "gpu" in low:
        return ConfigError("cluster.gpus_per_node", c.gpus_per_node,
                           f"GPUs the nodes have, 0 where they have none (sbatch: {message})")
    if "time limit" in low:
        return ConfigError("cluster.time_min", c.time_min, f"a time within the partition's limit (sbatch: {message})")
    if "node configuration is not available" in low or "node count" in low:
        nodes, cpus, mem_mb = _node_limits(c.partition)
        if nodes and int(c.nodes) > nodes:
            return ConfigError("cluster.nodes", c.nodes, f"at most {nodes} nodes in this partition")
        per_node = int(c.tasks_per_node) * int(c.cpus_per_task)
        if cpus and per_node > cpus:
            return ConfigError("cluster.tasks_per_node", c.tasks_per_node,
                               f"tasks_per_node x cpus_per_task <= {cpus} CPUs per node (now {per_node})")
        if mem_mb and c.mem_gb is not None and float(c.mem_gb) * 1024 > mem_mb:
            return ConfigError("cluster.mem_gb", c.mem_gb, f"at most {mem_mb // 1024} GB per node")
        return ConfigError("cluster.nodes", f"{c.nodes} x {c.tasks_per_node} tasks",
                           f"a request the partition's nodes can satisfy (sbatch: {message})")
    return ConfigError("cluster", c.name, f"a job Slurm accepts (sbatch --test-only: {message})")


def preflight(cfg: DictConfig, partitions: Sequence[str] | None = None) -> None:
    """Ask Slurm, without submitting, whether it would take this job (``sbatch --test-only``)."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = sbatch_parameters(cfg)
    part = params.get("partition")
    if part and partitions is not None and part not in partitions:
        raise ConfigError("cluster.partition", part, "one of " + ", ".join(partitions))
    text = _make_sbatch_string(command="true", folder="/tmp/gems-preflight", **params)
    try:
        out = slurm_command(["sbatch", "--test-only"], timeout=45, stdin=text)
    except subprocess.TimeoutExpired:
        raise ConfigError("cluster", cfg.cluster.name,
                          f"a Slurm controller that answers (sbatch timed out); {START_HINT}") from None
    if out.returncode != 0:
        msg = first_line(out.stderr or out.stdout)
        if "contact" in msg.lower() or "connection" in msg.lower():
            raise ConfigError("cluster", cfg.cluster.name, f"a Slurm controller that answers (sbatch: {msg}); {START_HINT}")
        raise refusal(cfg, msg)



__all__ = ["START_HINT", "check_reachable", "preflight", "refusal"]
