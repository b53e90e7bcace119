"""The package's imports held against the map of its layers in docs/design.md ("### Layers").

Every import of every module of gems is read from its source: at the top, inside functions (lazy ones), under
``TYPE_CHECKING``, and ``__import__``/``importlib.import_module`` of a fixed name. A unit (the longest dotted name
of the map that a module falls under) may import units on lower layers only, but for the declared exceptions,
and the units' imports make no circle. Nothing here is run but the reading, except one fresh interpreter that
imports the pipeline and finds no module of the spatial strategy loaded.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gems"
DESIGN = ROOT / "docs" / "design.md"
MAX_EXCEPTIONS = 8


def _block(text: str, tag: str) -> list[str]:
    """The lines of the fenced block ```TAG of ``text``."""
    start = text.index(f"```{tag}\n") + len(tag) + 4
    return [ln.split("#")[0].strip() for ln in text[start:text.index("```", start)].splitlines() if ln.strip()]


@dataclass(frozen=True)
class Map:
    layer: dict[str, int]  # unit -> its layer
    exceptions: frozenset[tuple[str, str]]  # (importer, imported) units allowed against the layers

    def unit(self, module: str) -> str | None:
        found = [u for u in self.layer if module == u or module.startswith(u + ".")]
        return max(found, key=len) if found else None


def read_map(text: str) -> Map:
    layer: dict[str, int] = {}
    for ln in _block(text, "layers"):
        n, *units = ln.split()
        for u in units:
            assert u not in layer, f"{u} on two layers"
            layer[u] = int(n)
    exceptions = set()
    for ln in _block(text, "exceptions"):  # "gems.a -> gems.b  why"
        a, arrow, b, *_why = ln.split()
        assert arrow == "->" and _why, f"an exception is 'gems.a -> gems.b why': {ln}"
        exceptions.add((a, b))
    return Map(layer, frozenset(exceptions))


@dataclass(frozen=True)
class Import:
    file: str
    line: int
    importer: str  # module
    target: str  # module (or a name in it)


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_imports(root: Path = PACKAGE) -> list[Import]:
    """Every import of a gems module by a module of the package (the package's face, gems/__init__.py, left out:
    it stands above everything)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        module = _module_of(path)
        if module == "gems":
            continue
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from gems import x` imports the module gems.x (or a name of the face)
                targets = [f"{base}.{a.name}" for a in node.names] if base == "gems" else [base]
            elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                fn = node.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                if name in ("__import__", "import_module") and isinstance(node.args[0].value, str):
                    targets = [node.args[0].value]
            out += [Import(str(path.relative_to(ROOT)), node.lineno, module, t)
                    for t in targets if t == "gems" or t.startswith("gems.")]
    return out


def violations(m: Map, imports: list[Import]) -> tuple[list[str], list[str], dict[str, set[str]]]:
    """(imports the map forbids, modules it does not place, the units' import graph)."""
    bad, unplaced, graph = [], [], {}
    for imp in imports:
        me, it = m.unit(imp.importer), m.unit(imp.target)
        if me is None:
            unplaced.append(imp.importer)
            continue
        if it is None:
            if imp.target != "gems":  # the face (`import gems`)
                unplaced.append(imp.target)
            continue
        if it == me:
            continue
        graph.setdefault(me, set()).add(it)
        if m.layer[it] >= m.layer[me] and (me, it) not in m.exceptions:
            bad.append(f"{imp.file}:{imp.line}: {me} (layer {m.layer[me]}) imports {imp.target} ({it}, layer "
                       f"{m.layer[it]})")
    return bad, sorted(set(unplaced)), graph


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph, or None."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


@pytest.fixture(scope="module")
def the_map() -> Map:
    return read_map(DESIGN.read_text())


def test_every_import_of_the_package_keeps_the_map_of_its_layers(the_map: Map) -> None:
    imports = read_imports()
    assert len(imports) > 300  # the reading found the package's imports (lazy ones too)
    bad, unplaced, graph = violations(the_map, imports)
    assert not unplaced, f"modules the map in docs/design.md does not place: {unplaced}"
    assert not bad, "imports the layers forbid (docs/design.md, ### Layers):\n" + "\n".join(bad)
    assert circle(graph) is None, circle(graph)
    assert len(the_map.exceptions) <= MAX_EXCEPTIONS
    assert the_map.layer["gems.pipeline"] == the_map.layer["gems.spatial"]  # neither reaches the other


def test_the_checker_finds_what_the_map_forbids(the_map: Map, tmp_path: Path) -> None:
    """Each kind of import is read, and one the map forbids fails it: a lazy import inside a function, an import
    under TYPE_CHECKING, `from gems import x`, a relative import and __import__ of a fixed name."""
    pkg = tmp_path / "gems"
    (pkg / "pipeline").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pipeline" / "__init__.py").write_text("")
    (pkg / "pipeline" / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"  # its own unit: allowed
        "from gems import errors\n"  # below: allowed
        "def f():\n    from gems.spatial.halo import x\n"  # same layer: forbidden
        "if TYPE_CHECKING:\n    from gems.rank.loop import Run\n"  # above: forbidden
        "g = __import__('gems.plan.memory')\n"  # above: forbidden
        "from gems import cli\n")  # above: forbidden
    (pkg / "pipeline" / "b.py").write_text("from ..spatial import context\n")  # relative, same layer: forbidden
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        imports = read_imports(pkg)
    finally:
        ROOT = saved
    bad, unplaced, graph = violations(the_map, imports)
    assert not unplaced
    got = sorted(b.split(" imports ")[1].split(" (")[0] for b in bad)
    assert got == ["gems.cli", "gems.plan.memory", "gems.rank.loop", "gems.spatial", "gems.spatial.halo"], bad
    assert circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert circle({"a": {"b"}, "b": {"c"}}) is None
    with pytest.raises(AssertionError):
        read_map("```layers\n1 gems.a\n0 gems.a\n```\n```exceptions\n```\n")


def test_the_pipeline_loads_nothing_of_the_spatial_strategy() -> None:
    """Importing the pipeline (and what it stands on) in a fresh interpreter loads no module of gems.spatial."""
    code = ("import sys, gems.pipeline, gems.pipeline.runtime, gems.models\n"
            "print(sorted(m for m in sys.modules if m.startswith('gems.spatial')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
