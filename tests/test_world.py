import pytest
from _worlds import allreduce_rank, fail_on_one

from gems.launch.world import run_world


def test_run_world_allreduce():
    assert run_world(allreduce_rank, 3) == [6.0, 6.0, 6.0]


def test_run_world_reports_the_failing_rank():
    with pytest.raises(RuntimeError, match="rank 1"):
        run_world(fail_on_one, 2, timeout=60)


@pytest.mark.parametrize("skips, stops", [(3, False), (60, True)])
def test_a_cut_header_too_long_stops_both_ends(skips, stops):
    """Both ranks of the cut raise the same error at once (the receiver does not wait for the watchdog); a cut of
    few skips learns its layout from the header and trains."""
    from _worlds import header_overflow

    got = run_world(header_overflow, 2, skips, timeout=120)
    if stops:
        assert got[0] == got[1] and "header of a pipeline cut needs" in got[0], got
    else:
        assert got == [None, None]
