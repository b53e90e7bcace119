"""Every spatial layer type equals its serial self: outputs, input and parameter
gradients, buffers; S = 2, 3, 4; one and two cut dims; uneven parts; 1D, 2D, 3D.
One 4-rank gloo world runs all cases; each case is reported on its own."""
import pytest

from _spatial_worlds import EXTRA_CASES, LAYER_CASES, case_names, cases_world
from gems.testing import run_world


@pytest.fixture(scope="module")
def failures():
    out = {}
    for per_rank in run_world(cases_world, 4, "layers", timeout=300):
        for case, text in per_rank.items():
            out[case] = out.get(case, "") + text + "\n"
    return out


@pytest.mark.parametrize("case", case_names(LAYER_CASES) + EXTRA_CASES["layers"])
def test_layer_matches_serial(failures, case):
    assert case not in failures, failures.get(case)
