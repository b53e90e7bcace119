"""What a data set declares of the model that trains on it, set on the configuration before launch: a task's
``dataset.json`` names its classes (``model.num_classes``) and its channels (``model.in_channels``), through its
layout (gems.data.layouts.Layout.declared). A key the user did not set takes the data's value, said once; one the
user set (gems.config.given) that disagrees is refused, naming both."""
from __future__ import annotations

from typing import Any, Iterable

from gems.errors import ConfigError


def declared(cfg: Any) -> dict[str, tuple[list[str], str]]:
    """{key: (the names the data declares, the setting whose files declare them)} of ``data.path``'s set and
    ``data.val_path``'s; two sets that declare a key otherwise are bad input naming both."""
    from gems.data import layouts

    d = cfg.data
    out: dict[str, tuple[list[str], str]] = {}
    for key, path in (("data.path", d.path), ("data.val_path", d.val_path)):
        if path in (None, ""):
            continue
        for name, names in layouts.detect(str(path), d.get("layout"), key).declared(str(path)).items():
            if name in out and out[name][0] != names:
                raise ConfigError(key, str(path), f"a set of the training set's {_what(name)} ({', '.join(out[name][0])}: "
                                  f"{out[name][1]}); it declares {', '.join(names)}")
            out.setdefault(name, (names, key))
    return out


def _what(key: str) -> str:
    return "classes" if key == "model.num_classes" else "channels"


def from_the_data(cfg: Any, fixed: Iterable[str] = ()) -> list[str]:
    """Set each model key the data declares (:func:`declared`) on ``cfg`` where the user did not set it
    (gems.config.given, or one of ``fixed``: a model file's); a value the user set that disagrees is bad input
    naming both. Returns what was set, a line each (the run says it)."""
    from omegaconf import OmegaConf, open_dict

    from gems.config import given

    said = []
    keep = set(fixed)
    for key, (names, where) in declared(cfg).items():
        now = OmegaConf.select(cfg, key)
        if int(now) == len(names):
            continue
        if given(cfg, key) or key in keep:
            raise ConfigError(key, now, f"{len(names)}, the {_what(key)} the set at {where} declares "
                              f"({', '.join(names)}: its dataset.json), or a set of {now}")
        with open_dict(cfg):
            OmegaConf.update(cfg, key, len(names))
        said.append(f"{key}={len(names)}: the {_what(key)} the set at {where} declares ({', '.join(names)})")
    return said
