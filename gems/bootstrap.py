"""Rank discovery and rendezvous: who am I, how many are we, where do we meet; which device and which backend.

A rank started by mpirun, Slurm, torchrun or gems's local launcher, or alone, finds its rank, the world's size and
the rendezvous (:func:`discover`), takes one GPU (``LOCAL_RANK``) or the CPU, and joins one backend a job: NCCL on
GPUs, gloo on CPUs; ``comm.backend=mpi`` sums the gradients through mpi4py beside it (gems.replication).
"""
from __future__ import annotations

import ctypes
import datetime
import os
import random
import re
import socket
import subprocess
from dataclasses import dataclass
from typing import Any

import torch

from gems import capture
from gems.config import section
from gems.errors import ConfigError
from gems.memory import limit_gpu, rank_cap_bytes


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str  # mpi | slurm | torchrun | single
    device: torch.device
    backend: str  # torch.distributed backend: nccl | gloo
    grad_comm: str  # torch | mpi
    mpi_comm: Any = None  # mpi4py COMM_WORLD when comm.backend=mpi
    hostname: str = ""
    timeout: datetime.timedelta | None = None  # of every collective: pass it to Mesh.build_groups


def first_slurm_host(nodelist: str) -> str:
    """The first host of a Slurm nodelist such as ``node[1-4],gpu07`` or ``nid[001234,001236]``."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    m = re.match(r"([^\[,]+)(\[([^\]]+)\])?", nodelist)
    if not m:
        return nodelist
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


#: the rendezvous ports a Slurm job's id picks from: 12000-31999, below Linux's ephemeral range (32768-60999 by
#: default, net.ipv4.ip_local_port_range), where outgoing connections take their local port and may hold the one
#: a job wants (20000 + id mod 20000 fell there for a third of the job ids); above the well-known ports
PORT_BASE, PORT_SPAN = 12000, 20000


def port_from_job(job_id: str) -> int:
    """The rendezvous port of a Slurm job, the same on every node: from its id, outside the ephemeral range."""
    digits = int(re.sub(r"\D", "", job_id) or 0)
    return PORT_BASE + digits % PORT_SPAN


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` now (all interfaces by default), for a rendezvous this process picks: drawn at
    random from the job ports' range (:data:`PORT_BASE`), not the kernel's ephemeral range, where any outgoing
    connection (a gloo pair of another job on the node) may take it between this check and rank 0's listen
    (EADDRINUSE: it failed a test run that way). The ephemeral range only if 64 draws are all taken."""
    draw = random.SystemRandom()
    for _ in range(64):
        port = PORT_BASE + draw.randrange(PORT_SPAN)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def discover(comm_backend: str = "auto") -> tuple[int, int, int, str, int, str, Any]:
    """(rank, size, local_rank, master_addr, master_port, source, mpi_comm) from the environment.

    * ``mpirun``/``mpiexec``/``srun --mpi=pmi2`` with ``comm.backend=mpi``: mpi4py's COMM_WORLD gives rank and
      size; rank 0 picks a free port and broadcasts it with its ``MASTER_ADDR`` (its host name where none is set),
      so no environment is needed and every rank takes rank 0's address.
    * Slurm (``srun``, also under submitit): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``; the host is the
      first node of ``SLURM_JOB_NODELIST`` and the port is derived from the job id (:func:`port_from_job`), so
      every rank computes the same address without talking.
    * torchrun and gems's local launcher: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
      ``MASTER_PORT``.
    * nothing: a single process.

    A ``MASTER_ADDR`` already in the environment always wins over the derived one, so a site that must rendezvous
    over another interface sets it in ``cluster.setup``.
    """
    env = os.environ
    if comm_backend == "mpi":
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ConfigError("comm.backend", "mpi", f"mpi4py with an MPI library (pip install mpi4py mpich): {e}") from None
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local_rank = local.Get_rank()
        local.Free()
        # rank 0 hosts the store: its MASTER_ADDR (a site's, e.g. an InfiniBand name) wins over its host
        # name, and every rank takes rank 0's choice, so all agree even where their environments differ
        addr_port = (env.get("MASTER_ADDR") or socket.gethostname(), free_port()) if rank == 0 else None
        addr, port = comm.bcast(addr_port, root=0)
        # rank 0 leaves MPI for the TCPStore next; without asynchronous progress (MPICH's OFI
        # tcp provider) its bcast may still sit in its send queue, and rank 1 would wait
        # until rank 0 calls MPI again. The barrier completes the delivery first.
        comm.Barrier()
        return rank, size, local_rank, addr, port, "mpi", comm
    if "RANK" in env and "WORLD_SIZE" in env:
        return (int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)), "torchrun", None)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "localhost")
        job = env.get("SLURM_JOB_ID", "0")
        return (int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)),
                first_slurm_host(nodelist), port_from_job(job), "slurm", None)
    return 0, 1, 0, "127.0.0.1", 0, "single", None


