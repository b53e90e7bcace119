"""Golden sbatch scripts: ``gems render`` output for the cluster presets, compared with files
recorded under tests/golden/, and checked against the text submitit itself generates.

A mismatch shows the diff; when the change is intended, record the new files with
``GEMS_ACCEPT_GOLDEN=1 python -m pytest tests/test_render.py`` and review them in the diff.
"""
from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from gems.config import compose
from gems.errors import ConfigError
from gems.launch.options import python_command, sbatch_parameters
from gems.launch.render import render, sbatch_options, srun_command

GOLDEN = Path(__file__).parent / "golden"
JOB_DIR = "/scratch/gems/.jobs/golden"
CONFIG = f"{JOB_DIR}/config.yaml"

# preset -> overrides that make a valid job (the mesh must equal nodes x tasks_per_node)
CASES: dict[str, list[str]] = {
    "local_slurm": ["cluster=local_slurm", "parallel.replicas=4"],
    "slurm": ["cluster=slurm", "cluster.partition=gpu", "cluster.mem_gb=7.5", "+cluster.additional.exclusive=true"],
    "perlmutter": ["cluster=perlmutter", "cluster.account=m0000", "parallel.replicas=4", "train.batch_size=8"],
    "juwels_booster": ["cluster=juwels_booster", "cluster.account=proj", "parallel.replicas=4", "train.batch_size=8"],
    "leonardo": ["cluster=leonardo", "cluster.account=EUHPC_X", "cluster.nodes=2", "parallel.replicas=8",
                 "train.batch_size=8"],
    "alps": ["cluster=alps", "cluster.account=a00", "parallel.replicas=4", "train.batch_size=8"],
    "frontier": ["cluster=frontier", "cluster.account=abc123", "parallel.replicas=8", "train.batch_size=8"],
}


