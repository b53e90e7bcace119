"""The rules that keep the GPU path right, checked on CPU machines (docs/design.md, "Rules of the GPU path").

NCCL takes device tensors only. On a CPU machine every tensor is on the CPU, so a
run over gloo cannot tell a tensor that would be on the GPU from one that would
stay on the host: the worker all-reduced its step times as ``torch.tensor(times)``
(a host tensor) and every multi-rank GPU run would have crashed before writing its
record, with every CPU test passing. A static check can tell: every tensor gems
hands to a torch.distributed call must come from the data of the step (parameters,
gradients, activations, buffers made with ``*_like``/``new_*``) or be created with
an explicit ``device=`` that is not the host. The recorder of gems.commlog checks the
same at run time wherever the rank's device is a GPU (``GEMS_COMM_LOG``).

Benchmarks (gems/bench) run on CPU ranks over gloo by design and are left out.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import gems

ROOT = Path(gems.__file__).parent
COMM_CALLS = {"all_reduce", "all_gather", "broadcast", "isend", "irecv", "send", "recv", "reduce", "gather",
              "scatter", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "P2POp"}
CREATORS = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "from_numpy", "rand", "randn",
            "randint", "linspace"}


def _is_host(expr: ast.AST) -> bool:
    """Whether a device expression names the host."""
    return any(isinstance(n, ast.Constant) and n.value == "cpu" for n in ast.walk(expr))


def _tensor_args(call: ast.Call) -> list[ast.AST]:
    name = call.func.attr if isinstance(call.func, ast.Attribute) else ""
    if name == "P2POp":
        return call.args[1:2]
    if name in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor"):
        return call.args[:2]
    return call.args[:1]


class _Checker(ast.NodeVisitor):
    """Finds tensors handed to torch.distributed that are made on the host."""

    def __init__(self, path: Path, where: str) -> None:
        self.path, self.where = path, where
        self.bad: list[str] = []
        self.assigned: dict[str, list[ast.AST]] = {}

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:  # noqa: N802
        saved = self.assigned
        self.assigned = {}
        for n in ast.walk(node):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        self.assigned.setdefault(t.id, []).append(n.value)
        self.generic_visit(node)
        self.assigned = saved

    visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

    def visit_Call(self, node: ast.Call) -> None:  # noqa: N802
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COMM_CALLS and isinstance(f.value, ast.Name) and f.value.id == "dist":
            for arg in _tensor_args(node):
                why = self._host_made(arg, set())
                if why:
                    self.bad.append(f"{self.where}:{node.lineno}: dist.{f.attr} gets {why}")
        self.generic_visit(node)

    def _host_made(self, expr: ast.AST, seen: set[str]) -> str | None:
        if isinstance(expr, ast.Name):
            if expr.id in seen:
                return None
            seen.add(expr.id)
            for value in self.assigned.get(expr.id, []):
                why = self._host_made(value, seen)
                if why:
                    return f"{expr.id} = {why}"
            return None
        if isinstance(expr, (ast.List, ast.Tuple)):
            return next((w for w in (self._host_made(e, seen) for e in expr.elts) if w), None)
        if isinstance(expr, (ast.ListComp, ast.GeneratorExp)):
            return self._host_made(expr.elt, seen)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            name = expr.func.attr
            owner = expr.func.value
            if name in CREATORS and isinstance(owner, ast.Name) and owner.id == "torch":
                device = next((k.value for k in expr.keywords if k.arg == "device"), None)
                if device is None:
                    return f"torch.{name}(...) without device= (made on the host)"
                if _is_host(device):
                    return f"torch.{name}(..., device=<the host>)"
                return None
            if name == "cpu":
                return "a .cpu() copy"
            if name == "to" and any(_is_host(a) for a in [*expr.args, *(k.value for k in expr.keywords)]):
                return "a .to(<the host>) copy"
            if name in ("clone", "contiguous", "detach", "reshape", "view", "float", "double"):
                return self._host_made(owner, seen)
        return None


def check_tree(root: Path) -> list[str]:
    bad: list[str] = []
    for path in sorted(root.rglob("*.py")):
        if "bench" in path.relative_to(root).parts or path.name == "commlog.py":
            continue
        c = _Checker(path, str(path.relative_to(root.parent)))
        c.visit(ast.parse(path.read_text(), str(path)))
        bad += c.bad
    return bad


def test_every_tensor_a_collective_gets_is_made_on_the_rank_device() -> None:
    bad = check_tree(ROOT)
    assert not bad, "tensors made on the host reach torch.distributed (NCCL takes device tensors only):\n" + \
        "\n".join(bad)


@pytest.mark.parametrize("code,found", [
    ("def f(w):\n    times = torch.tensor(w, dtype=torch.float64)\n    dist.all_reduce(times)\n", True),
    ("def f(w, d):\n    t = torch.tensor(w, device=d)\n    dist.all_reduce(t)\n", False),
    ("def f(w, d):\n    t = torch.zeros(3, device=d if d else 'cpu')\n    dist.all_reduce(t)\n", True),
    ("def f(x):\n    y = x.detach().cpu()\n    dist.all_reduce(y)\n", True),
    ("def f(x, p):\n    ops = [dist.P2POp(dist.isend, torch.empty(3), p)]\n", True),
    ("def f(x, p):\n    ops = [dist.P2POp(dist.isend, x.contiguous(), p)]\n", False),
    ("def f(bufs, x):\n    dist.all_gather([torch.empty_like(x) for _ in bufs], x)\n", False),
])
def test_the_check_finds_host_tensors(tmp_path: Path, code: str, found: bool) -> None:
    """The check itself: the worker's old step-time sum is found, device tensors pass."""
    (tmp_path / "m.py").write_text("import torch\nimport torch.distributed as dist\n" + code)
    assert bool(check_tree(tmp_path)) == found, check_tree(tmp_path)
