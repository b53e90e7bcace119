"""Configuration: the dataclass schemas behind the YAML groups in ``conf/``, one place for each key's default, and
Hydra's composition, which turns every user mistake into a ``ConfigError``.

Each YAML file of ``conf/<group>/`` lists its schema (``base_<group>`` in Hydra's ConfigStore) first in its defaults,
so a misspelt key or a value of the wrong type fails at composition, naming the key. A model's own keys type the
``model`` section once the model registry is loaded (:func:`extended`).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from gems.errors import ConfigError

#: optimizer steps of a run that names neither ``train.steps`` nor ``train.epochs``
DEFAULT_STEPS = 6


def key(default: Any = MISSING, help: str = "", *, choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None,
        ge: float | None = None, gt: float | None = None, lt: float | None = None, factory: Any = None) -> Any:
    """A schema field with its meaning and its valid values, stated once: :func:`validate` checks every
    key against them, and ``gems COMMAND --help`` prints them. ``choices`` may be a function; a list that a
    registry above the configuration owns (the schedules) is handed in by it (:func:`owned`)."""
    meta = {"help": help, "choices": choices, "ge": ge, "gt": gt, "lt": lt}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConf:
    """The keys every model takes. A model's own keys are declared beside its builder, in a dataclass extending this
    one (``register_model(..., options=...)``: gems/models/registry.py), and typed with it wherever the section is
    (:func:`schema_of`)."""

    name: str = key(MISSING, "the model: a registered one (gems.models.registry)")
    module: Optional[str] = key(None, "the module that registers model.name where it is not one of gems/models (set "
                                      "by model=NAME; every rank imports it to find the model)")
    size: int = key(128, "the input's edge length", ge=1)
    width: float = key(1.0, "channel multiplier (1.0 = the published model)", gt=0)
    num_classes: int = key(3, "classes (of a sample, or of each voxel)", ge=1)
    in_channels: int = key(4, "input channels", ge=1)


#: ``data.name`` of sample files in a layout gems reads (``data=files``); ``hdf5``, its older name, is an alias
FILES = ("files", "hdf5")


def reads_files(data: Any) -> bool:
    """Whether the ``data`` section reads sample files (``data=files``, or its older name ``data=hdf5``)."""
    return str(data.name) in FILES


@dataclass
class DataConf:
    name: str = key("synthetic", "synthetic (a function of train.seed) or files (data.path, in any layout gems "
                                 "reads; hdf5 is its older name, kept as an alias)", choices=("synthetic", "files", "hdf5"))
    path: Optional[str] = key(None, "files, every layout: a folder (or file) of samples in a layout gems reads "
                                    "(docs/data.md)")
    layout: Optional[str] = key(None, "files: the files' layout (a registered one: gems.data.layouts); null: "
                                      "detected from the files (docs/data.md)")
    num_samples: int = key(64, "synthetic: size of the training set (without train.epochs indices wrap around)", ge=1)
    int16: bool = key(True, "not read (kept so that older configurations compose): every layout reads the type its "
                            "files hold, and counts (exalearn, gems, lbann, tfrecord) become log(1+x) when read")
    prefetch: int = key(2, "steps of samples a background reader prepares ahead of the step (0: read in the step)",
                        ge=0)
    readers: int = key(4, "files, every layout: threads a rank reads its samples' files on (positional reads of contiguous "
                          "datasets, straight into the batch; chunked ones chunk by chunk, gzip undone here; other "
                          "filters through h5py, one at a time), at most a Slurm task's CPUs: gems bench data "
                          "measures each count", ge=1)
    shuffle: bool = key(True, "with train.epochs: each epoch walks the training set in an order drawn from "
                              "(train.seed, epoch), the same on every rank")
    val_path: Optional[str] = key(None, "files, every layout: a folder of validation samples in the training set's "
                                        "layout")
    val_samples: int = key(0, "synthetic: held-out validation samples (indices after the training set's)", ge=0)
    stage: str = key("none", "files, every layout: copy the files once at job start to node-local storage (node), split over "
                             "the node's ranks, and read them there; removed at the end", choices=("none", "node"))
    stage_dir: Optional[str] = key(None, "where data.stage=node copies to (null: the job's $TMPDIR, else /dev/shm)")
    standardize: Optional[list] = key(None, "files of counts (exalearn, gems, lbann, tfrecord): [mean, std]: inputs "
                                            "become (log(1+counts) - mean) / std (null: log(1+counts), as MLPerf's "
                                            "reference); gems data synth data.kind=cosmology prints its universes' "
                                            "figures. CT volumes (nifti, decathlon, tiles) take data.window")
    crop: Optional[int] = key(None, "files of universes (exalearn, gems, lbann): the edge of the samples cut from "
                                    "each file, as hyperslabs (the paper cut 512^3 universes into 128^3 crops); null: "
                                    "the model's input size. Files larger than a sample are cut into crops of the "
                                    "model's size (tfrecord and the CT layouts take only the model's edge)", ge=1)
    augment: str = key("none", "files of universes (exalearn, gems, lbann, tfrecord), training set: each sample "
                               "mirrored (flip: along any of its dims) or also its axes swapped (cube: the 48 "
                               "symmetries of a 3D box), drawn from (train.seed, epoch, sample); the target is kept, "
                               "so only for data whose statistics have those symmetries (a universe's do): "
                               "gems.data.augment")
    kind: str = key("lognormal", "gems data synth: lognormal (a quick stand-in, a field a sample), cosmology "
                                 "(universes moved by the Zel'dovich approximation from colossus's power "
                                 "spectrum: docs/science.md) or segmentation (CT volumes with liver and tumour "
                                 "labels in LiTS's NIfTI layout, for model=unet3d: docs/data.md)",
                    choices=("lognormal", "cosmology", "segmentation"))
    universes: int = key(64, "cosmology: training universes, written to data.path", ge=1)
    val_universes: int = key(16, "cosmology: validation universes (other universes), written to data.val_path",
                             ge=0)
    box_cells: int = key(128, "cosmology: cells along a universe's edge", ge=8)
    box_mpc: float = key(512.0, "cosmology: a universe's side in Mpc/h", gt=0)
    mean_count: float = key(8.0, "cosmology: the mean int16 count of a cell", gt=0)
    redshifts: Optional[list] = key(None, "cosmology: the redshift of each channel (null: 3, 1.5, 0.5, 0, as "
                                          "CosmoFlow's data)")
    param_ranges: Any = key(None, "cosmology: {Omega_m: [lo, hi], sigma_8: [..], n_s: [..], H_0: [..]} "
                                  "(null: the CosmoFlow data set's: 0.25-0.35, 0.78-0.95, 0.9-1.0, 60-80)")
    workers: int = key(0, "gems data synth and convert: processes writing (0: this machine's cores)", ge=0)
    window: Optional[list] = key(None, "NIfTI CT volumes: [low, high] Hounsfield units each voxel is clipped to, then "
                                       "scaled to [0, 1] (null: [-200, 250], the liver window)")
    tile: Optional[int] = key(None, "gems data convert of NIfTI volumes (LiTS's, a Decathlon task's): each case "
                                    "written tile by tile, tiles of this edge (the model's input size: a tile then "
                                    "reads as one block), one HDF5 file a case (layout tiles); null: uncompressed "
                                    ".nii", ge=1)
    orientation: str = key("stored", "NIfTI volumes: read as stored (stored), or every case in RAS+ orientation "
                                     "(RAS: x right, y anterior, z superior, each axis the file's nearest to it, as "
                                     "MONAI's Orientationd); labels are read onto their volume's grid either way",
                           choices=("stored", "RAS"))
    affine_tolerance: float = key(0.01, "NIfTI volumes: how far, in voxels, a volume's labels (or a case's other channel "
                                        "files) may lie off its grid and still be read on it: every corner of the "
                                        "volume mapped through its affine and back through theirs, against where flips "
                                        "and permutations of the axes put it (docs/data.md)", gt=0)
    out: Optional[str] = key(None, "gems data convert: the folder the converted files go to (a folder of the same "
                                   "name for each of data.path's, e.g. train/ and validation/)")


@dataclass
class ParallelConf:
    auto: bool = key(False, "choose the mesh (R x D x S, schedule and options) for parallel.world ranks: gems plan "
                            "ranks every candidate, gems run and gems sweep run the best (parallel=auto; "
                            "docs/planner.md, Choosing a mesh)")
    world: Optional[int] = key(None, "with parallel=auto: the ranks to choose a mesh for (null: cluster.nodes x the "
                                     "preset's GPUs a node)", ge=1)
    chosen: Any = key(None, "set by parallel=auto when it chose the mesh: by which search, of how many candidates, "
                            "the chosen's and the runner-up's predictions (the record keeps it)")
    replicas: int = key(1, "R: data-parallel copies", ge=1)
    pipeline: int = key(1, "D: model partitions", ge=1)
    spatial: Any = key(1, "S: an int, or a list of parts per cut dim ([2,2])")
    spatial_dims: Optional[list] = key(None, "cut dims among the spatial ones; default [0] (or 0..k-1 for a list)")
    schedule: str = key("lp", "pipeline schedule (the names registered in gems/pipeline/schedules.py)")
    virtual_stages: Optional[int] = key(None, "stages per rank of an interleaved schedule (default 2 there)", ge=1)
    split_backward: bool = key(False, "split each backward into input and weight gradients, the weight gradients "
                                      "filling the bubbles (1f1b, gpipe, mast, master; zbh1 always does)")
    micro_batches: int = key(1, "micro-batches per replica pass", ge=1)
    gems_replicas: Optional[int] = key(None, "eta for master (default 2); mast is always 2", ge=1)
    balance: Optional[list] = key(None, "layers per partition; automatic when absent")
    balance_by: str = key("auto", "auto (comm for mast/master at D = 2, else memory) | memory | time | comm (D = 2)",
                          choices=("auto", "memory", "time", "comm"))
    rounds_by: str = key("unit", "the clock a pipeline's exchange rounds are placed by: unit (a forward 1, a backward "
                                 "2; what gems plan's memory counts) | time (each action's time, measured in the "
                                 "first steps; may hold received buffers where the plan does not count them)",
                         choices=("time", "unit"))
    checkpoint: bool = key(False, "recompute activations in the backward: a pipeline partition whole, the plain path "
                                  "in pieces weighed on the model (gems plan notes where it saves no memory)")
    bn_stats: str = key("global", "BatchNorm statistics over spatial parts", choices=("global", "local"))
    gather_uncut: bool = key(False, "a layer gems cannot cut into spatial parts: true gathers the activation before "
                                    "it (the rest runs whole on every part, and the record's notes say so); false "
                                    "refuses it, naming the layer")
    overlap: Optional[bool] = key(None, "interior/halo overlap (null: on GPU only)")


@dataclass
class TrainConf:
    batch_size: int = key(4, "global batch of one optimizer step, all replicas together", ge=1)
    steps: Optional[int] = key(None, f"optimizer steps (null: train.epochs' worth, or {DEFAULT_STEPS} without epochs)", ge=1)
    epochs: Optional[int] = key(None, "passes over the training set, the last partial batch of each dropped "
                                      "(instead of train.steps)", ge=1)
    warmup_steps: int = key(2, "steps left out of the throughput (fewer than the run's steps)", ge=0)
    lr: float = key(1e-3, "learning rate (at train.lr_base_batch with train.lr_scaling=linear or sqrt)", gt=0)
    optimizer: str = key("adam", "the optimizer", choices=("sgd", "adam"))
    momentum: float = key(0.9, "sgd momentum", ge=0, lt=1)
    weight_decay: float = key(0.0, "L2 weight decay of the optimizer", ge=0)
    lr_schedule: str = key("constant", "the learning rate over the run: constant, step (train.lr_decay_boundaries "
                                       "and _factors) or cosine (to 0 at the end); after train.lr_warmup",
                           choices=("constant", "step", "cosine"))
    lr_warmup: float = key(0.0, "epochs (with train.epochs) or steps of linear warm-up from 0", ge=0)
    lr_decay_boundaries: Optional[list] = key(None, "step schedule: where the rate drops (epochs with "
                                                    "train.epochs, else steps), e.g. [32, 64]")
    lr_decay_factors: Optional[list] = key(None, "step schedule: the rate from each boundary on, as a multiple "
                                                 "of train.lr, e.g. [0.25, 0.125]")
    lr_scaling: str = key("none", "linear: train.lr x train.batch_size / train.lr_base_batch; sqrt: x its square "
                                  "root (Adam's rule of thumb)", choices=("none", "linear", "sqrt"))
    lr_base_batch: int = key(64, "the global batch train.lr is given for (train.lr_scaling=linear or sqrt)", ge=1)
    eval_every: Optional[int] = key(None, "steps between evaluations on the validation set (0: only at the end; "
                                          "null: once an epoch with train.epochs, else only at the end)", ge=0)
    target_mae: Optional[float] = key(None, "stop at the first evaluation whose train.target_metric reaches this "
                                            "(time to target, as MLPerf counts it)", gt=0)
    eval_average_crops: bool = key(False, "validation also averages the predictions of each file's crops "
                                          "(data.crop) and reports that error (mae_avg_crops): the fair "
                                          "baseline for small crops")
    bn_recalibrate: int = key(0, "before each evaluation, recompute BatchNorm's running statistics from this "
                                 "many batches of the training set (all its whole batches if fewer), in its "
                                 "order, with equal weights (0: keep "
                                 "training's exponential averages, which at small batches follow the last few)",
                              ge=0)
    ema: float = key(0.0, "evaluate with an exponential moving average of the weights, this decay a step (0: the "
                          "last step's weights; with BatchNorm, train.bn_recalibrate gives the average its own "
                          "statistics)", ge=0, lt=1)
    target_metric: str = key("mae", "what train.target_mae is compared with: the validation mae (<=), loss (<=) "
                                    "or accuracy (>=)", choices=("mae", "loss", "accuracy"))
    seed: int = key(0, "seed of weights, data and dropout", ge=0)
    precision: str = key("fp32", "compute precision", choices=("fp32", "bf16", "fp16"))
    check_fit: bool = key(True, "plan the run's memory before launching it (gems plan's quick path) and refuse "
                               "one that does not fit, exit 2")
    loss_scaling: str = key("auto", "dynamic loss scaling (torch.amp.GradScaler, the skip agreed over every rank; "
                                    "auto: fp16 only)", choices=("auto", "dynamic", "off"))
    loss_scale_init: float = key(65536.0, "the first loss scale (a power of two keeps fp32 exact)", gt=0)
    loss_scale_growth_interval: int = key(2000, "clean steps before the loss scale doubles", ge=1)
    device: str = key("auto", "where ranks compute", choices=("auto", "cpu", "cuda"))
    tf32: Optional[bool] = key(None, "TF32 for fp32 convolutions and matmuls on GPUs (null: torch's defaults, "
                                     "convolutions in TF32; false: full fp32, for exact comparisons)")
    threads: int = key(1, "torch threads per rank on CPU (0: torch's default)", ge=0)
    deterministic: bool = key(False, "deterministic kernels (cuDNN's, torch's where it has them, gems's own average "
                                     "pooling, cuBLAS's workspace fixed): two runs of one configuration, graphed or "
                                     "eager, give the same bits on a GPU where every op has one (CosmoFlow's do); the "
                                     "record names any op that had none; without it a GPU's atomic-add backward "
                                     "kernels (pooling, upsampling, weight gradients) round differently from run to run")
    cuda_graphs: bool = key(True, "GPU ranks replay their step (forward, loss, backward, gradient sums, the sync) "
                                  "from a CUDA graph on the plain path: no pipeline, recomputation or spatial parts "
                                  "(but with train.graph_spatial), where the run says it stays eager "
                                  "(gems.rank.graphs); false: eager")
    graph_optimizer: bool = key(False, "with train.cuda_graphs, the optimizer's update inside the graph too (a "
                                       "whole-step graph; its learning rate a tensor on the device, in eager runs "
                                       "too, so both run the same kernels); off until a GPU measures it faster")
    graph_pieces: bool = key(False, "with train.cuda_graphs, a pipeline's partitions replay their forward and "
                                    "backward of each micro-batch from graphs between the schedule's messages "
                                    "(gems.rank.pieces); off until a GPU has run them")
    graph_spatial: bool = key(False, "with train.cuda_graphs, spatial parts replay their whole step from one graph "
                                     "as the plain path, their halo messages captured in it (gems.rank.graphs); off "
                                     "until a GPU has run it")
    graph_collectives: bool = key(False, "with train.cuda_graphs, a multi-rank step's graph holds its NCCL work "
                                         "(gradient sums, the step's sync, halos with train.graph_spatial); off "
                                         "until a lent GPU has run such graphs to their end: those runs step eager "
                                         "and say so (one-rank steps and a pipeline's pieces, which hold none, graph)")
    host_memory: str = key("auto", "freed host memory stays in the process (auto: on CPU ranks)",
                           choices=("auto", "keep", "release"))
    checkpoint_every: int = key(0, "save every N steps (the last step too, where N divides it) so a preempted or "
                                   "requeued job resumes and another run can continue (train.resume_from); 0: only "
                                   "when preempted or near the time limit", ge=0)
    checkpoint_async: bool = key(False, "save checkpoints in the background (DCP's async_save): the step waits only "
                                        "for a copy of the rank's state in host memory, which gems plan counts")
    checkpoint_writers: int = key(8, "copies of each pipeline position that write its checkpoint, each about 1/N of "
                                     "its bytes (the first replicas, spatial part 0; at most parallel.replicas): a "
                                     "save's stall falls with N, its files stay N a position", ge=1)
    resume_from: Optional[str] = key(None, "continue another run's training from its checkpoint (a run's ckpt/ "
                                           "folder, a step folder in it, or its latest file) on this mesh, "
                                           "schedule and micro-batches: the same losses at the same global batch")
    init_from: Optional[str] = key(None, "start from another run's weights (a model file results/<run_id>.model.pt "
                                         "or a checkpoint), any mesh, a fresh optimizer at step 0")
    resume_stopped: bool = key(True, "a run of the same configuration that stopped on a bad file (its checkpoint and "
                                     "model kept) is resumed from its checkpoint, saying so; false starts over")
    on_nonfinite: str = key("stop", "a NaN or Inf global loss stops the run (stop) or is recorded (warn)",
                            choices=("stop", "warn"))
    profile: bool = key(False, "one torch.profiler chrome trace per rank of the first measured step, in the run's "
                               "folder (profile/rank<k>.json); that step is left out of the timings")


#: minutes a launcher waits for a running job past its time limit (cluster.time_min) before it stops waiting,
#: unless cluster.timeout_min sets the wait
WAIT_GRACE_MIN = 5


@dataclass
class ClusterConf:
    name: str = key("local", "the cluster preset")
    launcher: str = key("local", "local processes or Slurm", choices=("local", "slurm"))
    nodes: Optional[int] = key(1, "nodes of the job (null: as few as hold R x D x S ranks, one per GPU, or "
                                  "cpus_per_task CPUs each on CPU nodes)", ge=1)
    tasks_per_node: Optional[int] = key(1, "ranks per node (null: R x D x S / nodes; on GPU nodes at most "
                                           "gpus_per_node, the last node possibly partly used)", ge=1)
    ntasks: Optional[int] = key(None, "ranks of the job, R x D x S (derived; fewer than nodes x tasks_per_node "
                                      "where the last node is partly used)", ge=1)
    gpus_per_node: int = key(0, "GPUs per node", ge=0)
    cpus_per_task: int = key(1, "CPUs per rank", ge=1)
    cpus_per_node: Optional[int] = key(None, "CPUs of a node, for placing ranks on CPU nodes (null: unknown, one "
                                            "node unless cluster.nodes says otherwise)", ge=1)
    gpu_memory_gb: float = key(0.0, "memory of one GPU as its data sheet gives it, e.g. 40 for an A100 40GB (gems "
                                    "plan). For HBM GPUs that figure is binary, GiB not 10^9 bytes; the planner "
                                    "counts what CUDA reports for it: cluster.gpu's measured total when it names a "
                                    "GPU of this size, else this many GiB less 1.5% for the driver", ge=0)
    rank_memory_gb: Optional[float] = key(None, "the most memory one rank's tensors may take, in GiB, on CPU and GPU "
                                                "ranks alike: gems plan counts it as the rank's device (its whole "
                                                "memory on a CPU rank, no interpreter reserve beside it), and the run "
                                                "holds every rank to it (a GPU rank's caching allocator is limited to "
                                                "it; a CPU rank's tensor peak, measured in its profiled steps, past it "
                                                "fails the run); null: the device's own memory", gt=0)
    gpu: Optional[str] = key(None, "the GPU model, for gems plan's step-time prediction (a100-40gb, a100-64gb, "
                                   "a100-80gb, h100, h200, gh200, mi250x-gcd, v100-16gb, v100-32gb; null: CPU "
                                   "ranks, measured on the spot)")
    gpu_calibration: Optional[str] = key(None, "a file gems bench calibrate wrote on this kind of GPU: gems plan "
                                               "times the model's convolutions and counts cuDNN's workspaces "
                                               "from it")
    intra_node_GBps: Optional[float] = key(None, "bandwidth per rank and direction between ranks of one node "
                                                 "(GB/s, gems plan)", gt=0)
    intra_node_latency_us: Optional[float] = key(None, "latency of a message within a node (us, gems plan)", ge=0)
    inter_node_GBps: Optional[float] = key(None, "bandwidth per rank and direction between nodes (GB/s, gems "
                                                 "plan)", gt=0)
    inter_node_latency_us: Optional[float] = key(None, "latency of a message between nodes (us, gems plan)", ge=0)
    jitter: Optional[float] = key(None, "how much a rank's compute time varies from rank to rank: its standard "
                                        "deviation over one second of compute, in seconds (growing as the square "
                                        "root of the time), for gems plan's waits where ranks meet; null: none",
                                  ge=0)
    mem_gb: Optional[float] = key(None, "memory per node to ask for", gt=0)
    partition: Optional[str] = key(None, "Slurm partition")
    account: Optional[str] = key(None, "Slurm account")
    qos: Optional[str] = key(None, "Slurm QOS")
    constraint: Optional[str] = key(None, "Slurm node features")
    time_min: int = key(30, "the job's time limit in minutes", ge=1)
    signal_margin_s: int = key(120, "Slurm sends SIGUSR2 this long before the time limit: every rank checkpoints "
                                    "and the job is requeued", gt=0)
    setup: list = key(help="shell lines run before the ranks start", factory=list)
    srun_args: list = key(help='extra srun arguments, e.g. ["--mpi=pmi2"]', factory=list)
    additional: Any = key(None, "any other sbatch option, by its sbatch name, e.g. {gres:'gpu:4'} (a mapping)")
    python: Optional[str] = key(None, "interpreter on the compute nodes (default: this one)")
    poll_s: float = key(1.0, "how often the launcher checks its jobs at first (seconds; it backs off to 5x that, "
                             "at most 5 min, while nothing changes)", gt=0)
    arrays: bool = key(True, "the points of a sweep that ask for the same resources go to Slurm as one job array")
    timeout_min: Optional[float] = key(None, "stop waiting for a job this long after it started running (default: "
                                             "time_min + 5; its time in the queue does not count, and a requeue "
                                             "starts the clock again)", gt=0)
    cancel_on_timeout: bool = key(False, "cancel a job the launcher stops waiting for (cluster.timeout_min); by "
                                         "default it goes on, and gems status follows it")
    exclude: list = key(help="nodes the job must not run on (sbatch --exclude), e.g. [nid001234]", factory=list)
    exclude_bad_nodes: bool = key(False, "on Slurm, a job a node's failed health check stopped (health.check) is "
                                         "submitted once more without that node (added to cluster.exclude), and its "
                                         "record and gems status say so")
    resubmitted: Optional[str] = key(None, "set by the launcher: why this job was submitted again (the job before it, "
                                           "the nodes it leaves out and what was found on them)")

    def wait_s(self) -> float:
        """How long a launcher waits for a job once it runs: ``timeout_min``, or the time limit and 5 minutes."""
        return 60.0 * float(self.timeout_min if self.timeout_min is not None else self.time_min + WAIT_GRACE_MIN)

    def wait_key(self) -> str:
        """The key that sets :meth:`wait_s`, as a user would change it."""
        if self.timeout_min is not None:
            return f"cluster.timeout_min={self.timeout_min:g}"
        return f"cluster.time_min={self.time_min}, and {WAIT_GRACE_MIN} minutes"

    def room_for(self, seconds: float) -> str:
        """The override that lets a launcher wait ``seconds`` and a fifth more (whole minutes)."""
        minutes = math.ceil(1.2 * seconds / 60)
        if self.timeout_min is not None:
            return f"cluster.timeout_min={minutes}"
        return f"cluster.time_min={max(1, minutes - WAIT_GRACE_MIN)}"


@dataclass
class CommConf:
    backend: str = key("auto", "torch.distributed backend, or mpi for the gradient sum over mpi4py",
                       choices=("auto", "nccl", "gloo", "mpi"))
    bucket_mb: float = key(4.0, "gradient all-reduce bucket size (MiB)", gt=0)
    timeout_s: Optional[float] = key(None, "collective timeout, the backstop behind the watchdog (null: "
                                           "fault.warmup_timeout_s + fault.stall_timeout_s)", gt=0)


@dataclass
class ResultsConf:
    dir: str = key("results", "where records go")
    name: Optional[str] = key(None, "run name (default: derived from model and mesh)")
    sweep: Optional[str] = key(None, "sweep this run belongs to")
    scaling: str = key("auto", "how `gems results` computes efficiency: weak (the batch grows with the world), strong "
                               "(a fixed batch), or auto (inferred from the points)", choices=("auto", "weak", "strong"))
    repeats: int = key(1, "runs of each point of a sweep (the table gives medians and their spread)", ge=1)
    rerun: str = key("failed", "running a sweep again: re-run its failed and missing points, all of them, or none "
                               "(only the missing ones)", choices=("failed", "all", "none"))
    reference: Any = key(None, "expected figures per world size (or all): {WORLD: {throughput|efficiency|step_time: "
                               "[low, high]}}; `gems results` marks each point and exits 1 when one fails")
    detach: bool = key(False, "Slurm sweeps: submit every point, write the manifest and return at once")
    check_space: bool = key(True, "refuse before launch a run whose checkpoints, model file and records would not fit "
                                  "the room results.dir has (false: launch anyway)")
    point: Optional[str] = key(None, "set by gems sweep: the point of the sweep this run is")
    repeat: int = key(0, "set by gems sweep: which repeat of its point this run is", ge=0)


@dataclass
class PlanConf:
    format: str = key("table", "gems plan's output", choices=("table", "json"))
    reserve_gb: Optional[float] = key(None, "GiB (2^30 bytes) per rank set aside beside the planned tensors, "
                                            "replacing the modelled reserve (null: on GPUs the CUDA context, "
                                            "cuBLAS workspaces, NCCL buffers per communicator and 10% of the "
                                            "peak for fragmentation; on CPUs 0.5 GiB, and at most 0.5 when set)",
                                      ge=0)
    predict: bool = key(True, "predict the step time and throughput too (needs cluster.gpu on GPUs, and the "
                              "preset's link figures for more than one rank)")
    efficiency: Any = key(None, "fractions of a GPU's peak kernels reach, per op class: {conv: 0.4, matmul: 0.6, "
                                "memory: 0.85, pool: 0.13} (the defaults; conv at 64 channels and wider)")
    dry_run: bool = key(False, "instead of planning, run one step of the real code for rank plan.dry_run_rank "
                               "of the full world, alone, over torch's fake process group on fake tensors")
    dry_run_rank: int = key(0, "the rank the dry run plays", ge=0)


@dataclass
class FaultConf:
    stall_timeout_s: Optional[float] = key(60.0, "a rank without progress this long ends the job, or 10x the "
                                                 "run's slowest step where that is longer (null: no stall detection)",
                                           gt=0)
    warmup_timeout_s: float = key(600.0, "the same allowance during set-up, warm-up, the first step, "
                                         "checkpoints and the record", gt=0)
    kill_rank: int = key(-1, "fault injection: this rank kills itself at fault.at_step (-1: none)", ge=-1)
    stall_rank: int = key(-1, "fault injection: this rank stalls in the forward of fault.at_step", ge=-1)
    nan_rank: int = key(-1, "fault injection: this rank's input of fault.at_step is NaN", ge=-1)
    at_step: int = key(1, "the step of kill_rank, stall_rank and nan_rank (from 0)", ge=0)
    step_delay_s: float = key(0.0, "every rank sleeps this long in each step's data phase (a stand-in for long "
                                   "steps, e.g. to meet a time limit in a test)", ge=0)
    step_delay_once: bool = key(False, "fault.step_delay_s holds only until the job's first restart (the resumed "
                                       "job runs at its own pace)")
    preempt_at_step: int = key(-1, "save and stop at this step once; the launcher resumes the job", ge=-1)
    kill_in_save: bool = key(False, "fault injection: fault.kill_rank kills itself in the checkpoint of "
                                    "fault.at_step (saved before that step), once its own files are written (a crash "
                                    "mid-save)")
    save_delay_s: float = key(0.0, "fault injection: every checkpoint's writers wait this long before writing (an "
                                   "async save still in flight at the next save)", ge=0)
    max_restarts: int = key(3, "how often the local launcher resumes a preempted job", ge=0)


@dataclass
class EvalConf:
    path: Optional[str] = key(None, "gems eval: the model file or checkpoint it evaluates (set by `gems eval PATH`)")
    predictions: bool = key(True, "gems eval: write each sample's prediction and target (a CSV beside the record)")


@dataclass
class HealthConf:
    check: str = key("auto", "each node's GPUs checked through NVML before the rendezvous, once a node: auto where the "
                             "job's ranks use GPUs, always (a CPU job then imports pynvml), never",
                     choices=("auto", "always", "never"))
    gpus: bool = key(True, "check the GPUs a task sees against those the job asked for (false skips it)")
    ecc: bool = key(True, "check for uncorrected ECC errors since the driver loaded (false skips it)")
    retired_pages: bool = key(True, "check for pages waiting to be retired (false skips it)")
    row_remap: bool = key(True, "check for a failed row remap, or remaps waiting for a reset (false skips it)")
    memory: bool = key(True, "check for GPU memory held by processes that are not this job's (false skips it)")
    throttle: bool = key(True, "check for clocks held down at idle: hardware slowdown, thermal, power brake (false "
                               "skips it)")
    pcie: bool = key(True, "check for a PCIe link below its maximum width or generation (false skips it)")
    driver: bool = key(True, "check the driver's CUDA against the CUDA torch was built for (false skips it)")


@dataclass
class TelemetryConf:
    interval_s: Optional[float] = key(0.25, "how often a rank's sampler reads its GPU through NVML (power, clocks, "
                                            "throttle reasons, temperature, utilisation, memory) or its node's RAPL "
                                            "counters; null: no sampler (the energy is still read at the measured "
                                            "steps' bounds)", gt=0)
    trace_points: int = key(2000, "the most samples a rank keeps for the record's trace (the power and SM clock "
                                  "plot); past it every other one goes", ge=2)
    straggler_window: int = key(10, "steps a window of the straggler scores spans", ge=1)


@dataclass
class GemsConf:
    model: ModelConf = field(default_factory=ModelConf)
    data: DataConf = field(default_factory=DataConf)
    parallel: ParallelConf = field(default_factory=ParallelConf)
    train: TrainConf = field(default_factory=TrainConf)
    cluster: ClusterConf = field(default_factory=ClusterConf)
    comm: CommConf = field(default_factory=CommConf)
    results: ResultsConf = field(default_factory=ResultsConf)
    plan: PlanConf = field(default_factory=PlanConf)
    fault: FaultConf = field(default_factory=FaultConf)
    eval: EvalConf = field(default_factory=EvalConf)
    health: HealthConf = field(default_factory=HealthConf)
    telemetry: TelemetryConf = field(default_factory=TelemetryConf)
    run_id: Optional[str] = None  # set by the launcher


GROUP_SCHEMAS = {
    "model": ModelConf,
    "data": DataConf,
    "parallel": ParallelConf,
    "train": TrainConf,
    "cluster": ClusterConf,
    "comm": CommConf,
}
#: every node of the configuration and its schema
SECTIONS = {**GROUP_SCHEMAS, "results": ResultsConf, "plan": PlanConf, "fault": FaultConf, "eval": EvalConf,
            "health": HealthConf, "telemetry": TelemetryConf}


def section(cfg: Any, name: str) -> Any:
    """Section ``name`` of ``cfg`` (a DictConfig or a mapping) as an instance of its schema's dataclass
    (:func:`schema_of`: the model's own where a model extends it): typed values, and the schema's default for a key
    the configuration leaves out. What a module below an entry point takes instead of the whole configuration
    (``inject.arm(section(cfg, "fault"), ...)``); no fallback default of its own."""
    node = cfg.get(name) if hasattr(cfg, "get") else None
    try:
        if isinstance(node, DictConfig):  # resolved where it sits: an interpolation may name another section
            node = OmegaConf.to_container(node, resolve=True)
        merged = OmegaConf.merge(OmegaConf.structured(schema_of(name, node)), node if node is not None else {})
        return OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except Exception as e:  # a key the schema does not have, a value of the wrong type, an interpolation
        raise _omegaconf_error(e, within=name) from None


#: sections whose options declare keys of their own (each model: gems/models/registry.py): composed open to keys the
#: section's schema lacks, then typed by the option's schema where its registry is loaded (:func:`compose`,
#: :func:`typed`), else where the option is built (:func:`section`)
OPEN_SECTIONS = ("model",)
#: the schema of each option of an open section, handed here by its registry when it is imported (:func:`extended`)
_EXTENDED: dict[str, Callable[[Any], Optional[type]]] = {}


def extended(sec: str, schema: Callable[[Any], Optional[type]]) -> None:
    """Declare that the registry calling this extends section ``sec``'s schema (one of :data:`OPEN_SECTIONS`):
    ``schema(node)`` is the dataclass (a subclass of the section's) that a section ``node`` (a mapping) is typed by,
    for the option its ``name`` names; None where that option is not registered. The registry owns ``sec.name``'s
    values too (:func:`owned`)."""
    assert sec in OPEN_SECTIONS, sec
    _EXTENDED[sec] = schema


def schema_of(sec: str, node: Any = None) -> type:
    """The dataclass that section ``sec`` is typed by: its schema (:data:`SECTIONS`), or, where a registry extends
    it (:func:`extended`: the model), the schema of the option that the section ``node`` names."""
    got = _EXTENDED[sec](node) if sec in _EXTENDED and node is not None else None
    return got if got is not None else SECTIONS[sec]


def extensions(sec: str) -> dict[str, type]:
    """Every registered option of section ``sec`` whose schema extends the section's, by name (the models that
    declare keys of their own)."""
    names = choices_of(f"{sec}.name") if sec in _EXTENDED else None
    return {n: schema_of(sec, {"name": n}) for n in names or () if schema_of(sec, {"name": n}) is not SECTIONS[sec]}


def own_fields(schema: type, sec: str) -> list[Any]:
    """The fields ``schema`` adds to section ``sec``'s (a model's own keys)."""
    from dataclasses import fields

    common = {f.name for f in fields(SECTIONS[sec])}
    return [f for f in fields(schema) if f.name not in common]


def _node(cfg: Any, sec: str) -> Any:
    return cfg.get(sec) if cfg is not None and hasattr(cfg, "get") else None


def schema_keys(cfg: Any = None) -> dict[str, Any]:
    """``section.key`` -> the dataclass field (default, ``metadata``: help, choices, bounds); with ``cfg``, a section
    a registry extends has the keys of the option ``cfg`` names (the model's own)."""
    from dataclasses import fields

    return {f"{sec}.{f.name}": f for sec in SECTIONS for f in fields(schema_of(sec, _node(cfg, sec)))}


#: keys whose values a registry above the configuration owns (the schedules, the data's symmetries), handed here by
#: the registry when it is imported (:func:`owned`): the configuration checks and prints them without importing
#: upward; before that the registry checks the key itself where it is used (``gems.pipeline.make_schedule``)
_OWNED: dict[str, Callable[[], tuple[str, ...]]] = {}


def owned(name: str, values: Callable[[], Any]) -> None:
    """Declare that the registry calling this owns the values of key ``name``: ``values()`` lists them."""
    _OWNED[name] = lambda: tuple(values())


#: group options a registry above the configuration offers (the models), handed here when it is imported
#: (:func:`offered`): composed as ``group=NAME`` where ``conf/<group>/NAME.yaml`` is absent
_OFFERED: dict[str, Callable[[], dict[str, dict[str, Any]]]] = {}


def offered(group: str, options: Callable[[], dict[str, dict[str, Any]]]) -> None:
    """Declare that the registry calling this offers options of ``group``: ``options()`` maps each name to what
    ``group=NAME`` sets (a YAML file of that name, where one exists, is the preset instead)."""
    _OFFERED[group] = options


def import_modules(package: str) -> None:
    """Import every module of ``package`` whose name does not start with ``_``, in name order: a registry's package
    (the models, the data layouts), each of whose modules registers what it defines, so that a new module is found
    without a list to edit."""
    import importlib
    import pkgutil

    pkg = importlib.import_module(package)
    for mod in sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)):
        if not mod.startswith("_"):
            importlib.import_module(f"{package}.{mod}")


