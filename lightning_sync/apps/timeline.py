"""Recording a fit, batch by batch: the :class:`Timeline` callback in every rank, and reading its records back.

A timeline notes the time, training loss and seconds in collectives of every batch (and a ``periodic`` strategy's
divergence and period), and rank 0 probes the validation accuracy of the parameters it holds every few batches,
without any collective. :func:`run_with_timeline` trains one case (:func:`lightning_sync.apps.runner.run_case`) with a
timeline in every rank; :func:`read_timelines` reads the ``rank<r>.json`` records back. Used by
:mod:`lightning_sync.apps.study` and :mod:`lightning_sync.apps.ps_study`.
"""

from __future__ import annotations

import io
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_sync.apps._console import ProgressReport, quiet_lightning
from lightning_sync.apps.runner import run_case

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_sync.strategies.periodic import PeriodicSyncStrategy

TIMELINE_DIR = "timeline"
"""The folder, inside a run folder, of the ranks' timelines (``rank<r>.json``)."""


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
            "workers": strategy.num_processes
            * strategy.num_nodes,  # world_size reads 1 where each worker is a world of its own
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
