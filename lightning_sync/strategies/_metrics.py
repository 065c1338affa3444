"""The callback that logs a lightning_sync strategy's per-step metrics; every strategy adds it at setup."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override


class SyncMetricsLogger(pl.Callback):
    """Logs a lightning_sync strategy's metrics (``comm/*``, ``sync/*``) after each training batch.

    Logs ``trainer.strategy.step_metrics(write)`` with ``LightningModule.log_dict`` (on step, not synced across ranks);
    ``write``: whether the logger writes this step (``global_step`` a multiple of ``log_every_n_steps``, or the end).
    """

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step_metrics = getattr(trainer.strategy, "step_metrics", None)
        if step_metrics is None:
            return
        every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set by Lightning's logger connector
        metrics = step_metrics((every > 0 and trainer.global_step % every == 0) or trainer.should_stop)
        if metrics:
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """First among the callbacks' ``on_train_end``: a strategy whose ranks ran apart (``ps`` async/ssp) ends
        that run and has the ranks meet again, so the other callbacks' ``on_train_end`` may use collectives."""
        end_detached_run = getattr(trainer.strategy, "end_detached_run", None)
        if end_detached_run is not None:
            end_detached_run()
