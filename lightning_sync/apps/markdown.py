"""Markdown tables and their cells, for every report of the apps (compare, bench, the studies, the notebooks).

:func:`markdown_table` writes a GitHub-flavoured pipe table through ``tabulate``; :func:`format_cell` and
:func:`band_cell` format one cell.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tabulate import tabulate

from lightning_sync.apps.stats import spread

_ALIGN = {"l": "left", "r": "right", "c": "center", "-": None}


def markdown_table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | Sequence[str] | None = None
) -> str:
    """A Markdown (GitHub-flavoured) table, its columns padded so that it also reads as plain text.

    Args:
        headers: The column titles.
        rows: One sequence of cells per row; a cell is formatted with ``str`` (``None`` shows as ``-``).
        align: One letter per column, as a string (``"lrr"``) or a sequence: ``l`` left, ``r`` right, ``c`` centre,
            ``-`` the default (left). ``None`` leaves every column at the default.

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
    colalign = [_ALIGN[a] or "left" for a in letters] if body else None  # tabulate 0.9 needs a row to align
    return str(tabulate(body, header, tablefmt="pipe", colalign=colalign, disable_numparse=True))


def format_cell(value: Any, spec: str, suffix: str = "") -> str:
    """``value`` formatted with ``spec`` (and ``suffix``); ``-`` for ``None``."""
    return "-" if value is None else format(value, spec) + suffix


def band_cell(values: Sequence[float | None], spec: str = ".3f", suffix: str = "") -> str:
    """``mean [min, max]`` of the values that are not ``None`` (e.g. one per seed), each formatted with ``spec`` (and
    ``suffix``); ``-`` if there are none. When only some runs gave a value, ``(k of n)`` follows."""
    found = spread(values)
    if found is None:
        return "-"
    cell = f"{found.mean:{spec}}{suffix} [{found.low:{spec}}, {found.high:{spec}}]"
    return cell if found.n == len(values) else f"{cell} ({found.n} of {len(values)})"
