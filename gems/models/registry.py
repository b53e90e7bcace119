"""The model registry: each model module registers its builder, its shapes, its own keys and a small example where the
model is defined (:func:`register_model`; docs/parallelism.md, "The registered models"). Every module of the package
is imported when the registry is first read, and nothing outside it decides by a model's name: what other layers
need is a property of its :class:`ModelSpec`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

from omegaconf import OmegaConf
from torch import nn

from gems.config import ModelConf, extended, import_modules, offered, owned
from gems.errors import ConfigError

#: a model's section: :class:`ModelConf`, or the dataclass extending it with the model's own keys
Conf = TypeVar("Conf", bound=ModelConf)


@dataclass
class ModelSpec:
    """A model and its contract with the data and the loss.

    ``target`` is ``"vector"`` (one vector of ``num_outputs`` per sample,
    e.g. CosmoFlow's 4 parameters) or ``"dense"`` (one class per voxel, shaped
    like the input's spatial dims, e.g. U-Net). ``spatial_end`` is the index of
    the first layer that needs the whole sample (spatial parallelism gathers
    the activation before it); None when the model is spatial to the end.
    ``shape_key`` is the key that sets the input's shape (what a refusal of the shape names), and
    ``source_known`` whether the model's layers are gems's own source (the planner keeps their traces on disk,
    keyed by gems's source digest: a user's callable is traced afresh).
    """

    module: nn.Sequential
    name: str
    input_shape: tuple[int, ...]  # (C, *spatial)
    num_outputs: int
    loss: str  # "mse" | "cross_entropy"
    target: str = "vector"
    spatial_end: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    shape_key: str = "model.size"
    source_known: bool = True

    @property
    def spatial_ndim(self) -> int:
        return len(self.input_shape) - 1

    @property
    def classes(self) -> int | None:
        """The classes a voxel's label must be below where the model takes one class a voxel, else None."""
        return int(self.num_outputs) if self.target == "dense" and self.loss == "cross_entropy" else None

    @property
    def shape_value(self) -> Any:
        """The value of :attr:`shape_key` this model was built from."""
        return list(self.input_shape) if self.shape_key == "model.input_shape" else self.input_shape[1]


@dataclass(frozen=True)
class ModelKind:
    """A registered model: ``build`` makes its :class:`ModelSpec` from the typed section (an instance of ``options``);
    ``about`` is its line in ``--help`` and the docs; ``shapes`` the inputs it takes (words); ``config`` what
    ``model=NAME`` sets where no YAML of that name exists; ``example`` the model's keys at a size seconds train on a
    CPU (what the tests build every registered model at, S = 2 and D = 2 against one process); ``benchmark`` the
    MLPerf HPC benchmark it is a version of (what a run's MLPerf log names), None for none; ``options`` the
    dataclass of its keys: :class:`ModelConf`'s and its own (``model.KEY=value``, checked against their
    declarations and listed under its name by ``gems run --help``)."""

    name: str
    build: Callable[[Any], ModelSpec]
    about: str
    shapes: str
    config: Mapping[str, Any]
    example: Mapping[str, Any]
    benchmark: str | None = None
    options: type[ModelConf] = ModelConf


_REGISTRY: dict[str, ModelKind] = {}
_FOUND = False


def register_model(name: str, build: Callable[[Conf], ModelSpec], about: str, shapes: str,
                   example: Mapping[str, Any], config: Mapping[str, Any] | None = None,
                   benchmark: str | None = None, options: type[Conf] | None = None) -> None:
    """Register a model under ``name`` (``model=NAME``); called by the module that defines it, at import
    (:class:`ModelKind` says what each argument is). ``options``: a dataclass extending :class:`ModelConf` whose
    fields, each a :func:`gems.config.key`, are the model's own keys; the builder takes an instance of it."""
    old = _REGISTRY.get(name)
    if old is not None and (old.build.__module__, old.build.__qualname__) != (build.__module__, build.__qualname__):
        raise ValueError(f"model {name!r} is registered twice ({old.build.__module__} and {build.__module__})")
    schema: type[ModelConf] = options if options is not None else ModelConf
    if not (dataclasses.is_dataclass(schema) and issubclass(schema, ModelConf)):
        raise ValueError(f"model {name!r}: options must be a dataclass extending gems.config.ModelConf")
    keys = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted((set(example) | set(config or {})) - keys)
    if unknown:
        raise ValueError(f"model {name!r}: {', '.join(unknown)} in its example or config is no key of "
                         f"{schema.__name__}")
    # a model registered outside this package: the ranks import its module to find it (model.module)
    where = {} if build.__module__.startswith("gems.models.") or build.__module__ == "__main__" else \
        {"module": build.__module__}
    _REGISTRY[name] = ModelKind(name, build, about, shapes, {"name": name, **where, **dict(config or {})},
                                {"name": name, **dict(example)}, benchmark, schema)


def find(node: Any) -> ModelKind | None:
    """The registered model a ``model`` section names (a mapping, a DictConfig or the schema's dataclass):
    ``model.name``, found once ``model.module`` is imported where the section gives one (a model registered outside
    this package); None for a name not registered."""
    def value(k: str) -> Any:
        if OmegaConf.is_config(node):
            return OmegaConf.select(node, k, default=None, throw_on_missing=False)
        return node.get(k) if isinstance(node, Mapping) else getattr(node, k, None)

    name, module = value("name"), value("module")
    if name not in registered() and module:
        import importlib

        try:
            importlib.import_module(str(module))
        except ImportError as e:
            raise ConfigError("model.module", module, f"an importable module that registers model {name} "
                              f"({type(e).__name__}: {e})") from None
    return registered().get(str(name))


#: the keys every model's section held before a model declared its own (gems's model files and checkpoints of then
#: hold them all, a null norm meaning the model's own)
_ONCE_SHARED = ("dropout", "depth", "norm", "_target_", "kwargs", "input_shape", "num_outputs", "loss", "target",
                "spatial_end")


def saved_section(node: Mapping[str, Any]) -> dict[str, Any]:
    """A ``model`` section as a model file or checkpoint holds it, as its model takes it now: of a file written before
    models declared their own keys, the keys its model does not declare, and the nulls that meant its default, left
    out (any other key stays, and is refused where the section is typed)."""
    kind = find(node)
    if kind is None:
        return dict(node)
    fields = {f.name: f for f in dataclasses.fields(kind.options)}
    return {k: v for k, v in node.items()
            if k not in _ONCE_SHARED or (k in fields and (v is not None or fields[k].default is None))}


def registered() -> dict[str, ModelKind]:
    """Every registered model by name, sorted; the first call imports every module of this package."""
    global _FOUND
    if not _FOUND:
        import_modules("gems.models")
        _FOUND = True
    return dict(sorted(_REGISTRY.items()))


def names_text() -> str:
    """The registered names, for a refusal: "one of a, b or c"."""
    names = list(registered())
    return "one of " + (", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0])


def first_flatten(seq: nn.Sequential) -> int | None:
    """The index of ``seq``'s first ``nn.Flatten`` (where a model's spatial trunk ends by default), None if none."""
    for i, layer in enumerate(seq):
        if isinstance(layer, nn.Flatten):
            return i
    return None


def sized(allowed: str, fn: Callable[..., nn.Sequential], size: int, **kw: Any) -> nn.Sequential:
    """``fn(size=size, **kw)``, its ValueError the refusal of ``model.size`` with what it allows."""
    try:
        return fn(size=size, **kw)
    except ValueError:
        raise ConfigError("model.size", size, allowed) from None



# the configuration checks model.name against the registry, lists it in --help, composes model=NAME from a
# registration where conf/model/NAME.yaml is absent, and types the section by the model's own keys
# (gems.config.owned, gems.config.offered, gems.config.extended)
owned("model.name", lambda: registered())
offered("model", lambda: {k.name: dict(k.config) for k in registered().values()})
extended("model", lambda node: getattr(find(node), "options", None))
