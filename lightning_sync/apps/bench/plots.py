"""The benchmark's plots: one PNG per workload, with a panel per network rate of the cases' medians and repeats, and
for a timed workload a second row with each case's first successful run: test accuracy or validation loss over
training seconds.

matplotlib is imported only here, when the plots are drawn (it is in the ``test`` extra); without it they are
skipped with a note.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_sync.apps.bench.config import RATE_MBIT
from lightning_sync.apps.bench.workloads import WORKLOADS

_AXIS_LABEL = {
    "step_time_ms": "ms per step",
    "window_step_ms": "ms per step (a window of whole sync periods)",
    "seconds_to_target": "seconds to target",
    "seconds_at_budget": "seconds",
    "busbw_mbit": "bus bandwidth, Mbit/s",
}


def write_plots(rows: list[dict[str, Any]], records: list[dict[str, Any]], out: Path, target: float) -> list[Path]:
    """Draws ``<workload>.png`` into ``out`` for each workload of the summary ``rows``.

    Args:
        rows: the report's summary rows (:func:`~lightning_sync.apps.bench.report.summarize`).
        records: the runs' records, whose ``trajectory`` the curves show.
        out: the folder to write into.
        target: the test accuracy a time-to-accuracy run aims at (a time-to-loss run's target is in its rows).

    Returns:
        The files written (none without matplotlib).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed (pip install 'lightning-sync[test]'): no plots")
        return []
    written = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        group = [r for r in rows if r["workload"] == workload]
        rates = list(dict.fromkeys(r["rate"] for r in group))
        curves = WORKLOADS[workload].metric in ("time_to_accuracy", "time_to_loss")
        fig, axes = plt.subplots(1 + curves, len(rates), figsize=(5.5 * len(rates), 4 * (1 + curves)), squeeze=False)
        for col, rate in enumerate(rates):
            subset = [r for r in group if r["rate"] == rate]
            _draw_medians(axes[0][col], subset, workload, rate)
            if curves:
                _draw_curves(axes[1][col], subset, records, workload, rate, target)
        fig.tight_layout()
        path = out / f"{workload}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(path)
    return written


def _draw_medians(ax: Any, subset: list[dict[str, Any]], workload: str, rate: str) -> None:
    """One bar per case (its median) with a dot per repeat; the link rate as a line under bus bandwidth."""
    ax.barh([r["case"] for r in subset], [r["median"] or 0.0 for r in subset], color="tab:blue", alpha=0.6)
    for y, r in enumerate(subset):
        dots = [v for v in r["repeats"] if v is not None]
        ax.plot(dots, [y] * len(dots), "k.", markersize=4)
    ax.invert_yaxis()
    ax.set_title(f"{workload}, {rate}")
    ax.set_xlabel(_AXIS_LABEL[subset[0]["metric"]])
    if rate in RATE_MBIT and subset[0]["metric"] == "busbw_mbit":
        ax.axvline(RATE_MBIT[rate], color="tab:red", linestyle="--", label="link rate")
        ax.legend()


def _draw_curves(
    ax: Any, subset: list[dict[str, Any]], records: list[dict[str, Any]], workload: str, rate: str, target: float
) -> None:
    """Each case's first successful run: test accuracy (or validation loss) over training seconds, and the target."""
    loss = WORKLOADS[workload].metric == "time_to_loss"
    for name in (r["case"] for r in subset):
        run = next(
            (
                r
                for r in records
                if (r["workload"], r["rate"], r["case"]) == (workload, rate, name) and r["ok"] and r.get("trajectory")
            ),
            None,
        )
        if run is not None:
            seconds, _, accuracy = zip(*run["trajectory"])
            ax.plot(seconds, accuracy, label=name)
    goal = next((r.get("target_loss") for r in subset if r.get("target_loss")), None) if loss else target
    if goal is not None:
        ax.axhline(goal, color="gray", linestyle=":", label=f"target {goal:.4g}")
    ax.set_xlabel("training seconds (first repeat)")
    ax.set_ylabel("validation loss, nats/char" if loss else "test accuracy")
    if not loss:
        ax.set_ylim(0.5, 1.0)
    ax.legend(fontsize=7)