def choices_of(name: str, f: Any = None) -> tuple[str, ...] | None:
    """The values a key takes, where the schema (its field ``f``, for a model's own key) or the registry that owns
    the key (:func:`owned`) lists them."""
    if name in _OWNED:
        return _OWNED[name]()
    f = f if f is not None else schema_keys().get(name)
    got = f.metadata.get("choices") if f is not None else None
    return tuple(got()) if callable(got) else got


def _bounds_text(meta: Any) -> str:
    parts = []
    if meta.get("ge") is not None:
        parts.append(f">= {meta['ge']:g}")
    if meta.get("gt") is not None:
        parts.append(f"> {meta['gt']:g}")
    if meta.get("lt") is not None:
        parts.append(f"< {meta['lt']:g}")
    return " and ".join(parts)


def check_key(name: str, val: Any, f: Any = None) -> None:
    """ConfigError when ``val`` is outside the choices or bounds the schema declares for ``name`` (in its field
    ``f``, for a model's own key)."""
    f = f if f is not None else schema_keys().get(name)
    if f is None or val is None:
        return
    meta = f.metadata
    choices = choices_of(name, f)
    if choices and val not in choices:
        raise ConfigError(name, val, "one of " + ", ".join(choices))
    if isinstance(val, bool) or not isinstance(val, (int, float)):
        return
    bad = ((meta.get("ge") is not None and not val >= meta["ge"]) or (meta.get("gt") is not None and not val > meta["gt"])
           or (meta.get("lt") is not None and not val < meta["lt"]) or val != val)
    if bad:
        kind = "an integer" if f.type in (int, "int", "Optional[int]") else "a number"
        raise ConfigError(name, val, f"{kind} {_bounds_text(meta)}" + (f" ({meta['help']})" if meta.get("help") else ""))


