"""Every spatial layer type equals its serial self: outputs, input and parameter
gradients, buffers; S = 2, 3, 4; one and two cut dims; uneven parts; 1D, 2D, 3D;
overlap on, off and the CPU default. One 4-rank gloo world runs all cases; each
case is reported on its own. An 8-rank world cuts 3D inputs into 2x2x2 cubes,
where every part exchanges halos with all 7 others (faces, edges, the corner)."""
import pytest
from _spatial_worlds import COMM, CUBE_CASES, EXTRA_CASES, LAYER_CASES, RAN, case_names, cases_world

from gems.commlog import replay
from gems.launch.world import run_world


def _collect(which, world):
    out = {}
    logs = {}
    for rank, per_rank in enumerate(run_world(cases_world, world, which, timeout=300)):
        logs[rank] = per_rank.pop(COMM)
        out.setdefault(RAN, set()).update(per_rank.pop(RAN))
        for case, text in per_rank.items():
            out[case] = out.get(case, "") + text + "\n"
    out[COMM] = logs
    return out


@pytest.fixture(scope="module")
def failures():
    return _collect("layers", 4)


@pytest.fixture(scope="module")
def cube_failures():
    return _collect("cubes", 8)


@pytest.mark.parametrize("case", case_names(LAYER_CASES) + EXTRA_CASES["layers"])
def test_layer_matches_serial(failures, case):
    assert case in failures[RAN], f"{case} ran on no rank"
    assert case not in failures, failures.get(case)


@pytest.mark.parametrize("case", case_names(CUBE_CASES))
def test_cube_layer_matches_serial(cube_failures, case):
    assert case in cube_failures[RAN], f"{case} ran on no rank"
    assert case not in cube_failures, cube_failures.get(case)


@pytest.mark.parametrize("which", ["layers", "cubes"])
def test_halo_orders_complete_under_nccl(failures, cube_failures, which):
    """Everything the ranks issued for every layer case (halos both ways, the no-copy route's two autograd
    nodes, global BatchNorm and pooling collectives, gathers) replayed under NCCL's rules (gems.commlog):
    batches on the spatial group's stream in issue order, messages matched by order, not by tag."""
    logs = (failures if which == "layers" else cube_failures)[COMM]
    for strict in (False, True):
        ran = replay(logs, strict_sends=strict)
        assert ran["messages"] > 100 and ran["collectives"] > 10, ran
