"""The layout picture of ``docs/layout.md`` (one line per module, with its purpose) names every module of
the package and of the converter, so it cannot fall behind the code."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "layout.md"
HEADING = "## Every module, one line each"
INDENT = 2
"""Spaces per level of the tree."""


def picture(text: str) -> dict[str, str]:
    """Module path (``megatron_mugrpo/loop/run.py``; a package's line stands for its ``__init__.py``) → purpose,
    read from the first fenced block after ``HEADING``."""
    block = text.split(HEADING, 1)[1].split("```", 2)[1]
    found: dict[str, str] = {}
    parents: list[str] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // INDENT
        name, _, purpose = line.strip().partition(" ")
        del parents[depth:]
        path = "/".join([*parents, name.rstrip("/")])
        if name.endswith("/"):
            parents.append(name.rstrip("/"))
            path += "/__init__.py"
        found[path] = purpose.strip()
    return found


def package_modules() -> list[str]:
    return sorted(
        str(path.relative_to(ROOT)) for top in ("megatron_mugrpo", "conversion") for path in (ROOT / top).rglob("*.py")
    )


def test_the_picture_reads_a_tree_of_modules():
    tree = ["pkg/    the package", "  a.py  one job", "  sub/  a part", "    b.py  another", "  c.py  a third"]
    text = "\n".join([HEADING, "```", *tree, "```"])
    assert picture(text) == {
        "pkg/__init__.py": "the package",
        "pkg/a.py": "one job",
        "pkg/sub/__init__.py": "a part",
        "pkg/sub/b.py": "another",
        "pkg/c.py": "a third",
    }


def test_every_module_has_its_line_in_the_layout_picture():
    listed = picture(PAGE.read_text())
    missing = [module for module in package_modules() if module not in listed]
    assert not missing, f"add these modules to docs/layout.md's picture, one line each with its purpose: {missing}"
    assert all(listed.values()), f"lines without a purpose: {[m for m, p in listed.items() if not p]}"
