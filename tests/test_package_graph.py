"""The package graph: no import cycles, no layer importing one above it, and the boundaries the
architecture promises (ARCHITECTURE.md's module map, workers/__init__.py's layers).

Every import counts: module level, inside functions and under ``TYPE_CHECKING`` alike, read from
the source with ``ast`` (nothing is imported). A *unit* is a subpackage of workers/, cluster/ or
router/ (``workers.engine``) or a module at one of those roots (``workers.errors``); units may not
import each other in a cycle either, so every unit has a place in one order.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "kernels", "workers", "router", "cluster", "benchmarks")
# top-level package -> what it may import (besides itself)
ALLOWED = {
    "protos": set(),
    "kernels": set(),
    "workers": {"kernels", "protos"},
    "router": {"protos", "workers"},  # workers: only ROUTER_MAY_USE below
    "cluster": {"protos", "kernels", "workers", "router"},
    "benchmarks": {"protos", "kernels", "workers", "router", "cluster"},
}
# the torch-free parts of workers that the router shares with the engine
ROUTER_MAY_USE = {"workers.errors", "workers.block_hash", "workers.detokenizer", "workers.structured.spec", "workers.structured.convert",
                  "workers.structured.grammar"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (names resolved to the longest existing module)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    modules = set(files)

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in modules:
                return ".".join(parts[:i])
        return None

    edges: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                names = [f"{source}.{a.name}" for a in node.names]
            else:
                continue
            targets.update(t for n in names if (t := resolve(n)) is not None and t != mod)
        edges[mod] = targets
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in ("workers", "cluster", "router") and len(parts) > 1 else parts[0]


def _closure(start: Iterable[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(start)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph().get(m, ()))
    return seen


def test_no_module_cycles() -> None:
    assert _cycles(graph()) == []


def test_no_unit_cycles() -> None:
    units: dict[str, set[str]] = {}
    for mod, targets in graph().items():
        units.setdefault(unit(mod), set()).update(unit(t) for t in targets if unit(t) != unit(mod))
    assert _cycles(units) == []


def test_layers_import_only_downwards() -> None:
    wrong = sorted(f"{m} -> {t}" for m, ts in graph().items() for t in ts
                   if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in ALLOWED[m.split(".")[0]])
    assert wrong == []


def test_router_uses_only_the_shared_torch_free_workers_modules() -> None:
    wrong = sorted(f"{m} -> {t}" for m, ts in graph().items() if m.startswith("router")
                   for t in ts if t.startswith("workers") and t not in ROUTER_MAY_USE)
    assert wrong == []


def test_the_engine_never_downloads() -> None:
    """Engines and the drafter's engine receive checkpoint directories; resolving names (and
    downloading or converting) is the edges' job (workers/models/assets/)."""
    engine = [m for m in graph() if m.startswith("workers.engine")] + ["workers.spec_decode.drafter"]
    reached = sorted(m for m in _closure(engine) if m.startswith("workers.models.assets"))
    assert reached == []


def test_the_checker_sees_cycles_and_upward_imports() -> None:
    """The checks above can fail: a two-module cycle is found, and so is a kernel importing workers."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert "workers" not in ALLOWED["kernels"] and unit("workers.engine.engine") == "workers.engine"
