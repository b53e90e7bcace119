"""The job suite end to end on the real Slurm test cluster, through the `gems` command.

Needs scripts/slurm_cluster.sh start (CI does it). A 2-point sweep (R = 2 and 4 on 2 nodes) reaches its table,
and its 2-node x 2-task job a record with 4 ranks on 2 nodes and the serial losses. ``gems`` runs through
``gems.cli.main`` in the test's process (tests/_cli.py's ``gems_here``: the launcher's own code; the jobs and their
ranks are real, on the cluster's nodes).
"""
import shutil

import pytest
import torch
from _cli import gems_here, records

pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(shutil.which("sinfo") is None, reason="Slurm is not installed (scripts/slurm_cluster.sh start)")]

SMALL = ["model.size=32", "model.width=0.5", "train.batch_size=4", "train.steps=4", "train.warmup_steps=1"]


_SWEEP: dict = {}  # its folder, for the session (a worker may set a module's fixtures up twice)


@pytest.fixture
def sweep(tmp_path_factory):
    """A 2-point sweep on 2 nodes: R = 2 (a task a node) and R = 4 (two tasks a node), run once; its folder."""
    if "folder" not in _SWEEP:
        tmp = tmp_path_factory.mktemp("sweep")
        out = gems_here("sweep", f"results.dir={tmp}", "results.sweep=slurm_sweep", "cluster=local_slurm",
                        "cluster.nodes=2", "parallel.replicas=2,4", *SMALL)
        assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
        _SWEEP["folder"] = tmp / "slurm_sweep"
    return _SWEEP["folder"]


def test_two_nodes_two_tasks_reach_a_record_with_the_serial_losses(tmp_path, sweep):
    (r,) = [r for r in records(str(sweep)) if r["world_size"] == 4]  # the sweep's R = 4 point: 2 tasks a node
    assert r["status"] == "ok" and r["nodes"] == 2, r.get("error")
    assert len(r["env"]["hostnames"]) == 2 and r["env"]["slurm_job_id"]
    serial = gems_here("run", f"results.dir={tmp_path}/serial", *SMALL)
    assert serial.returncode == 0, serial.stderr
    (s,) = records(str(tmp_path / "serial"))
    torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(s["loss"]), rtol=1e-5, atol=1e-7)


def test_mpi_over_srun_pmi2(tmp_path):
    # MPICH under srun --mpi=pmi2 on four slurmd of one host. With MPICH's UCX netmod,
    # MPI_Init failed or hung now and then under load: Slurm 22.05 reads a long PMI-1 line
    # in pieces and rejects the tail ("mpi/pmi2: invalid client request"). local_slurm
    # selects the OFI netmod, whose address exchange is one short line per rank; no retry.
    out = gems_here("run", f"results.dir={tmp_path}", "cluster=local_slurm", "cluster.nodes=2",
                    "parallel.replicas=2", "comm=mpi", "cluster.timeout_min=4", "comm.timeout_s=60", *SMALL)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "invalid client request" not in out.stderr
    (r,) = records(str(tmp_path))
    assert r["status"] == "ok" and r["env"]["launcher"] == "mpi" and r["nodes"] == 2
    (script,) = tmp_path.rglob("*_submission.sh")
    assert "export MPIR_CVAR_CH4_NETMOD=ofi" in script.read_text()


def test_a_two_point_sweep_reaches_its_table(sweep):
    table = (sweep / "table.md").read_text()
    assert table.count("| cosmoflow32-R") == 2 and "| ok |" in table
    assert (sweep / "scaling.png").exists()


def test_slurm_failure_is_recorded_not_waited_on(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", "cluster=local_slurm", "cluster.nodes=2", "parallel.replicas=2",
                    "fault.kill_rank=1", "fault.at_step=1", "comm.timeout_s=30", *SMALL)
    assert out.returncode == 1, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    assert r["status"] == "failed" and r["error"]


def test_a_requeued_job_resumes_from_its_checkpoint(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", "cluster=local_slurm", "cluster.nodes=2", "parallel.replicas=2",
                    "fault.preempt_at_step=2", "cluster.timeout_min=6", *SMALL)
    assert out.returncode == 0, out.stderr[-3000:]
    (r,) = records(str(tmp_path))
    assert r["status"] == "ok" and r["restarts"] == 1 and len(r["loss"]) == 4


def test_two_nodes_sharing_a_tmpdir_stage_the_same_data_each_in_a_folder_of_its_own(tmp_path):
    """data.stage=node on two nodes whose staging folder lies on the same storage (the test cluster's nodes share
    this host's disk, as nodes share a TMPDIR on a parallel filesystem): each node copies into a folder named by
    the job and the node, so they never write the same paths; the run trains like one that reads in place, and
    the copies are gone at the end. (The run that reads in place is a local one of the same mesh: the launcher
    changes no loss.)"""
    from gems.data.synth import write_synthetic

    write_synthetic(tmp_path / "train", 8, (4, 32, 32, 32), seed=1)
    shared = tmp_path / "shared-tmp"
    base = ["parallel.replicas=2", "data=hdf5", f"data.path={tmp_path / 'train'}", *SMALL]
    staged = gems_here("run", f"results.dir={tmp_path}/staged", "cluster=local_slurm", "cluster.nodes=2",
                       "cluster.tasks_per_node=1", *base, "data.stage=node", f"data.stage_dir={shared}")
    assert staged.returncode == 0, staged.stderr[-3000:]
    plain = gems_here("run", f"results.dir={tmp_path}/plain", *base)
    assert plain.returncode == 0, plain.stderr[-3000:]
    (s,), (p,) = records(str(tmp_path / "staged")), records(str(tmp_path / "plain"))
    assert s["loss"] == p["loss"]
    note = next(n for n in s["notes"] if "copied to" in n)
    assert f"-{s['env']['slurm_job_id']}-node" in note, note  # the job's and the node's own folder
    assert "8 files" in note and shared.is_dir() and not list(shared.iterdir())
