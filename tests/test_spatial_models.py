"""CosmoFlow (paper and MLPerf variants) and the 3D U-Net, spatially partitioned,
equal serial: outputs, input gradients, summed parameter gradients, BatchNorm
running statistics, with dropout drawn per sample (training mode). The paper's
sizes (128^3 to 512^3) are checked on fake tensors: their shapes, not their values."""
import pytest
from _spatial_worlds import COMM, EXTRA_CASES, RAN, case_names, cases_world, model_cases
from torch import nn

from gems.commlog import replay
from gems.launch.world import run_world
from gems.pipeline.partition import boundary_shapes


@pytest.fixture(scope="module")
def failures():
    out = {}
    logs = {}
    for rank, per_rank in enumerate(run_world(cases_world, 4, "models", timeout=300)):
        logs[rank] = per_rank.pop(COMM)
        out.setdefault(RAN, set()).update(per_rank.pop(RAN))
        for case, text in per_rank.items():
            out[case] = out.get(case, "") + text + "\n"
    out[COMM] = logs
    return out


@pytest.mark.parametrize("case", case_names(model_cases()) + EXTRA_CASES["models"])
def test_model_matches_serial(failures, case):
    assert case in failures[RAN], f"{case} ran on no rank"
    assert case not in failures, failures.get(case)


@pytest.mark.parametrize("size,pools", [(128, 5), (256, 6), (512, 7)])
def test_cosmoflow_paper_sizes_flatten_to_2048(size, pools):
    """The paper variant at its three sizes (gems/models/cosmoflow.py): one AvgPool3d k3s2p1 after
    each of conv1-5, plus one more at 256^3 and two at 512^3, right after the first, so that the
    dense head always sees 256 x 2^3 = 2048 features. Traced on fake tensors (no 512^3 activation
    is allocated)."""
    from gems.models import build_model

    spec = build_model(dict(name="cosmoflow", size=size, width=1.0, dropout=0.2))
    seq, end = spec.module, spec.spatial_end
    assert spec.input_shape == (4, size, size, size) and isinstance(seq[end], nn.Flatten)
    kinds = [type(m).__name__ for m in seq[:end]]
    assert kinds.count("AvgPool3d") == pools and kinds.count("Conv3d") == 7
    assert all(isinstance(m, nn.AvgPool3d) and (m.kernel_size, m.stride, m.padding) == (3, 2, 1)
               for m in seq[:end] if "Pool" in type(m).__name__)
    convs = [i for i, k in enumerate(kinds) if k == "Conv3d"]
    # the extra pools follow the first: conv1, LeakyReLU, pools - 4 pools, conv2
    assert kinds[:convs[1]] == ["Conv3d", "LeakyReLU"] + ["AvgPool3d"] * (pools - 4)
    for a, b in zip(convs[1:5], convs[2:6]):  # conv2-conv5: one pool each
        assert kinds[a:b] == ["Conv3d", "LeakyReLU", "AvgPool3d"]
    assert "AvgPool3d" not in kinds[convs[5]:]  # none after conv6, conv7
    trunk, flat = boundary_shapes([seq[:end], seq[end:end + 1], seq[end + 1:]], (1, 4, size, size, size))
    assert trunk[0] == (1, 256, 2, 2, 2) and flat[0] == (1, 2048)
    assert seq[end + 1].in_features == 2048


def test_model_orders_complete_under_nccl(failures):
    """CosmoFlow and the U-Net, every cut, replayed under NCCL's rules (gems.commlog)."""
    for strict in (False, True):
        ran = replay(failures[COMM], strict_sends=strict)
        assert ran["messages"] > 100, ran
