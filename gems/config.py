"""Configuration: dataclass schemas behind the YAML groups in ``conf/``, and
composition with Hydra that turns every user mistake into a ``ConfigError``.

Schemas are registered in Hydra's ConfigStore as ``base_<group>`` and each
YAML file in ``conf/<group>/`` lists its schema first in its defaults, so a
misspelt key or a value of the wrong type fails at composition with the key
named. ``conf/config.yaml`` holds only the defaults list.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf

from gems.errors import ConfigError


@dataclass
class ModelConf:
    name: str = MISSING
    size: int = 128  # the input's edge length
    width: float = 1.0  # channel multiplier (1.0 = the published model)
    dropout: float = 0.2
    depth: int = 110  # resnet: 9n+2
    num_classes: int = 3  # unet3d / resnet classes
    in_channels: int = 4
    norm: str = "batch"  # batch | group | none (resnet, unet3d)
    _target_: Optional[str] = None  # custom: dotted path of a callable returning nn.Sequential
    kwargs: dict = field(default_factory=dict)  # custom: arguments of that callable
    input_shape: Optional[list] = None  # custom: [C, *spatial]
    num_outputs: int = 4
    loss: str = "mse"  # mse | cross_entropy
    target: str = "vector"  # vector | dense
    spatial_end: Optional[int] = None  # custom: first layer that needs the whole sample


@dataclass
class DataConf:
    name: str = "synthetic"  # synthetic | hdf5
    path: Optional[str] = None  # hdf5: a folder of one-file-per-sample .h5 files
    num_samples: int = 64  # synthetic: size of the dataset (indices wrap around)
    int16: bool = True  # hdf5 files hold int16 counts; log(x+1) is applied when read


@dataclass
class ParallelConf:
    replicas: int = 1  # R: data-parallel copies
    pipeline: int = 1  # D: model partitions
    spatial: Any = 1  # S: an int, or a list of parts per cut dim
    spatial_dims: Optional[list] = None  # cut dims among the spatial ones; default [0] (or 0..k-1 for a list)
    schedule: str = "lp"  # lp | gpipe | 1f1b | mast | master
    micro_batches: int = 1
    gems_replicas: Optional[int] = None  # eta for master (default 2); mast is always 2
    balance: Optional[list] = None  # layers per partition; automatic when absent
    balance_by: str = "auto"  # auto (comm for mast/master at D = 2, else memory) | memory | time | comm (D = 2 only)
    checkpoint: bool = False  # recompute activations in the backward
    bn_stats: str = "global"  # global | local BatchNorm statistics over spatial parts
    overlap: Optional[bool] = None  # interior/halo overlap (null: on GPU only)


@dataclass
class TrainConf:
    batch_size: int = 4  # global batch of one optimizer step, all replicas together
    steps: int = 6
    warmup_steps: int = 2
    lr: float = 1e-3
    optimizer: str = "adam"  # sgd | adam
    momentum: float = 0.9
    seed: int = 0
    precision: str = "fp32"  # fp32 | bf16 | fp16
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 1  # torch threads per rank on CPU (0: torch's default)
    host_memory: str = "auto"  # auto | keep | release: freed host memory stays in the process (auto: on CPU ranks)
    checkpoint_every: int = 0  # save every N steps so a preempted or requeued job resumes (0: only when preempted)


@dataclass
class ClusterConf:
    name: str = "local"
    launcher: str = "local"  # local | slurm
    nodes: int = 1
    tasks_per_node: Optional[int] = 1  # null: R x D x S / nodes
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    gpu_memory_gb: float = 0.0
    mem_gb: Optional[float] = None
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    time_min: int = 30
    setup: list = field(default_factory=list)  # shell lines run before the ranks start
    srun_args: list = field(default_factory=list)  # e.g. ["--mpi=pmi2"]
    additional: dict = field(default_factory=dict)  # any other sbatch option, by its sbatch name
    python: Optional[str] = None  # interpreter on the compute nodes (default: this one)
    poll_s: float = 1.0  # how often the launcher checks the job
    timeout_min: Optional[float] = None  # give up waiting after this long (default: time_min + 5)


@dataclass
class CommConf:
    backend: str = "auto"  # auto | nccl | gloo | mpi
    bucket_mb: float = 4.0  # gradient all-reduce bucket size (MiB): small enough to overlap with the backward
    timeout_s: int = 300  # collective timeout: a dead peer ends the run instead of hanging it


@dataclass
class ResultsConf:
    dir: str = "results"
    name: Optional[str] = None  # run name (default: derived from model and mesh)
    sweep: Optional[str] = None  # sweep this run belongs to
    scaling: str = "weak"  # weak | strong: how `gems results` computes efficiency


@dataclass
class PlanConf:
    format: str = "table"  # table | json
    reserve_gb: float = 1.0  # per rank, set aside for the CUDA context, allocator and workspaces (CPU: at most 0.5)


@dataclass
class FaultConf:
    kill_rank: int = -1
    at_step: int = 1
    preempt_at_step: int = -1  # save and stop at this step once; the launcher resumes the job
    max_restarts: int = 3  # how often the local launcher resumes a preempted job


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
    run_id: Optional[str] = None  # set by the launcher


GROUP_SCHEMAS = {
    "model": ModelConf,
    "data": DataConf,
    "parallel": ParallelConf,
    "train": TrainConf,
    "cluster": ClusterConf,
    "comm": CommConf,
}

CHOICES = {
    "parallel.schedule": ("lp", "gpipe", "1f1b", "mast", "master"),
    "train.optimizer": ("sgd", "adam"),
    "train.precision": ("fp32", "bf16", "fp16"),
    "train.device": ("auto", "cpu", "cuda"),
    "train.host_memory": ("auto", "keep", "release"),
    "comm.backend": ("auto", "nccl", "gloo", "mpi"),
    "cluster.launcher": ("local", "slurm"),
    "data.name": ("synthetic", "hdf5"),
    "plan.format": ("table", "json"),
    "results.scaling": ("weak", "strong"),
    "parallel.bn_stats": ("global", "local"),
    "parallel.balance_by": ("auto", "memory", "time", "comm"),
    "model.norm": ("batch", "group", "none"),
}


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    # arithmetic for experiments, e.g. a weak-scaling batch: ${mul:${parallel.replicas},4}
    OmegaConf.register_new_resolver("mul", lambda a, b: int(a) * int(b), replace=True)
    # nodes for a world: ${ceildiv:${mul:${parallel.replicas},${parallel.spatial}},${cluster.gpus_per_node}}
    OmegaConf.register_new_resolver("ceildiv", lambda a, b: -(-int(a) // max(1, int(b))), replace=True)

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=GemsConf)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"base_{group}", node=schema)


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
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


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
    if check:
        validate(cfg)
    return cfg


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


def _omegaconf_error(e: Exception) -> ConfigError:
    import re

    key = getattr(e, "full_key", None) or "config"
    msg = str(e).splitlines()[0]
    if "not in struct" in msg or "Missing key" in msg or "Key '" in msg:
        return ConfigError(key, "?", "a key that exists in the schema (gems/config.py); new keys take a + prefix")
    m = re.search(r"Value '(.*)' of type '(\w+)' could not be converted to (\w+)", msg)
    if m:
        return ConfigError(key, m.group(1), f"a value of type {m.group(3).lower()}")
    return ConfigError(key, "?", msg)


def validate(cfg: DictConfig) -> None:
    """Checks that do not need the world: choices, positivity, divisibility."""
    for key, allowed in CHOICES.items():
        val = OmegaConf.select(cfg, key)
        if val is not None and val not in allowed:
            raise ConfigError(key, val, "one of " + ", ".join(allowed))
    for key in ("train.batch_size", "train.steps", "parallel.replicas", "parallel.pipeline",
                "parallel.micro_batches", "parallel.gems_replicas", "cluster.nodes", "cluster.tasks_per_node"):
        val = OmegaConf.select(cfg, key)
        if val is not None and (not isinstance(val, int) or val < 1):
            raise ConfigError(key, val, "a positive integer")
    if cfg.train.warmup_steps < 0 or cfg.train.warmup_steps >= cfg.train.steps:
        raise ConfigError("train.warmup_steps", cfg.train.warmup_steps, f"0 <= warmup < train.steps={cfg.train.steps}")
    if cfg.train.lr <= 0:
        raise ConfigError("train.lr", cfg.train.lr, "a positive learning rate")
    sp = cfg.parallel.spatial
    if isinstance(sp, int) or (OmegaConf.is_list(sp) and all(isinstance(x, int) for x in sp) and len(sp) > 0):
        pass
    else:
        raise ConfigError("parallel.spatial", sp, "an integer (parts along parallel.spatial_dims) or a list like [2,2]")
    from gems.mesh import mesh_from_config

    mesh = mesh_from_config(cfg)
    B, R = cfg.train.batch_size, mesh.replicas
    if B % R:
        raise ConfigError("train.batch_size", B, f"a multiple of parallel.replicas={R} (the global batch is split over replicas)")
    if cfg.cluster.launcher == "slurm" or cfg.cluster.name != "local":
        nodes = int(cfg.cluster.nodes)
        if cfg.cluster.tasks_per_node is None:  # derive the tasks from the mesh
            if mesh.size % nodes:
                raise ConfigError("cluster.nodes", nodes, f"a divisor of R x D x S = {mesh.size} ({mesh.describe()}), "
                                  "or set cluster.tasks_per_node")
            from omegaconf import open_dict

            with open_dict(cfg):
                cfg.cluster.tasks_per_node = mesh.size // nodes
        world = nodes * cfg.cluster.tasks_per_node
        if world != mesh.size:
            raise ConfigError(
                "cluster.tasks_per_node", cfg.cluster.tasks_per_node,
                f"nodes x tasks_per_node = {nodes} x {cfg.cluster.tasks_per_node} = {world} ranks "
                f"to equal R x D x S = {mesh.size} ({mesh.describe()}); leave it null to derive it",
            )
    if cfg.parallel.get("balance_by") == "comm":
        from gems.pipeline.partition import check_comm_cut

        check_comm_cut(int(cfg.parallel.pipeline))
    if cfg.data.name == "hdf5" and not cfg.data.path:
        raise ConfigError("data.path", cfg.data.path, "a folder of .h5 sample files (write one with `gems data synth`)")


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