def pick_device(train_device: str, local_rank: int) -> torch.device:
    """This rank's device: GPU ``local_rank`` of those it sees (a launcher that binds one GPU to each task,
    ``srun --gpus-per-task=1``, leaves it one: it takes that one), else the CPU. Whether two ranks of a node
    ended up on one GPU is checked across the ranks (:func:`check_devices`)."""
    if train_device == "cuda" or (train_device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda", "auto or cpu (no CUDA device is visible on this node)")
        n = torch.cuda.device_count()
        dev = torch.device("cuda", local_rank if local_rank < n else local_rank % n)
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def device_id(device: torch.device, host: str) -> str:
    """The node and the GPU a rank runs on, or "" for CPU ranks: the GPU's UUID where the build reports one, else
    its PCI address (ROCm builds without ``uuid``: under ``--gpus-per-task=1`` every rank's device index is 0,
    which told no GPUs apart), else the physical index the visible-devices list maps it to."""
    if device.type != "cuda":
        return ""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid:
        return f"{host}/{uuid}"
    pci = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if all(v is not None for v in pci):
        return f"{host}/pci-{pci[0]:04x}:{pci[1]:02x}:{pci[2]:02x}"
    index = device.index or 0
    for var in ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        visible = [v for v in os.environ.get(var, "").split(",") if v.strip()]
        if index < len(visible):
            return f"{host}/{var}={visible[index].strip()}"
    return f"{host}/{index}"


#: the test aid that lets several ranks share one GPU (scripts/gpu_check.sh): never for users' runs
SHARE_GPU_ENV = "GEMS_TEST_SHARE_GPU"
#: NCCL then treats each rank as a host of its own and carries messages over sockets on the loopback, with its
#: real matching, stream and connection rules (the rig other projects use to test multi-rank NCCL on one GPU)
SHARE_GPU_NCCL = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
                  "NCCL_SOCKET_IFNAME": "lo"}


def sharing_gpu() -> bool:
    """Whether the test aid ``GEMS_TEST_SHARE_GPU=1`` is on: ranks of the local launcher may share a GPU, each
    with its own ``NCCL_HOSTID``. Timings of such runs mean nothing; whether they finish and their losses do."""
    return os.environ.get(SHARE_GPU_ENV) == "1"


def check_devices(store: Any, rank: int, size: int, device: torch.device, gpu: str) -> None:
    """Every rank of a job on one kind of device, and never two ranks on one GPU: a ConfigError on every rank
    otherwise, before the process group starts (mixed ranks would start gloo on some and NCCL on others and
    hang; NCCL refuses two ranks on one GPU with "Duplicate GPU detected" deep in the first collective).

    Agreed through the rendezvous store with O(1) requests a rank (counters, not a read of every rank's
    entry): how many ranks arrived, how many run on a GPU, how many share this rank's GPU."""
    store.add("gems/devices/cuda", 1 if device.type == "cuda" else 0)
    if gpu:
        store.add(f"gems/devices/gpu/{gpu}", 1)
    if store.add("gems/devices/arrived", 1) == size:
        store.set("gems/devices/all", "1")
    store.wait(["gems/devices/all"])
    on_gpu = store.add("gems/devices/cuda", 0)
    if 0 < on_gpu < size:
        raise ConfigError("train.device", "auto", f"cuda or cpu for the whole job: {on_gpu} of its {size} ranks see a "
                          "GPU and the others none (gloo and NCCL cannot mix); check the nodes' GPUs and "
                          "CUDA_VISIBLE_DEVICES")
    if gpu and not sharing_gpu():
        sharing = store.add(f"gems/devices/gpu/{gpu}", 0)
        if sharing > 1:
            node, uuid = gpu.split("/", 1)
            raise ConfigError("cluster.tasks_per_node", ranks_on_this_node(),
                              f"at most one rank per GPU: {sharing} ranks share GPU {uuid} on {node} (NCCL refuses "
                              "two ranks on one GPU; give each task its own GPU or run fewer tasks per node)")


