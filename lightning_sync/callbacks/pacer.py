"""Workers that each train at a set pace: every batch takes at least ``step_s`` seconds.

Workers sharing a machine's cores speed up when one is lost, which says more about the machine than the method; a
batch padded by sleep to a fixed time longer than its compute keeps each worker at its own pace.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_sync.errors import check_range


class StepPacer(pl.Callback):
    """Pads every training batch (forward, backward, optimizer step and any sync included) to at least ``step_s``
    seconds by sleeping after it; a batch that took longer (a slow sync) is not padded.

    Args:
        step_s: the shortest time of a batch, in seconds (> 0).
        clock: returns the current time in seconds (a test passes a fake one).
        sleep: sleeps for the given seconds (a test passes one that advances its fake clock).

    Raises:
        ConfigError: ``step_s`` not > 0 (names the field).
    """

    def __init__(
        self,
        step_s: float,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        check_range("step_s", step_s, low=0, low_open=True)
        self.step_s = float(step_s)
        self._clock, self._sleep = clock, sleep
        self._started = 0.0
        self.padded_s = 0.0

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        """Notes when the batch starts."""
        self._started = self._clock()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Sleeps for what is left of ``step_s`` since the batch started (nothing if the batch took longer)."""
        left = self.step_s - (self._clock() - self._started)
        if left > 0:
            self._sleep(left)
            self.padded_s += left
