"""A model of a study run on a slower link: the run's measured compute time and bytes sent, over a link rate.

:func:`modelled_step_seconds` and :func:`modelled_time_to_accuracy` turn a run's measured compute time and bytes
into a model of the same training on a slower link; :func:`format_link_model` and :func:`format_seed_link_model`
tabulate it per run or per case over its seeds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from lightning_sync.apps.markdown import band_cell, format_cell, markdown_table
from lightning_sync.apps.stats import spread, verdict
from lightning_sync.apps.study_run import StudyRun

LINK_RATES: dict[str, float] = {"10mbit": 10e6, "100mbit": 100e6, "1gbit": 1e9}
"""Link rates in bits per second for :func:`modelled_step_seconds`, named as the benchmark's ``network.rate``."""


def modelled_step_seconds(run: StudyRun, bits_per_second: float) -> float | None:
    """A model of one batch's time on a link of ``bits_per_second`` per rank and direction: the run's compute
    seconds per batch plus its bytes sent per batch over the link; no latency, no overlap of compute and
    transfer. ``None`` if the run lacks a figure."""
    compute, sent = run.compute_seconds_per_batch(), run.bytes_sent_per_batch
    if compute is None or sent is None:
        return None
    return compute + 8 * sent / bits_per_second


def modelled_time_to_accuracy(run: StudyRun, target: float, bits_per_second: float) -> float | None:
    """The batches rank 0 needed to reach ``target`` validation accuracy times :func:`modelled_step_seconds`
    (``None``: the target was not reached, or a figure is missing)."""
    batches, step = run.batches_to_accuracy(target), modelled_step_seconds(run, bits_per_second)
    return None if batches is None or step is None else batches * step


def format_link_model(runs: Iterable[StudyRun], target: float, rates: Mapping[str, float] = LINK_RATES) -> str:
    """A Markdown table of the slow-link model, one row per run: compute ms per batch, batches to ``target``
    validation accuracy, and at each rate the modelled ms per batch and seconds to ``target``."""
    header = ["case", "compute ms/batch", f"batches to {target:.0%}"]
    for rate in rates:
        header += [f"modelled ms/batch {rate}", f"modelled s to {target:.0%} {rate}"]
    rows = []
    for run in runs:
        compute = run.compute_seconds_per_batch()
        cells = [
            run.name,
            format_cell(None if compute is None else 1e3 * compute, ".2f"),
            format_cell(run.batches_to_accuracy(target), "d"),
        ]
        for bps in rates.values():
            step = modelled_step_seconds(run, bps)
            cells += [
                format_cell(None if step is None else 1e3 * step, ",.1f"),
                format_cell(modelled_time_to_accuracy(run, target, bps), ",.1f"),
            ]
        rows.append(cells)
    return markdown_table(header, rows)


def modelled_accuracy_curve(run: StudyRun, bits_per_second: float) -> tuple[list[float], list[float]]:
    """``(modelled seconds, validation accuracy)``: rank 0's probes, each at its batch count times
    :func:`modelled_step_seconds` (empty if a figure is missing)."""
    step = modelled_step_seconds(run, bits_per_second)
    if step is None:
        return [], []
    batches, acc = run.accuracy_curve(x="batch")
    return [b * step for b in batches], acc


def modelled_time_to_loss(run: StudyRun, target: float, bits_per_second: float) -> float | None:
    """The batches rank 0 needed to reach validation loss ``target`` times :func:`modelled_step_seconds`
    (``None``: not reached, or a figure is missing)."""
    batches, step = run.batches_to_loss(target), modelled_step_seconds(run, bits_per_second)
    return None if batches is None or step is None else batches * step


def format_seed_link_model(
    groups: Mapping[str, Sequence[StudyRun]],
    target: float,
    rates: Mapping[str, float] = LINK_RATES,
    reference: str | None = None,
) -> str:
    """:func:`format_link_model` over seeds: one row per case of :func:`by_case`, every figure as ``mean [min, max]``
    over its seeds (a seed that never reached ``target`` gives none: ``(k of n)``). With ``reference``, a
    ``vs <reference> <rate>`` column after each rate's modelled seconds says ``tie`` when the ranges overlap, else
    ``better`` (less time) or ``worse``."""

    def seconds(group: Sequence[StudyRun], bps: float) -> list[float | None]:
        return [modelled_time_to_accuracy(r, target, bps) for r in group]

    header = ["case", "compute ms/batch mean [min, max]", f"batches to {target:.0%} mean [min, max]"]
    for rate in rates:
        header += [f"modelled ms/batch {rate} mean [min, max]", f"modelled s to {target:.0%} {rate} mean [min, max]"]
        if reference is not None:
            header.append(f"vs {reference} {rate}")
    rows = []
    for name, group in groups.items():
        compute = [r.compute_seconds_per_batch() for r in group]
        cells = [
            name,
            band_cell([None if c is None else 1e3 * c for c in compute], ".2f"),
            band_cell([r.batches_to_accuracy(target) for r in group], ".1f"),
        ]
        for bps in rates.values():
            steps = [modelled_step_seconds(r, bps) for r in group]
            cells += [
                band_cell([None if s is None else 1e3 * s for s in steps], ",.1f"),
                band_cell(seconds(group, bps), ",.2f"),
            ]
            if reference is not None:
                ref = spread(seconds(groups[reference], bps))
                cells.append(verdict(spread(seconds(group, bps)), ref, higher_is_better=False))
        rows.append(cells)
    return markdown_table(header, rows)
