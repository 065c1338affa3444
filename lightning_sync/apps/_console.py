"""What the jobs print: Lightning's banners and known-harmless warnings silenced, and one progress display per run.

:func:`quiet_lightning` sets Lightning's loggers to WARNING, which drops the informational lines it prints around
every ``fit``/``test`` (accelerator banners, the logger tip, "Initializing distributed", ...), and silences the
warnings it raises for settings these jobs choose on purpose (``warnings`` filters on exact messages), so errors and
other warnings still show. Both are process state, so ranks forked afterwards (``strategy.start_method=fork``)
inherit them. The model summary is off in ``conf/trainer`` (``enable_model_summary: false``).

:class:`ProgressReport` is the progress display of one run, drawn on global rank 0 only: a tqdm bar when its stream
is a terminal, one plain line per epoch otherwise (a CI log stays readable).
"""

from __future__ import annotations

import logging
import math
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any, TextIO

import lightning.pytorch as pl
from tqdm import tqdm
from typing_extensions import override

_QUIET_LOGGERS = ("lightning.pytorch", "lightning.fabric")
"""Lightning's loggers: set to WARNING, they drop the INFO lines printed around every fit/test (accelerator banners,
the logger tip, "Initializing distributed", the ``distributed_backend`` box, the fit's end, lightning_sync's own
``rank_zero_info`` notes); warnings and errors still show."""
# Warnings these jobs cause on purpose (message start, as ``warnings.filterwarnings`` matches it).
_HARMLESS_WARNINGS = (
    # torch's pytree API used by Lightning 2.6 itself
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    # train/loss is logged per rank on purpose: a sync per step would cost time the comparison measures
    r"It is recommended to use `self.log\('[^']*', \.\.\., sync_dist=True\)`",
    # the test split is sharded over the ranks like the training split; torchmetrics syncs the accuracy
    r"Using `DistributedSampler` with the dataloaders. During `trainer.test\(\)`",
    # the run folder already holds config.yaml (and summary.json of a resumed run)
    r"Experiment logs directory .* exists and is not empty",
    r"Checkpoint directory .* exists and is not empty",
    # the digits fit in memory: worker processes would only add start-up time
    r"The '\w+_dataloader' does not have many workers",
    # Lightning 2.6's own all_gather (the divergence check goes through the strategy's)
    r"torch.distributed.nn.functional.all_gather is deprecated",
)


def quiet_lightning() -> None:
    """Silences Lightning's banners and the known-harmless warnings in this process and the ranks it forks.

    Idempotent: calling it again adds no second filter.
    """
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for message in _HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


