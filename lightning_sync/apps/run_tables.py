"""Markdown tables of study runs: one row per run (:func:`format_runs`) or per case over its seeds
(:func:`format_seed_runs`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from lightning_sync.apps.markdown import band_cell, format_cell, markdown_table
from lightning_sync.apps.stats import spread, verdict
from lightning_sync.apps.study_run import StudyRun


def _accuracy_cell(run: StudyRun) -> str:
    if run.diverged:
        return f"diverged at step {run.summary.get('diverged_at_step')}"
    return format_cell(None if run.test_accuracy is None else 100 * run.test_accuracy, ".2f", "%")


COLUMNS: dict[str, Callable[[StudyRun], str]] = {
    "test acc": _accuracy_cell,
    "ms/step": lambda r: format_cell(r.step_time_ms, ".2f"),
    "comm ms/step": lambda r: format_cell(
        None if r.comm_seconds_per_step is None else 1e3 * r.comm_seconds_per_step, ".2f"
    ),
    "calls/step": lambda r: format_cell(r.summary.get("calls_per_step"), ".1f"),
    "bytes sent/step": lambda r: format_cell(r.bytes_sent_per_step, ",.0f"),
    "bytes sent/batch": lambda r: format_cell(r.bytes_sent_per_batch, ",.0f"),
    "syncs": lambda r: str(r.syncs),
    "mean divergence": lambda r: format_cell(r.mean_divergence, ".4f"),
    "comm share": lambda r: format_cell(None if r.comm_share is None else 100 * r.comm_share, ".1f", "%"),
    "training s": lambda r: format_cell(r.training_s, ".1f"),
}
"""The columns :func:`format_runs` can show, by header."""


def format_runs(
    runs: Iterable[StudyRun],
    columns: Sequence[str] = ("test acc", "ms/step", "comm ms/step", "bytes sent/step", "training s"),
) -> str:
    """A Markdown table, one row per run: its name, then ``columns`` (headers of :data:`COLUMNS`).

    ``ms/step`` is the median batch on rank 0; ``comm ms/step`` and ``bytes sent/step`` are means per optimizer
    step over training; ``syncs`` and ``mean divergence`` are rank 0's (:attr:`StudyRun.mean_divergence`).
    """
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        raise ValueError(f"columns {unknown} are not allowed; choose from: {', '.join(COLUMNS)}")
    return markdown_table(("case", *columns), ([run.name, *(COLUMNS[c](run) for c in columns)] for run in runs))


def _percent(value: float | None) -> float | None:
    return None if value is None else 100 * value


SEED_METRICS: dict[str, tuple[Callable[[StudyRun], float | None], str, str]] = {
    "test acc": (lambda r: None if r.diverged else _percent(r.test_accuracy), ".2f", "%"),
    "ms/step": (lambda r: r.step_time_ms, ".2f", ""),
    "comm ms/step": (lambda r: None if r.comm_seconds_per_step is None else 1e3 * r.comm_seconds_per_step, ".2f", ""),
    "calls/step": (lambda r: r.summary.get("calls_per_step"), ".1f", ""),
    "bytes sent/step": (lambda r: r.bytes_sent_per_step, ",.0f", ""),
    "bytes sent/batch": (lambda r: r.bytes_sent_per_batch, ",.0f", ""),
    "syncs": (lambda r: r.syncs, ".1f", ""),
    "mean divergence": (lambda r: r.mean_divergence, ".4f", ""),
    "comm share": (lambda r: _percent(r.comm_share), ".1f", "%"),
    "training s": (lambda r: r.training_s, ".1f", ""),
}
"""What :func:`format_seed_runs` can show, by header: ``(a run's value, format, suffix)``."""


def format_seed_runs(
    groups: Mapping[str, Sequence[StudyRun]],
    columns: Sequence[str] = ("test acc", "ms/step", "comm ms/step", "bytes sent/step", "training s"),
    reference: str | None = None,
) -> str:
    """A Markdown table, one row per case of :func:`by_case`: each of ``columns`` (headers of :data:`SEED_METRICS`)
    as ``mean [min, max]`` over the case's seeds; a diverged run gives no test accuracy (``(k of n)``: k seeds gave
    one, see :func:`band_cell`).

    With ``reference`` (a case of ``groups``), a ``vs <reference>`` column after ``test acc`` says ``tie`` when the
    case's range of test accuracy overlaps the reference's, else ``better`` or ``worse``
    (:func:`lightning_sync.apps.stats.verdict`).
    """
    unknown = [c for c in columns if c not in SEED_METRICS]
    if unknown:
        raise ValueError(f"columns {unknown} are not allowed; choose from: {', '.join(SEED_METRICS)}")
    if reference is not None and reference not in groups:
        raise ValueError(f"reference {reference!r} is not a case; the cases are: {', '.join(groups)}")
    accuracy = SEED_METRICS["test acc"][0]
    ref = None if reference is None else spread([accuracy(r) for r in groups[reference]])
    header = ["case"]
    for column in columns:
        header.append(f"{column} mean [min, max]")
        if column == "test acc" and reference is not None:
            header.append(f"vs {reference}")
    rows = []
    for name, group in groups.items():
        cells = [name]
        for column in columns:
            value, spec, suffix = SEED_METRICS[column]
            cells.append(band_cell([value(r) for r in group], spec, suffix))
            if column == "test acc" and reference is not None:
                cells.append(verdict(spread([accuracy(r) for r in group]), ref, higher_is_better=True))
        rows.append(cells)
    return markdown_table(header, rows)
