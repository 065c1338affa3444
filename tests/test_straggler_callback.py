"""``StragglerCallback``: one worker slow all the time, or stragglers that come and go, under any strategy.

Single-process fits (rank 0) check who sleeps, how long and how often; the Hydra option ``callbacks=straggler``
composes with the app's config; bad values name their field.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import time

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_utils import make_trainer

from lightning_sync.callbacks import StragglerCallback

pytestmark = pytest.mark.unit


class _SlowModel(BoringModel):
    """A BoringModel whose step takes at least 20 ms, so a sleep of 2x its time is measurable."""

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)


def _fit(callback: StragglerCallback, batches: int = 10) -> float:
    trainer = make_trainer("auto", devices=1, max_steps=batches, callbacks=[callback])
    torch.manual_seed(0)
    started = time.perf_counter()
    trainer.fit(_SlowModel())
    return time.perf_counter() - started


def test_the_slow_rank_sleeps_slowdown_minus_one_times_its_batches():
    slow = StragglerCallback(rank=0, slowdown=3.0)
    _fit(slow)
    assert slow.slow_batches == 10
    slept = slow._straggler.slept_s
    assert 10 * 2 * 0.02 <= slept < 10 * 2 * 0.2  # 2x each batch's own time (>= 20 ms each)


def test_another_rank_is_never_slowed():
    other = StragglerCallback(rank=1, slowdown=3.0)
    _fit(other)
    assert other.slow_batches == 0 and other._straggler is None


def test_stragglers_that_come_and_go_are_drawn_per_batch_and_repeat_with_the_seed():
    counts = []
    for _ in range(2):
        hiccups = StragglerCallback(rank=None, slowdown=2.0, chance=0.3, seed=7)
        _fit(hiccups, batches=40)
        counts.append(hiccups.slow_batches)
    assert counts[0] == counts[1]
    assert 2 <= counts[0] <= 25  # about 12 of 40
    assert StragglerCallback(rank=None, chance=0.3, seed=8) is not None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"slowdown": 0.5}, "slowdown"), ({"chance": 0.0}, "chance"), ({"chance": 1.5}, "chance"), ({"rank": -1}, "rank")],
)
def test_bad_values_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StragglerCallback(**kwargs)


def test_the_hydra_option_builds_the_callback():
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lightning_sync.apps import train

    with initialize_config_dir(config_dir=train.CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["callbacks=[none,straggler]", "callbacks.straggler.rank=1"])
    callback = instantiate(cfg.callbacks.straggler)
    assert isinstance(callback, StragglerCallback) and callback.rank == 1 and callback.slowdown == 3.0