def check_section(sec: str, values: Any) -> None:
    """:func:`check_key` for every key of ``values``, section ``sec`` as its schema's dataclass (what the Python
    API's mapping becomes: :func:`section`)."""
    from dataclasses import fields

    for f in fields(values):
        check_key(f"{sec}.{f.name}", getattr(values, f.name), f)


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    # arithmetic for experiments, e.g. a weak-scaling batch: ${mul:${parallel.replicas},4}
    OmegaConf.register_new_resolver("mul", lambda a, b: int(a) * int(b), replace=True)
    # nodes for a world: ${ceildiv:${mul:${parallel.replicas},${parallel.spatial}},${cluster.gpus_per_node}}
    OmegaConf.register_new_resolver("ceildiv", lambda a, b: -(-int(a) // max(1, int(b))), replace=True)
    # a batch of the same voxels at every crop edge: ${pow:${div:128,${data.crop}},3}
    OmegaConf.register_new_resolver("div", lambda a, b: int(a) // max(1, int(b)), replace=True)
    OmegaConf.register_new_resolver("pow", lambda a, b: int(a) ** int(b), replace=True)

    cs = ConfigStore.instance()
    base = OmegaConf.structured(GemsConf)
    for sec in OPEN_SECTIONS:  # a model's own keys compose; compose() types them by the model's schema
        OmegaConf.set_struct(base[sec], False)
    cs.store(name="base_config", node=base)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)
    for group, options in _OFFERED.items():
        files = {p.stem for p in (conf_dir() / group).glob("*.yaml")}
        for name, node in options().items():
            if name not in files:
                cs.store(group=group, name=name, node=node)


def conf_dir() -> Path:
    """The ``conf/`` folder: $GEMS_CONF, else the one beside the package."""
    env = os.environ.get("GEMS_CONF")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "conf", here / "conf"):
        if (cand / "config.yaml").is_file():
            return cand
    raise ConfigError("GEMS_CONF", env, "a folder holding config.yaml (the conf/ of a gems checkout)")


def _group_options(group: str) -> list[str]:
    d = conf_dir() / group
    files = {p.stem for p in d.glob("*.yaml")} if d.is_dir() else set()
    return sorted(files | set(_OFFERED[group]() if group in _OFFERED else ()))


def compose(overrides: list[str] | tuple[str, ...] = (), return_hydra_config: bool = False,
            check: bool = True) -> DictConfig:
    """Compose ``conf/config.yaml`` with overrides; any mistake is a ConfigError."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hcompose("config", overrides=list(overrides), return_hydra_config=return_hydra_config)
    except MissingConfigException as e:
        raise _missing_option(str(e), list(overrides)) from None
    except OverrideParseException as e:
        bad = next((o for o in overrides if o and str(e).find(o) >= 0), " ".join(overrides))
        raise ConfigError("override", bad, "key=value, group=option or +experiment=NAME") from None
    except ConfigCompositionException as e:
        raise _with_value(_composition_error(e, list(overrides)), overrides) from None
    except Exception as e:  # omegaconf validation errors carry the key
        raise _with_value(_omegaconf_error(e), overrides) from None
    finally:
        GlobalHydra.instance().clear()
    try:
        type_options(cfg)
        validate(cfg, relations=check)
        if check:
            place_job(cfg)
    except ConfigError as e:
        raise _with_value(e, overrides) from None
    if cfg.get("parallel") is not None and cfg.parallel.get("auto"):
        chosen_by_hand(overrides)
    mark_given(cfg, overrides)
    return cfg


#: the flag :func:`compose` sets on each key the command line gives (:func:`given`)
GIVEN = "gems_given"


def mark_given(cfg: DictConfig, overrides: Any) -> None:
    """Flag each key that ``overrides`` set (``section.key=value``; not a group's option) as the user's."""
    for ov in overrides:
        k, eq, _ = str(ov).lstrip("+~").partition("=")
        parent, _, name = k.rpartition(".")
        node = OmegaConf.select(cfg, parent) if eq and parent else None
        if isinstance(node, DictConfig) and name in node:
            node._get_node(name)._set_flag(GIVEN, True)  # type: ignore[union-attr]


def given(cfg: Any, key: str) -> bool:
    """Whether ``key`` (``section.key``) was set on the command line that composed ``cfg`` (:func:`compose` flags
    each), rather than left to its default or a YAML's value: what a value derived from elsewhere (a data set's
    classes: gems.data.task) may replace, and what it must agree with."""
    parent, _, name = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else None
    return bool(isinstance(node, DictConfig) and name in node
                and node._get_node(name)._get_flag(GIVEN))  # type: ignore[union-attr]


#: the keys of a mesh that parallel=auto chooses (gems.plan.search): one given beside it is refused
MESH_KEYS = ("parallel.replicas", "parallel.pipeline", "parallel.spatial", "parallel.spatial_dims",
             "parallel.schedule", "parallel.micro_batches", "parallel.gems_replicas", "parallel.virtual_stages",
             "parallel.split_backward", "parallel.checkpoint", "parallel.balance")


def chosen_by_hand(overrides: Any) -> None:
    """A mesh key given on the command line beside ``parallel=auto`` is bad input naming it."""
    for ov in overrides:
        k, _, v = str(ov).lstrip("+~").partition("=")
        if k in MESH_KEYS:
            raise ConfigError(k, v, "unset with parallel=auto, which chooses the mesh (drop parallel=auto to set it by "
                              "hand, or give parallel.world=N and let the search choose)")


def _with_value(err: ConfigError, overrides: Any) -> ConfigError:
    """Name the value the user typed for the failing key."""
    for ov in overrides:
        k, _, v = ov.lstrip("+~").partition("=")
        if k == err.key:
            return ConfigError(err.key, v, err.expected)
    return err


def _missing_option(msg: str, overrides: list[str]) -> ConfigError:
    for ov in overrides:
        key, _, val = ov.lstrip("+~").partition("=")
        group = key.split("@")[0]
        if "." not in group and val and (conf_dir() / group).is_dir() and val not in _group_options(group):
            return ConfigError(group, val, "one of " + ", ".join(_group_options(group)))
    return ConfigError("config", msg.splitlines()[0], "an existing group option (see conf/)")


def _composition_error(e: Exception, overrides: list[str]) -> ConfigError:
    cause = e.__cause__ or e
    msg = str(cause).splitlines()[0] if str(cause) else str(e)
    if hasattr(cause, "full_key") or type(cause).__module__.startswith("omegaconf"):
        return _omegaconf_error(cause)
    for ov in overrides:
        key = ov.lstrip("+~").partition("=")[0]
        if key and key in msg:
            return ConfigError(key, ov.partition("=")[2], _hint_for(msg))
    return ConfigError("override", " ".join(overrides), msg)


def _hint_for(msg: str) -> str:
    if "not in struct" in msg or "Could not override" in msg or "Key" in msg:
        return "a key that exists in the schema (gems/config.py); add new keys with +key=value"
    return msg


def _omegaconf_error(e: BaseException, within: str = "") -> ConfigError:
    """The ConfigError of omegaconf's error ``e``, naming the key (in section ``within``, where ``e`` was raised
    merging that section alone)."""
    import re

    key = getattr(e, "full_key", None) or (within or "config")
    if within and key != within and not str(key).startswith(within + "."):
        key = f"{within}.{key}"
    msg = str(e).splitlines()[0]
    if "not in struct" in msg or "Missing key" in msg or "Key '" in msg:
        own = _extension_of(str(key), getattr(e, "object_type", None))
        if own is not None:  # a key the model does not take: its keys named
            return _not_the_models(str(key), own, getattr(e, "parent_node", None))
        near = nearest_key(str(key))
        hint = f"{near}, the nearest key" if near else "a key that exists in the schema (gems/config.py)"
        return ConfigError(key, "?", f"{hint} (`gems run --help` lists them; new keys take a + prefix)")
    m = re.search(r"Value '(.*)' of type '(\w+)' could not be converted to (\w+)", msg)
    if m:
        return ConfigError(key, m.group(1), f"a value of type {m.group(3).lower()}")
    return ConfigError(key, "?", msg)


def _extension_of(key: str, schema: Any) -> type | None:
    """``schema`` where it is an option's extension of the section ``key`` is in (a model's own keys), else None."""
    sec = key.split(".", 1)[0]
    base = SECTIONS.get(sec)
    if sec not in _EXTENDED or base is None or not isinstance(schema, type) or schema is base:
        return None
    return schema if issubclass(schema, base) else None


def _not_the_models(key: str, schema: type, node: Any) -> ConfigError:
    """The refusal of ``key``, which the option of ``schema`` does not take: the nearest of its keys, and its own."""
    from dataclasses import fields

    sec, leaf = key.split(".", 1)[0], key.rsplit(".", 1)[-1]
    name = OmegaConf.select(node, "name", default=None, throw_on_missing=False) if OmegaConf.is_config(node) else None
    who = f"{sec}={name}" if name else f"this {sec}"
    own = ", ".join(f"{sec}.{f.name}" for f in own_fields(schema, sec))
    others = [n for n, s in extensions(sec).items() if leaf in {f.name for f in own_fields(s, sec)}]
    near = None if others else nearest_key(key, [f"{sec}.{f.name}" for f in fields(schema)])
    hint = (f"{near}, the nearest key {who} takes" if near else f"a key {who} takes"
            + (f", not {' or '.join(others)}'s own" if others else ""))
    return ConfigError(key, "?", f"{hint} (its own: {own or 'none'}; `gems run --help` lists every {sec}'s keys)")


def nearest_key(name: str, keys: list[str] | None = None) -> str | None:
    """The schema key (of ``keys``, default every section's) closest to a misspelt ``name`` (``train.stepz`` ->
    ``train.steps``), if one is close."""
    import difflib

    keys = list(schema_keys()) if keys is None else keys
    got = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
    if not got and "." in name:  # a right key in the wrong section, or a section misspelt
        leaf = name.rsplit(".", 1)[1]
        got = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[1] for k in keys], n=1, cutoff=0.75)
        got = [next(k for k in keys if k.endswith("." + got[0]))] if got else []
    return got[0] if got else None


def help_text(command: str, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The keys every command takes, with the value a run with ``overrides`` would use (the composed defaults:
    ``model=resnet --help`` shows resnet's), its bounds and meaning from the schemas; each registered model's own
    keys under its name."""
    import dataclasses

    try:
        composed: DictConfig | None = compose(list(overrides), check=False)
    except ConfigError:
        composed = None
    lines = [f"gems {command} [OVERRIDES]: key=value, group=option, +experiment=NAME", "",
             "values: what this command would use" + (f" with {' '.join(overrides)}" if overrides else "")
             + ("" if composed is not None else " (the overrides do not compose: the schemas' defaults)"), "",
             "groups: " + ", ".join(f"{g}=[{'|'.join(_group_options(g))}]" for g in GROUP_SCHEMAS if _group_options(g)),
             ""]
    for sec, cls in SECTIONS.items():
        lines.append(f"{sec}:")
        lines += [_help_line(sec, f, composed) for f in dataclasses.fields(cls)]
        for name, schema in extensions(sec).items():  # each model's own keys, under its name
            chosen = composed is not None and OmegaConf.select(composed, f"{sec}.name", default=None,
                                                               throw_on_missing=False) == name
            lines.append(f"  {sec}.name={name} takes these too:")
            lines += ["  " + _help_line(sec, f, composed if chosen else None) for f in own_fields(schema, sec)]
        lines.append("")
    lines.append("`gems COMMAND [OVERRIDES] --cfg job` prints the composed configuration.")
    return "\n".join(lines)


