"""The benchmark's Lightning pieces: the no-communication floor and the time-to-accuracy callback."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_sync.apps.bench.clock import AccuracyClock
from lightning_sync.strategies.allreduce import AllReduceStrategy


class NoSyncStrategy(AllReduceStrategy):
    """The compute-only floor: replicas start identical (rank 0's state is broadcast) and never communicate again,
    apart from Lightning's own per-batch SIGTERM-flag broadcast. The bench builds it with ``skip_nonfinite=False``
    (Lightning's DDP checks nothing either)."""

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        assert self.synchronizer is not None
        self.synchronizer.remove_hooks()
        self.synchronizer = None


class TimeToAccuracy(pl.Callback):
    """Stops the fit on every rank once rank 0's replica reaches ``target`` test accuracy (tested every ``every``
    optimizer steps, clock stopped meanwhile); :attr:`clock` holds the times.

    Args:
        target: the test accuracy to reach.
        every: test every this many optimizer steps.
    """

    def __init__(self, target: float, every: int) -> None:
        self.target = target
        self.every = every
        self.clock: AccuracyClock | None = None
        self._last_step = -1

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        inputs, labels = trainer.datamodule.splits["test"].tensors
        self.clock = AccuracyClock(
            inputs, labels, self.target, self.every, lambda value: trainer.strategy.broadcast(value, src=0)
        )
        self.clock.start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.clock is None or step == self._last_step:
            return
        self._last_step = step
        if self.clock.check(pl_module, step):
            trainer.should_stop = True
