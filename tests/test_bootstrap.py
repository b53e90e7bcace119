"""Rank discovery from each launcher's traces, and the torchrun path end to end."""
import json
import os
import subprocess
import sys

import pytest

from gems.bootstrap import discover, first_slurm_host, port_from_job


@pytest.mark.parametrize("nodelist,first", [
    ("node[1-4]", "node1"), ("gpu07", "gpu07"), ("nid[001234,001236-001240]", "nid001234"), ("a01,b02", "a01"),
])
def test_first_host_of_a_nodelist(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_port_is_derived_from_the_job_id_and_in_range():
    ports = {port_from_job(str(j)) for j in range(1000, 1100)}
    assert len(ports) == 100
    assert port_from_job("123_4") == port_from_job("123_4")
    # never in Linux's ephemeral range (32768-60999 by default), where outgoing connections take their port:
    # 20000 + id mod 20000 fell there for a third of the job ids
    every = [port_from_job(str(j)) for j in range(0, 200_000, 7)]
    assert all(1024 <= p < 32768 for p in every), max(every)


def test_gpus_are_told_apart_without_a_uuid(monkeypatch):
    """ROCm builds without ``props.uuid``: under ``--gpus-per-task=1`` every rank sees its GPU as index 0, so
    comparing indices refused every job as two ranks on one GPU. The PCI address tells GPUs apart, else the
    visible-devices list's physical index."""
    from types import SimpleNamespace

    import torch

    from gems.bootstrap import device_id

    dev = torch.device("cuda", 0)
    props = {"a": SimpleNamespace(pci_domain_id=0, pci_bus_id=0xC1, pci_device_id=0),
             "b": SimpleNamespace(pci_domain_id=0, pci_bus_id=0xC9, pci_device_id=0)}
    ids = []
    for k in ("a", "b"):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, _p=props[k]: _p)
        ids.append(device_id(dev, "nid1"))
    assert ids == ["nid1/pci-0000:c1:00", "nid1/pci-0000:c9:00"]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace())
    seen = []
    for physical in ("3", "5"):
        monkeypatch.setenv("ROCR_VISIBLE_DEVICES", physical)
        seen.append(device_id(dev, "nid1"))
    assert seen == ["nid1/ROCR_VISIBLE_DEVICES=3", "nid1/ROCR_VISIBLE_DEVICES=5"]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid="GPU-1234"))
    assert device_id(dev, "nid1") == "nid1/GPU-1234"


def test_slurm_variables(monkeypatch):
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[12-15]")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    rank, size, local, addr, port, source, _ = discover("auto")
    assert (rank, size, local, addr, port, source) == (5, 8, 1, "gpu12", port_from_job("4242"), "slurm")


def test_torchrun_variables_win_over_slurm(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert discover("auto")[:6] == (1, 2, 0, "10.1.2.3", 29999, "torchrun")


def test_torchrun_launches_a_two_rank_job(tmp_path):
    from omegaconf import open_dict

    from gems.config import compose, to_yaml

    cfg = compose(["model.size=32", "model.width=0.25", "parallel.replicas=2", "train.batch_size=2",
                   "train.steps=2", "train.warmup_steps=1", f"results.dir={tmp_path}"])
    with open_dict(cfg):
        cfg.run_id = "torchrun-test"
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "gems.worker", "--config", str(path)], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads((tmp_path / "torchrun-test.json").read_text())
    assert rec["status"] == "ok" and rec["world_size"] == 2 and rec["env"]["launcher"] == "torchrun"


def test_python_api_example_under_torchrun():
    import pathlib

    example = pathlib.Path(__file__).resolve().parent.parent / "examples" / "spatial_own_loop.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_"))}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                          str(example), "--replicas", "2"], capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "losses equal the serial run" in out.stdout


def test_a_rendezvous_port_this_process_picks_is_free_and_outside_the_ephemeral_range():
    """Outgoing connections take their local port from the kernel's ephemeral range (32768-60999 here), so a
    port picked there may be taken before rank 0 listens on it; gems draws from the job ports' range instead."""
    import socket

    from gems.bootstrap import PORT_BASE, PORT_SPAN, free_port

    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert len(ports) > 1  # drawn, not one fixed port
    for port in ports:
        assert PORT_BASE <= port < PORT_BASE + PORT_SPAN
    with socket.socket() as s:  # and free: rank 0 can listen on it
        port = free_port("127.0.0.1")
        s.bind(("127.0.0.1", port))
        s.listen()
