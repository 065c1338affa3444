"""``StragglerCallback``: one worker slow all the time, or stragglers that come and go, under any strategy.

The callback's hooks are driven directly with a fake clock (``tests/fake_clock.py``): each batch takes exactly the
time the test says, so who sleeps, how long and how often are checked exactly, with no real sleep. One fit checks
that Lightning calls the hooks; the Hydra option ``callbacks=straggler`` composes with the app's config; bad values
name their field.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from types import SimpleNamespace

import pytest
from fake_clock import FakeClock

from lightning_sync.callbacks import StragglerCallback


def _batches(callback: StragglerCallback, clock: FakeClock, seconds: list[float], rank: int = 0) -> None:
    """Runs ``callback``'s hooks as a fit on ``rank`` does, one batch per entry of ``seconds`` (its compute time)."""
    trainer = SimpleNamespace(global_rank=rank)
    callback.on_train_start(trainer, None)
    for i, took in enumerate(seconds):
        callback.on_train_batch_start(trainer, None, None, i)
        clock.advance(took)
        callback.on_train_batch_end(trainer, None, None, None, i)


@pytest.mark.unit
def test_the_slow_rank_sleeps_slowdown_minus_one_times_each_batch():
    clock = FakeClock()
    slow = StragglerCallback(rank=1, slowdown=3.0, clock=clock, sleep=clock.sleep)
    took = [0.02, 0.05, 0.01, 0.04]
    start = clock.now
    _batches(slow, clock, took, rank=1)
    assert slow.slow_batches == len(took)
    assert clock.slept == pytest.approx([2 * t for t in took])  # each batch's own time, not an average
    assert slow.slept_s == pytest.approx(2 * sum(took))
    assert clock.now - start == pytest.approx(3 * sum(took))  # every batch took slowdown times its compute


@pytest.mark.unit
def test_another_rank_is_never_slowed():
    clock = FakeClock()
    other = StragglerCallback(rank=1, slowdown=3.0, clock=clock, sleep=clock.sleep)
    _batches(other, clock, [0.02] * 5, rank=0)
    assert other.slow_batches == 0 and other._draws is None and clock.slept == []


@pytest.mark.unit
def test_stragglers_that_come_and_go_are_drawn_per_batch_and_repeat_with_the_seed():
    def pattern(seed: int, rank: int) -> list[float]:
        clock = FakeClock()
        hiccups = StragglerCallback(rank=None, slowdown=2.0, chance=0.3, seed=seed, clock=clock, sleep=clock.sleep)
        _batches(hiccups, clock, [0.01 * (1 + i % 3) for i in range(40)], rank=rank)
        assert len(clock.slept) == hiccups.slow_batches
        return clock.slept

    first = pattern(7, 0)
    assert first == pattern(7, 0)  # the seed repeats the pattern
    assert 2 <= len(first) <= 25  # about 12 of 40
    assert first != pattern(7, 1) and first != pattern(8, 0)  # each rank and seed draws its own


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_a_fit_runs_the_hooks_on_the_chosen_rank():
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning_utils import make_trainer

    slow, other = StragglerCallback(rank=0, slowdown=1.5), StragglerCallback(rank=1, slowdown=1.5)
    make_trainer("auto", devices=1, max_steps=4, callbacks=[slow, other]).fit(BoringModel())
    assert slow.slow_batches == 4 and slow.slept_s > 0
    assert other.slow_batches == 0 and other._draws is None


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"slowdown": 0.5}, "slowdown"), ({"chance": 0.0}, "chance"), ({"chance": 1.5}, "chance"), ({"rank": -1}, "rank")],
)
def test_bad_values_name_their_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StragglerCallback(**kwargs)


@pytest.mark.unit
def test_the_hydra_option_builds_the_callback():
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lightning_sync.apps import train

    with initialize_config_dir(config_dir=train.CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["callbacks=[none,straggler]", "callbacks.straggler.rank=1"])
    callback = instantiate(cfg.callbacks.straggler)
    assert isinstance(callback, StragglerCallback) and callback.rank == 1 and callback.slowdown == 3.0
