"""Experiments through Lightning: run cases of the Hydra config and read back what each run saw, batch by batch.

Shared by the notebooks (``notebooks/01_overview``, ``02_periodic``, ``04_compression``) and, through
:class:`Timeline`, :func:`run_with_timeline` and the table helpers, by :mod:`lightning_sync.apps.ps_study`. One case is
one Hydra config (overrides on ``conf/config.yaml``) trained in this process with forked ranks
(:func:`lightning_sync.apps.runner.run_case`), with a :class:`Timeline` callback in every rank. A timeline notes the
time, training loss and seconds in collectives of every batch (and a ``periodic`` strategy's divergence and
period), and rank 0 probes the validation accuracy of the parameters it holds every few batches, without any
collective. :func:`run_cases` runs several cases and reads each back into a :class:`StudyRun`: its
``summary.json`` (test accuracy, step time, bytes and comm seconds per step), rank 0's timeline and its
``metrics.csv`` (``comm/*`` per optimizer step).

The time axis of a run (:meth:`StudyRun.loss_curve`, :meth:`StudyRun.accuracy_curve` with ``x="time"``) is rank
0's training clock: seconds since its first batch, with the probes' own cost taken out.

:func:`modelled_step_seconds` and :func:`modelled_time_to_accuracy` turn a run's measured compute time and bytes
into a model of the same training on a slower link; :func:`load_time_to_accuracy` reads the measured numbers that
``python -m lightning_sync.bench`` writes (emulated links need root), if any.

    from lightning_sync.apps.study import run_cases, format_runs
    runs = run_cases({"ddp": ["strategy=ddp"], "allreduce": ["strategy=allreduce"]}, "outputs/study",
                     common=["trainer.max_epochs=5"])
    print(format_runs(runs.values()))
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_sync.apps._console import ProgressReport, quiet_lightning
from lightning_sync.apps.markdown import band_cell, format_cell, markdown_table
from lightning_sync.apps.provenance import provenance
from lightning_sync.apps.runner import STUDY_OVERRIDES, case_dir_name, run_case
from lightning_sync.apps.stats import spread, verdict

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_sync.strategies.periodic import PeriodicSyncStrategy

TIMELINE_DIR = "timeline"
"""The folder, inside a run folder, of the ranks' timelines (``rank<r>.json``)."""
LINK_RATES: dict[str, float] = {"10mbit": 10e6, "100mbit": 100e6, "1gbit": 1e9}
"""Link rates in bits per second for :func:`modelled_step_seconds`, named as the benchmark's ``network.rate``."""