def _format_seconds(seconds: float | None) -> str:
    """``m:ss`` (or ``h:mm:ss``) for a duration; ``?`` when it is not known yet."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _epoch_text(trainer: pl.Trainer) -> str:
    """``epoch 3/30`` (``epoch 3`` when the run ends on steps, not epochs)."""
    epochs = trainer.max_epochs
    return f"epoch {trainer.current_epoch + 1}" + (f"/{epochs}" if epochs is not None and epochs > 0 else "")


# Metrics shown in the plain per-epoch line, each the first of its alternatives found in callback_metrics.
_SHOWN_METRICS = (("train/loss_epoch", "train/loss"), ("val/loss",), ("val/acc",))
# The fault-tolerance counters of a strategy with ``fault_tolerance`` (``ft/*``), shown in the line and the bar.
_FT_COUNTERS = (("ft/quorum_size", "quorum"), ("ft/commits", "commits"), ("ft/failed_commits", "failed"),
                ("ft/heals", "heals"))  # fmt: skip


def _ft_text(metrics: Mapping[str, Any]) -> str:
    """``"quorum 3 commits 12 failed 1 heals 0"`` from the ``ft/*`` metrics logged so far; ``""`` without them."""
    return " ".join(f"{label} {float(metrics[name]):.0f}" for name, label in _FT_COUNTERS if name in metrics)


class ProgressReport(pl.Callback):
    """The progress of one run on global rank 0: epoch, step, time left; a bar on a terminal, else a line per epoch.

    The time left is this run's (from its own pace so far) plus, for a job of several runs, the runs after it:
    ``later_runs`` times ``run_seconds`` (the mean wall time of the runs already done), or times this run's own
    projected training time while no run has finished.

    Args:
        label: names the run in every line (e.g. ``"[3/10] allreduce"``); empty for none.
        bar: ``True`` draws a tqdm bar, ``False`` writes one plain line per epoch, ``None`` draws a bar when
            ``stream`` is a terminal.
        later_runs: how many runs of the same job follow this one.
        run_seconds: mean wall time of the job's finished runs, if any.
        stream: where to write; ``None`` is ``sys.stderr`` at the time of writing.
    """

    def __init__(
        self,
        label: str = "",
        bar: bool | None = None,
        later_runs: int = 0,
        run_seconds: float | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.label = label
        self.bar = bar
        self.later_runs = later_runs
        self.run_seconds = run_seconds
        self.stream = stream
        self._bar: tqdm | None = None
        self._started = 0.0
        self._batches = 0
        self._total = 0
        self._last_postfix = 0.0

    def _out(self) -> TextIO:
        return self.stream if self.stream is not None else sys.stderr

    def _use_bar(self) -> bool:
        if self.bar is not None:
            return self.bar
        isatty = getattr(self._out(), "isatty", None)
        return bool(isatty and isatty())

    @staticmethod
    def _total_batches(trainer: pl.Trainer) -> int:
        """Training batches the fit will run (``max_epochs`` or ``max_steps``, whichever ends it first)."""
        per_epoch = trainer.num_training_batches
        if not math.isfinite(per_epoch):
            return 0
        total = math.inf
        if trainer.max_epochs is not None and trainer.max_epochs >= 0:
            total = trainer.max_epochs * per_epoch
        if trainer.max_steps is not None and trainer.max_steps > 0:
            total = min(total, trainer.max_steps * trainer.accumulate_grad_batches)
        done = trainer.current_epoch * per_epoch  # a resumed run starts part-way
        return int(max(total - done, 0)) if math.isfinite(total) else 0

    def _eta(self) -> tuple[float | None, float | None]:
        """Seconds left in this run and in the whole job (``None`` until a batch has been timed)."""
        if not self._batches or not self._total:
            return None, None
        elapsed = time.perf_counter() - self._started
        run_left = elapsed / self._batches * max(self._total - self._batches, 0)
        per_run = self.run_seconds if self.run_seconds is not None else elapsed + run_left
        return run_left, run_left + self.later_runs * per_run

    def _eta_text(self) -> str:
        run_left, job_left = self._eta()
        text = f"eta {_format_seconds(run_left)}"
        if self.later_runs:
            text += f", all runs {_format_seconds(job_left)}"
        return text

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        self._started = time.perf_counter()
        self._batches = 0
        self._total = self._total_batches(trainer)
        if self._use_bar():
            self._bar = tqdm(
                total=self._total or None,
                desc=self.label or "train",
                unit="step",
                leave=False,
                file=self._out(),
                dynamic_ncols=True,
            )

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero:
            return
        self._batches += 1
        if self._bar is None:
            return
        self._bar.update(1)
        now = time.perf_counter()
        if now - self._last_postfix >= 1.0:  # formatting the postfix every step would cost step time
            self._last_postfix = now
            ft = _ft_text(trainer.callback_metrics)
            self._bar.set_postfix_str(
                f"{_epoch_text(trainer)} {ft + ' ' if ft else ''}{self._eta_text()}", refresh=False
            )

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero or self._bar is not None:
            return
        parts = [self.label] if self.label else []
        parts.append(f"{_epoch_text(trainer)} step {trainer.global_step}")
        metrics = trainer.callback_metrics
        for names in _SHOWN_METRICS:
            name = next((n for n in names if n in metrics), None)
            if name is not None:
                parts.append(f"{name.removesuffix('_epoch')} {float(metrics[name]):.4g}")
        ft = _ft_text(metrics)
        if ft:
            parts.append(ft)
        parts.append(self._eta_text())
        print(" | ".join(parts), file=self._out(), flush=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
