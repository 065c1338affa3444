"""Workers slowed on purpose, for experiments under any strategy: stragglers (:class:`StragglerCallback`), and a set
pace per batch (:class:`StepPacer`).

Workers sharing a machine's cores speed up when one is lost, which says more about the machine than the method; a
batch padded by sleep to a fixed time longer than its compute keeps each worker at its own pace.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import lightning.pytorch as pl
from typing_extensions import override

from lightning_sync.callbacks.report import BatchTimer
from lightning_sync.errors import check_range


class StragglerCallback(BatchTimer):
    """Makes workers slower: a slow batch sleeps, after the batch, ``slowdown - 1`` times the time it took.

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
        ConfigError: a value outside the ranges above, naming the field.
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
        super().__init__(clock, sleep)
        self.rank, self.slowdown, self.chance, self.seed = rank, float(slowdown), float(chance), int(seed)
        self.slow_batches = 0
        self._draws: random.Random | None = None  # set on a worker that may be slow

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Seeds this worker's draws (a worker that is never slow gets none)."""
        if self.rank is None or self.rank == trainer.global_rank:
            self._draws = random.Random(self.seed * 1_000_003 + trainer.global_rank)

    @override
    def _timed(self, batch_s: float) -> float:
        if self._draws is None or self._draws.random() >= self.chance:
            return 0.0
        self.slow_batches += 1
        return (self.slowdown - 1.0) * batch_s


class StepPacer(BatchTimer):
    """Pads every training batch to at least ``step_s`` seconds by sleeping after it; a batch that took longer (a
    slow sync) is not padded.

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
        super().__init__(clock, sleep)
        self.step_s = float(step_s)

    @override
    def _timed(self, batch_s: float) -> float:
        return self.step_s - batch_s
