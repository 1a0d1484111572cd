"""The package's import graph, read from the source: no import cycle, and only the composition root
imports the config module.

Imports inside functions and under ``TYPE_CHECKING`` count: a lazy import that dodges a cycle at
run time is still a cycle in the design. A package importing its own children (``__init__``
re-exports) is not an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_mugrpo"
SUBPACKAGE_DIRS = {"megatron_mugrpo.conversion": ROOT / "conversion"}
"""Subpackages whose code lives outside the package directory (setup.py's package_dir)."""
CONFIG = "megatron_mugrpo.config"
COMPOSITION_ROOTS = {"megatron_mugrpo.cli", "megatron_mugrpo.loop.setup"}
"""The composition root, the only modules that may import the config module: the program's entry
(``cli`` reads the run's YAML and overrides before the process knows its role, so it stays light: a
rollout worker never imports Megatron) and the trainer's set-up (``loop.setup`` composes a run from
the sections). Everything else receives the sections, or a loader, from them."""


def _modules() -> dict[str, Path]:
    found = {}
    roots = {"megatron_mugrpo": PACKAGE, **SUBPACKAGE_DIRS}
    for name, directory in roots.items():
        for path in sorted(directory.rglob("*.py")):
            parts = [*name.split("."), *path.relative_to(directory).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(anchor + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            candidates = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in candidates:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + ".") and not target.startswith(name + "."):
                targets.add(target)
    return targets


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_converter_is_part_of_the_graph():
    graph = import_graph()
    assert "megatron_mugrpo.conversion.live" in graph
    assert "megatron_mugrpo.conversion.errors" in graph["megatron_mugrpo.conversion.live"]


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (give each job one home so the arrows run one way): " + "; ".join(
        " ".join(c) for c in found
    )


def test_only_the_composition_root_imports_the_config():
    importers = sorted(name for name, targets in import_graph().items() if CONFIG in targets)
    assert set(importers) <= COMPOSITION_ROOTS, (
        f"{sorted(set(importers) - COMPOSITION_ROOTS)} import {CONFIG}: components own their config sections; "
        "only the composition root composes them"
    )
