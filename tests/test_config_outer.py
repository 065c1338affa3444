"""The outer optimizer's defaults (``lightning_sync.config.outer``): plain outer SGD, and the paper one knob away."""

from __future__ import annotations

import pytest

from lightning_sync import ParameterServerStrategy, PeriodicSyncStrategy
from lightning_sync.algorithms import ps_settings
from lightning_sync.config import ParameterServerConfig, PeriodicConfig, knob_docs
from lightning_sync.config.outer import OUTER_LR, PAPER_OUTER_MOMENTUM
from lightning_sync.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("config", [PeriodicConfig, ParameterServerConfig])
def test_the_default_is_outer_sgd_without_momentum_and_the_paper_is_one_knob_away(config):
    ours = config()
    assert (ours.outer_lr, ours.outer_momentum) == (OUTER_LR, 0.0) == (0.7, 0.0)
    paper = config(outer_momentum=PAPER_OUTER_MOMENTUM)
    assert (paper.outer_lr, paper.outer_momentum, paper.outer_nesterov) == (0.7, 0.9, True)
    assert config(outer_lr=0.3, outer_momentum=0.9).outer_lr == 0.3  # an explicit lr is kept
    assert "outer_momentum=0.9" in knob_docs(config)["outer_lr"]


@pytest.mark.parametrize("momentum", [1.0, -0.1])
def test_a_bad_momentum_is_named_before_any_process_starts(momentum):
    with pytest.raises(ConfigError, match=rf"outer_momentum={momentum!r} is not allowed"):
        PeriodicSyncStrategy(mode="diloco", outer_momentum=momentum)


def test_the_strategies_build_their_outer_optimizers_with_the_defaults():
    averager = PeriodicSyncStrategy(mode="diloco", sync_every=16).averager
    assert averager is not None
    assert (averager.outer_lr, averager.outer_momentum) == (OUTER_LR, 0.0)
    paper = PeriodicSyncStrategy(mode="diloco", sync_every=16, outer_momentum=0.9).averager
    assert paper is not None
    assert (paper.outer_lr, paper.outer_momentum, paper.outer_nesterov) == (0.7, 0.9, True)
    ps = ParameterServerStrategy(mode="async", local_steps=8)
    assert (ps.config.outer_lr, ps.config.outer_momentum) == (OUTER_LR, 0.0)
    settings = ps_settings(ParameterServerConfig(mode="async", local_steps=8))
    assert (settings.outer_lr, settings.outer_momentum) == (OUTER_LR, 0.0)
