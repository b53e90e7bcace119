import pytest

from gems.errors import ConfigError
from gems.mesh import Axis, Mesh


def test_layout_is_spatial_innermost_and_roundtrips():
    m = Mesh(replicas=2, pipeline=3, parts=(2, 2), spatial_dims=(0, 1))
    assert m.size == 24 and m.spatial == 4
    seen = set()
    for rank in range(m.size):
        c = m.coord(rank)
        assert m.rank_of(c.replica, c.pipeline, c.spatial) == rank
        assert m.spatial_of(c.spatial_grid) == c.spatial
        seen.add((c.replica, c.pipeline, c.spatial))
    assert len(seen) == 24
    assert m.coord(5).spatial_grid == (0, 1) and m.coord(5).pipeline == 1
    assert m.spatial_ranks(1, 2) == [20, 21, 22, 23]
    assert m.pipeline_ranks(0, 1) == [1, 5, 9]
    assert m.replica_ranks(2, 3) == [11, 23]


def test_every_axis_partitions_the_world():
    m = Mesh(replicas=2, pipeline=2, parts=(3,))
    for axis in Axis:
        lists = m.all_rank_lists(axis)
        flat = sorted(r for lst in lists for r in lst)
        assert flat == list(range(m.size)), axis


def test_world_mismatch_is_a_config_error():
    with pytest.raises(ConfigError, match="R x D x S = 2 x 2 x 2 = 8"):
        Mesh(replicas=2, pipeline=2, parts=(2,), world_size=6)


@pytest.mark.parametrize("kw,key", [
    (dict(replicas=0), "parallel.replicas"),
    (dict(parts=(2, 0), spatial_dims=(0, 1)), "parallel.spatial"),
    (dict(parts=(2, 2), spatial_dims=(0,)), "parallel.spatial_dims"),
    (dict(parts=(2, 2), spatial_dims=(1, 1)), "parallel.spatial_dims"),
])
def test_bad_degrees(kw, key):
    with pytest.raises(ConfigError) as e:
        Mesh(**kw)
    assert e.value.key == key
