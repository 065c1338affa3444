"""Statistics over seeds: a metric's mean and range, the verdict of one case against another, seed bands.

A leaf of :mod:`lightning_sync.apps`: the main job (``compare``), the notebooks' studies and the parameter-server
study all judge their cases with :func:`spread` and :func:`verdict`; the outer-optimizer sweep and the periodic
guide's table judge a loss against DDP's with :func:`versus_reference`, which also asks for a mean within
:data:`TIE_PERCENT`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Spread:
    """A metric over seeds: its mean and range. ``n`` counts the runs that gave a value (a diverged run gives none)."""

    mean: float
    low: float
    high: float
    n: int

    @classmethod
    def of_row(cls, row: Mapping[str, Any]) -> Spread:
        """The spread a results table's row stores as ``mean``, ``min``, ``max`` and its per-seed ``values``."""
        return cls(row["mean"], row["min"], row["max"], len(row.get("values") or ()))

    def overlaps(self, other: Spread) -> bool:
        """Whether the two ranges share a point: the cases cannot be told apart (a tie)."""
        return self.low <= other.high and other.low <= self.high


def spread(values: Sequence[float | None]) -> Spread | None:
    """The mean and the min-max range of the finite values that are not ``None`` (``None`` if there are none)."""
    kept = [v for v in values if v is not None and math.isfinite(v)]
    if not kept:
        return None
    return Spread(statistics.fmean(kept), min(kept), max(kept), len(kept))


def verdict(case: Spread | None, reference: Spread | None, higher_is_better: bool) -> str:
    """``tie`` when the ranges overlap, else ``better`` or ``worse`` than ``reference``; ``-`` if either is missing."""
    if case is None or reference is None:
        return "-"
    if case.overlaps(reference):
        return "tie"
    return "better" if (case.mean > reference.mean) == higher_is_better else "worse"


#: A case ties its reference when its mean is within this many percent of the reference's and the ranges overlap (the
#: bar issue 27 sets for the outer-optimizer defaults against DDP).
TIE_PERCENT = 2.0


def versus_reference(case: Spread, reference: Spread, tie_percent: float = TIE_PERCENT) -> tuple[float, str]:
    """``(percent, verdict)`` of a lower-is-better metric: ``case``'s mean as a percent difference from
    ``reference``'s, and ``tie`` when that is within ``tie_percent`` and the ranges overlap, else ``better``/``worse``."""
    percent = 100.0 * (case.mean / reference.mean - 1.0)
    if abs(percent) <= tie_percent and case.overlaps(reference):
        return percent, "tie"
    return percent, "better" if percent < 0 else "worse"


def seed_band(
    curves: Sequence[tuple[Sequence[float], Sequence[float]]], points: int = 50
) -> tuple[list[float], list[float], list[float], list[float]]:
    """``(x, mean, low, high)`` of several seeds' curves ``(x, y)``, each interpolated linearly on a common grid of
    ``points`` values of x over the range every curve covers (empty lists if they share none)."""
    arrays = [(np.asarray(x, float), np.asarray(y, float)) for x, y in curves if len(x)]
    if not arrays:
        return [], [], [], []
    start, end = max(x[0] for x, _ in arrays), min(x[-1] for x, _ in arrays)
    if end < start:
        return [], [], [], []
    grid = np.linspace(start, end, points) if end > start else np.array([start])
    values = np.stack([np.interp(grid, x, y) for x, y in arrays])
    return grid.tolist(), values.mean(0).tolist(), values.min(0).tolist(), values.max(0).tolist()


def error_bar(values: Sequence[float | None]) -> tuple[float, list[list[float]]] | None:
    """``(mean, [[mean - min], [max - mean]])`` of the values that are not ``None`` (e.g. one per seed): a point and
    its ``yerr`` or ``xerr`` for matplotlib's ``errorbar``, ``bar`` and ``barh``; ``None`` if there are none.

    Both arms are at least 0: the mean of equal values can round just past them, and matplotlib refuses a negative
    error bar.
    """
    found = spread(values)
    if found is None:
        return None
    return found.mean, [[max(0.0, found.mean - found.low)], [max(0.0, found.high - found.mean)]]
