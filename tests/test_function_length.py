"""Small units (STYLE: "look twice at anything over 80"): the package's functions of more than
``LONG_LINES`` lines are counted, and their count may only shrink."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LONG_LINES = 60
MAX_LONG_FUNCTIONS = 3
"""Functions (methods and nested functions included) longer than ``LONG_LINES``, from ``def`` to the last
line of the body, over ``megatron_mugrpo/`` and ``conversion/``. Lower it when one is cut; never raise it."""


def long_functions(roots: tuple[Path, ...], limit: int = LONG_LINES) -> list[tuple[int, str]]:
    """(lines, ``path:line name``) of every function longer than ``limit`` lines, longest first."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        found.append((lines, f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def test_the_counter_counts_lines_from_def_to_the_end_of_the_body(tmp_path: Path):
    body = "\n".join(f"    x{i} = {i}" for i in range(3))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef three():\n{body}\n")
    assert [lines for lines, _ in long_functions((tmp_path,), limit=3)] == [4]


def test_few_functions_are_long():
    found = long_functions((ROOT / "megatron_mugrpo", ROOT / "conversion"))
    assert len(found) <= MAX_LONG_FUNCTIONS, (
        f"{len(found)} functions over {LONG_LINES} lines (at most {MAX_LONG_FUNCTIONS}): cut one into named "
        "steps:\n" + "\n".join(f"  {lines:4d}  {where}" for lines, where in found)
    )


if __name__ == "__main__":
    for lines, where in long_functions((ROOT / "megatron_mugrpo", ROOT / "conversion")):
        print(f"{lines:4d}  {where}")
