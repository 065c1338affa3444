"""``FlushDenormal``: subnormal floats are zero on every rank while it fits, and torch's default comes back after.

The ranks check it inside ``training_step`` (a fork-launched 2-rank fit), so a rank where the setting did not
reach fails the fit; the Hydra option ``callbacks=[...,flush_denormal]`` builds the callback.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_utils import make_trainer

from lightning_sync import AllReduceStrategy
from lightning_sync.callbacks import FlushDenormal

SUBNORMAL = 1e-39  # below float32's smallest normal number, 1.18e-38


def _product_of_a_subnormal() -> float:
    return float(torch.tensor([SUBNORMAL]) * 1.5)


class _Probe(BoringModel):
    """Fails the step on a rank where subnormal floats are not flushed to zero."""

    def training_step(self, batch, batch_idx):
        product = _product_of_a_subnormal()
        assert product == 0.0, f"rank {self.global_rank}: 1e-39 * 1.5 = {product}, not flushed"
        return super().training_step(batch, batch_idx)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_every_rank_flushes_subnormals_while_it_fits_and_the_default_returns():
    assert _product_of_a_subnormal() != 0.0  # torch's default keeps them
    trainer = make_trainer(
        AllReduceStrategy(start_method="fork", timeout_s=60), max_steps=3, callbacks=[FlushDenormal()]
    )
    trainer.fit(_Probe())
    assert trainer.state.finished
    assert _product_of_a_subnormal() != 0.0  # cleared at teardown


@pytest.mark.e2e
def test_without_the_callback_a_rank_keeps_subnormals():
    trainer = make_trainer("auto", devices=1, max_steps=1)
    with pytest.raises(AssertionError, match="not flushed"):
        trainer.fit(_Probe())


@pytest.mark.unit
def test_the_hydra_option_builds_the_callback():
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lightning_sync.apps import train

    with initialize_config_dir(config_dir=train.CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["callbacks=[default,flush_denormal]"])
    assert isinstance(instantiate(cfg.callbacks.flush_denormal), FlushDenormal)
    assert "model_checkpoint" in cfg.callbacks
