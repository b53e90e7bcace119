"""The reserve of a GPU rank: what its process holds on the device beside the tensors the plan counts, from its
parts (the CUDA context, NCCL's buffers of each communicator the rank uses, the caching allocator's
fragmentation; :func:`gpu_reserve`), or ``plan.reserve_gb``; and the workspaces cuBLAS and cuDNN take from the
caching allocator, which the plan adds to the tensors' peak instead (:func:`blas_workspace_bytes`,
:func:`cudnn_workspace`). Each part is per rank and in bytes, its sources beside it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from gems.plan.devices import GiB, MiB

__all__ = ["Communicator", "Reserve", "rank_communicators", "gpu_reserve", "blas_workspace_bytes", "cudnn_workspace"]


#: (a) The CUDA context: the driver's state, the kernels of torch, cuDNN and cuBLAS it loads, the handles.
#: torch sets CUDA_MODULE_LOADING=LAZY unless the user did (github.com/pytorch/pytorch/pull/86509, since
#: 1.13), so kernels load as they are first used. Measured with lazy loading: 287047680 bytes after one tensor
#: (that pull request; 666632192 eager), "~300MB" and "around 400MB if CUDA >= 11.7 is used and lazy module
#: loading enabled" (torch's ptrblck in pytorch/pytorch#107667 and #109888), 426 MiB on an RTX 6000 Ada with
#: torch 2.10 / CUDA 13.0 (unslothai/unsloth-zoo#1053); before CUDA 11.7 (every kernel loaded) over 1000 MB.
#: No figure per GPU generation was found; a training step also loads cuDNN's and cuBLAS's kernels for its
#: shapes, so the largest measured figure is rounded up to 512 MiB for every GPU (an assumption: no GPU here).
CUDA_CONTEXT_BYTES = 512 * MiB

#: (b) cuBLAS's workspace, per (handle, stream), when CUBLAS_WORKSPACE_CONFIG is unset: torch's default is
#: ":4096:8" (32 MiB) on sm90 GPUs (Hopper) and ":4096:2:16:8" (8 MiB + 128 KiB) on the others
#: (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize); cuBLASLt shares it
#: (TORCH_CUBLASLT_UNIFIED_WORKSPACE, on by default), while torch's ROCm builds give hipBLASLt 76 MiB of its
#: own (parseCUDABlasLtWorkspaceSize, same file). It comes from the caching allocator, so CUDA counts it as
#: allocated: the plan adds it to the peak of a rank whose model runs matmuls (``activations_detail.blas_workspace``),
#: not to the reserve. The H200's 64^3 rows (results/gpu/h200-2026-11-26.json) allocated 55-69 MB more than the
#: plan counted without it, 2 x 32 MiB.
CUBLAS_WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
CUBLAS_WORKSPACE_SM90_BYTES = 4096 * 1024 * 8
HIPBLASLT_WORKSPACE_BYTES = 76 * MiB
#: handles a rank's matmuls run on: cuBLAS handles are per thread (CublasHandlePool.cpp's thread-local pool),
#: and a step runs its forward on the main thread and its backward on autograd's thread for the device
BLAS_HANDLES = 2
SM90 = frozenset({"h100", "h200", "gh200"})
ROCM = frozenset({"mi250x-gcd"})
ARM_HOSTS = frozenset({"gh200"})  # Grace: NCCL's SIMPLE buffer is 1 MiB on Arm hosts (below)

#: cuDNN's convolution workspace is not reserved apart: torch allocates it through the caching allocator for the
#: call that needs it (aten/src/ATen/native/cudnn/Conv_v8.cpp), so it counts in ``max_memory_allocated`` at the
#: layer that runs, and the activation model adds it there (:func:`cudnn_workspace`,
#: ``activations_detail.workspace``) rather than to the reserve.
CUDNN_WORKSPACE_BYTES = 0
#: cuDNN's workspace of a convolution's forward or backward, as a fraction of the larger of its input and output
#: at the micro-batch, where ``gems bench calibrate`` has not measured it on the GPU at hand: fit to the H200's
#: figures (results/gpu/h200-2026-11-26.json: the six one-rank rows, CosmoFlow 64^3 at batch 4 in fp32, fp16 and
#: bf16, 128^3 at batch 8 in fp32 and bf16, 256^3 at batch 4, with cuBLAS's workspaces and the allocator's
#: rounding counted: the smallest fraction that leaves none of the six planned peaks under what CUDA allocated,
#: set by the 64^3 fp16 row, whose 10 MB over the bf16 row's nothing else here explains).
CUDNN_WORKSPACE_FRACTION = 0.30


def cudnn_workspace(sig: tuple, batch: int, input_grad: bool, elem_bytes: int, calibration: Any = None,
                    precision: str | None = None) -> int:
    """Bytes cuDNN's workspace takes for the convolution of signature ``sig`` (gems.trace.ops) at micro-batch
    ``batch``: measured on the GPU by ``gems bench calibrate`` where the calibration has its signature (per
    sample, so scaled by the batch), else :data:`CUDNN_WORKSPACE_FRACTION` of its larger operand."""
    per_sample = None if calibration is None else calibration.workspace_per_sample(sig, precision)
    if per_sample is None:
        per_sample = CUDNN_WORKSPACE_FRACTION * max(sig[2], sig[3]) * math.prod(sig[-1]) * elem_bytes
    return int(per_sample * max(1, int(batch)))

#: (c) The caching allocator's fragmentation, as a fraction of the rank's tensor peak: an assumption (no GPU run
#: of gems measured reserved against allocated memory). The allocator rounds requests above 1 MiB up to
#: 2 MiB, serves 1-10 MiB ones from 20 MiB segments and keeps freed blocks cached
#: (c10/cuda/CUDACachingAllocator.cpp: kRoundLarge, kLargeBuffer, kMinLargeAlloc); cuDNN's workspaces go in
#: the gaps.
FRAGMENTATION = 0.10

#: (d) NCCL's buffers. Per communicator, every channel connects to its peers, and each connection holds one
#: buffer per protocol: SIMPLE, NCCL_BUFFSIZE, 4 MiB by default (NCCL's environment-variable documentation,
#: docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-buffsize; src/init.cc computeBuffSizes:
#: DEFAULT_BUFFSIZE 1 << 22, DEFAULT_BUFFSIZE_ARM 1 << 20 on Arm hosts); LL128,
#: NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x 8 = 120 x 640 x 8 x 8 bytes; LL,
#: NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x sizeof(ncclLLFifoLine) = 8 x 512 x 8 x 16
#: bytes (src/include/device.h). "The memory usage is linearly tied to the number of channels", "Ring uses a
#: limited amount of memory as it only has 2 connections regardless of the scale", and more communicators
#: use more memory unless split with shared resources (NCCL's sjeaugey in NVIDIA/nccl#864, quoted in #986;
#: that issue measured about 1.6 GB for one communicator with an all-reduce, 6 GB for three).
NCCL_BUFFSIZE = 4 * MiB
NCCL_BUFFSIZE_ARM = 1 * MiB
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16
#: channels per communicator: NCCL picks them from the topology, up to MAXCHANNELS = 64 (src/include/device.h;
#: NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS bound them) and prints them with NCCL_DEBUG=INFO ("N coll
#: channels"): 24-32 in logs of 8-GPU NVLink/NVSwitch nodes, 2-8 between nodes with a NIC or two
#: (NVIDIA/nccl#687: 2; #1189: 8). Assumed: 16, between the two (a rank's groups span 4-GPU nodes or nodes).
NCCL_CHANNELS = 16
#: connections a channel of a collective communicator holds: a ring's two, from the previous rank and to the
#: next (trees, which NCCL picks for small messages, add up to three more: left out). On the pipeline's
#: communicator each directed link a rank sends or receives on is one point-to-point connection a channel
#: (its point-to-point channels to the peer, "p2p channels per peer" in NCCL_DEBUG=INFO's log, taken as many
#: as NCCL_CHANNELS).
NCCL_CONNECTIONS = 2
NCCL_LINK_CONNECTIONS = 1
#: NCCL connects a communicator's peers when an operation first needs them, not when it is created
#: (NCCL_RUNTIME_CONNECT, on by default since NCCL 2.22, listed in the environment-variable documentation
#: above; torch 2.7 ships NCCL 2.26.2), so a communicator the rank joins but never uses holds no buffers
#: (TensorRT-LLM sets NCCL_RUNTIME_CONNECT=0 "for accurate KV cache size estimation" for that reason). With an
#: older NCCL, or NCCL_RUNTIME_CONNECT=0, the idle ones hold buffers too: plan.reserve_gb then.


def nccl_communicator_bytes(arm_host: bool = False, connections: int = NCCL_CONNECTIONS,
                            channels: int = NCCL_CHANNELS) -> int:
    """Bytes of NCCL buffers one communicator a rank uses holds on its GPU: channels x connections x the three
    protocols' buffers."""
    simple = NCCL_BUFFSIZE_ARM if arm_host else NCCL_BUFFSIZE
    return channels * connections * (simple + NCCL_LL128_BUFFSIZE + NCCL_LL_BUFFSIZE)


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a rank joins: what it is for, its ranks, whether gems runs anything on it."""

    name: str
    size: int
    used: bool
    why: str = ""
    connections: int = NCCL_CONNECTIONS  # a channel's connections (a ring's two; a one-way pipeline link's one)


def rank_communicators(replicas: int, pipeline: int, spatial: int, grad_size: int,
                       links: Sequence[tuple[int, int]] = ()) -> list[Communicator]:
    """The NCCL communicators a rank joins (:meth:`gems.mesh.Mesh.build_groups`), each only where it has more
    than one rank. gems binds each rank's device when it creates the world (``device_id``, gems.bootstrap), so
    torch creates every group's communicator at once, split from the world's, for the ranks in it
    (torch.distributed.distributed_c10d: ``eager_connect_single_device``, ``split_from``): the world, the
    spatial, pipeline and replica groups and the gradient group. ``links``: the directed (sending, receiving)
    pipeline positions this rank's schedule sends or receives on (:meth:`gems.pipeline.schedules.Schedule.links`):
    every pipeline message goes on the line's ``pipeline`` group in exchange rounds (gems.pipeline.exchange),
    each directed link one point-to-point connection a channel there; the halo exchange batches its operations
    on the spatial group's."""
    world = replicas * pipeline * spatial
    out = [
        Communicator("world", world, True, "the step-time all-reduce and the record's all-gather (gems.worker)"),
        Communicator("spatial", spatial, True, "halo exchanges, the spatial all-reduces and the gather"),
        Communicator("pipeline", pipeline, bool(links),
                     "the stages' messages, exchange rounds" if links else "created, but this schedule sends nothing",
                     NCCL_LINK_CONNECTIONS * max(1, len(set(links)))),
        Communicator("replica", replicas, False, "created, but gradients are summed over the gradient group"),
        Communicator("grad", grad_size, True, "the gradient all-reduce (gems.replication)"),
    ]
    return [c for c in out if c.size > 1]