def _help_line(sec: str, f: Any, composed: DictConfig | None) -> str:
    """A key's line in ``--help``: the value ``composed`` gives it (else its default), its values, its meaning."""
    import dataclasses

    meta = f.metadata
    if composed is not None and OmegaConf.select(composed, f"{sec}.{f.name}", default="<none>") != "<none>":
        value = OmegaConf.select(composed, f"{sec}.{f.name}")
        default = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    elif f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        default = "(required)"
    allowed = choices_of(f"{sec}.{f.name}", f)
    extra = f" [{' | '.join(allowed)}]" if allowed else (f" [{_bounds_text(meta)}]" if _bounds_text(meta) else "")
    return f"  {sec}.{f.name}={default}{extra}  {meta.get('help', '')}".rstrip()


def typed(cfg: Any) -> DictConfig:
    """``cfg`` (a mapping, a DictConfig, the YAML a launcher wrote) as the typed settings everything below an entry
    point reads: merged onto the schemas (:class:`GemsConf`, the model section onto its model's: :func:`schema_of`),
    so every key has its type and its one default (written once, in the dataclasses above and the models'), and a
    misspelt or mistyped key fails here, naming itself. The worker, the planner and the dry run take their
    configuration through this once; nothing below them reads a key with a fallback of its own."""
    if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is GemsConf:
        return cfg  # typed already (a plan of a typed configuration: gems.plan.search plans thousands)
    base = OmegaConf.structured(GemsConf)
    try:
        for sec in OPEN_SECTIONS:  # the section as its option declares it (the model's own keys)
            schema = schema_of(sec, _node(cfg, sec))
            if schema is not SECTIONS[sec]:
                base[sec] = OmegaConf.structured(schema)
            elif sec not in _EXTENDED:  # its registry not loaded here: its own keys are typed where it is built
                OmegaConf.set_struct(base[sec], False)
        out = OmegaConf.merge(base, cfg)
    except ConfigError:
        raise
    except Exception as e:  # a key the schemas do not have, or a value of the wrong type
        raise _omegaconf_error(e) from None
    assert isinstance(out, DictConfig)
    return out


