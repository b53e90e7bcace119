"""The R x D x S device mesh: one validated object, named axes, one vocabulary (docs/design.md, "Vocabulary").

Its pure part (sizes, coordinates, rank lists) needs no process group, so the planner and the tests use it at any
world size; :meth:`Mesh.build_groups` makes the torch.distributed groups once the world exists.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from gems.errors import ConfigError


def unravel(index: int, parts: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinates of spatial index ``index`` in a grid of ``parts``."""
    out = []
    for p in reversed(parts):
        out.append(index % p)
        index //= p
    return tuple(reversed(out))


def ravel(grid: Sequence[int], parts: Sequence[int]) -> int:
    """The spatial index of grid coordinates ``grid`` (inverse of :func:`unravel`)."""
    index = 0
    for g, p in zip(grid, parts):
        index = index * p + g
    return index


class Axis(str, enum.Enum):
    """Names of the mesh axes (never of tensor dims)."""

    REPLICA = "replica"
    PIPELINE = "pipeline"
    SPATIAL = "spatial"


@dataclass(frozen=True)
class Coord:
    """Where one rank sits on the mesh."""

    replica: int
    pipeline: int
    spatial: int
    spatial_grid: tuple[int, ...]  # coordinates of ``spatial`` in the parts grid


@dataclass
class Groups:
    """This rank's process groups along each axis, and the ranks in them (None: a group of one).

    ``grad``: every rank that holds a copy of this rank's parameters (the same pipeline positions over all
    replicas and spatial parts), whose gradients are summed together."""

    spatial: Any = None
    spatial_ranks: list[int] = field(default_factory=list)
    pipeline: Any = None
    pipeline_ranks: list[int] = field(default_factory=list)
    #: gloo only: a second group of the pipeline line's ranks, for the messages that go up the line (to a lower
    #: position; gems.pipeline.runtime): gloo runs both directions of a pair of ranks on one connection, whose
    #: lock a large message holds (None: every message on ``pipeline``)
    pipeline_up: Any = None
    replica: Any = None
    replica_ranks: list[int] = field(default_factory=list)
    grad: Any = None
    grad_ranks: list[int] = field(default_factory=list)
    built: bool = False  # build_groups ran
    #: what building them asked of torch.distributed, one entry a call: ("split", axis) one split of the world's
    #: communicator for a whole axis (NCCL), ("members", axis) a group made by its members alone (the dry run),
    #: ("every", axis) one group of an axis made by every rank (gloo, MPI: no communicator of the world's)
    setup_calls: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Mesh:
    """Degrees of parallelism, validated against each other and the world.

    ``parts`` lists the number of parts along each cut spatial dim and
    ``spatial_dims`` which spatial dims are cut (0 = depth in 3D, height in 2D).
    """

    replicas: int = 1
    pipeline: int = 1
    parts: tuple[int, ...] = (1,)
    spatial_dims: tuple[int, ...] = (0,)
    world_size: int | None = None
    groups: Groups = field(default_factory=Groups, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.parts = tuple(int(p) for p in self.parts)
        self.spatial_dims = tuple(int(d) for d in self.spatial_dims)
        for key, val in (("parallel.replicas", self.replicas), ("parallel.pipeline", self.pipeline)):
            if not isinstance(val, int) or val < 1:
                raise ConfigError(key, val, "a positive integer")
        if any(p < 1 for p in self.parts):
            raise ConfigError("parallel.spatial", list(self.parts), "positive integers, e.g. 2 or [2,2]")
        if len(self.parts) != len(self.spatial_dims):
            raise ConfigError(
                "parallel.spatial_dims",
                list(self.spatial_dims),
                f"one dim per entry of parallel.spatial={list(self.parts)} "
                f"(e.g. {list(range(len(self.parts)))})",
            )
        if len(set(self.spatial_dims)) != len(self.spatial_dims) or any(d < 0 for d in self.spatial_dims):
            raise ConfigError("parallel.spatial_dims", list(self.spatial_dims), "distinct non-negative dims, e.g. [0] or [0,1]")
        if self.world_size is not None and self.world_size != self.size:
            raise ConfigError(
                "world size",
                self.world_size,
                f"R x D x S = {self.replicas} x {self.pipeline} x {self.spatial} = {self.size} "
                "(change parallel.* or cluster.nodes/cluster.tasks_per_node)",
            )

    # ---- sizes -----------------------------------------------------------------
    @property
    def spatial(self) -> int:
        return math.prod(self.parts)

    @property
    def size(self) -> int:
        return self.replicas * self.pipeline * self.spatial

    @property
    def pipeline_enabled(self) -> bool:
        return self.pipeline > 1

    @property
    def spatial_enabled(self) -> bool:
        return self.spatial > 1

    # ---- coordinates ------------------------------------------------------------
    def rank_of(self, replica: int, pipeline: int, spatial: int) -> int:
        return (replica * self.pipeline + pipeline) * self.spatial + spatial

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} outside a mesh of {self.size}")
        s = rank % self.spatial
        d = (rank // self.spatial) % self.pipeline
        r = rank // (self.spatial * self.pipeline)
        return Coord(r, d, s, self.grid_of(s))

    def grid_of(self, spatial: int) -> tuple[int, ...]:
        """Row-major coordinates of spatial index ``spatial`` in the parts grid."""
        return unravel(spatial, self.parts)

    def spatial_of(self, grid: Sequence[int]) -> int:
        return ravel(grid, self.parts)

    # ---- rank lists (pure) --------------------------------------------------------
    def spatial_ranks(self, replica: int, pipeline: int) -> list[int]:
        return [self.rank_of(replica, pipeline, s) for s in range(self.spatial)]

    def pipeline_ranks(self, replica: int, spatial: int) -> list[int]:
        return [self.rank_of(replica, d, spatial) for d in range(self.pipeline)]

    def replica_ranks(self, pipeline: int, spatial: int) -> list[int]:
        return [self.rank_of(r, pipeline, spatial) for r in range(self.replicas)]

    def stage_ranks(self, pipelines: Sequence[int]) -> list[int]:
        """All ranks (every replica and spatial part) at the given pipeline positions."""
        return sorted(
            self.rank_of(r, d, s)
            for r in range(self.replicas)
            for d in sorted(set(pipelines))
            for s in range(self.spatial)
        )

    def all_rank_lists(self, axis: Axis) -> list[list[int]]:
        if axis is Axis.SPATIAL:
            return [self.spatial_ranks(r, d) for r in range(self.replicas) for d in range(self.pipeline)]
        if axis is Axis.PIPELINE:
            return [self.pipeline_ranks(r, s) for r in range(self.replicas) for s in range(self.spatial)]
        return [self.replica_ranks(d, s) for d in range(self.pipeline) for s in range(self.spatial)]

    # ---- process groups -------------------------------------------------------------
    def build_groups(self, rank: int, mirrored: bool = False, timeout: Any = None,
                     groups: Sequence[Sequence[int]] | None = None) -> None:
        """Create the torch.distributed groups this rank belongs to.

        ``timeout`` (a ``datetime.timedelta``; ``World.timeout`` from :func:`gems.init`) bounds every
        collective of the groups. Pass it: torch gives a new group its backend's default (30 minutes on
        gloo), not the default group's timeout, so a stalled peer would hold the others that long.

        One call an axis where NCCL makes the groups (:meth:`_axis_group`): at
        2048 ranks four splits of the world's communicator where one
        ``new_group`` a group made thousands. ``groups`` lists the pipeline positions whose
        ranks hold copies of the same partitions (a schedule's
        ``holder_groups()``: ``(d, D-1-d)`` for GEMS-MAST/MASTER); each gradient
        group is those positions over every replica and spatial part.
        ``mirrored=True`` without ``groups`` means GEMS's pairs; otherwise each
        position is its own group (``R x S`` ranks).

        A pipeline line's messages all go on its ``pipeline`` group, one communicator, in exchange rounds
        (:mod:`gems.pipeline.exchange`; docs/design.md, "Rules of the GPU path"); over gloo, those going up the
        line go on a second group of the same ranks, ``pipeline_up`` (:func:`up_group_wanted`).
        """
        me = self.coord(rank)
        for axis in Axis:
            lists = self.all_rank_lists(axis)
            g = self._axis_group(axis.value, lists, rank, timeout)
            mine = next(r for r in lists if rank in r)
            setattr(self.groups, axis.value, g)
            setattr(self.groups, axis.value + "_ranks", mine)
        if up_group_wanted() and self.pipeline > 1:
            self.groups.pipeline_up = self._axis_group("pipeline_up", self.all_rank_lists(Axis.PIPELINE), rank,
                                                       timeout)
        if groups is None:
            groups = [tuple(sorted({d, self.pipeline - 1 - d})) if mirrored else (d,) for d in range(self.pipeline)]
        keys = list(dict.fromkeys(tuple(sorted(set(int(d) for d in pos))) for pos in groups))
        lists = [self.stage_ranks(key) for key in keys]
        self.groups.grad = self._axis_group("grad", lists, rank, timeout)
        self.groups.grad_ranks = next(r for key, r in zip(keys, lists) if me.pipeline in key)
        self.groups.built = True

    def _axis_group(self, axis: str, lists: list[list[int]], rank: int, timeout: Any) -> Any:
        """This rank's group of one axis, whose rank lists partition the world. Where the world's backend
        splits its communicator (NCCL with a bound device), one split for the whole axis
        (``torch.distributed.split_group``): torch's ``new_group`` would split the whole world once per group,
        members or not. The dry run's fake group: its members alone make it, one call (what the count of
        calls a GPU job makes reads). Elsewhere (gloo, MPI) every rank makes every group, as torch's
        ``new_group`` asks (each a barrier over the rendezvous store, no communicator of the world's: groups made
        by their members alone hang in torch 2.13 once a group was made the other way). None where the axis's
        groups have one rank."""
        import torch.distributed as dist

        from gems.progress import mark

        mark("setup")  # the set-up moves on: one mark an axis
        if max(len(r) for r in lists) < 2:
            return None
        mine = next(r for r in lists if rank in r)
        if _splits():
            self.groups.setup_calls.append(("split", axis))
            return dist.split_group(split_ranks=lists, timeout=timeout, group_desc=f"gems {axis}")
        if dist.get_backend() == "fake":
            self.groups.setup_calls.append(("members", axis))
            return dist.new_group(mine, timeout=timeout, use_local_synchronization=True, group_desc=f"gems {axis}")
        out = None
        for ranks in lists:
            self.groups.setup_calls.append(("every", axis))
            g = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                out = g
        return out

    def group(self, axis: Axis | str) -> Any:
        """The process group of this rank along ``axis`` (None when of size 1)."""
        name = axis.value if isinstance(axis, Axis) else axis
        return getattr(self.groups, name)

    def ranks(self, axis: Axis | str) -> list[int]:
        name = axis.value if isinstance(axis, Axis) else axis
        return list(getattr(self.groups, name + "_ranks"))

    def describe(self) -> str:
        sp = "x".join(str(p) for p in self.parts)
        return f"R{self.replicas} x D{self.pipeline} x S{self.spatial}({sp} over dims {list(self.spatial_dims)})"


def up_group_wanted() -> bool:
    """Whether a pipeline line carries its messages up the line (to a lower position) on a second group of its ranks:
    over gloo only. gloo runs a ``batch_isend_irecv`` as its operations one by one, and both directions of a pair of
    ranks on one connection under one lock, which its I/O thread holds while it reads a message in: a rank's send
    waited 2-4 ms for the peer's 2 MB activation coming the other way (gems bench pipeline's model, two ranks, timed
    by hand; results/history/pipeline-schedules.md#pipeline-gloo-directions measures the change). A group of its own
    for each direction gives each its own connection and thread. NCCL runs a batch as one group, which must be on one
    communicator; MPI progresses both directions itself."""
    import torch.distributed as dist

    return dist.is_initialized() and dist.get_backend() == "gloo"


def _splits() -> bool:
    """Whether the world's backend splits its communicator for new groups (NCCL with a bound device)."""
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    device = getattr(default, "bound_device_id", None)
    if device is None:
        return False
    try:
        return bool(default._get_backend(device).supports_splitting)
    except RuntimeError:
        return False


def mesh_from_config(cfg: Any, world_size: int | None = None) -> Mesh:
    """Build the mesh from the ``parallel`` config node."""
    p = cfg.parallel
    spatial = p.spatial
    parts = [spatial] if isinstance(spatial, int) else list(spatial)
    dims = p.spatial_dims
    if dims is None:
        dims = list(range(len(parts)))
    dims = list(dims)
    if len(parts) == 1 and len(dims) > 1:
        raise ConfigError("parallel.spatial", spatial, f"a list with one entry per dim in parallel.spatial_dims={dims}")
    return Mesh(int(p.replicas), int(p.pipeline), tuple(parts), tuple(dims), world_size)