@dataclass
class Reserve:
    """The reserve of a GPU rank, from its parts (bytes), or ``plan.reserve_gb`` when set."""

    source: str  # "modelled" or "plan.reserve_gb"
    cuda_context: int = 0
    cublas_workspace: int = 0
    cudnn_workspace: int = 0
    nccl: int = 0
    fragmentation: int = 0  # FRAGMENTATION x the tensor peak (set once the peak is known)
    fragmentation_fraction: float = 0.0
    override: int = 0  # plan.reserve_gb, which replaces the parts
    communicators: list[Communicator] | None = None
    arm_host: bool = False  # NCCL's SIMPLE buffer is NCCL_BUFFSIZE_ARM
    pipeline_position: int = 0  # where the communicators were counted (the position whose buffers are largest)

    @property
    def fixed(self) -> int:
        """The parts that do not grow with the tensors."""
        return self.override + self.cuda_context + self.cublas_workspace + self.cudnn_workspace + self.nccl

    @property
    def total(self) -> int:
        return self.fixed + self.fragmentation

    def parts(self) -> dict[str, int]:
        if self.source != "modelled":
            return {"plan.reserve_gb": self.override}
        return {"cuda_context": self.cuda_context, "cublas_workspace": self.cublas_workspace,
                "cudnn_workspace": self.cudnn_workspace, "nccl": self.nccl, "fragmentation": self.fragmentation}

    def communicator_bytes(self, c: Communicator) -> int:
        """NCCL buffers of one of this rank's communicators: none unless gems runs something on it."""
        return nccl_communicator_bytes(self.arm_host, c.connections) if c.used else 0

    def with_peak(self, peak: int) -> Reserve:
        """The reserve once the tensor peak is known (its fragmentation part)."""
        self.fragmentation = int(math.ceil(self.fragmentation_fraction * peak))
        return self

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "bytes": self.total, "parts": self.parts()}
        if self.source == "modelled":
            comms = self.communicators or []
            out.update({
                "fragmentation_fraction": self.fragmentation_fraction,
                "pipeline_position": self.pipeline_position,
                "communicators": [{"name": c.name, "size": c.size, "used": c.used, "why": c.why,
                                   "connections": c.connections, "bytes": self.communicator_bytes(c)}
                                  for c in comms],
                "assumed": {"nccl_channels": NCCL_CHANNELS, "nccl_connections_per_channel": NCCL_CONNECTIONS,
                            "nccl_link_connections_per_channel": NCCL_LINK_CONNECTIONS,
                            "cuda_context_bytes": CUDA_CONTEXT_BYTES, "blas_handles": BLAS_HANDLES},
            })
        return out


