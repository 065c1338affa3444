"""Fault injection: workers made slower on purpose, for experiments with stragglers under any strategy."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_sync.errors import check_range
from lightning_sync.ps.straggler import Straggler


class StragglerCallback(pl.Callback):
    """Makes workers slower, for experiments with stragglers under any strategy: a slow batch sleeps, after the
    batch (its optimizer step and any sync or push included), ``slowdown - 1`` times the time the batch took.

    Two patterns, set by ``rank`` and ``chance``:

    * one worker slow all the time: ``rank=2, slowdown=3`` (``chance=1``);
    * stragglers that come and go: ``rank=None, chance=0.1``: every worker, independently, makes each batch slow
      with probability ``chance`` (a hiccup), drawn from its own generator seeded by ``seed`` and its rank.

    Args:
        rank: the slow worker's global rank, or ``None`` for every worker.
        slowdown: how many times as long a slow batch takes, ``>= 1``.
        chance: the probability that a batch of a slow worker is slow, in ``(0, 1]``.
        seed: seeds the draws (with the rank), so a pattern repeats from run to run.
        clock: returns the current time in seconds (a test passes a fake one).
        sleep: sleeps for the given seconds (a test passes one that advances its fake clock).

    Raises:
        ValueError: a value outside the ranges above, naming the field.
    """

    def __init__(
        self,
        rank: int | None = None,
        slowdown: float = 3.0,
        chance: float = 1.0,
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rank is not None:
            check_range("rank", rank, low=0, integer=True)
        check_range("slowdown", slowdown, low=1)
        check_range("chance", chance, low=0, high=1, low_open=True)
        self.rank, self.slowdown, self.chance, self.seed = rank, float(slowdown), float(chance), int(seed)
        self._clock, self._sleep = clock, sleep
        self.slow_batches = 0
        self._straggler: Any = None
        self._draws: Any = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Sets up this worker's sleeper and its draws (a worker that is never slow gets none)."""
        rank = trainer.global_rank
        if self.rank is None or self.rank == rank:
            self._straggler = Straggler(rank, rank, self.slowdown, clock=self._clock, sleep=self._sleep)
            self._draws = random.Random(self.seed * 1_000_003 + rank)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        """Starts the batch's clock on a worker that may be slow."""
        if self._straggler is not None:
            self._straggler.step_start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Sleeps if this batch is a slow one (``chance``)."""
        if self._straggler is None:
            return
        if self._draws.random() < self.chance:
            self.slow_batches += 1
            self._straggler.step_end()
