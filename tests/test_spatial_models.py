"""CosmoFlow (paper and MLPerf variants) and the 3D U-Net, spatially partitioned,
equal serial: outputs, input gradients, summed parameter gradients, BatchNorm
running statistics, with dropout drawn per sample (training mode)."""
import pytest

from _spatial_worlds import EXTRA_CASES, case_names, cases_world, model_cases
from gems.testing import run_world


@pytest.fixture(scope="module")
def failures():
    out = {}
    for per_rank in run_world(cases_world, 4, "models", timeout=300):
        for case, text in per_rank.items():
            out[case] = out.get(case, "") + text + "\n"
    return out


@pytest.mark.parametrize("case", case_names(model_cases()) + EXTRA_CASES["models"])
def test_model_matches_serial(failures, case):
    assert case not in failures, failures.get(case)
