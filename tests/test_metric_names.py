"""Every metric name is spelled once, in ``megatron_mugrpo/metric_names.py``, and both its producer and its
readers (``report``, ``plan.actual``, ``drift_plots``, the console line of ``metrics``) go through that
constant, so a rename in a producer cannot silently break a reader.

Read from the source, not imported, so the report's light imports stay light and no producer's
dependencies (torch, Megatron) load here:

- every name ``metric_names.PRODUCERS`` lists is written by its producing module through the constant it
  imports from metric_names (in full, or as ``stat_name(CONSTANT)`` under the prefix its caller adds);
- a module that hands bare names to its caller spells none of them itself;
- no module of the package spells a metric name (a string under a metric prefix) outside
  metric_names.py, but for ``AWAITING_CONVERSION``;
- every constant has a producer, so a reader cannot read a name nobody writes.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from megatron_mugrpo import metric_names

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_mugrpo"
SCANNED = (PACKAGE, ROOT / "conversion")
"""The package's code (``conversion`` is a subpackage whose code lives beside it)."""
METRIC_LITERAL = re.compile(r"^(train|rollout|perf|eval|replay)/[\w@/]*$")
"""A string that is a whole metric name (or a metric prefix), not prose that mentions one: in an f-string
this is the constant part, so ``f"perf/stage_overhead_{name}_s"`` is caught by its ``perf/stage_overhead_``."""
AWAITING_CONVERSION: dict[str, str] = {}
"""Modules allowed for a while to spell metric names (path → why), when other work is changing them as
the names move here; their names in ``PRODUCERS`` are then checked as spelled in full. Each entry must
still be needed (a stale one fails), so the list only shrinks; empty since the async and env modules
were converted."""

CONSTANTS = {v: k for k, v in vars(metric_names).items() if k.isupper() and isinstance(v, str)}
"""Name → its constant in metric_names."""


def _relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _imported_names(source: str) -> set[str]:
    return {
        alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.module == "megatron_mugrpo.metric_names"
        for alias in node.names
    }


def _string_literals(source: str) -> list[str]:
    """Every string constant of the module, f-strings' constant parts included (docstrings too)."""
    return [n.value for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def spelled_metric_names(source: str) -> list[str]:
    return [value for value in _string_literals(source) if METRIC_LITERAL.match(value)]


def _package_files() -> list[Path]:
    return sorted(p for root in SCANNED for p in root.rglob("*.py") if p != PACKAGE / "metric_names.py")


def test_the_scan_flags_names_prefixes_and_fstring_parts_but_not_prose() -> None:
    source = '''
"""Logs ``train/loss`` and perf/ timers."""
A = {"train/loss": 1.0, "rollout/": 2}
B = f"perf/stage_overhead_{name}_s"
C = f"{EVAL_PREFIX}{name}/pass@1"
D = "train/ratio mean, see above"
'''
    assert spelled_metric_names(source) == ["train/loss", "rollout/", "perf/stage_overhead_"]


def test_no_module_spells_a_metric_name_outside_metric_names() -> None:
    spelled = {_relative(p): names for p in _package_files() if (names := spelled_metric_names(p.read_text()))}
    unexplained = {path: names for path, names in spelled.items() if path not in AWAITING_CONVERSION}
    assert unexplained == {}, f"{unexplained}: import their constants from metric_names.py (add any new one there)"
    stale = sorted(set(AWAITING_CONVERSION) - set(spelled))
    assert stale == [], f"{stale} spell no metric name any more: drop them from AWAITING_CONVERSION"


def test_every_listed_name_is_written_through_its_constant() -> None:
    for module, names in metric_names.PRODUCERS.items():
        source = (ROOT / module).read_text()
        if module in AWAITING_CONVERSION:
            missing = [name for name in names if name not in _string_literals(source)]
        else:
            missing = [name for name in names if CONSTANTS[name] not in _imported_names(source)]
        assert not missing, f"{module} no longer writes {missing} through metric_names: rename them there too"


def test_a_bare_name_producer_spells_none_of_its_bare_names() -> None:
    """A module that imports ``stat_name`` hands bare names to a caller that prefixes them."""
    bare_producers = {
        m: names
        for m, names in metric_names.PRODUCERS.items()
        if "stat_name" in _imported_names((ROOT / m).read_text())
    }
    assert "megatron_mugrpo/algorithms/loss_core.py" in bare_producers
    for module, names in bare_producers.items():
        literals = set(_string_literals((ROOT / module).read_text()))
        spelled = sorted(metric_names.stat_name(n) for n in names if metric_names.stat_name(n) in literals)
        assert spelled == [], f"{module} spells {spelled}: write stat_name(<its constant>) instead"


def test_every_name_has_a_producer() -> None:
    produced = {name for names in metric_names.PRODUCERS.values() for name in names}
    names = {v for v in CONSTANTS if v not in metric_names.METRIC_PREFIXES and "(" not in v}
    assert sorted(names - produced) == [], "a name in metric_names.py has no entry in PRODUCERS"
    assert produced <= set(CONSTANTS), "PRODUCERS lists a name metric_names.py does not define"


def test_the_readers_read_names_only_from_metric_names() -> None:
    for reader in ("report.py", "plan/actual.py", "drift_plots.py", "metrics.py"):
        source = (PACKAGE / reader).read_text()
        assert spelled_metric_names(source) == [], f"{reader} spells metric names: import them from metric_names.py"
        assert _imported_names(source), f"{reader} reads no metric name from metric_names.py"


def test_stat_name_strips_the_prefix_only() -> None:
    assert metric_names.stat_name(metric_names.CLIP_LOW) == "clip_frac_low"
    assert metric_names.stat_name(metric_names.REWARD) == "reward_mean"
    assert metric_names.stat_name(metric_names.EVAL_AVG) == "avg_pass@1"


def test_the_moe_layer_pattern_matches_the_producers_key() -> None:
    assert metric_names.moe_layer_load_key("max", 7) == "train/moe_load_max_layer_07"
    assert metric_names.moe_layer_load_key("min", 12) == "train/moe_load_min_layer_12"
    for bound in ("min", "max"):
        match = re.match(metric_names.MOE_LAYER_LOAD_PATTERN, metric_names.moe_layer_load_key(bound, 3))
        assert match is not None and match.groups() == (bound, "03")
    assert "moe_layer_load_key(bound, layer)" in (PACKAGE / "training" / "moe.py").read_text()
