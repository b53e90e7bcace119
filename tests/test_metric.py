"""gems.rank.loss.Metric's crop averages (train.eval_average_crops) on numbers worked by hand: what an evaluation
of crops of universes reports does not depend on a trained model's luck (an integration test that asked whether
averaging changed the error could only be as good as the few steps of training behind it)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from gems.mesh import Mesh
from gems.models import ModelSpec
from gems.rank.loss import Metric


def _metric(groups: int) -> Metric:
    spec = ModelSpec(nn.Sequential(nn.Identity()), "toy", (1, 4, 4, 4), 2, "mse")
    m = Metric(spec, Mesh(parts=(1,), world_size=1), counts=True)
    m.group_by(lambda i: i // 2, groups)  # two crops a universe
    return m


def test_crop_averages_are_the_error_of_each_universes_mean_prediction() -> None:
    y = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0], [0.0, 2.0]])  # two universes, two crops each
    out = torch.tensor([[2.0, 1.0], [0.0, -1.0], [0.0, 3.0], [1.0, 2.0]])
    m = _metric(2)
    got = m.report(m(out[:3], y[:3], ids=[0, 1, 2]) + m(out[3:], y[3:], ids=[3]))  # summed over two batches
    # per sample |error|: (1, 1), (1, 1), (0, 1), (1, 0) -> mae 6 / 8
    assert got["mae"] == pytest.approx(6 / 8) and got["samples"] == 4 and got["groups"] == 2
    # the universes' mean predictions (1, 0) and (0.5, 2.5) against (1, 0) and (0, 2): errors (0, 0), (0.5, 0.5)
    assert got["mae_avg_crops_per_target"] == pytest.approx([0.25, 0.25])
    assert got["mae_avg_crops"] == pytest.approx(0.25) and got["mae_avg_crops"] < got["mae"]


def test_crops_that_agree_average_to_their_own_error() -> None:
    """Crops predicting alike (an untrained network's mean) average to the same error: equal, never larger."""
    y = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    out = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    m = _metric(1)
    got = m.report(m(out, y, ids=[0, 1]))
    assert got["mae_avg_crops"] == pytest.approx(got["mae"]) == pytest.approx(0.5)
