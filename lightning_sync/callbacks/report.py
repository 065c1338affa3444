"""The run summary: step time and communication per optimizer step, as a JSON file on rank 0 that other callbacks
add their keys to (:func:`merge_summary`) and :func:`read_summary` reads back."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override


def merge_summary(path: str | None, part: dict[str, Any]) -> None:
    """Merges ``part`` into the JSON file at ``path`` (nothing if ``None``): with fork/spawn, fit and test run in
    different processes, and several callbacks write their own keys."""
    if path is not None:
        Path(path).write_text(json.dumps({**read_summary(path), **part}, indent=2, sort_keys=True))


def read_summary(path: str) -> dict[str, Any]:
    """The summary JSON at ``path`` (``{}`` if there is none yet)."""
    file = Path(path)
    return json.loads(file.read_text()) if file.is_file() else {}


class BatchTimer(pl.Callback):
    """Times each training batch, from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward, sync
    and optimizer step; data loading excluded), hands the seconds to :meth:`_timed`, and sleeps for what it returns.

    Args:
        clock: returns the current time in seconds (a test passes a fake one).
        sleep: sleeps for the given seconds (a test passes one that advances its fake clock).
    """

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        self._clock, self._sleep = clock, sleep
        self._started = 0.0
        self.slept_s = 0.0

    def _timed(self, seconds: float) -> float:
        """What the callback does with a batch's time; returns the seconds to sleep after the batch."""
        return 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self._started = self._clock()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        pause = self._timed(self._clock() - self._started)
        if pause > 0:
            self._sleep(pause)
            self.slept_s += pause


class SyncReport(BatchTimer):
    """Times every training batch and sums the strategy's communication; writes a JSON summary on rank 0.

    The step time of a batch is rank 0's :class:`BatchTimer` time. The first ``warmup_steps`` batches are left out of
    the median. Bytes per step divide what the meter counted during training (setup traffic
    excluded) by the optimizer steps taken; strategies without a lightning_sync meter (e.g. Lightning's own
    ``"ddp"``) report none.

    Args:
        path: where to write the summary JSON after fit/test (``None``: don't write); an existing file is updated.
        warmup_steps: batches left out of the step-time median.
    """

    def __init__(self, path: str | None = None, warmup_steps: int = 3) -> None:
        super().__init__()
        self.path = path
        self.warmup_steps = warmup_steps
        self.step_seconds: list[float] = []
        self.summary: dict[str, Any] = {}

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A new fit starts a new summary: a file left by an earlier run in the same folder is removed."""
        if self.path is not None and trainer.is_global_zero:
            Path(self.path).unlink(missing_ok=True)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Notes where a resumed fit resumed (``resumed_from``, ``resumed_at_step``; said on rank 0's stderr)."""
        if trainer.ckpt_path:
            self.summary.update(resumed_from=str(trainer.ckpt_path), resumed_at_step=trainer.global_step)
            if trainer.is_global_zero:
                print(
                    f"resumed from {trainer.ckpt_path} at step {trainer.global_step} (epoch {trainer.current_epoch})",
                    file=sys.stderr,
                    flush=True,
                )

    @override
    def _timed(self, seconds: float) -> float:
        self.step_seconds.append(seconds)
        return 0.0

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        timed = self.step_seconds[self.warmup_steps :] or self.step_seconds
        steps = max(trainer.global_step, 1)
        self.summary.update(
            strategy=type(trainer.strategy).__name__,
            world_size=trainer.world_size,
            optimizer_steps=trainer.global_step,
            batches=len(self.step_seconds),
            step_time_ms=1000 * statistics.median(timed) if timed else None,
        )
        synchronizer = getattr(getattr(trainer.strategy, "gradients", None), "synchronizer", None)
        if synchronizer is not None:
            self.summary["launch_point"] = synchronizer.launch_point
        lost = getattr(trainer.strategy, "lost_workers", None)
        if lost:  # the elastic ps modes: the ranks the servers dropped, and why (each survivor is now alone)
            self.summary["lost_workers"] = {str(worker): why for worker, why in lost.items()}
            self.summary["world_size"] = trainer.num_nodes * trainer.num_devices
        added = getattr(trainer.strategy, "added_workers", None)
        if added:  # the workers added to the run in a spare slot (join), by their worker rank
            self.summary["added_workers"] = list(added)
        total = getattr(trainer.strategy, "comm_totals", None)  # a lightning_sync strategy's meter, in training only
        if total is not None:  # (setup broadcasts are not a step's), and across resumes, as global_step is
            self.summary.update(
                bytes_sent_per_step=total.bytes_sent / steps,
                bytes_recv_per_step=total.bytes_recv / steps,
                calls_per_step=total.calls / steps,
                comm_seconds_per_step=total.seconds / steps,
            )
        self._write(trainer)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.summary["test"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}
        self._write(trainer)

    def _write(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero:
            merge_summary(self.path, self.summary)
