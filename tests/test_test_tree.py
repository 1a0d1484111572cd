"""tests/ mirrors the package: the tests of ``megatron_mugrpo/<pkg>/`` (and of the converter,
``conversion/``) live in ``tests/<pkg>/``, so a module's tests are found where its code is. Top-level
test files are for top-level modules (``config.py``, ``resume.py``, ...) and for checks across the
whole repository (layout, docs, import structure). Basenames are unique across tests/, since test
directories without ``__init__.py`` import their modules by basename."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CROSS_CUTTING_DIRS = {"e2e": "end-to-end runs of the mugrpo CLI, across packages"}


def package_dirs() -> set[str]:
    """The library's subpackages (a directory with ``__init__.py``) and the converter's top-level package."""
    pkg = ROOT / "megatron_mugrpo"
    return {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()} | {"conversion"}


def test_every_test_directory_mirrors_a_package_directory() -> None:
    dirs = {p.relative_to(TESTS).parts[0] for p in TESTS.rglob("test_*.py") if p.parent != TESTS}
    stray = sorted(dirs - package_dirs() - CROSS_CUTTING_DIRS.keys())
    assert not stray, f"tests/{stray} match no package directory of megatron_mugrpo/: move their files"


def test_a_subpackages_tests_are_not_at_the_top_level() -> None:
    packages = package_dirs()
    misplaced = sorted(
        p.name for p in TESTS.glob("test_*.py") if p.stem.removeprefix("test_").split("_")[0] in packages
    )
    assert not misplaced, f"{misplaced} test a subpackage: move them into tests/<package>/"


def test_test_basenames_are_unique() -> None:
    counts = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [name for name, n in counts.items() if n > 1], "pytest refuses two test modules of one basename"