def init_world(cfg: Any) -> World:
    """Discover this rank, pick its device and initialise torch.distributed."""
    import torch.distributed as dist

    backend_cfg = cfg.comm.backend
    rank, size, local_rank, addr, port, source, mpi_comm = discover(backend_cfg)
    device = pick_device(cfg.train.device, local_rank)
    limit_gpu(rank_cap_bytes(cfg), device)  # cluster.rank_memory_gb: the allocator held to it, as the plan counts it
    if backend_cfg == "nccl" and device.type != "cuda":
        raise ConfigError("comm.backend", "nccl", "gloo or auto on CPU nodes (nccl needs GPUs)")
    if backend_cfg == "gloo" and device.type == "cuda":
        raise ConfigError("comm.backend", "gloo", "nccl, mpi or auto on GPU ranks (gloo has no CUDA point-to-point "
                          "messages or all-gather)")
    backend = backend_for(device)
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # several slurmd on one host: distinct nodes
    from gems.fault.watchdog import collective_timeout_s

    timeout = datetime.timedelta(seconds=collective_timeout_s(section(cfg, "comm"), section(cfg, "fault")))
    if size > 1 and not dist.is_initialized():
        # env:// honours a MASTER_ADDR the site set (e.g. an InfiniBand hostname) and torchrun's
        # agent-hosted store; Slurm and MPI ranks fill in what they derived or were told. MPI ranks
        # take rank 0's broadcast, which already is the site's MASTER_ADDR where rank 0 had one
        if source == "mpi":
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
        else:
            os.environ.setdefault("MASTER_ADDR", addr)
            os.environ.setdefault("MASTER_PORT", str(port))
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(size)
        # NCCL: a collective that fails or times out aborts its communicators and raises in the rank's next
        # wait (2, CleanUpOnly), so the rank writes its failure report (gems.fault.reports) and the record
        # names it; 3 (torch's default) and 1 kill the process from NCCL's watchdog thread, leaving no report
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        kw: dict[str, Any] = {}
        if backend == "nccl":
            kw["device_id"] = device
            if bool(cfg.train.cuda_graphs):  # no stream recorded on a tensor a captured collective holds
                capture.avoid_record_streams()
            if sharing_gpu():  # the test aid: every rank its own NCCL host, messages over loopback sockets
                os.environ["NCCL_HOSTID"] = f"gems-test-rank{rank}"
                for k, v in SHARE_GPU_NCCL.items():
                    os.environ.setdefault(k, v)
        # the rendezvous env:// makes, taken here: the ranks check their devices on its store first
        store, rank, size = next(dist.rendezvous("env://", rank, size, timeout=timeout))
        store.set_timeout(timeout)
        check_devices(store, rank, size, device, device_id(device, host))
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout, **kw)
    return World(rank, size, local_rank, addr, port, source, device, backend,
                 "mpi" if backend_cfg == "mpi" else "torch", mpi_comm, host, timeout)


def backend_for(device: torch.device) -> str:
    """The torch.distributed backend of a rank on ``device``: NCCL on GPUs (``comm.backend=mpi`` too: MPI then
    sums the gradients, NCCL carries the rest), gloo on CPUs. Every group of a job has this one backend, so
    every tensor a collective gets lives on the rank's device (docs/design.md)."""
    return "nccl" if device.type == "cuda" else "gloo"


def job_device(cfg: Any) -> str:
    """``cuda`` or ``cpu``: what the ranks of the job will run on, as the launching machine can tell before
    anything starts (Slurm: ``cluster.gpus_per_node``; the local launcher: this machine's GPUs)."""
    want, c = str(cfg.train.device), cfg.cluster
    if c.launcher == "slurm":
        has, where = int(c.gpus_per_node or 0) > 0, f"cluster.gpus_per_node={c.gpus_per_node}"
    else:
        has, where = torch.cuda.is_available(), "no GPU on this machine"
    if want == "cuda" and not has:
        raise ConfigError("train.device", "cuda", f"cpu or auto ({where})")
    return "cpu" if want == "cpu" or not has else "cuda"


def plan_device(cfg: Any) -> str:
    """``cuda`` or ``cpu``: what a plan (and the fit check before a run) counts the ranks on. ``train.device``
    when it names one; with ``auto`` a GPU where the job's ranks will have one: ``cluster.gpu`` or
    ``cluster.gpu_memory_gb`` given (planning for a GPU machine from anywhere), else :func:`job_device` (Slurm with
    ``cluster.gpus_per_node`` > 0; the local launcher on a machine with a GPU)."""
    want, c = str(cfg.train.device), cfg.cluster
    if want != "auto":
        return want
    if c.gpu or float(c.gpu_memory_gb or 0.0) > 0:
        return "cuda"
    return job_device(cfg)