def validate(cfg: DictConfig, relations: bool = True) -> None:
    """Every key against its schema's choices and bounds (a model's own keys against its declaration), then
    (``relations``) the checks that relate keys to each other (none needs the world or the model: those are
    :func:`gems.prepare.preflight`'s, the batch over the mesh :func:`gems.parallel.resolve`'s). Reads only: what is
    derived from the keys is derived where the configuration is built (:func:`compose`, :func:`place_job`)."""
    for name, f in schema_keys(cfg).items():
        check_key(name, OmegaConf.select(cfg, name, default=None), f)
    for sec in _EXTENDED:  # a key the option does not declare (model.name changed after its keys were composed)
        section(cfg, sec)
    if not relations:
        return
    t = cfg.train
    if t.steps is not None and t.epochs is not None:
        raise ConfigError("train.steps", t.steps, f"null with train.epochs={t.epochs} (the epochs set the steps)")
    steps = t.steps if t.steps is not None else (None if t.epochs is not None else DEFAULT_STEPS)
    if steps is not None and t.warmup_steps >= steps:  # (with epochs the steps are known with the data set)
        raise ConfigError("train.warmup_steps", t.warmup_steps, f"0 <= warmup < train.steps={steps}")
    check_lr_schedule(t)
    sp = cfg.parallel.spatial
    if isinstance(sp, int) or (OmegaConf.is_list(sp) and all(isinstance(x, int) for x in sp) and len(sp) > 0):
        pass
    else:
        raise ConfigError("parallel.spatial", sp, "an integer (parts along parallel.spatial_dims) or a list like [2,2]")
    from gems.mesh import mesh_from_config

    mesh = mesh_from_config(cfg)
    for k in ("kill_rank", "stall_rank", "nan_rank"):
        if int(cfg.fault.get(k, -1)) >= mesh.size:
            raise ConfigError(f"fault.{k}", cfg.fault[k], f"a rank below the world size {mesh.size} ({mesh.describe()}), "
                              "or -1 for none")
    if cfg.cluster.launcher == "slurm" and int(cfg.cluster.signal_margin_s) >= 60 * int(cfg.cluster.time_min):
        raise ConfigError("cluster.signal_margin_s", cfg.cluster.signal_margin_s,
                          f"fewer seconds than the time limit cluster.time_min={cfg.cluster.time_min} min "
                          f"(= {60 * int(cfg.cluster.time_min)} s) holds")
    if cfg.parallel.get("balance_by") == "comm":
        check_comm_cut(int(cfg.parallel.pipeline))
    if reads_files(cfg.data) and not cfg.data.path:
        raise ConfigError("data.path", cfg.data.path, "a folder of sample files in a layout gems reads (docs/data.md; "
                          "write one with `gems data synth`)")