# ---------------------------------------------------------------------------------------------------- recording
class Timeline(pl.Callback):
    """In every rank of a fit: notes each training batch; writes ``rank<r>.json`` when training ends.

    A row per training batch: ``t`` (``time.monotonic`` after the batch), ``batch`` (rows so far, this one
    included), ``seconds`` (the batch's wall time, its start hook to its end hook), ``comm_s`` (the seconds of
    collectives the strategy's meter counted in it; ``None`` without a meter), ``step`` (``trainer.global_step``
    after it), ``loss`` (the batch's training loss, ``None`` if ``training_step`` returned none) and, under a
    strategy that has them (``periodic``), ``divergence`` (its ``last_divergence``: this rank's distance from the
    average at a sync in this step, else ``None``) and ``period`` (its current period). Lightning's CSV logger cannot
    give these per batch: it writes an ``on_step`` key's last value again at every later step of the epoch.

    Rank 0 also probes the model on the datamodule's validation split every ``probe_every_s`` seconds and/or after
    the first batch and every ``probe_every_batches`` batches: accuracy and cross-entropy of a classifier's logits,
    with the parameters that rank holds (in ``local_sgd``/``diloco`` its own replica between syncs), without any
    collective, so no other rank waits for it; each probe notes its own cost (``cost_s``, about a millisecond on
    the digits).

    Subclasses add fields through :meth:`_row` (returning ``None`` skips the batch, and its probe) and
    :meth:`_probe_fields`.

    Args:
        out_dir: where to write ``rank<r>.json`` (created if missing).
        probe_every_s: seconds between rank 0's probes; ``None``: not on time.
        probe_every_batches: batches between rank 0's probes; ``None``: not on batches.
    """

    def __init__(
        self, out_dir: str | Path, probe_every_s: float | None = None, probe_every_batches: int | None = None
    ) -> None:
        if probe_every_batches is not None and probe_every_batches < 1:
            raise ValueError(f"probe_every_batches={probe_every_batches} is not allowed; it must be >= 1 (or None)")
        self.out_dir = Path(out_dir)
        self.probe_every_s = probe_every_s
        self.probe_every_batches = probe_every_batches
        self._rows: list[dict[str, Any]] = []
        self._probes: list[dict[str, Any]] = []
        self._meta: dict[str, Any] = {}
        self._first_batch: float | None = None
        # (time.monotonic, the meter's comm seconds or None without a meter) at the current batch's start
        self._batch_start: tuple[float, float | None] = (0.0, 0.0)
        self._last_probe = -math.inf
        self._probe_data: tuple[torch.Tensor, torch.Tensor] | None = None

    def _meta_fields(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The record's header: rank, ranks, the strategy's mode, trained parameter bytes, fit start."""
        strategy = cast("DDPStrategy", trainer.strategy)  # every strategy a study runs is a DDPStrategy
        params = [p for p in pl_module.parameters() if p.requires_grad]
        return {
            "rank": trainer.global_rank,
            "workers": strategy.num_processes * strategy.num_nodes,  # world_size reads 1 once async workers detach
            "mode": getattr(getattr(strategy, "config", None), "mode", None),
            "model_bytes": sum(p.numel() * p.element_size() for p in params),
            "fit_start": time.monotonic(),
        }

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._meta = self._meta_fields(trainer, pl_module)
        self._rows, self._probes, self._first_batch, self._last_probe = [], [], None, -math.inf

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        if self._first_batch is None:
            self._first_batch = now
            self._meta.update(
                batch_size=_batch_size(batch),
                batch_elements=_batch_elements(batch),
                cpu_at_first_batch=time.process_time(),
            )
        self._batch_start = (now, _comm_seconds(trainer))

    def _row(self, trainer: pl.Trainer, outputs: Any) -> dict[str, Any] | None:
        """This batch's fields besides ``t`` and ``batch`` (``None``: no row and no probe for this batch)."""
        strategy = trainer.strategy
        row = {"step": trainer.global_step, "loss": batch_loss(outputs)}
        if hasattr(strategy, "last_divergence"):  # a PeriodicSyncStrategy
            periodic = cast("PeriodicSyncStrategy", strategy)
            row.update(divergence=periodic.last_divergence, period=periodic.period)
        return row

    def _probe_fields(self, trainer: pl.Trainer) -> dict[str, Any]:
        """More fields for a probe taken now."""
        return {}

    def _probe_due(self, now: float) -> bool:
        on_time = self.probe_every_s is not None and now - self._last_probe >= self.probe_every_s
        every = self.probe_every_batches
        on_batches = every is not None and (len(self._rows) % every == 0 or len(self._rows) == 1)
        return on_time or on_batches

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.monotonic()
        row = self._row(trainer, outputs)
        if row is None:
            return
        comm = _comm_seconds(trainer)
        started, comm_at_start = self._batch_start
        self._rows.append(
            {
                "t": now,
                "batch": len(self._rows) + 1,
                "seconds": now - started,
                "comm_s": None if comm is None or comm_at_start is None else comm - comm_at_start,
                **row,
            }
        )
        if trainer.global_rank == 0 and self._probe_due(now):
            self._last_probe = now
            self._probe(trainer, pl_module, now)

    def _probe(self, trainer: pl.Trainer, pl_module: pl.LightningModule, now: float) -> None:
        """Rank 0's validation accuracy and loss with the parameters it holds now."""
        started = time.monotonic()
        if self._probe_data is None:
            # Lightning's DataConnector sets Trainer.datamodule, which the Trainer class does not declare
            batches = list(trainer.datamodule.val_dataloader())  # type: ignore[attr-defined]
            self._probe_data = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        x, y = self._probe_data
        was_training = pl_module.training
        pl_module.eval()
        with torch.no_grad():
            logits = pl_module(x)
        pl_module.train(was_training)
        # a classifier's (N, classes) or a language model's (N, T, vocab) against (N,) or (N, T) targets
        logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
        self._probes.append({
            "t": now,
            "batch": len(self._rows),
            "step": trainer.global_step,
            "acc": float((logits.argmax(-1) == y).float().mean()),
            "loss": float(torch.nn.functional.cross_entropy(logits, y)),
            **self._probe_fields(trainer),
            "cost_s": time.monotonic() - started,
        })  # fmt: skip

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {
            **self._meta,
            "first_batch": self._first_batch,
            "cpu_at_end": time.process_time(),
            "rows": self._rows,
            "probes": self._probes,
        }
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def batch_loss(outputs: Any) -> float | None:
    """The training loss in ``training_step``'s output (a tensor, or a dict's ``loss``), as a float."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _comm_seconds(trainer: pl.Trainer) -> float | None:
    """The strategy meter's total seconds of collectives so far (``None``: the strategy has no meter)."""
    meter = getattr(trainer.strategy, "meter", None)
    return None if meter is None else meter.total.seconds


def _batch_size(batch: Any) -> int | None:
    """Samples in a batch: the first dimension of its first tensor (``None`` if it has none)."""
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.ndim > 0 else None


def _batch_elements(batch: Any) -> int | None:
    """Elements of a batch's first tensor: samples, or a language model's tokens (windows x length)."""
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    return int(first.numel()) if isinstance(first, torch.Tensor) else None


def read_timelines(folder: str | Path) -> list[dict[str, Any]]:
    """The ``rank<r>.json`` records in ``folder``, by rank (empty if there are none)."""
    files = sorted(Path(folder).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(f.read_text()) for f in files]


def run_with_timeline(
    name: str,
    overrides: Sequence[str],
    run_dir: str | Path,
    timeline: Timeline,
    callbacks: Sequence[pl.Callback] = (),
    quiet: bool = True,
) -> tuple[dict[str, Any], float]:
    """Trains one case with ``timeline`` (and ``callbacks``) in every rank; Lightning's banners silenced.

    Timelines left in ``timeline.out_dir`` by an earlier run are removed first.

    Args:
        name: the case's name (labels its progress lines).
        overrides: Hydra overrides on ``conf/config.yaml``.
        run_dir: the run folder.
        timeline: the recording callback; its ``out_dir`` is usually inside ``run_dir``.
        callbacks: more Trainer callbacks, after the timeline.
        quiet: no per-epoch progress lines (otherwise: the run's progress on stderr).

    Returns:
        ``(summary, wall seconds of the whole case)``: the summary as :func:`lightning_sync.apps.train.run` returns it.
    """
    quiet_lightning()
    for old in timeline.out_dir.glob("rank*.json"):
        old.unlink()
    progress = ProgressReport(label=name, bar=False, stream=io.StringIO() if quiet else None)
    started = time.perf_counter()
    summary = run_case(list(overrides), Path(run_dir), callbacks=[timeline, *callbacks, progress])
    return summary, time.perf_counter() - started


# ---------------------------------------------------------------------------------------------------- one run
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


def run_study(
    name: str, overrides: Sequence[str], run_dir: str | Path, probe_every_batches: int | None = 5, quiet: bool = True
) -> StudyRun:
    """Runs one case with a :class:`Timeline` (rank 0 probing every ``probe_every_batches`` batches) and reads it
    back. A diverged run is returned as well (:attr:`StudyRun.diverged`; no test accuracy)."""
    run_dir = Path(run_dir)
    timeline = Timeline(run_dir / TIMELINE_DIR, probe_every_batches=probe_every_batches)
    summary, wall = run_with_timeline(name, overrides, run_dir, timeline, quiet=quiet)
    return StudyRun.load(name, run_dir, summary, wall)


def run_cases(
    cases: Mapping[str, Sequence[str]],
    out: str | Path,
    common: Sequence[str] = (),
    probe_every_batches: int | None = 5,
    quiet: bool = True,
) -> dict[str, StudyRun]:
    """Runs every case one after the other, each in ``<out>/<case folder>``; returns them by name.

    Each case's overrides are :data:`STUDY_OVERRIDES`, then the case's own, then ``common``. ``<out>/provenance.json``
    records the commit, command, versions and CPU (:func:`lightning_sync.apps.provenance.provenance`). A case's folder is its
    name with ``/``, ``:``, ``%``, spaces and other punctuation replaced (``auto, target 2%`` -> ``auto_target_2pct``).

    Args:
        cases: ``{name: Hydra overrides}`` (e.g. :func:`lightning_sync.apps.cases.hydra_cases`).
        out: the parent folder of the run folders.
        common: overrides for every case, applied last (epochs, batch limits, seed).
        probe_every_batches: rank 0's validation probes (see :class:`Timeline`).
        quiet: no per-epoch progress lines.
    """
    Path(out).mkdir(parents=True, exist_ok=True)  # where these runs came from, beside them
    Path(out, "provenance.json").write_text(json.dumps(provenance(), indent=1) + "\n")
    return {
        name: run_study(
            name,
            [*STUDY_OVERRIDES, *overrides, *common],
            Path(out, re.sub(r"[^\w.+-]+", "_", case_dir_name(name))),
            probe_every_batches,
            quiet,
        )
        for name, overrides in cases.items()
    }


# ---------------------------------------------------------------------------------------------------- tables
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


# ---------------------------------------------------------------------------------------------------- slow links
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


def load_time_to_accuracy(path: str | Path) -> list[dict[str, Any]]:
    """Measured time-to-accuracy records (``python -m lightning_sync.bench`` writes them to
    ``<out>/time_to_accuracy.json``), or ``[]`` if the file is absent.

    Each record: ``case`` (str), ``rate`` (str, e.g. ``10mbit``), ``seconds_to_target`` (float, or ``None`` when
    the target was not reached) and ``target`` (the accuracy aimed at).

    Args:
        path: the JSON file (a list of records).

    Raises:
        ValueError: the file is not a list of such records (names the record and the field).
    """
    file = Path(path)
    if not file.is_file():
        return []
    records = json.loads(file.read_text())
    if not isinstance(records, list):
        raise ValueError(f"{file}: expected a list of records, got {type(records).__name__}")
    expected = "expected {case: str, rate: str, seconds_to_target: number or null, target: number}"
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"{file}: record {i} is {record!r}; {expected}")
        checks = {"case": (str,), "rate": (str,), "seconds_to_target": (int, float, type(None)), "target": (int, float)}
        for name, types in checks.items():
            value = record.get(name)
            if name not in record or not isinstance(value, types) or isinstance(value, bool):
                raise ValueError(f"{file}: record {i} has {name}={value!r}; {expected}")
    return records


