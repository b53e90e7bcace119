"""The extension points follow their registries: every registered schedule, layout and model is in ``--help`` and
in its docs table (and nothing unregistered is), a model registered without a YAML is composed, built and planned
from its registration, ``data=files`` and its older name ``data=hdf5`` are one thing, and no layer outside
``gems/models`` (nor a test of the schedules) decides by a name."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from torch import nn

from gems.cli import load_registries, main
from gems.config import ModelConf, compose, reads_files
from gems.data.layouts import registered as layouts
from gems.models import build_model, check_shapes
from gems.models import registered as models
from gems.models.registry import _REGISTRY, ModelSpec, register_model
from gems.pipeline.schedules import registered as schedules

ROOT = Path(__file__).resolve().parents[1]


def _table(doc: str, header: str) -> set[str]:
    """The backticked names of the first column of the table whose header row starts with ``| header |``."""
    lines = (ROOT / doc).read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"| {header} |"))
    names = set()
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        names |= set(re.findall(r"`([^`]+)`", ln.split("|")[1]))
    return names


@pytest.mark.parametrize("registry,key,doc,header", [
    (schedules, "parallel.schedule", "docs/parallelism.md", "schedule"),
    (models, "model.name", "docs/parallelism.md", "model"),
    (layouts, "data.layout", "docs/data.md", "layout (`data.layout`)"),
])
def test_every_registered_name_is_in_help_and_its_docs_table_and_nothing_else(capsys, registry, key, doc, header):
    assert main(["run", "--help"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(f"  {key}="))
    listed = set(re.search(r"\[([^\]]*)\]", line).group(1).split(" | "))
    names = set(registry())
    assert listed == names, (key, listed ^ names)
    assert _table(doc, header) == names, (doc, _table(doc, header) ^ names)


@pytest.fixture
def tiny_model():
    """A model registered as a new module registers one, with no YAML, removed again after the test."""

    def build(m: ModelConf) -> ModelSpec:
        seq = nn.Sequential(nn.Conv2d(int(m.in_channels), 2, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                            nn.Flatten(), nn.Linear(2, int(m.num_classes)))
        return ModelSpec(seq, "tiny_registered", (int(m.in_channels), m.size, m.size), int(m.num_classes),
                         "cross_entropy", "vector", 3)

    models()
    register_model("tiny_registered", build, "a test's model", "C x N^2", {"size": 8},
                   config={"size": 12, "in_channels": 2, "num_classes": 3})
    yield "tiny_registered"
    _REGISTRY.pop("tiny_registered")


def test_a_model_registered_without_a_yaml_is_composed_built_and_planned(tiny_model, capsys):
    load_registries()
    assert not (ROOT / "conf" / "model" / f"{tiny_model}.yaml").exists()
    cfg = compose([f"model={tiny_model}"])
    assert cfg.model.name == tiny_model and cfg.model.size == 12 and cfg.model.in_channels == 2
    spec = build_model(cfg.model)
    assert spec.input_shape == (2, 12, 12) and spec.spatial_ndim == 2 and spec.source_known
    assert main(["plan", f"model={tiny_model}", "parallel.spatial=2", "train.batch_size=2"]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["run", "--help"]) == 0 and tiny_model in capsys.readouterr().out
    with pytest.raises(ValueError, match="registered twice"):  # one name, one model
        register_model(tiny_model, lambda m: spec, "another", "", {})


@pytest.fixture
def keyed_model():
    """tests/_keyed_model.py's model (a key of its own, registered by a module outside gems/models), registered as
    that module does when imported, removed again after the test."""
    import _keyed_model

    models()
    _keyed_model.register()
    yield _keyed_model.NAME
    _REGISTRY.pop(_keyed_model.NAME)


def test_a_models_own_key_reaches_its_builder_on_the_ranks_and_its_help(keyed_model, tmp_path, capsys):
    """``model.hidden``, declared beside the model's builder and set on the command line, is typed and checked at
    once, counts in the checkpoint's fingerprint, and is what the rank built with (its trained model's convolution
    has that many channels); a value out of bounds or a key the model does not take is one line, exit 2;
    ``--help`` lists the key under the model."""
    import torch
    from _cli import gems_here, records

    from gems.checkpoint import fingerprint

    load_registries()
    cfg = compose([f"model={keyed_model}", "model.hidden=3"])
    assert cfg.model.hidden == 3 and cfg.model.module == "_keyed_model"
    assert fingerprint(cfg)["model.hidden"] == 3 and fingerprint(compose([f"model={keyed_model}"]))["model.hidden"] == 2
    run = gems_here("run", f"model={keyed_model}", "model.hidden=3", "train.batch_size=2", "train.steps=1",
                    "train.warmup_steps=0", f"results.dir={tmp_path}")
    assert run.returncode == 0, run.stderr[-3000:]
    (r,) = records(str(tmp_path))
    weights = torch.load(r["model_file"], map_location="cpu", weights_only=True)["state_dict"]
    assert r["status"] == "ok" and tuple(weights["0.weight"].shape) == (3, 1, 3, 3, 3)
    for bad, said in (("model.hidden=0", "model.hidden=0: expected an integer >= 1"),
                      ("model.hiden=3", "expected model.hidden, the nearest key model=keyed takes (its own: model.hidden;"),
                      ("model.depth=11", "model.depth=11: expected a key model=keyed takes, not resnet's own")):
        out = gems_here("run", f"model={keyed_model}", bad, f"results.dir={tmp_path / 'bad'}")
        err = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(err) == 1 and said in err[0], out.stderr
    assert not (tmp_path / "bad").exists()
    assert main(["run", "--help"]) == 0
    assert (f"  model.name={keyed_model} takes these too:\n    model.hidden=2 [>= 1]  channels of its convolution"
            in capsys.readouterr().out)


def test_the_check_before_launch_runs_for_every_model():
    """A built-in model's shape is traced before launch too (no model is exempt by its name): its example passes,
    and a shape the layers cannot take names the key that sets it."""
    for kind in models().values():
        check_shapes(build_model(kind.example))
    from gems.errors import ConfigError

    spec = build_model(dict(name="resnet", depth=11, size=16, width=0.25, num_classes=5))
    spec.module[-1] = nn.Linear(7, 5)  # (a layer that cannot take what reaches it)
    with pytest.raises(ConfigError) as e:
        check_shapes(spec)
    assert e.value.key == "model.size" and "layer" in e.value.expected


def test_data_files_and_its_older_name_hdf5_are_one_thing(tmp_path):
    from gems.checkpoint import fingerprint

    new = compose(["data=files", f"data.path={tmp_path}"], check=False)
    old = compose(["data=hdf5", f"data.path={tmp_path}"], check=False)
    named = compose(["data=files", "data.name=hdf5", f"data.path={tmp_path}"], check=False)
    assert new.data.name == old.data.name == "files" and reads_files(named.data)
    assert fingerprint(named) == fingerprint(new)  # a checkpoint of data=hdf5 resumes under data=files


def test_a_schedules_in_flight_is_read_off_its_action_lists():
    got = {k: v.in_flight for k, v in schedules().items()}
    assert got["lp"] == "one" and got["gpipe"] == "all" and got["loopedbfs"] == "all"
    assert got["1f1b"] == got["mast"] == got["zbh1"] == "depth"


def _compared(root: Path, names: set[str], skip: str | None = None, only_if: bool = False) -> list[str]:
    """``file:line`` of every comparison with one of ``names`` as a literal (``only_if``: in an ``if``'s test)."""
    found = []
    for f in sorted(root.rglob("*.py")):
        if skip and str(f.relative_to(ROOT)).startswith(skip):
            continue
        tree = ast.parse(f.read_text())
        tests = [n.test for n in ast.walk(tree) if isinstance(n, (ast.If, ast.IfExp))] if only_if else [tree]
        for t in tests:
            for n in ast.walk(t):
                if isinstance(n, ast.Compare):
                    lits = {c.value for side in (n.left, *n.comparators) for c in ast.walk(side)
                            if isinstance(c, ast.Constant) and isinstance(c.value, str)}
                    if lits & names:
                        found.append(f"{f.relative_to(ROOT)}:{n.lineno}")
    return found


def test_no_layer_decides_by_a_model_name_and_no_test_by_a_schedule_name():
    assert _compared(ROOT / "gems", set(models()), skip="gems/models") == []
    assert _compared(ROOT / "tests", set(schedules()), only_if=True) == []


def test_every_registered_layout_keeps_the_readers_rules(tmp_path):
    """The rules docs/data.md states for a layout, held to every registered one (a new layout is held to them with
    no change here): its module maps no file (mmap, numpy's memmap or mmap_mode); what it writes opens as a
    FileSamples (the base that stamps files and turns a failed read into the one-line refusal); and a file cut short
    after the set was opened is refused naming it, a ConfigError (exit 2), never an OSError or a read of what is
    left. The files are `gems bench data`'s, each layout's as its published tool writes them."""
    import inspect
    import os

    from gems.bench.data import layout_folders
    from gems.data.layouts import FileSamples
    from gems.errors import ConfigError

    for name, layout in layouts().items():
        text = Path(inspect.getsourcefile(type(layout)) or "").read_text()
        assert not re.search(r"\bmmap\b|memmap|mmap_mode", text), f"layout {name} maps its files"
    folders, skipped = layout_folders(tmp_path, 8, n=2)
    assert not skipped, skipped
    opened = {}
    for row, src in folders.items():
        layout = layouts()[src.layout]
        dense = dict(target="dense", classes=3) if src.dense else {}
        edge = src.edge
        samples = layout.open(src.folder, (1 if src.dense else 4, edge, edge, edge), **dense)
        assert isinstance(samples, FileSamples), (row, type(samples))
        samples.batch([0])
        opened.setdefault(src.layout, (samples, src))
    assert set(opened) == set(layouts()), sorted(set(layouts()) - set(opened))
    for name, (samples, src) in opened.items():
        first = samples.files[samples.locate(0)[0]]
        with open(first, "r+b") as f:
            f.truncate(os.path.getsize(first) // 2)
        with pytest.raises(ConfigError) as e:
            samples.batch([0])
        assert e.value.key in ("data.path",) and first.name in str(e.value), (name, str(e.value))
        samples.close()
