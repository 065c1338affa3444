"""Markdown tables for every report, and the generator of the docs' results page.

:func:`markdown_table` is the one table writer: the main job (``compare``), the benchmark's report, the notebooks'
study tables and the parameter-server study all format their tables with it.

Each table on the results page names where it comes from: the ``provenance`` record
(:func:`lightning_sync.apps.provenance.provenance`: command, commit, date, versions, machine) that ``compare`` and
the benchmark store in their ``results.json``, or a ``provenance.json`` beside the results file.

``python -m lightning_sync.apps.tables`` writes ``docs/results.md`` from the results files under
``benchmarks/results/`` (or the folders given): every ``results.json`` written by ``compare``, the benchmark or
``benchmarks/ps_straggler.py``, and every ``<name>.md`` table that has a ``<name>.provenance.json`` beside it. Each
table carries its command and provenance; a file without a provenance record says so. ``--check`` exits with 1
when the page on disk differs from what the results files give (for CI: the page is never edited by hand).

    python -m lightning_sync.apps.tables                      # benchmarks/results -> docs/results.md
    python -m lightning_sync.apps.tables outputs/compare      # a fresh `make compare` as well
    python -m lightning_sync.apps.tables --check
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lightning_sync.apps.provenance import git_output

_ALIGN = {"l": ":---", "r": "---:", "c": ":---:", "-": "---"}
PROVENANCE_FILE = "provenance.json"
DEFAULT_SOURCES = ("benchmarks/results",)
DEFAULT_OUT = "docs/results.md"
COMPARE_TITLE = "Main job: every sync mode, over seeds"


# ------------------------------------------------------------------------------------------------------ the writer
def markdown_table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | Sequence[str] | None = None, pad: bool = False
) -> str:
    """A Markdown (GitHub-flavoured) table.

    Args:
        headers: The column titles.
        rows: One sequence of cells per row; a cell is formatted with ``str`` (``None`` shows as ``-``).
        align: One letter per column, as a string (``"lrr"``) or a sequence: ``l`` left, ``r`` right, ``c`` centre,
            ``-`` the renderer's default. ``None`` leaves every column at the default.
        pad: Pad every column to its widest cell, so the table also reads well as plain text (a terminal).

    Returns:
        The table, one line per row, without a trailing newline.

    Raises:
        ValueError: A row or ``align`` has another number of columns than ``headers``, or an unknown align letter.
    """
    header = [str(h) for h in headers]
    body = [["-" if cell is None else str(cell) for cell in row] for row in rows]
    letters = list(align) if align is not None else ["-"] * len(header)
    for what, cells in [("align", letters), *((f"row {i}", r) for i, r in enumerate(body))]:
        if len(cells) != len(header):
            raise ValueError(f"markdown_table: {what} has {len(cells)} columns, the headers {len(header)}")
    unknown = sorted(set(letters) - set(_ALIGN))
    if unknown:
        raise ValueError(f"markdown_table: align letters {unknown} are not allowed; use l, r, c or -")
    if pad:
        widths = [max(3, len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    else:
        widths = [0] * len(header)

    def line(cells: Sequence[str]) -> str:
        padded = (c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, letters))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(_rule(a, w) for a, w in zip(letters, widths)) + "|"
    return "\n".join([line(header), rule, *map(line, body)])


def _rule(letter: str, width: int) -> str:
    """A separator cell: the alignment marker, widened to ``width + 2`` dashes when the table is padded."""
    marker = _ALIGN[letter]
    extra = max(0, width + 2 - len(marker))
    if letter == "r":
        return "-" * extra + marker
    return marker + "-" * extra


# ------------------------------------------------------------------------------------------------------ provenance
def provenance_line(record: dict[str, Any] | None, path: Path) -> str:
    """One Markdown paragraph: the command as code, then commit, date, versions and machine."""
    if not record:
        committed = (git_output("log", "-1", "--format=%h %cs", "--", path.name, cwd=path.parent) or "").strip()
        where = f"committed in {committed.split()[0]} on {committed.split()[1]}" if committed else "not committed"
        return f"Command and versions not recorded for `{path.as_posix()}` ({where})."
    parts = []
    if record.get("commit"):
        parts.append(f"commit `{record['commit'][:10]}`" + (" with local changes" if record.get("dirty") else ""))
    if record.get("date"):
        parts.append(str(record["date"]))
    if record.get("python"):
        parts.append(f"Python {record['python']}")
    parts += [f"{name} {v}" for name, v in (record.get("versions") or {}).items() if v]
    if record.get("machine"):
        parts.append(str(record["machine"]))
    head = f"Command: `{record['command']}`" if record.get("command") else "Command not recorded"
    note = f" {record['note']}" if record.get("note") else ""
    return f"{head}  \nProvenance: {', '.join(parts) or 'not recorded'}; file `{path.as_posix()}`.{note}"


# ------------------------------------------------------------------------------------------------------ the page
def render_results(path: Path, data: Any) -> tuple[str, str]:
    """``(title, tables)`` for one ``results.json`` (``data``, as read from ``path``), by the shape its writer gives it.

    Raises:
        ValueError: The file is not one of the known results files.
    """
    if isinstance(data, dict) and "workloads" in data:
        from lightning_sync.apps import compare

        return COMPARE_TITLE, compare.format_results(data).replace("### ", "#### ")
    if isinstance(data, dict) and {"config", "summary", "records"} <= data.keys():
        from lightning_sync.apps.bench.report import markdown

        cfg = _bench_config(data["config"])
        return "Benchmark: " + ", ".join(cfg.workloads), markdown(data["summary"], cfg).replace("### ", "#### ")
    if isinstance(data, dict) and {"args", "summary", "runs"} <= data.keys():
        from lightning_sync.apps.ps_study import format_table as ps_table

        modes = data["args"].get("modes") or ["sync"]
        return "Parameter server under a straggler", ps_table(data["summary"], reference=modes[0])
    raise ValueError(f"{path}: not a results file of compare, the benchmark or ps_straggler")


def _bench_config(saved: dict[str, Any]) -> Any:
    """The :class:`BenchConfig` a results file was written with (fields it no longer knows are left out)."""
    from dataclasses import fields

    from lightning_sync.apps.bench.config import BenchConfig, NetworkConfig

    values = {f.name: saved[f.name] for f in fields(BenchConfig) if f.name in saved}
    if isinstance(values.get("network"), dict):
        known = {f.name for f in fields(NetworkConfig)}
        values["network"] = NetworkConfig(**{k: v for k, v in values["network"].items() if k in known})
    return BenchConfig(**values)


def results_page(sources: Sequence[str | Path]) -> str:
    """The whole results page: one section per results file found under ``sources``, in path order."""
    sections = []
    for source in map(Path, sources):
        files = [source] if source.is_file() else sorted(source.rglob("*")) if source.is_dir() else []
        for path in files:
            if path.name == "results.json":
                data = json.loads(path.read_text())
                title, tables = render_results(path, data)
                embedded = data.get("provenance") if isinstance(data, dict) else None
                record = embedded or _read_json(path.parent / PROVENANCE_FILE)
            elif path.suffix == ".md" and (path.with_suffix(".provenance.json")).exists():
                record = _read_json(path.with_suffix(".provenance.json"))
                title = record.get("title") or path.stem
                tables = path.read_text().strip().replace("### ", "#### ")
            else:
                continue
            sections.append(f"## {title}\n\n{provenance_line(record, path)}\n\n{tables.strip()}\n")
    head = (
        "# Results\n\n"
        "<!-- generated by `python -m lightning_sync.apps.tables`; do not edit by hand -->\n\n"
        "Every table on this page is generated from a results file by `python -m lightning_sync.apps.tables`, "
        "and names the command that produced it and where it ran. To add or refresh one, run its command with "
        "`--out` (compare) or `out=` (bench) under `benchmarks/results/`, then the generator.\n"
    )
    if not any(s.startswith(f"## {COMPARE_TITLE}") for s in sections):
        sections.insert(
            0,
            f"## {COMPARE_TITLE}\n\nNo results of the main job found under "
            + ", ".join(f"`{Path(s).as_posix()}`" for s in sources)
            + ': run `make compare COMPARE_ARGS="--out benchmarks/results/compare"`, then the generator.\n',
        )
    return head + "\n" + "\n".join(sections)


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str] | None = None) -> int:
    """Writes (or with ``--check`` compares) the results page; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sources", nargs="*", default=list(DEFAULT_SOURCES), help="results folders or files")
    parser.add_argument("--out", default=DEFAULT_OUT, help="the page to write (default: %(default)s)")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the results files")
    args = parser.parse_args(argv)
    page = results_page(args.sources)
    out = Path(args.out)
    if args.check:
        current = out.read_text() if out.exists() else ""
        if current != page:
            print(f"{out} is out of date: run python -m lightning_sync.apps.tables", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
