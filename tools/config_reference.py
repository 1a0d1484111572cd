"""Write the configuration reference (a Markdown page) from the config dataclasses themselves.

Every section of ``RunConfig`` is a ``@dataclass`` whose fields carry a docstring (the string literal
under the field, STYLE's rule). Python keeps no such docstrings at run time, so this tool reads each
class's source with ``ast`` and pairs every field with its string; types and defaults come from the
dataclass. The page therefore cannot drift from the code: ``make docs`` regenerates it before MkDocs
builds the site, and ``tests/test_docs.py`` checks that every leaf key has a description.

    python tools/config_reference.py docs/reference/configuration.md
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import sys
import typing
from pathlib import Path
from typing import Any

HEADER = """# Configuration reference

Generated from the config dataclasses (`megatron_mugrpo/**/config.py` and the sections their
components own) by `tools/config_reference.py`; `make docs` rewrites it. A run is a YAML file in
`configs/` plus dotted overrides on the command line (`stages.mini_groups=8`). Each section checks
itself when it is built: a bad value is one `error:` line naming the key and the fix.
"""


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` over ``cls`` and its bases (registries build sections by subclassing)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is not object:
            docs |= class_field_docs(klass)
    return docs


def class_field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` read from the class body: a string literal right after an annotated field."""
    module = sys.modules[cls.__module__]
    tree = ast.parse(Path(inspect.getfile(module)).read_text())  # inspect.getsource misses some classes
    found = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == cls.__name__]
    if not found:
        return {}
    body = found[0].body
    docs: dict[str, str] = {}
    for node, after in itertools.pairwise(body):
        is_doc = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and is_doc:
            docs[node.target.id] = inspect.cleandoc(str(after.value.value))
    return docs


def sections(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    """``(dotted prefix, dataclass)`` for ``cls`` and every nested section, in declaration order."""
    out = [(prefix, cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += sections(hints[f.name], f"{prefix}{user_key(f.name)}.")
    return out


def user_key(name: str) -> str:
    from megatron_mugrpo.config import user_key

    return user_key(name)


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value: Any = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "(section)"
    else:
        return "required"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def type_text(hint: Any) -> str:
    text = getattr(hint, "__name__", None) if isinstance(hint, type) else None
    return text or str(hint).replace("typing.", "")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(root: type) -> str:
    lines = [HEADER]
    for prefix, cls in sections(root):
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        leaves = [f for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]
        if not leaves:
            continue
        title = prefix.rstrip(".") or "top level"
        lines += [f"## `{title}`", "", _cell(inspect.getdoc(cls) or ""), ""]
        lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in leaves:
            key = f"`{prefix}{user_key(f.name)}`"
            doc = _cell(docs.get(f.name, ""))
            lines.append(f"| {key} | `{_cell(type_text(hints[f.name]))}` | `{_cell(default_text(f))}` | {doc} |")
        lines.append("")
    return "\n".join(lines)


def undocumented(root: type) -> list[str]:
    """Leaf keys without a field docstring."""
    missing = []
    for prefix, cls in sections(root):
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(hints[f.name]) and not docs.get(f.name):
                missing.append(prefix + user_key(f.name))
    return missing


def main(argv: list[str]) -> int:
    from megatron_mugrpo.config import RunConfig

    if len(argv) != 1:
        print("usage: python tools/config_reference.py OUT.md", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(RunConfig))
    print(f"wrote {out} ({len(sections(RunConfig))} sections)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
