import pytest
from _worlds import allreduce_rank, fail_on_one

from gems.launch.world import run_world


def test_run_world_allreduce():
    assert run_world(allreduce_rank, 3) == [6.0, 6.0, 6.0]


def test_run_world_reports_the_failing_rank():
    with pytest.raises(RuntimeError, match="rank 1"):
        run_world(fail_on_one, 2, timeout=60)
