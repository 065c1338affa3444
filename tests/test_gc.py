"""``freeze_gc``: the start-up heap is frozen while training runs, released after, and the knob turns it off."""

from __future__ import annotations

import gc

import lightning.pytorch as pl
import pytest
from lightning_utils import make_trainer

from lightning_sync import AllReduceStrategy, PeriodicSyncStrategy
from lightning_sync.examples.data import DigitsDataModule
from lightning_sync.examples.models import DigitsClassifier
from lightning_sync.strategies._base import freeze_startup_heap, release_startup_heap


@pytest.mark.unit
def test_freeze_and_release_nest_per_fit():
    assert gc.get_freeze_count() == 0
    try:
        freeze_startup_heap()
        frozen = gc.get_freeze_count()
        assert frozen > 0
        freeze_startup_heap()  # a second fit in the same process
        release_startup_heap()
        assert gc.get_freeze_count() >= frozen, "released while another fit still runs"
        release_startup_heap()
        assert gc.get_freeze_count() == 0
        release_startup_heap()  # one release too many is harmless
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


class _FrozenDuringTraining(pl.Callback):
    """Asserts, in each rank, whether the heap is frozen while the batches run."""

    def __init__(self, expect_frozen: bool) -> None:
        self.expect_frozen = expect_frozen
        self.counts: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.counts.append(gc.get_freeze_count())

    def on_fit_end(self, trainer, pl_module) -> None:
        assert self.counts, "no batch ran"
        if self.expect_frozen:
            assert min(self.counts) > 0, self.counts
        else:
            assert max(self.counts) == 0, self.counts


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "make_strategy, expect_frozen",
    [
        (lambda: AllReduceStrategy(start_method="fork"), True),
        (lambda: PeriodicSyncStrategy(start_method="fork", mode="local_sgd", sync_every=2), True),
        (lambda: AllReduceStrategy(start_method="fork", freeze_gc=False), False),
    ],
    ids=["allreduce", "local_sgd", "off"],
)
def test_heap_is_frozen_while_training(make_strategy, expect_frozen):
    trainer = make_trainer(make_strategy(), callbacks=[_FrozenDuringTraining(expect_frozen)], max_steps=4)
    trainer.fit(DigitsClassifier(hidden=16, num_hidden_layers=1), datamodule=DigitsDataModule(batch_size=16))
