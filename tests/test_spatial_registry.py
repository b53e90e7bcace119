"""Layers by registration: the spatial converter learns layer types from registrations (the models' and
the user's), cuts global pooling exactly, and refuses a layer it cannot cut, naming it, unless the user asks for
the activation to be gathered before it (``parallel.gather_uncut=true``), which the record then says. Every case
trains like the serial run."""
from __future__ import annotations

import pytest
import torch
from _cli import gems_here, records
from torch import nn

from gems.cut_rules import rule_for
from gems.errors import ConfigError
from gems.spatial import CannotCut, gather_point, register_layer

COMMON = ["model=custom", "model.num_outputs=3", "train.batch_size=4", "train.steps=3", "train.warmup_steps=1",
          "train.optimizer=sgd", "train.lr=0.05"]


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    cache = {}

    def get(*args):
        if args not in cache:
            d = tmp_path_factory.mktemp("serial")
            out = gems_here("run", f"results.dir={d}", *args)
            assert out.returncode == 0, out.stderr[-2000:]
            (r,) = records(str(d))
            cache[args] = r["loss"]
        return cache[args]

    return get


@pytest.mark.parametrize("target,shape,par,note", [
    ("_custom_models.resnet_head_2d", "[1,8,8]", ["parallel.spatial=2"], None),
    ("_custom_models.resnet_head_2d", "[1,8,8]", ["parallel.spatial=[2,2]", "parallel.spatial_dims=[0,1]"], None),
    ("_custom_models.max_head_3d", "[1,8,8,8]", ["parallel.spatial=2"], None),
    ("_custom_models.global_pool", "[1,8,8,8]", ["parallel.spatial=[2,2]", "model.spatial_end=3"], None),
    ("_custom_models.adaptive_3", "[1,8,8,8]", ["parallel.spatial=2", "parallel.gather_uncut=true"],
     "layer 2 AdaptiveAvgPool3d(output_size=2)"),
    ("_custom_models.own_layer", "[1,8,8,8]", ["parallel.spatial=2", "parallel.gather_uncut=true"],
     "layer 1 Normalize()"),
    ("_custom_models.registered_own", "[1,8,8,8]", ["parallel.spatial=2"], None),
    ("_custom_models.resnet_head_2d", "[1,8,8]", ["parallel.spatial=2", "parallel.pipeline=2",
                                                  "parallel.schedule=mast"], None),
])
def test_models_with_global_pooling_or_uncut_layers_train_like_serial(tmp_path, serial, target, shape, par, note):
    base = [*COMMON, f"model._target_={target}", f"model.input_shape={shape}"]
    ref = serial(*base)
    out = gems_here("run", f"results.dir={tmp_path}", *base, *par)
    assert out.returncode == 0, out.stderr[-2000:]
    (r,) = records(str(tmp_path))
    torch.testing.assert_close(torch.tensor(r["loss"]), torch.tensor(ref), rtol=1e-5, atol=1e-7)
    if note is None:  # nothing gathered early (other notes, such as on the few measured steps, may be there)
        assert not any("gathered before it" in n for n in r.get("notes") or []), r.get("notes")
    else:
        assert any(note in n and "gathered before it" in n for n in r["notes"]), r.get("notes")
        assert note in out.stderr  # said before launch too


def test_gather_point_is_the_first_layer_gems_cannot_cut():
    seq = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.AdaptiveAvgPool3d(2), nn.Flatten(), nn.Linear(16, 3))
    end, note = gather_point(seq, 2, (2,), (0,))
    assert end == 1 and "AdaptiveAvgPool3d" in note
    seq = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.AdaptiveMaxPool3d(1), nn.ReLU(), nn.Flatten(), nn.Linear(2, 3))
    end, note = gather_point(seq, 3, (2,), (0,))
    assert end == 2 and "global pooling" in note  # the output is whole after the pooling: the trunk ends there
    assert gather_point(seq, 2, (2,), (0,)) == (2, None)
    reflect = nn.Sequential(nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect"), nn.Flatten(), nn.Linear(64, 1))
    end, note = gather_point(reflect, 1, (2,), (0,))
    assert end == 0 and "padding_mode='zeros'" in note


def test_a_registration_is_all_a_new_layer_type_needs():
    class Halve(nn.Module):
        def forward(self, x):
            return x / 2

    assert rule_for(Halve()) is None

    def refuse(m, conv, label):
        raise CannotCut("an even number of channels")

    register_layer(Halve, refuse)
    seq = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), Halve(), nn.Flatten(), nn.Linear(128, 1))
    end, note = gather_point(seq, 2, (2,), (0,))
    assert end == 1 and "an even number of channels" in note
    from gems.spatial import register_pointwise

    register_pointwise(Halve)
    assert gather_point(seq, 2, (2,), (0,)) == (2, None)


def test_a_dense_model_is_refused_when_a_layer_cannot_be_cut(tmp_path):
    out = gems_here("run", f"results.dir={tmp_path}", "model=custom", "model._target_=_custom_models.dense_own",
                    "model.input_shape=[1,8,8,8]", "model.target=dense", "model.loss=cross_entropy", "model.num_outputs=2",
                    "parallel.spatial=2")
    assert out.returncode == 2 and "model=custom" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_layer_gems_cannot_cut_is_refused_unless_gathered_by_request(tmp_path):
    """A block the spatial code does not know is not gathered silently (an equivalence test would then pass while
    nothing was cut): the run is refused before launch, naming the layer and the key that gathers it."""
    out = gems_here("run", f"results.dir={tmp_path}", *COMMON, "model._target_=_custom_models.own_layer",
                    "model.input_shape=[1,8,8,8]", "parallel.spatial=2")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "parallel.gather_uncut=False" in out.stderr and "layer 1 Normalize()" in out.stderr, out.stderr
    assert not list(tmp_path.glob("*.json"))
    seq = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.AdaptiveAvgPool3d(2), nn.Flatten(), nn.Linear(16, 3))
    with pytest.raises(ConfigError, match="layer 1 AdaptiveAvgPool3d"):
        gather_point(seq, 2, (2,), (0,), gather_uncut=False)
