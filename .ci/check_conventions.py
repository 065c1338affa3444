"""Fails on a break of the repository's conventions for text: what ``make lint`` checks beyond code style.

Run from the repository root (``make lint``); exit code 1 and one line per finding. Checked:

- ``README.md`` is a short front page: at most :data:`README_MAX_LINES` lines, naming ``make test``, ``make compare``
  and the docs;
- every page under ``docs/`` is in ``mkdocs.yml``'s nav and every nav entry exists (``mkdocs build --strict`` fails
  on a missing page, not on one left out of the nav), and the API reference covers the core modules;
- every relative Markdown link in ``README.md`` and ``docs/`` resolves (mkdocs does not read the README);
- the README, the docs (but the generated results page) and the package's docstrings and comments describe the
  present: no history (:data:`HISTORY`, which belongs in ``CHANGELOG.md`` and commit messages) and no lab notebook
  (:data:`LAB_NOTEBOOK`: a commit, a machine or a timing "here"; findings belong on the generated results page);
- the notebooks (jupytext ``py:percent`` sources in ``notebooks/``) have a ``SMOKE`` mode and take everything from
  the installed package: no ``sys.path`` edit, and no CSV reading, ``run_case`` or ``subprocess`` in a cell.

Usage: ``python .ci/check_conventions.py`` (no arguments).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = {DOCS / "results.md"}
README_MAX_LINES = 160
README_NAMES = ("make test", "make compare", "docs/")
API_MODULES = ("strategies", "config", "comm", "ps", "callbacks", "errors")
HISTORY = ("before this change", "no longer", "used to ", "(was ", "previous session", "cause is not found")
LAB_NOTEBOOK = re.compile(
    r"\bat commit [0-9a-f]{7,}\b"
    r"|\b\d+-core (?:machine|vm|box)\b"
    r"|\bon this (?:machine|box|vm)\b"
    r"|\b(?:development|dev) machine\b"
    r"|\b\d+(?:\.\d+)? ?(?:ms|s|seconds|minutes) here\b"
    r"|\bnot verified by a rerun\b",
    re.IGNORECASE,
)
NOTEBOOK_PLUMBING = ("sys.path", "import csv", "run_case(", "subprocess")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _markdown() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def check_readme() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    found = [f"README.md: {len(lines)} lines; at most {README_MAX_LINES}"] if len(lines) > README_MAX_LINES else []
    text = "\n".join(lines)
    return found + [f"README.md: does not name {name!r}" for name in README_NAMES if name not in text]


def _nav_pages(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [page for item in node for page in _nav_pages(item)]
    if isinstance(node, dict):
        return [page for value in node.values() for page in _nav_pages(value)]
    return []


def check_docs_site() -> list[str]:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    found = [f"mkdocs.yml: {page} is in the nav twice" for page in sorted({p for p in nav if nav.count(p) > 1})]
    found += [f"docs/{page}: not in mkdocs.yml's nav" for page in sorted(pages - set(nav))]
    found += [f"mkdocs.yml: nav entry {page} has no page" for page in sorted(set(nav) - pages)]
    if config.get("strict") is not True:
        found.append("mkdocs.yml: strict must be true")
    reference = "\n".join(p.read_text() for p in (DOCS / "reference").glob("*.md"))
    found += [
        f"docs/reference: no '::: lightning_sync.{m}'"
        for m in API_MODULES
        if f"::: lightning_sync.{m}" not in reference
    ]
    return found


def check_links() -> list[str]:
    found = []
    for path in _markdown():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if not re.match(r"[a-z]+:", target) and not (path.parent / target).exists():
                found.append(f"{_rel(path)}: broken link {target}")
    return found


def check_present_tense() -> list[str]:
    found = []
    for path in _markdown():
        if path in GENERATED:
            continue
        text = path.read_text()
        found += [f"{_rel(path)}: {phrase!r} tells history" for phrase in HISTORY if phrase in text.lower()]
        found += _lab_notebook(path, text)
    for path in sorted((ROOT / "lightning_sync").rglob("*.py")):
        found += _lab_notebook(path, path.read_text())
    return found


def _lab_notebook(path: Path, text: str) -> list[str]:
    return [
        f"{_rel(path)}:{number}: {match.group(0)!r} is a finding or history, not behaviour"
        for number, line in enumerate(text.splitlines(), 1)
        for match in LAB_NOTEBOOK.finditer(line)
    ]


def _code_cells(source: str) -> list[str]:
    """The code cells of a ``py:percent`` source (cells start at ``# %%``; ``# %% [markdown]`` ones are text)."""
    cells, current, is_code = [], [], False
    for line in source.splitlines():
        if line.startswith("# %%"):
            if is_code:
                cells.append("\n".join(current))
            current, is_code = [], "[markdown]" not in line
        else:
            current.append(line)
    if is_code:
        cells.append("\n".join(current))
    return cells


def check_notebooks() -> list[str]:
    found = []
    for path in sorted((ROOT / "notebooks").glob("*.py")):
        source = path.read_text()
        if "SMOKE" not in source:
            found.append(f"{_rel(path)}: no SMOKE mode")
        cells = _code_cells(source)
        if len(cells) < 3 or "# %% [markdown]" not in source:
            found.append(f"{_rel(path)}: not a py:percent notebook with markdown and at least 3 code cells")
        found += [
            f"{_rel(path)}: {plumbing!r} in a cell belongs in the package"
            for plumbing in NOTEBOOK_PLUMBING
            if any(plumbing in cell for cell in cells)
        ]
    return found


def main() -> int:
    found = [
        *check_readme(),
        *check_docs_site(),
        *check_links(),
        *check_present_tense(),
        *check_notebooks(),
    ]
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