def check_launch(cfg: Any, world: int) -> str:
    """The device/backend combinations refused before launch (exit 2), for ``world`` ranks; returns the job's
    device. gloo on GPU ranks (no CUDA point-to-point or all-gather), NCCL on CPU ranks, more ranks on a
    node than it has GPUs."""
    dev, backend, c = job_device(cfg), str(cfg.comm.backend), cfg.cluster
    if dev == "cuda" and backend == "gloo":
        raise ConfigError("comm.backend", "gloo", "nccl, mpi or auto on GPU ranks (gloo has no CUDA point-to-point "
                          "messages or all-gather: halos and pipeline transfers would fail)")
    if dev == "cpu" and backend == "nccl":
        raise ConfigError("comm.backend", "nccl", "gloo, mpi or auto on CPU ranks (NCCL needs a GPU per rank"
                          + (")" if c.launcher == "slurm" else "; this machine has none)"))
    if sharing_gpu() and c.launcher == "slurm":
        raise ConfigError(SHARE_GPU_ENV, "1", "unset: ranks sharing a GPU are a test aid of the local launcher "
                          "on one machine (scripts/gpu_check.sh), not for Slurm jobs")
    if dev == "cuda" and not sharing_gpu():
        if c.launcher == "slurm":
            per_node, gpus = int(c.tasks_per_node or world), int(c.gpus_per_node)
            key, val = "cluster.tasks_per_node", str(per_node)
        else:
            per_node, gpus = world, torch.cuda.device_count()
            key, val = "parallel", f"{world} ranks"
        if per_node > gpus:
            raise ConfigError(key, val, f"at most {gpus} ranks per node, one per GPU (NCCL refuses two ranks on one "
                              "GPU); more nodes, or fewer ranks")
    return dev


def keep_host_memory() -> bool:
    """Keep freed host memory in the process for reuse (``train.host_memory=keep``); True when applied.

    glibc serves large blocks (above its mmap threshold, up to 32 MiB and
    always beyond) with a fresh ``mmap`` and unmaps them on free, and trims
    the heap top once it is free. A training step frees and reallocates the
    same activations every step, so by default every step faults all of its
    large tensors in again, page by page, with the kernel zeroing each page.
    On this project's CPU benchmark machine that was 40% of a CosmoFlow 128^3
    step, and worse when two ranks fault at once (the kernel serialises
    them): the pipeline and spatial schedules, whose ranks compute at the
    same time, lost far more than one rank alone. With ``M_MMAP_MAX=0`` large
    blocks come from the heap and with ``M_TRIM_THRESHOLD`` at its maximum the
    heap is not given back, so from the second step on allocations reuse
    memory already mapped (the same effect as CUDA's caching allocator or
    preloading jemalloc/tcmalloc). The price is resident memory: RSS stays at
    its high-water mark, and torch's 64-byte-aligned allocations fragment
    glibc's heap (an aligned request cannot reuse a free block of exactly its
    own size, so the heap grows until freed neighbours coalesce: a loop that
    reallocates one 96 MiB tensor settles after ~6 rounds at ~6 blocks). On
    the CosmoFlow benchmark peak RSS grew 30-50% while tensor memory stayed
    the same; ``train.host_memory=release`` trades the speed back for it. A C
    library without ``mallopt`` (not glibc) is left alone.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_max = -1, -4
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


#: how much more resident memory a rank holds with freed memory kept than the peak of a step without
#: (glibc's heap fragments under torch's aligned allocations: +30-50% measured on CosmoFlow, README)
KEEP_GROWTH = 1.6


def release_host_memory() -> bool:
    """Undo :func:`keep_host_memory`: glibc's defaults again, and what the heap holds free given back."""
    try:
        libc = ctypes.CDLL(None)
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_max = -1, -4
    ok = bool(mallopt(m_mmap_max, 65536)) and bool(mallopt(m_trim_threshold, 128 * 1024))
    trim(0)
    return ok


def ranks_on_this_node() -> int:
    """How many ranks share this node (the local launcher's, Slurm's or MPI's count; 1 when none says)."""
    env = os.environ
    for key in ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        if env.get(key, "").isdigit():
            return int(env[key])
    m = re.match(r"(\d+)", env.get("SLURM_TASKS_PER_NODE", ""))
    return int(m.group(1)) if m else 1


def node_memory_bytes() -> int | None:
    """Memory this node's ranks may use: MemAvailable, or the job's cgroup limit where it is lower."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and avail is not None:
            avail = min(avail, int(text))
    return avail


def keeps_host_memory_within(peak_rss: int, budget_bytes: int | None, ranks: int) -> bool:
    """``train.host_memory=auto``'s rule: keep freed memory when every rank of the node, at the resident
    memory that costs (:data:`KEEP_GROWTH` x the peak of a step without it), fits in 90% of the budget."""
    if budget_bytes is None:
        return True
    return ranks * KEEP_GROWTH * peak_rss <= 0.9 * budget_bytes