def type_options(cfg: DictConfig) -> None:
    """Each open section of the composed ``cfg`` (the model) set to its option's schema (:func:`schema_of`): its own
    keys with their types and defaults, one it does not declare refused, naming the option's keys. Left as composed
    where the option's registry is not loaded, or the option is not registered (:func:`validate` names it)."""
    from omegaconf import open_dict

    for sec in OPEN_SECTIONS:
        node = cfg.get(sec)
        schema = schema_of(sec, node)
        if node is None or schema is SECTIONS[sec]:
            continue
        try:
            node = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.to_container(node))
        except Exception as e:  # a key the option does not declare, a value of the wrong type
            raise _omegaconf_error(e, within=sec) from None
        with open_dict(cfg):
            cfg[sec] = node


def place_job(cfg: DictConfig) -> None:
    """Where a launcher places the job on nodes (Slurm, or a cluster preset): ``cluster.nodes``,
    ``cluster.tasks_per_node`` and ``cluster.ntasks`` for the mesh's ranks (:func:`place`, which refuses what does
    not fit), set on ``cfg``. Not with ``parallel=auto``: the mesh is not chosen yet, and each candidate is placed
    when it is planned."""
    if not (cfg.cluster.launcher == "slurm" or cfg.cluster.name != "local") or cfg.parallel.get("auto"):
        return
    from omegaconf import open_dict

    from gems.mesh import mesh_from_config

    mesh = mesh_from_config(cfg)
    nodes, tasks = place(cfg.cluster, mesh.size, mesh.describe())
    with open_dict(cfg):
        cfg.cluster.nodes, cfg.cluster.tasks_per_node, cfg.cluster.ntasks = nodes, tasks, mesh.size


