"""Cluster presets that launch on their machines: the network settings their centres document are in
the rendered sbatch script, and a MASTER_ADDR a site sets is the rendezvous under comm.backend=mpi too."""
from __future__ import annotations

import os
import sys
import types

import pytest
from test_render import CONFIG, JOB_DIR, _cfg  # tests/ is on sys.path (conftest.py)

from gems.bootstrap import discover
from gems.launch.render import render

# preset -> lines its rendered script must hold (the sources are named beside them in conf/cluster/)
NETWORK: dict[str, list[str]] = {
    "juwels_booster": ['export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)i"'],
    "frontier": [
        "module load rccl-net-plugin",
        "#SBATCH --network=disable_rdzv_get",
        "export NCCL_SOCKET_IFNAME=hsn0,hsn1,hsn2,hsn3",
        "export NCCL_CROSS_NIC=1",
        "export NCCL_NET_GDR_LEVEL=PHB",
        "export FI_MR_CACHE_MONITOR=kdreg2",
        "export FI_CXI_DISABLE_HOST_REGISTER=1",
        "export FI_CXI_DEFAULT_CQ_SIZE=131072",
        "export FI_CXI_RDZV_PROTO=alt_read",
        "export FI_CXI_RX_MATCH_MODE=hybrid",
    ],
    "alps": [
        'export NCCL_NET="AWS Libfabric"',
        "export NCCL_NET_GDR_LEVEL=PHB",
        "export NCCL_CROSS_NIC=1",
        "export NCCL_PROTO=^LL128",
        "export FI_CXI_DEFAULT_CQ_SIZE=131072",
        "export FI_CXI_DEFAULT_TX_SIZE=16384",
        "export FI_CXI_DISABLE_HOST_REGISTER=1",
        "export FI_CXI_RX_MATCH_MODE=software",
        "export FI_MR_CACHE_MONITOR=userfaultfd",
    ],
}


@pytest.mark.parametrize("name", sorted(NETWORK))
def test_rendered_script_holds_the_network_settings(name: str) -> None:
    lines = render(_cfg(name), JOB_DIR, CONFIG).splitlines()
    missing = [want for want in NETWORK[name] if want not in lines]
    assert not missing, f"{name}: the rendered sbatch script lacks {missing}"
    if name == "frontier":  # the plugin's module needs rocm loaded before it
        assert lines.index("module load PrgEnv-gnu rocm") < lines.index("module load rccl-net-plugin")
    # each setting names its source in a comment just above it, in the script a user submits
    first = min(lines.index(w) for w in NETWORK[name] if not w.startswith("#SBATCH"))
    above = [ln for ln in lines[:first] if ln.startswith("# ")]
    assert above and any("Source:" in ln or "docs." in ln for ln in above[-8:]), (name, above[-8:])


class _FakeComm:
    """COMM_WORLD of one rank of a job: bcast hands every rank what rank 0 sends."""

    def __init__(self, rank: int, size: int, root_sends: object = None) -> None:
        self.rank, self.size, self.root_sends = rank, size, root_sends
        self.sent: object = None

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Split_type(self, split_type: int, key: int = 0) -> _FakeComm:
        return _FakeComm(self.rank % 4, 4)

    def Free(self) -> None:
        pass

    def bcast(self, obj: object, root: int = 0) -> object:
        if self.rank == root:
            self.sent = obj
            return obj
        return self.root_sends

    def Barrier(self) -> None:
        pass


def _fake_mpi(monkeypatch: pytest.MonkeyPatch, comm: _FakeComm) -> None:
    mpi = types.SimpleNamespace(COMM_WORLD=comm, COMM_TYPE_SHARED=0)
    pkg = types.ModuleType("mpi4py")
    pkg.MPI = mpi  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mpi4py", pkg)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)


def test_mpi_rank0_sends_the_site_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "jwb0038i")
    comm = _FakeComm(rank=0, size=8)
    _fake_mpi(monkeypatch, comm)
    rank, size, _, addr, port, source, _ = discover("mpi")
    assert (rank, size, source, addr) == (0, 8, "mpi", "jwb0038i")
    assert comm.sent == ("jwb0038i", port) and port > 0  # every rank is told the site's address


def test_mpi_rank0_sends_its_host_name_without_a_site_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    comm = _FakeComm(rank=0, size=2)
    _fake_mpi(monkeypatch, comm)
    assert discover("mpi")[3] == socket.gethostname()


def test_mpi_ranks_take_rank0s_address_over_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "somewhere-else")
    _fake_mpi(monkeypatch, _FakeComm(rank=3, size=8, root_sends=("jwb0038i", 31234)))
    assert discover("mpi")[3:5] == ("jwb0038i", 31234)  # all ranks meet at one store


def test_init_world_under_mpi_keeps_the_site_master_addr(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MASTER_ADDR env:// reads is the site's, not rank 0's host name, after init_world."""
    import torch.distributed as dist

    from gems.bootstrap import init_world
    from gems.config import compose

    # init_world writes os.environ (RANK, MASTER_PORT...): a copy keeps that from the other tests
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE",
                                                     "TORCH_NCCL_ASYNC_ERROR_HANDLING")})
    monkeypatch.setenv("MASTER_ADDR", "jwb0038i")
    _fake_mpi(monkeypatch, _FakeComm(rank=0, size=2))
    seen: dict[str, str] = {}

    def fake_rendezvous(url: str, rank: int, size: int, **kw: object):  # env:// reads the environment here
        seen.update(addr=os.environ["MASTER_ADDR"], port=os.environ["MASTER_PORT"])
        yield dist.HashStore(), rank, size

    def fake_init(backend: str, **kw: object) -> None:
        seen.update(backend=backend, nccl_errors=os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", ""))

    import gems.bootstrap

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "rendezvous", fake_rendezvous)
    monkeypatch.setattr(gems.bootstrap, "check_devices", lambda *a, **k: None)  # the other rank is not there
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    world = init_world(compose(["comm.backend=mpi", "train.device=cpu"]))
    assert seen["addr"] == "jwb0038i" == world.master_addr
    assert seen["port"] == str(world.master_port) and world.source == "mpi" and seen["backend"] == "gloo"
    # NCCL's failures raise in the rank (2: CleanUpOnly) so that it writes its failure report; torch's default (3)
    # would kill the process from NCCL's watchdog without one (docs/design.md, "Rules of the GPU path")
    assert seen["nccl_errors"] == "2"
