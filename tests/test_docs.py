"""The documentation cannot drift: every config key is documented where it is declared (the generated
reference reads those docstrings), every page the site's nav names exists, and the README stays a
short tour whose links resolve. (`make docs` builds the site itself, strictly; CI runs it.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

from megatron_mugrpo.config import RunConfig, user_key

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import config_reference  # noqa: E402

README_MAX_LINES = 200


def test_every_config_key_is_documented_in_the_generated_reference() -> None:
    assert config_reference.undocumented(RunConfig) == [], "give these fields a docstring in their dataclass"
    page = config_reference.render(RunConfig)
    from test_config_keys import leaf_keys  # the schema's leaves, as the key-coverage test sees them

    for key in leaf_keys():
        head, dot, rest = key.partition(".")
        spelled = user_key(head) + dot + rest
        assert f"`{spelled}`" in page, f"{spelled} is missing from the configuration reference"


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_nav_page_exists_and_every_page_is_in_the_nav() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = _nav_pages(config["nav"])
    generated = {"reference/configuration.md"}
    missing = [p for p in pages if p not in generated and not (ROOT / "docs" / p).is_file()]
    assert not missing, f"nav pages without a file: {missing}"
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")} - generated
    assert not on_disk - set(pages), f"pages not in mkdocs.yml's nav: {sorted(on_disk - set(pages))}"


def test_the_readme_is_a_short_tour_whose_links_resolve() -> None:
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move details to docs/"
    commands = [line.split("#")[0].strip() for line in lines[:12] if line.startswith("make ")]
    assert commands[:2] == ["make demo", "make test"], "the README starts with make demo and make test"
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
