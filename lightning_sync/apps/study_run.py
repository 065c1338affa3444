"""One finished study run read back: :class:`StudyRun`, its summary, rank 0's timeline and its per-step metrics.

The time axis of a run (:meth:`StudyRun.loss_curve`, :meth:`StudyRun.accuracy_curve` with ``x="time"``) is rank
0's training clock: seconds since its first batch, with the probes' own cost taken out.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sync.apps.timeline import TIMELINE_DIR, read_timelines


@dataclass
class StudyRun:
    """One finished case: its summary, rank 0's timeline and its per-step metrics.

    Attributes:
        name: the case's name.
        run_dir: the run folder.
        summary: ``summary.json`` (step time, bytes and comm seconds per step, test metrics, ``diverged``).
        timeline: rank 0's timeline (:class:`Timeline`).
        wall_s: the whole case's wall time in this process (start-up and test included).
    """

    name: str
    run_dir: Path
    summary: dict[str, Any]
    timeline: dict[str, Any]
    wall_s: float = math.nan
    _metrics: list[dict[str, str]] | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if not self.timeline.get("rows"):
            raise ValueError(f"{self.run_dir}: rank 0 recorded no batch; did the fit run?")

    @classmethod
    def load(
        cls, name: str, run_dir: str | Path, summary: dict[str, Any] | None = None, wall_s: float = math.nan
    ) -> StudyRun:
        """Reads a run folder written by :func:`run_cases` (``summary``: ``summary.json`` if not given).

        Raises:
            ValueError: the folder has no timeline of rank 0.
        """
        run_dir = Path(run_dir)
        timelines = read_timelines(run_dir / TIMELINE_DIR)
        if not timelines or timelines[0].get("rank") != 0:
            raise ValueError(f"{run_dir}: no timeline of rank 0 in {TIMELINE_DIR}/")
        if summary is None:
            file = run_dir / "summary.json"
            summary = json.loads(file.read_text()) if file.is_file() else {}
        return cls(name, run_dir, summary, timelines[0], wall_s)

    # -------------------------------------------------------------------------------------------- summary
    @property
    def diverged(self) -> bool:
        """Whether the divergence guard stopped the run (it was then not tested)."""
        return bool(self.summary.get("diverged"))

    @property
    def test_accuracy(self) -> float | None:
        """``test/acc`` of the final model (``None`` if the run was not tested)."""
        return self.summary.get("test", {}).get("test/acc")

    @property
    def test_loss(self) -> float | None:
        """``test/loss`` of the final model (``None`` if the run was not tested)."""
        return self.summary.get("test", {}).get("test/loss")

    @property
    def step_time_ms(self) -> float | None:
        """Median wall time of rank 0's training batches (:class:`~lightning_sync.callbacks.SyncReport`)."""
        return self.summary.get("step_time_ms")

    @property
    def bytes_sent_per_step(self) -> float | None:
        """Bytes each rank sent per optimizer step in training (``None`` without a lightning_sync meter)."""
        return self.summary.get("bytes_sent_per_step")

    @property
    def comm_seconds_per_step(self) -> float | None:
        """Seconds collectives were in flight per optimizer step, rank 0 (overlapped ones in full)."""
        return self.summary.get("comm_seconds_per_step")

    def _per_batch(self, per_step: float | None) -> float | None:
        """A per-optimizer-step figure spread over the training batches (they differ under accumulation)."""
        steps, batches = self.summary.get("optimizer_steps"), self.summary.get("batches")
        if per_step is None or not steps or not batches:
            return None
        return per_step * steps / batches

    @property
    def bytes_sent_per_batch(self) -> float | None:
        """Bytes each rank sent per training batch: comparable across periods and accumulation."""
        return self._per_batch(self.bytes_sent_per_step)

    def compute_seconds_per_batch(self, warmup: int = 3) -> float | None:
        """The median over rank 0's batches of the batch's wall time minus its seconds in collectives: what a batch
        costs apart from communication, compression and the rest of the sync's own work included.

        Args:
            warmup: first batches left out.

        Returns:
            Seconds, or ``None`` if the strategy has no meter.
        """
        rows = self.timeline["rows"]
        rows = rows[warmup:] or rows
        if any(r.get("comm_s") is None for r in rows):
            return None
        return statistics.median(r["seconds"] - r["comm_s"] for r in rows)

    @property
    def comm_share(self) -> float | None:
        """Share of rank 0's training time its collectives were in flight."""
        steps = self.summary.get("optimizer_steps")
        if self.comm_seconds_per_step is None or not steps:
            return None
        return self.comm_seconds_per_step * steps / self.training_s

    # -------------------------------------------------------------------------------------------- timeline
    @property
    def batches(self) -> int:
        """Training batches rank 0 ran."""
        return len(self.timeline["rows"])

    def _clock(self, t: float) -> float:
        """Rank 0's training clock at monotonic time ``t``: since its first batch, minus the probes before."""
        probes = sum(p["cost_s"] for p in self.timeline["probes"] if p["t"] < t)
        return t - self.timeline["first_batch"] - probes

    @property
    def training_s(self) -> float:
        """Rank 0's training time, first batch to last, without the probes' cost."""
        return self._clock(self.timeline["rows"][-1]["t"])

    def _x(self, items: Sequence[dict[str, Any]], x: str) -> list[float]:
        if x in ("batch", "step"):
            return [float(item[x]) for item in items]
        if x == "time":
            return [self._clock(item["t"]) for item in items]
        raise ValueError(f"x={x!r} is not allowed; choose one of: batch, step, time")

    def loss_curve(self, x: str = "batch", smooth: int = 10) -> tuple[list[float], list[float]]:
        """``(x, training loss of rank 0)``, a running mean over ``smooth`` batches.

        Args:
            x: ``batch`` (training batches so far), ``step`` (optimizer steps so far) or ``time`` (rank 0's
                training clock, seconds).
            smooth: batches in the running mean (1: raw).
        """
        rows = [r for r in self.timeline["rows"] if r["loss"] is not None]
        losses = [r["loss"] for r in rows]
        means = [statistics.fmean(losses[max(0, i + 1 - smooth) : i + 1]) for i in range(len(losses))]
        return self._x(rows, x), means

    def accuracy_curve(self, x: str = "batch") -> tuple[list[float], list[float]]:
        """``(x, validation accuracy)`` of rank 0's probes (see :meth:`loss_curve` for ``x``)."""
        probes = self.timeline["probes"]
        return self._x(probes, x), [p["acc"] for p in probes]

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """``(x, value)`` of rank 0's batches whose timeline row has ``key`` set, e.g. ``divergence`` (only the
        steps that synced) or ``period`` (see :meth:`loss_curve` for ``x``)."""
        rows = [r for r in self.timeline["rows"] if r.get(key) is not None]
        return self._x(rows, x), [float(r[key]) for r in rows]

    @property
    def syncs(self) -> int:
        """Syncs rank 0 saw in training (``periodic`` modes; the final sync after training is not among them)."""
        return len(self.series("divergence")[1])

    @property
    def mean_divergence(self) -> float | None:
        """Mean of rank 0's ``divergence`` over its syncs (``None``: no sync)."""
        values = self.series("divergence")[1]
        return statistics.fmean(values) if values else None

    def probe_loss_curve(self, x: str = "batch") -> tuple[list[float], list[float]]:
        """``(x, validation loss)`` of rank 0's probes (see :meth:`loss_curve` for ``x``; ``x="tokens"``: the
        elements every rank has trained on together, e.g. characters for a language model)."""
        probes = self.timeline["probes"]
        if x == "tokens":
            return [p["batch"] * self.tokens_per_batch for p in probes], [p["loss"] for p in probes]
        return self._x(probes, x), [p["loss"] for p in probes]

    @property
    def tokens_per_batch(self) -> int:
        """Elements of one training batch over all ranks (a language model's characters: ranks x windows x
        length); rank 0's first batch times the ranks."""
        elements = self.timeline.get("batch_elements") or self.timeline.get("batch_size") or 0
        return int(elements) * int(self.timeline.get("workers", 1))

    def batches_to_loss(self, target: float) -> int | None:
        """Training batches before rank 0's first probe with validation loss at or below ``target`` (``None``:
        never reached)."""
        return next((p["batch"] for p in self.timeline["probes"] if p["loss"] <= target), None)

    def batches_to_accuracy(self, target: float) -> int | None:
        """Training batches before rank 0's first probe at or above ``target`` (``None``: never reached)."""
        return next((p["batch"] for p in self.timeline["probes"] if p["acc"] >= target), None)

    # -------------------------------------------------------------------------------------------- metrics.csv
    def metric(self, name: str) -> tuple[list[int], list[float]]:
        """``(optimizer step, value)`` of every row of ``metrics.csv`` that has ``name`` (e.g. ``comm/bytes_sent``);
        rank 0's values, as the CSV logger writes only there. A key logged only on some steps (``sync/*``) is
        written again with its last value at the epoch's later steps: read those from :meth:`series`."""
        if self._metrics is None:
            file = self.run_dir / "metrics.csv"
            with open(file, newline="") as f:
                self._metrics = list(csv.DictReader(f))
        rows = [r for r in self._metrics if r.get(name)]
        return [int(r["step"]) for r in rows], [float(r[name]) for r in rows]
