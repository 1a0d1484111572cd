"""The package's import graph, read from the source: the floors of ``docs/architecture.md`` hold, no
import cycle, and only the composition root imports the config module.

Imports inside functions and under ``TYPE_CHECKING`` count: a lazy import that dodges a cycle at
run time is still a cycle in the design. A package importing its own children (``__init__``
re-exports) is not an edge.

``FLOORS`` below is the layers contract, the source of truth that ``docs/architecture.md`` describes:
arrows run down (or sideways within a floor), never up. Run this file as a script for the counts
(floor violations, packages that import each other both ways).
"""

from __future__ import annotations

import ast
import functools
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


FLOORS: dict[str, tuple[str, ...]] = {
    "bottom": (
        "megatron_mugrpo",
        "megatron_mugrpo.errors",
        "megatron_mugrpo.records",
        "megatron_mugrpo.durable",
        "megatron_mugrpo.faults",
        "megatron_mugrpo.datafiles",
        "megatron_mugrpo.commands",
        "megatron_mugrpo.char_tokenizer",
        "megatron_mugrpo.metric_names",
    ),
    "math": ("megatron_mugrpo.algorithms", "megatron_mugrpo.kernels"),
    "components": (
        "megatron_mugrpo.rollout",
        "megatron_mugrpo.rewards",
        "megatron_mugrpo.envs",
        "megatron_mugrpo.scoring",
        "megatron_mugrpo.training",
        "megatron_mugrpo.conversion",
        "megatron_mugrpo.evaluation",
        "megatron_mugrpo.metrics",
        "megatron_mugrpo.report",
        "megatron_mugrpo.drift_plots",
        "megatron_mugrpo.sweep",
        "megatron_mugrpo.plan",
        "megatron_mugrpo.warmstart",
        "megatron_mugrpo.rundir",
        "megatron_mugrpo.state",
        "megatron_mugrpo.resume",
        "megatron_mugrpo.asynchronous",
    ),
    "loops": ("megatron_mugrpo.loop",),
    "composition root": ("megatron_mugrpo.cli", "megatron_mugrpo.config", "megatron_mugrpo.loop.setup"),
}
"""Each floor's modules (a name covers its submodules; the longest match wins), lowest first. A module
imports its own floor or those below it; the bottom floor imports nothing of the package but
``errors``. ``commands`` (argv builders, no imports) sits at the bottom so that ``sweep`` and ``cli``
both reach it; ``config`` belongs to the root (only the root imports it, see ``COMPOSITION_ROOTS``)."""
BOTTOM_MAY_IMPORT = {"megatron_mugrpo.errors"}
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
"""(importer prefix, imported module) → why this upward arrow is still allowed. Each entry must still
be needed: a stale one fails the test, so the list only shrinks."""


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


@functools.cache  # read once per session; no test changes it
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


def floor_of(module: str) -> str:
    """The floor whose longest listed name covers ``module``; KeyError when none does."""
    best, found = -1, None
    for floor, names in FLOORS.items():
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), floor
    if found is None:
        raise KeyError(module)
    return found


def _allowed_upward(importer: str, target: str) -> str | None:
    return next((key for key in KNOWN_UPWARD if importer.startswith(key[0]) and target == key[1]), None)


def violations(graph: dict[str, set[str]]) -> tuple[list[str], set[tuple[str, str]]]:
    """(arrows that break the floors, the ``KNOWN_UPWARD`` entries in use)."""
    rank = {floor: i for i, floor in enumerate(FLOORS)}
    found, used = [], set()
    for importer, targets in sorted(graph.items()):
        mine = floor_of(importer)
        for target in sorted(targets):
            theirs = floor_of(target)
            if mine == "bottom":
                ok = target in BOTTOM_MAY_IMPORT
            else:
                ok = rank[theirs] <= rank[mine]
            if ok:
                continue
            if (key := _allowed_upward(importer, target)) is not None:
                used.add(key)
                continue
            found.append(f"{importer} ({mine}) -> {target} ({theirs})")
    return found, used


def room(module: str) -> str:
    """The package a module belongs to, one level below ``megatron_mugrpo`` (``rollout``, ``state``)."""
    return ".".join(module.split(".")[:2])


def two_way_pairs(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Pairs of packages (``room``) each of which imports the other."""
    arrows = {(room(a), room(b)) for a, targets in graph.items() for b in targets if room(a) != room(b)}
    return sorted((a, b) for a, b in arrows if a < b and (b, a) in arrows)


def test_every_module_has_a_floor():
    unplaced = []
    for module in import_graph():
        try:
            floor_of(module)
        except KeyError:
            unplaced.append(module)
    assert not unplaced, f"{unplaced} are on no floor: add them to FLOORS (and to docs/architecture.md's table)"


def test_the_floor_checker_sees_an_upward_arrow():
    graph = {"megatron_mugrpo.records": {"megatron_mugrpo.rollout.routes"}, "megatron_mugrpo.rollout.routes": set()}
    assert violations(graph)[0] == ["megatron_mugrpo.records (bottom) -> megatron_mugrpo.rollout.routes (components)"]
    assert two_way_pairs({"a.x.m": {"a.y.n"}, "a.y.n": {"a.x.k"}, "a.x.k": set()}) == [("a.x", "a.y")]


def test_imports_run_down_the_floors():
    found, used = violations(import_graph())
    assert not found, "imports that run up the floors of docs/architecture.md (move the shared piece down):\n" + (
        "\n".join(found)
    )
    assert used == set(KNOWN_UPWARD), f"KNOWN_UPWARD entries no longer needed: {sorted(set(KNOWN_UPWARD) - used)}"


MAX_TWO_WAY_PAIRS = 1
"""Packages that import each other both ways (the arrows between them run both ways at package level
while each module's arrows stay acyclic). Lower this when a pair is cut; never raise it."""


def test_few_packages_import_each_other_both_ways():
    pairs = two_way_pairs(import_graph())
    assert len(pairs) <= MAX_TWO_WAY_PAIRS, f"packages importing each other both ways: {pairs}"


if __name__ == "__main__":
    graph = import_graph()
    found, used = violations(graph)
    print(f"modules {len(graph)}  floor violations {len(found)}  known upward arrows in use {len(used)}")
    print("\n".join("  " + line for line in found))
    pairs = two_way_pairs(graph)
    print(f"two-way package pairs {len(pairs)}: {pairs}")