def serial(cfg: Any) -> DictConfig:
    """``cfg`` on one rank, here: every ``parallel`` key at its schema default (one replica, one partition, one
    part, ``lp``, no micro-batches, replica passes, virtual stages or recomputation: the defaults are the one-rank
    values), the local launcher; the model, the data and the training as they are. What the model's own work is
    counted on, whatever the mesh and schedule (gems.plan.roofline)."""
    import dataclasses

    from omegaconf import open_dict

    out = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    assert isinstance(out, DictConfig)
    with open_dict(out):
        for f in dataclasses.fields(ParallelConf):
            if f.default is not dataclasses.MISSING:
                out.parallel[f.name] = f.default
        out.cluster.launcher, out.cluster.name = "local", "local"
        out.cluster.nodes = out.cluster.tasks_per_node = None
    return out


def check_comm_cut(stages: int, ranks: int | None = None) -> None:
    """``parallel.balance_by=comm`` picks the one cut of two partitions; anything else is bad input (checked here,
    where the key is, and by the pipeline's balance and :func:`gems.parallel.resolve` with the schedule's stages). ``ranks``:
    the pipeline ranks, where they differ from the partitions (an interleaved schedule)."""
    if stages == 2:
        return
    where = (f"parallel.pipeline={stages}" if ranks is None or ranks == stages else
             f"{stages} partitions (parallel.pipeline={ranks} x parallel.virtual_stages={stages // max(1, ranks)})")
    raise ConfigError("parallel.balance_by", "comm", f"memory or time at {where} (comm picks the one cut of two "
                      "partitions on D = 2)")


