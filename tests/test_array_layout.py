"""The base of a layout of one C-order array a file (gems.data.layouts.array), through the worked layout of
docs/data.md ("Adding a layout"), run as the page shows it: uint16 values of either byte order come back exactly,
and what the base refuses is a ConfigError naming the key and the file."""
from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch

from gems.data import augment as augmentation
from gems.data import layouts
from gems.data.layouts import _REGISTRY
from gems.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def documented() -> str:
    """The first ``python`` block of docs/data.md's "Adding a layout"."""
    text = (ROOT / "docs" / "data.md").read_text()
    start = text.index("```python\n", text.index("## Adding a layout")) + len("```python\n")
    return text[start:text.index("```", start)]


@pytest.fixture(scope="module")
def raw():
    """The documented layout, registered while this module's tests run (then removed: the docs table and --help
    hold the registry to the built-in layouts)."""
    module = types.ModuleType("raw_layout")
    exec(compile(documented(), "docs/data.md", "exec"), module.__dict__)
    yield layouts.get("raw")
    _REGISTRY.pop("raw")


def _values(n: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    """(values (1, 4, 4, 4), target) pairs: 0, 1, 2, 3 over the cells and uint16's largest, 65535, in one."""
    out = []
    for i in range(n):
        v = (np.arange(64).reshape(1, 4, 4, 4) + i) % 4
        v[0, 0, 0, i] = 65535
        out.append((v, np.array([i, -0.5], np.float32)))
    return out


def test_uint16_of_either_byte_order_reads_back_exactly(raw, tmp_path):
    values = _values()
    raw.write(tmp_path, values[:2])
    raw.write(tmp_path, values[2:], name="sample_big_{:05d}", dtype=">u2")  # a big-endian file among them
    assert layouts.detect(tmp_path).name == "raw"
    s = raw.open(tmp_path, (1, 4, 4, 4))
    want = torch.from_numpy(np.stack([v for v, _ in values]).astype(np.float32))
    got, targets = s.batch([0, 1, 2], raw=True)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(targets, torch.from_numpy(np.stack([t for _, t in values])))
    assert torch.equal(s.batch([0, 1, 2])[0], torch.log1p(want))  # finish(): log(1 + x), the other layouts' rule
    part = raw.open(tmp_path, (1, 4, 4, 4), slices=(slice(1, 3),), augment="cube")  # a rank's part, a symmetry
    got, _ = part.batch([0, 2], [0, 5], raw=True)
    assert torch.equal(got, torch.stack([want[0][:, 1:3], augmentation.apply(5, want[2])[:, 1:3]]))
    assert torch.equal(s.target(2), targets[2])


def test_what_the_base_refuses_names_the_key_and_the_file(raw, tmp_path):
    good = raw.write(tmp_path / "complex", _values(1))
    raw.write(tmp_path / "complex", [(np.ones((1, 4, 4, 4)), [0.0, 0.0])], name="z_{:05d}", dtype="<c8")
    with pytest.raises(ConfigError) as e:
        raw.open(tmp_path / "complex", (1, 4, 4, 4)).check_all()
    assert e.value.key == "data.path" and "z_00000.raw" in str(e.value) and "complex64" in str(e.value)
    assert len(str(e.value).splitlines()) == 1
    with pytest.raises(ConfigError, match=r"^data.layout=raw: expected a layout with a class per voxel"):
        raw.open(good[0], (1, 4, 4, 4), target="dense")
    with pytest.raises(ConfigError, match=r"^data.window=\[0, 1\]: expected null for raw files"):
        raw.open(good[0], (1, 4, 4, 4), window=[0, 1])
    mixed = raw.write(tmp_path / "mixed", _values(2))
    raw.write(tmp_path / "mixed", _values(1), name="z_{:05d}", dtype="<i2")
    with pytest.raises(ConfigError, match=r"the first file's type, uint16; z_00000.raw \(file 3 of 3\) holds int16"):
        raw.open(tmp_path / "mixed", (1, 4, 4, 4)).batch([2])
    with open(mixed[1], "r+b") as f:
        f.truncate(mixed[1].stat().st_size - 2)
    with pytest.raises(ConfigError, match=r"sample_00001.raw \(file 2 of 3\) is cut short"):
        raw.open(tmp_path / "mixed", (1, 4, 4, 4)).check_all(None, 2)
    with pytest.raises(ConfigError, match=r"a target of 3 numbers .* has 2"):
        raw.open(good[0], (1, 4, 4, 4)).check_all(None, 3)