def blas_workspace_bytes(gpu: str | None, sm90: bool | None = None, rocm: bool | None = None) -> int:
    """cuBLAS (and hipBLASLt) workspaces of one rank: BLAS_HANDLES x torch's default for the GPU."""
    sm90 = (gpu in SM90) if sm90 is None else sm90
    rocm = (gpu in ROCM) if rocm is None else rocm
    per = (CUBLAS_WORKSPACE_SM90_BYTES if sm90 else CUBLAS_WORKSPACE_BYTES) + (HIPBLASLT_WORKSPACE_BYTES if rocm else 0)
    return BLAS_HANDLES * per


def gpu_reserve(communicators_by_position: dict[int, list[Communicator]], gpu: str | None = None,
                override_gib: float | None = None, sm90: bool | None = None, rocm: bool | None = None) -> Reserve:
    """A GPU rank's reserve: ``plan.reserve_gb`` GiB when set (``override_gib``), else the CUDA context, the BLAS
    workspaces, NCCL's buffers of the communicators the rank uses (at the pipeline position that uses the
    most) and a fragmentation part, FRAGMENTATION x the tensor peak (filled in by :meth:`Reserve.with_peak`)."""
    if override_gib is not None:
        return Reserve("plan.reserve_gb", override=int(float(override_gib) * GiB))
    r = Reserve("modelled", cuda_context=CUDA_CONTEXT_BYTES, cublas_workspace=0,  # in the peak (above)
                cudnn_workspace=CUDNN_WORKSPACE_BYTES, fragmentation_fraction=FRAGMENTATION, arm_host=gpu in ARM_HOSTS)
    nccl = {d: sum(r.communicator_bytes(c) for c in comms) for d, comms in communicators_by_position.items()}
    if nccl:
        r.pipeline_position = max(nccl, key=lambda d: (nccl[d], -d))
        r.communicators, r.nccl = communicators_by_position[r.pipeline_position], nccl[r.pipeline_position]
    return r