def _cfg(name: str):  # the interpreter is pinned so that the files do not depend on this machine
    return compose(CASES[name] + ["cluster.python=python"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_matches_golden(name: str) -> None:
    text = render(_cfg(name), JOB_DIR, CONFIG)
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("GEMS_ACCEPT_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if os.environ.get("GEMS_ACCEPT_GOLDEN") != "1":
            pytest.fail(f"recorded a new golden file {path}; review it and run the test again")
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            fromfile=f"golden/{name}.sbatch", tofile="render()"))
        pytest.fail(f"gems render differs from {path}:\n{diff}\n"
                    "If the change is intended: GEMS_ACCEPT_GOLDEN=1 python -m pytest tests/test_render.py")


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_equals_submitit(name: str) -> None:
    """The #SBATCH lines, setup and srun prefix are exactly those submitit submits."""
    from submitit.slurm.slurm import _make_sbatch_string

    cfg = _cfg(name)
    command = f"{python_command(cfg)} -u -m submitit.core._submit {JOB_DIR}"
    theirs = _make_sbatch_string(command=command, folder=JOB_DIR, **sbatch_parameters(cfg))
    ours = render(cfg, JOB_DIR, CONFIG)

    def sbatch_lines(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]

    assert sbatch_lines(ours) == sbatch_lines(theirs)
    assert sbatch_lines(ours) == [f"#SBATCH {o}" for o in sbatch_options(cfg, JOB_DIR)]
    srun_theirs = next(ln for ln in theirs.splitlines() if ln.startswith("srun "))
    srun_ours = next(ln for ln in ours.splitlines() if ln.startswith("srun "))
    prefix = srun_command(cfg, JOB_DIR) + " " + python_command(cfg) + " -u -m "
    assert srun_theirs.startswith(prefix) and srun_ours.startswith(prefix)
    assert srun_ours.endswith(f"gems.worker --config {CONFIG}")
    for line in cfg.cluster.setup:
        assert line in theirs.splitlines() and line in ours.splitlines()


def test_missing_account_is_a_config_error() -> None:
    cfg = compose(["cluster=perlmutter", "parallel.replicas=4", "train.batch_size=8"])
    with pytest.raises(ConfigError) as e:
        render(cfg, JOB_DIR, CONFIG)
    assert e.value.key == "cluster.account" and "cluster.account=" in str(e.value)


def test_gres_replaces_gpus_per_node() -> None:
    cfg = _cfg("juwels_booster")
    opts = sbatch_options(cfg, JOB_DIR)
    assert "--gres=gpu:4" in opts and not any(o.startswith("--gpus-per-node") for o in opts)
    assert "--gpus-per-node=4" in sbatch_options(_cfg("perlmutter"), JOB_DIR)


@pytest.mark.parametrize("name", ["perlmutter", "juwels_booster", "leonardo", "alps", "frontier"])
def test_gpu_presets_are_complete(name: str) -> None:
    c = _cfg(name).cluster
    assert c.launcher == "slurm" and c.gpus_per_node > 0 and c.gpu_memory_gb > 0
    assert c.tasks_per_node == c.gpus_per_node  # one rank per GPU
    text = (Path(__file__).parents[1] / "conf" / "cluster" / f"{name}.yaml").read_text()
    assert text.startswith("# ") and ("docs." in text.splitlines()[0] or "apps." in text.splitlines()[0])


def test_every_preset_gives_srun_the_cpus_per_task() -> None:
    """Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task: a rank would be pinned to one core with
    its OpenMP threads, the data reader and NCCL's proxy thread (Frontier's preset set -c 7 and nothing carried it
    to srun). Every preset's script gives srun the preset's CPUs per task, a value in cluster.srun_args wins."""
    import glob

    presets = sorted(Path(p).stem for p in glob.glob(str(Path(__file__).parent.parent / "conf" / "cluster" / "*.yaml")))
    assert set(CASES) >= set(presets) - {"local"}, "a preset without a render case"
    for name in sorted(CASES):
        cfg = _cfg(name)
        srun = next(line for line in render(cfg, JOB_DIR, CONFIG).splitlines() if line.startswith("srun "))
        n = int(cfg.cluster.cpus_per_task)
        if n > 1:
            assert f" --cpus-per-task={n} " in srun, (name, srun)
        else:
            assert "--cpus-per-task" not in srun, (name, srun)
    mine = compose(CASES["frontier"] + ["cluster.python=python", "cluster.srun_args=[-c,3]"])
    srun = srun_command(mine, JOB_DIR)
    assert "--cpus-per-task" not in srun and srun.endswith(" -c 3")


@pytest.mark.parametrize("mesh,nodes,per_node,idle", [
    (["parallel.replicas=7"], 2, 4, 1),  # was 7 nodes x 1 task: 21 GPUs idle
    (["parallel.replicas=5", "parallel.pipeline=2", "parallel.schedule=mast"], 3, 4, 2),  # was 5 nodes x 2
    (["parallel.replicas=8"], 2, 4, 0),
])
def test_gpu_nodes_hold_the_world_on_the_fewest_nodes(mesh: list[str], nodes: int, per_node: int, idle: int) -> None:
    """On 4-GPU Perlmutter nodes the fewest nodes that hold the ranks, at most a GPU's worth each: the last node
    partly used, the job asking Slurm for exactly the world's tasks, and the script saying how many GPUs stay
    idle (the first node count that divided the world asked for 7 nodes for 7 ranks)."""
    world = 1
    for m in mesh:
        if m.split("=")[0] in ("parallel.replicas", "parallel.pipeline"):
            world *= int(m.split("=")[1])
    cfg = compose(["cluster=perlmutter", "cluster.account=m0000", f"train.batch_size={4 * world}", *mesh,
                   "cluster.python=python"])
    assert (cfg.cluster.nodes, cfg.cluster.tasks_per_node, cfg.cluster.ntasks) == (nodes, per_node, world)
    text = render(cfg, JOB_DIR, CONFIG)
    assert f"#SBATCH --nodes={nodes}" in text and f"#SBATCH --ntasks-per-node={per_node}" in text
    assert (f"#SBATCH --ntasks={world}" in text) == (nodes * per_node > world)
    assert (f"; {idle} GPU(s) idle." in text.splitlines()[1]) == (idle > 0), text.splitlines()[1]