# ---------------------------------------------------------------------------------------------------- seeds
def seed_cases(cases: Mapping[str, Sequence[str]], seeds: Iterable[int]) -> dict[str, list[str]]:
    """``{"<case> s<seed>": overrides + seed=<seed>}``: every case once per seed, seed by seed (so a drift of the
    machine's load spreads over all cases alike). Read them back by case with :func:`by_case`."""
    return {f"{name} s{seed}": [*overrides, f"seed={seed}"] for seed in seeds for name, overrides in cases.items()}


def by_case(runs: Mapping[str, StudyRun]) -> dict[str, list[StudyRun]]:
    """The runs of :func:`seed_cases` grouped by case (the name before `` s<seed>``), in first-seen order."""
    grouped: dict[str, list[StudyRun]] = {}
    for name, run in runs.items():
        grouped.setdefault(name.rsplit(" s", 1)[0], []).append(run)
    return grouped


def modelled_time_to_loss(run: StudyRun, target: float, bits_per_second: float) -> float | None:
    """The batches rank 0 needed to reach validation loss ``target`` times :func:`modelled_step_seconds`
    (``None``: not reached, or a figure is missing)."""
    batches, step = run.batches_to_loss(target), modelled_step_seconds(run, bits_per_second)
    return None if batches is None or step is None else batches * step


def load_bench_rows(workload: str, root: str | Path) -> list[dict[str, Any]]:
    """The summary rows of ``workload`` in every benchmark ``results.json`` under ``root`` (the folders ``python -m
    lightning_sync.bench`` writes), or ``[]`` if there are none.

    Each row is the benchmark's (``case``, ``rate``, ``median``, ``spread``, ``target_loss``,
    ``median_bytes_sent_per_step``, ``median_wire_bytes_per_step``, ``median_wire_over_meter``, ...) plus ``file``:
    the results file it came from.
    """
    folder = Path(root)
    rows = []
    for file in sorted(folder.rglob("results.json")) if folder.is_dir() else []:
        data = json.loads(file.read_text())
        if isinstance(data, dict) and {"config", "summary"} <= data.keys():
            rows += [{**r, "file": str(file)} for r in data["summary"] if r.get("workload") == workload]
    return rows


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