def check_lr_schedule(t: Any) -> None:
    """The learning-rate keys fit the schedule they name, and a target needs something to evaluate on."""
    b, f = t.lr_decay_boundaries, t.lr_decay_factors
    if t.lr_schedule == "step":
        if not b or not f or len(b) != len(f):
            raise ConfigError("train.lr_decay_boundaries", list(b) if b else b, "as many boundaries as "
                              "train.lr_decay_factors (both given) for train.lr_schedule=step, e.g. [32, 64] and "
                              "[0.25, 0.125]")
        if any(float(x) <= 0 for x in b) or list(b) != sorted(b):
            raise ConfigError("train.lr_decay_boundaries", list(b), "increasing positive epochs or steps")
        if any(float(x) <= 0 for x in f):
            raise ConfigError("train.lr_decay_factors", list(f), "positive multiples of train.lr")
    elif b or f:
        key = "train.lr_decay_boundaries" if b else "train.lr_decay_factors"
        raise ConfigError(key, list(b or f), f"null with train.lr_schedule={t.lr_schedule} (only step decays "
                          "at boundaries)")


def place(cluster: Any, world: int, mesh_text: str = "") -> tuple[int, int]:
    """(nodes, tasks per node) for ``world`` ranks: what ``cluster.nodes`` and ``cluster.tasks_per_node`` fix,
    the rest derived. With neither fixed: on GPU nodes the fewest nodes that hold the world at most
    ``gpus_per_node`` ranks each, the last node possibly partly used (``tasks_per_node`` is then the most a node
    runs, and the job asks Slurm for ``world`` tasks: :func:`idle_gpus` says how many GPUs stay idle); on CPU
    nodes as few nodes as hold the ranks (``cpus_per_node / cpus_per_task`` each, all on one where the node's
    size is unknown), then the next count that divides the world evenly. Each point of a sweep is placed by its
    own world."""
    what = f"R x D x S = {world}" + (f" ({mesh_text})" if mesh_text else "")
    nodes, tasks = cluster.get("nodes"), cluster.get("tasks_per_node")
    if nodes is not None and tasks is not None:
        if int(nodes) * int(tasks) != world:
            raise ConfigError("cluster.tasks_per_node", tasks, f"nodes x tasks_per_node = {nodes} x {tasks} = "
                              f"{int(nodes) * int(tasks)} ranks to equal {what}; leave it null to derive it")
        return int(nodes), int(tasks)
    if nodes is not None:
        if world % int(nodes):
            raise ConfigError("cluster.nodes", nodes, f"a divisor of {what}, or null to derive it")
        return int(nodes), world // int(nodes)
    if tasks is not None:
        if world % int(tasks):
            raise ConfigError("cluster.tasks_per_node", tasks, f"a divisor of {what}, or null to derive it")
        return world // int(tasks), int(tasks)
    gpus, cpus = int(cluster.get("gpus_per_node") or 0), cluster.get("cpus_per_node")
    if gpus > 0:
        n = -(-world // gpus)
        return n, -(-world // n)  # the ranks spread evenly: a last node partly used, never an idle node
    per_node = max(1, int(cpus) // int(cluster.get("cpus_per_task") or 1)) if cpus else world
    n = -(-world // per_node)
    while world % n:
        n += 1
    return n, world // n


def idle_gpus(cluster: Any) -> int:
    """GPUs a placed job leaves idle: ``nodes x gpus_per_node`` less its ranks (0 on CPU nodes)."""
    gpus = int(cluster.get("gpus_per_node") or 0)
    if gpus <= 0 or cluster.get("nodes") is None:
        return 0
    return max(0, int(cluster.nodes) * gpus - job_tasks(cluster))


def job_tasks(cluster: Any) -> int:
    """The job's ranks: ``cluster.ntasks`` once placed, else ``nodes x tasks_per_node``."""
    if cluster.get("ntasks"):
        return int(cluster.ntasks)
    return int(cluster.nodes) * int(cluster.tasks_per_node)


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
