"""The documentation's shape: a short README front page, every docs page in the mkdocs nav, links that resolve.

The site build itself (``mkdocs build --strict``) runs in CI through ``make docs``; these checks need no mkdocs.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 160
# phrases that tell history rather than describe the present (history goes to CHANGELOG.md and commit messages)
HISTORY = ("before this change", "no longer", "used to ", "(was ", "previous session", "cause is not found")


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def _mkdocs() -> dict:
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def _pages() -> set[str]:
    return {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}


def test_readme_is_a_short_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"
    text = "\n".join(lines)
    for needed in ("make compare", "make test", 'strategy="sync_allreduce"', "| mode |", "docs/"):
        assert needed in text, needed


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    nav = _nav_pages(_mkdocs()["nav"])
    assert len(nav) == len(set(nav)), "a page is in the nav twice"
    pages = _pages()
    assert sorted(pages - set(nav)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - pages) == [], "nav entries without a page"
    assert _mkdocs()["strict"] is True


def test_the_api_reference_covers_the_core():
    reference = "\n".join(p.read_text() for p in (DOCS / "reference").glob("*.md"))
    for module in ("strategies", "config", "comm", "ps", "callbacks", "errors"):
        assert f"::: lightning_sync.{module}" in reference, module


def test_relative_links_resolve():
    """Every relative Markdown link in the README and docs points at an existing file."""
    broken = []
    for path in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_readme_and_docs_describe_the_present():
    found = []
    for path in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        text = path.read_text().lower()
        found += [f"{path.relative_to(ROOT)}: {phrase!r}" for phrase in HISTORY if phrase in text]
    assert found == [], "history belongs in CHANGELOG.md"


def test_license_and_changelog_exist():
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert "Version 2.0" in (ROOT / "LICENSE").read_text()
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# Changelog")
