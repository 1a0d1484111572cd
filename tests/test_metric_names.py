"""Metric names live with their producers (``megatron_mugrpo/metric_names.py``), not with their readers.

Read from the source, not imported, so the report's light imports stay light and no producer's
dependencies (torch, Megatron) load here:

- every name ``metric_names.PRODUCERS`` lists is still written by its producing module: through the
  constant it imports from metric_names (evaluation.py, training/moe.py), in full, or as the bare name
  after the prefix its caller adds;
- every name ``report.py`` and ``plan/actual.py`` read is one of ``metric_names``'s (so has a producer);
- ``report.py`` spells no metric name of its own.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from megatron_mugrpo import metric_names

ROOT = Path(__file__).resolve().parents[1]
METRIC_LITERAL = re.compile(r"^(train|rollout|perf|eval|replay)/[\w@/]*$")
"""A string that is a whole metric name (or a metric prefix / suffix), not prose that mentions one."""


CONSTANTS = {v: k for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}
"""Name → its constant in metric_names."""


def _emits(path: Path, name: str) -> bool:
    """The module imports ``name``'s constant from metric_names, or spells ``name`` in full, or its bare part
    after the prefix as a whole string literal ("x" or f"{prefix}x")."""
    source, bare = path.read_text(), name.partition("/")[2]
    if CONSTANTS[name] in _imported_names(path):
        return True
    return name in source or f'"{bare}"' in source or f'}}{bare}"' in source


def _names() -> set[str]:
    return {v for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str) and "(" not in v}


def _imported_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "megatron_mugrpo.metric_names"
        for alias in node.names
    }


def test_every_listed_name_is_still_emitted_by_its_producer() -> None:
    for module, names in metric_names.PRODUCERS.items():
        missing = [name for name in names if not _emits(ROOT / module, name)]
        assert not missing, f"{module} no longer writes {missing}: rename them in metric_names.py too"


def test_every_name_has_a_producer() -> None:
    produced = {name for names in metric_names.PRODUCERS.values() for name in names}
    assert _names() - produced == set(), "a name in metric_names.py has no entry in PRODUCERS"


def test_the_report_reads_names_only_from_metric_names() -> None:
    for path in (ROOT / "megatron_mugrpo" / "report.py", ROOT / "megatron_mugrpo" / "plan" / "actual.py"):
        spelled = [
            node.value
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and METRIC_LITERAL.match(node.value)
        ]
        assert spelled == [], f"{path.name} spells metric names {spelled}: import them from metric_names.py"
        assert _imported_names(path), f"{path.name} reads no metric name from metric_names.py"


def test_the_moe_layer_pattern_matches_the_producers_key() -> None:
    source = (ROOT / "megatron_mugrpo" / "training" / "moe.py").read_text()
    assert 'f"train/moe_load_{bound}_layer_{layer:02d}"' in source  # training.moe.load_layer_key
    assert re.match(metric_names.MOE_LAYER_LOAD_PATTERN, "train/moe_load_max_layer_07")
