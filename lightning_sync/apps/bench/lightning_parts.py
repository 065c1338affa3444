"""The benchmark's Lightning pieces: the no-communication floor, the time-to-target callback and the wire counter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from torch import nn
from typing_extensions import override

from lightning_sync.apps.bench.clock import TargetClock
from lightning_sync.strategies.allreduce import AllReduceStrategy


class NoSyncStrategy(AllReduceStrategy):
    """The compute-only floor: replicas start identical (rank 0's state is broadcast) and never communicate again,
    apart from Lightning's own per-batch SIGTERM-flag broadcast. The bench builds it with ``skip_nonfinite=False``
    (Lightning's DDP checks nothing either)."""

    @override
    def configure_ddp(self) -> None:
        super().configure_ddp()
        assert self.gradients is not None and self.gradients.synchronizer is not None
        self.gradients.synchronizer.remove_hooks()
        self.gradients.synchronizer = None


class TimeToTarget(pl.Callback):
    """Stops the fit on every rank once rank 0's replica reaches the target score (scored every ``every``
    optimizer steps, clock stopped meanwhile) or ``give_up_s`` of training time has passed; :attr:`clock` holds
    the times. Where each worker is a world of its own (ps async) it scores its own replica and stops on its own.

    Args:
        score: makes the scorer from the datamodule (``datamodule -> (model -> float)``).
        target: the score to reach (``None``: run the whole budget).
        every: score every this many optimizer steps.
        lower_is_better: a loss (``True``) or an accuracy.
        give_up_s: training seconds after which a run that has not reached the target stops.
    """

    def __init__(
        self,
        score: Callable[[Any], Callable[[nn.Module], float]],
        target: float | None,
        every: int,
        lower_is_better: bool = False,
        give_up_s: float | None = None,
    ) -> None:
        self.make_score = score
        self.target = target
        self.every = every
        self.lower_is_better = lower_is_better
        self.give_up_s = give_up_s
        self.clock: TargetClock | None = None
        self._last_step = -1

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        self.clock = TargetClock(
            # Lightning's DataConnector sets Trainer.datamodule, which the Trainer class does not declare
            self.make_score(trainer.datamodule),  # type: ignore[attr-defined]
            self.target,
            self.every,
            lambda value: strategy.broadcast(value, src=0),
            lower_is_better=self.lower_is_better,
            give_up_s=self.give_up_s,
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


class WireBytes(pl.Callback):
    """Reads this rank's network interface byte counters when training starts and ends (see
    :class:`lightning_sync.apps.netns.InterfaceCounters`); :attr:`counters` holds them."""

    def __init__(self, counters: Any) -> None:
        self.counters = counters

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.counters.start()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.counters.stop()
