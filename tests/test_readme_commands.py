"""Every command the README, jobs/README.md and the pages under docs/ show runs here as written (with
one step), so a documented example can never be the broken one; the ones that need another machine say why.

The commands are read from the documents themselves (README.md, jobs/README.md and every docs/*.md, in
sorted order; fenced ``bash`` blocks and indented code lines): a command added to any of them without a
line in COMMANDS fails the first test, and so does a line in COMMANDS that no document shows any more."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import gems_here, records

ROOT = Path(__file__).resolve().parents[1]
FEWER = ["train.steps=1", "train.warmup_steps=0"]
WALK = "walkthrough"

#: command as documented -> overrides for the test (fewer steps; a key the command names takes the test's value), or
#: a reason it does not run here
COMMANDS: dict[str, list[str] | str] = {
    "bash scripts/setup.sh && gems run": [],  # the set-up is CI's first step: the test runs `gems run`
    "bash scripts/test.sh": "this test suite itself",
    "bash scripts/gpu_check.sh": "needs a GPU (its summary is committed under results/gpu/ where one was lent)",
    "bash scripts/gpu_check.sh --prepare": "copies this machine's installed pure-Python packages into .gpu/site (git "
        "ignores it) for a GPU machine that lacks them; the dry lease (tests/test_gpu_check.py) runs what it carries",
    "bash scripts/gpu_check.sh --dry": "tests/test_gpu_check.py runs it (its 1F1B part, to keep the suite short)",
    # a warm-up step and a measured one, every rank's messages and collectives logged and replayed under NCCL's rules
    # (REPLAYED below)
    "gems run parallel.spatial=2": ["train.steps=2", "train.warmup_steps=1"],
    "gems run parallel.spatial=[2,2] parallel.spatial_dims=[0,1]": FEWER,
    "gems run parallel.pipeline=2 parallel.schedule=mast": FEWER,
    "gems run parallel.pipeline=4 parallel.schedule=mast parallel.balance_by=time": FEWER,
    "gems run parallel.pipeline=4 parallel.schedule=master parallel.gems_replicas=4 train.batch_size=8": FEWER,
    "gems run parallel.replicas=2 parallel.pipeline=2 parallel.spatial=2 parallel.schedule=mast train.batch_size=8": FEWER,
    # the smallest sizes that still cut the same models the same way (the documented sizes take minutes here)
    "gems run model=unet3d model.size=64 parallel.spatial=4": [*FEWER, "model.size=32"],
    "gems run model=resnet model.depth=110 model.size=512 parallel.pipeline=4 parallel.schedule=mast":
        [*FEWER, "model.size=64"],
    # the HDF5 commands at 64^3 instead of 128^3 (the same reads, cuts and recipe; a quarter of the time)
    "gems data synth data.path=/scratch/cosmo data.num_samples=64 model.size=128":
        ["data.num_samples=8", "model.size=64"],
    "gems run model=cosmoflow data=files data.path=/scratch/cosmo parallel.spatial=4": [*FEWER, "model.size=64"],
    "gems data synth data.path=/scratch/cosmo/val data.num_samples=16 model.size=128 train.seed=1":
        ["data.num_samples=4", "model.size=64"],
    # one epoch of the 8 samples the test writes instead of 128 epochs of 64, the evaluation on 4
    "gems run model=cosmoflow_mlperf data=files data.path=/scratch/cosmo data.val_path=/scratch/cosmo/val "
    "train.epochs=128 train.target_mae=0.124": ["train.epochs=1", "train.warmup_steps=1", "model.size=64"],
    "gems run comm=mpi parallel.replicas=2": FEWER,
    "gems sweep +experiment=replication_weak": "the command jobs/replication_weak.sh runs (`exec gems sweep "
                                               "+experiment=replication_weak \"$@\"`), which runs here: its three "
                                               "points are checked there",
    "gems run cluster=local_slurm cluster.nodes=2 parallel.replicas=4": FEWER,
    "gems sweep +experiment=cosmoflow512_weak cluster=perlmutter cluster.account=m1234":
        "submits to NERSC Perlmutter (its render is tested in test_render.py)",
    "gems render cluster=juwels_booster cluster.account=myproj parallel.spatial=8 parallel.replicas=8 train.batch_size=64": [],
    "jobs/replication_weak.sh": FEWER,
    "jobs/replication_weak.sh cluster=local_slurm":
        "the script runs here as jobs/replication_weak.sh (the sweep it execs); the same study on the Slurm test "
        "cluster, waited for, is the walkthrough's second sweep (test_the_studies_walkthrough_runs_in_order)",
    "ACCOUNT=m1234 jobs/cosmoflow512_weak.sh cluster=perlmutter": "submits to NERSC Perlmutter",
    "gems plan model=cosmoflow model.size=512 cluster.gpu_memory_gb=40 train.batch_size=1": [],
    # the studies walkthrough: one after the other in one folder (test_the_studies_walkthrough_runs_in_order)
    "gems sweep +experiment=replication_weak cluster=local_slurm --detach": WALK,
    "gems status replication_weak": WALK,
    "gems results results/replication_weak": WALK,
    "gems sweep +experiment=replication_weak cluster=local_slurm results.sweep=replication_weak_sgd "
    "train.optimizer=sgd": WALK,
    "gems results --compare results/replication_weak results/replication_weak_sgd": WALK,
    "gems cancel replication_weak": WALK,
    "gems plan model=cosmoflow model.size=512 parallel.spatial=8 cluster=perlmutter cluster.account=x": [],
    "gems plan model=resnet model.depth=1001 model.size=512 parallel.pipeline=4 parallel.schedule=mast "
    "cluster.gpu=h100": [],
    "gems plan +experiment=cosmoflow512_weak cluster=perlmutter cluster.account=x": [],
    # the sample-size study (docs/science.md): the universes at the smallest size, the study's taste as documented
    "gems data synth data.kind=cosmology data.path=data/cosmology/train data.val_path=data/cosmology/val "
    "data.universes=256 data.val_universes=32 data.box_cells=128 data.box_mpc=1024":
        ["data.universes=2", "data.val_universes=1", "data.box_cells=32"],
    "jobs/cosmoflow_sample_size.sh": "the study itself, about an hour here: its result is committed in "
                                     "results/cosmoflow_sample_size",
    "UNIVERSES=8 VAL_UNIVERSES=4 BOX_CELLS=64 jobs/cosmoflow_sample_size.sh data.crop=32 train.epochs=1 "
    "train.bn_recalibrate=2 results.sweep=sample_size_taste":
        "the same script, study and arguments as its cluster=local_slurm line, which runs here (1-2 minutes; the "
        "ranks of every other test run this way)",
    "UNIVERSES=8 VAL_UNIVERSES=4 BOX_CELLS=64 jobs/cosmoflow_sample_size.sh cluster=local_slurm data.crop=32 "
    "train.epochs=1 train.bn_recalibrate=2 results.sweep=sample_size_taste": [],
    "gems run +experiment=cosmoflow_sample_size data.crop=64 model.norm=batch data.augment=none "
    "train.batch_size=8 train.epochs=4 \"train.lr_decay_boundaries=[2.8,3.6]\" data.path=data/cosmology/train "
    "data.val_path=data/cosmology/val":
        "one point of the study with another recipe, about 17 minutes here, on the study's universes: its records "
        "are committed in results/cosmoflow_batchnorm (the taste above runs the same experiment)",
    "gems run +experiment=cosmoflow_sample_size data.crop=128 train.epochs=12 "
    "\"train.lr_decay_boundaries=[8.4,10.8]\" data.path=data/cosmology/train data.val_path=data/cosmology/val":
        "the 128^3 point for twice the study's epochs, about 27 minutes here: its record is committed in "
        "results/cosmoflow_longer (the taste above runs the same experiment)",
    "gems data synth data.kind=cosmology data.path=data/cosmology1024/train data.val_path=data/cosmology1024/val "
    "data.universes=1024 data.val_universes=32 data.box_cells=128 data.box_mpc=1024":
        ["data.universes=2", "data.val_universes=1", "data.box_cells=32"],
    "gems run +experiment=cosmoflow_sample_size data.crop=128 train.epochs=4 \"train.lr_decay_boundaries=[2.8,3.6]\" "
    "cluster.time_min=60 data.path=data/cosmology1024/train data.val_path=data/cosmology1024/val":
        "the 128^3 point on four times the universes, about 40 minutes here: its record is committed in "
        "results/cosmoflow_more_universes (the taste above runs the same experiment)",
    "gems sweep +experiment=cosmoflow_sample_size cluster=perlmutter cluster.account=m1234 "
    "data.path=/pscratch/cosmoUniverse/train data.val_path=/pscratch/cosmoUniverse/val data.box_cells=512 "
    "data.standardize=null data.crop=128,256,512 model.width=1 train.epochs=32 \"train.lr_decay_boundaries=[22.4,28.8]\"":
        "submits to NERSC Perlmutter",
    # docs/training.md: what a checkpoint holds the step, synchronous and async (CosmoFlow 128^3 here)
    "gems run model=cosmoflow model.size=128 train.batch_size=2 train.steps=7 train.warmup_steps=1 "
    "train.checkpoint_every=2 train.checkpoint_async=false":
        ["model.size=32", "model.width=0.25", "train.steps=3", "train.checkpoint_every=1"],
    "gems run model=cosmoflow model.size=128 train.batch_size=2 train.steps=7 train.warmup_steps=1 "
    "train.checkpoint_every=2 train.checkpoint_async=true":
        ["model.size=32", "model.width=0.25", "train.steps=3", "train.checkpoint_every=1"],
    "gems plan model=cosmoflow model.size=512 parallel.spatial=4 parallel.replicas=512 train.batch_size=512 "
    "cluster=perlmutter cluster.account=x plan.dry_run=true plan.dry_run_rank=1234": [],
    # docs/data.md: the published sets are not here; tests/test_tfrecord.py and test_nifti.py run the same commands
    # on files written by TensorFlow and nibabel
    "gems data convert data.path=/data/cosmoUniverse_2019_05_4parE_tf_v2 data.out=/scratch/mlperf":
        "needs MLPerf's 1.7 TB set (tests/test_tfrecord.py converts TensorFlow's own files the same way)",
    "gems run model=cosmoflow_mlperf data=files data.path=/scratch/mlperf/train data.val_path=/scratch/mlperf/validation":
        "needs MLPerf's set converted (tests/test_tfrecord.py trains on converted TensorFlow files)",
    "gems run model=cosmoflow model.size=512 data=files data.path=/data/cosmoUniverse_2019_05_4parE parallel.spatial=8 "
    "cluster=perlmutter":
        "needs ExaLearn's universes and submits to NERSC Perlmutter (tests/test_layouts.py reads ExaLearn's layout "
        "a universe a sample)",
    "gems run model=cosmoflow_mlperf model.size=128 data=files data.path=/data/cosmoUniverse_2019_05_4parE "
    "data.crop=128 data.augment=cube":
        "needs ExaLearn's universes (tests/test_layouts.py cuts crops of data.crop from ExaLearn's layout)",
    "gems run model=unet3d model.size=128 data=files data.path=/data/lits/train data.val_path=/data/lits/val":
        "needs LiTS (tests/test_nifti.py trains the U-Net on nibabel's volumes)",
    "gems data convert data.path=/data/lits_gz data.out=/data/lits":
        "needs LiTS's .nii.gz (tests/test_nifti.py converts nibabel's the same way)",
    "gems data convert data.path=/data/lits_gz data.out=/data/lits_tiles data.tile=128":
        "needs LiTS's .nii.gz (tests/test_tiles.py converts nibabel's into tiles the same way)",
    "gems data convert data.path=/data/Task03_Liver data.out=/data/Task03_Liver_nii":
        "needs the Decathlon's Task03_Liver (tests/test_decathlon.py converts a task folder written as it ships)",
    "gems run model=unet3d model.size=128 data=files data.path=/data/Task03_Liver_nii data.val_path=/data/Task03_Liver_val":
        "needs the Decathlon's Task03_Liver converted (tests/test_decathlon.py trains on a converted task folder)",
    "gems data convert data.path=/data/nnUNet_raw/Dataset003_Liver data.out=/data/Dataset003_Liver_nii":
        "needs an nnU-Net raw dataset (tests/test_nnunet.py converts one written as nnU-Net takes it)",
    "gems run model=unet3d model.size=128 data=files data.path=/data/Dataset003_Liver_nii":
        "needs an nnU-Net dataset converted (tests/test_nnunet.py trains on a converted dataset)",
    "gems data check data.path=/data/Task03_Liver cluster=perlmutter cluster.nodes=4":
        "needs the Decathlon's task and submits to NERSC Perlmutter (tests/test_data_check.py checks as a Slurm job on "
        "the test cluster)",
    "gems data check data.path=/data/cosmoUniverse_2019_05_4parE_tf_v2/train data.workers=16":
        "needs MLPerf's set (tests/test_data_check.py checks TensorFlow's own files, good and bad)",
    # docs/planner.md: the search at 2048 GPUs takes most of a minute on this machine's first call
    "gems plan parallel=auto parallel.world=2048 model=unet3d model.size=256 train.batch_size=64 cluster=perlmutter "
    "cluster.account=x":
        "the search at 2048 GPUs, timed by `gems bench search` (results/bench/search.md); tests/test_search.py holds "
        "the same search to the exhaustive one on small worlds",
    "gems data synth data.kind=segmentation data.path=data/seg/train data.val_path=data/seg/val data.num_samples=16 "
    "data.val_samples=4 model=unet3d model.size=32": ["data.num_samples=2", "data.val_samples=1", "model.size=16"],
    "gems run model=unet3d model.size=32 model.width=0.25 data=files data.path=data/seg/train data.val_path=data/seg/val "
    "train.batch_size=4 train.epochs=40 train.eval_every=4 train.optimizer=adam train.lr=0.003":
        "the CPU-sized U-Net run, 4 minutes here: its figures are in docs/data.md (tests/test_nifti.py trains the same "
        "way, on one rank and S = 2)",
}

#: commands that need the Slurm test cluster
SLURM = ("cluster=local_slurm",)
#: documented runs whose ranks log every message and collective (GEMS_COMM_LOG) and replay them under NCCL's rules
#: (gems.commlog), as tests/test_nccl_order_runs.py's runs do: the README's own example hung in that replay once
REPLAYED = ("gems run parallel.spatial=2",)
#: `gems` commands run in this process through gems.cli.main, the console script's own function (tests/_cli.gems_here):
#: every one; the ranks a run or a sweep launches are real processes (multiprocessing's fork server; Slurm's, mpiexec's),
#: given the launcher's environment. The study scripts are processes of their own (bash calls `gems`); what only the
#: console script's own process does (forking its ranks from itself) is tests/test_cli.py's and test_forkserver.py's
HERE = ("plan", "render", "data", "results", "status", "cancel", "run", "sweep", "eval")


#: the documents whose commands are listed in COMMANDS
DOCS = [ROOT / "README.md", ROOT / "jobs" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def documented() -> list[str]:
    out: list[str] = []
    for doc in DOCS:
        text = doc.read_text()
        lines = [ln for block in re.findall(r"```bash\n(.*?)```", text, re.S) for ln in block.splitlines()]
        lines += [ln for ln in text.splitlines() if ln.startswith("    ") and not ln.startswith("     ")]
        for ln in lines:
            cmd = ln.split("  #")[0].strip()
            if re.match(r"([A-Z_]+=\S+ )*(gems |jobs/|bash scripts/)", cmd) or cmd == "gems run":
                out.append(re.sub(r"\s+", " ", cmd))
    return list(dict.fromkeys(out))


def test_every_documented_command_is_listed_here():
    docs = documented()
    assert set(docs) == set(COMMANDS), (sorted(set(docs) - set(COMMANDS)), sorted(set(COMMANDS) - set(docs)))


RUN = [c for c, how in COMMANDS.items() if isinstance(how, list)]
WALKTHROUGH = [c for c, how in COMMANDS.items() if how == WALK]
#: the walkthrough's two studies: one step a point, and two of the study's three points, R = 1 and 2 (each point a
#: Slurm job; R = 4 over two nodes is `gems run cluster=local_slurm cluster.nodes=2 parallel.replicas=4` above)
WALK_SWEEP = [*FEWER, "parallel.replicas=1,2"]


@pytest.mark.slurm
@pytest.mark.skipif(shutil.which("sinfo") is None, reason="no Slurm test cluster")
def test_the_studies_walkthrough_runs_in_order(tmp_path):
    import time

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for cmd in WALKTHROUGH:
        words = shlex.split(cmd)
        if words[1] == "sweep":  # a process of its own, as a user's: it submits the study's points to Slurm
            out = subprocess.run([sys.executable, "-m", "gems.cli", *words[1:], *WALK_SWEEP], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=600)
        else:  # status, results, cancel: they launch nothing (gems.cli.main here)
            out = gems_here(*words[1:], cwd=tmp_path)
        assert out.returncode == 0, f"{cmd}\n{out.stderr[-3000:]}\n{out.stdout[-1500:]}"
        if "--detach" in words:  # wait for the detached study, as a user would with gems status
            t0 = time.monotonic()
            while True:
                st = gems_here("status", "replication_weak", cwd=tmp_path)
                assert st.returncode == 0, st.stderr[-1500:]
                if "pending" not in st.stdout and "running" not in st.stdout:
                    break
                assert time.monotonic() - t0 < 900, st.stdout  # a guard against a hang only
                time.sleep(3)
    assert (tmp_path / "results" / "replication_weak" / "compare-replication_weak-vs-replication_weak_sgd.md").exists()


def _marks(cmd: str) -> list:
    if any(s in cmd for s in SLURM):
        return [pytest.mark.slurm, pytest.mark.skipif(shutil.which("sinfo") is None, reason="no Slurm test cluster")]
    return []


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=_marks(c)) for c in RUN if "/scratch/cosmo" not in c])
def test_the_documented_command_runs(tmp_path, cmd):
    logged = {"GEMS_COMM_LOG": str(tmp_path / "comm")} if cmd in REPLAYED else {}
    out = _run(tmp_path, cmd, COMMANDS[cmd], logged)
    if logged:  # every rank's calls, set-up to the record's, replay under NCCL's rules, strict sends too
        from gems.commlog import load, replay

        (rec,) = records(str(tmp_path / "results"))
        logs = load(tmp_path / "comm")
        assert sorted(logs) == list(range(rec["world_size"])) and rec["world_size"] > 1
        for strict in (False, True):
            ran = replay(logs, strict_sends=strict)
            assert ran["messages"] > 0 and ran["collectives"] > 0
    if cmd == "jobs/replication_weak.sh":  # the sweep it execs, `gems sweep +experiment=replication_weak`: R = 1, 2, 4
        recs = records(str(tmp_path / "results" / "replication_weak"))
        assert sorted(r["world_size"] for r in recs) == [1, 2, 4], [r["_path"] for r in recs]
    if cmd.startswith("UNIVERSES") and "cluster=local_slurm" in cmd:  # the study's cluster writes the universes too
        assert "gems data synth: Slurm job" in out.stdout, out.stdout[-1500:]


def test_the_documented_hdf5_commands_run_one_after_the_other(tmp_path):
    for cmd in [c for c in RUN if "/scratch/cosmo" in c]:
        _run(tmp_path, cmd.replace("/scratch/cosmo", str(tmp_path / "cosmo")), COMMANDS[cmd])


def _here(args: list[str], cwd: Path, environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``gems ARGS`` in this process, with ``environ`` set for it (the launcher hands its environment to the ranks)
    and put back after."""
    before = {k: os.environ.get(k) for k in environ}
    os.environ.update(environ)
    try:
        return gems_here(*args, cwd=cwd)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run(tmp_path: Path, cmd: str, extra: list[str], environ: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    """``cmd`` as documented, with the test's ``extra`` overrides and ``environ`` (for a process of its own)."""
    words = shlex.split(cmd.split("&&")[-1])
    given = {}  # the variables the command line sets (UNIVERSES=8 jobs/...)
    while words and "=" in words[0] and not words[0].startswith(("gems", "jobs/")):
        k, _, v = words.pop(0).partition("=")
        given[k] = v
    env = dict(os.environ, PYTHONUNBUFFERED="1", **given, **(environ or {}))
    keys = {e.split("=", 1)[0] for e in extra}
    args = [a for a in words[1:] if a.split("=", 1)[0] not in keys] + list(extra)  # the test's value of a key
    if words[0] == "gems" and words[1] in HERE:
        out = _here(args, tmp_path, {**given, **(environ or {})})
    else:
        if words[0] == "gems":
            argv = [sys.executable, "-m", "gems.cli", *args]
        else:  # a study script: it calls `gems` on PATH
            argv = ["bash", str(ROOT / words[0]), *args]
            env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
        out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"{cmd}\n{out.stderr[-3000:]}\n{out.stdout[-1500:]}"
    if words[0] in ("jobs/replication_weak.sh",) or words[1] in ("run", "sweep"):
        recs = records(str(tmp_path / "results"))
        assert recs and all(r["status"] == "ok" for r in recs), [r.get("error") for r in recs]
    return out
