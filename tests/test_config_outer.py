"""The outer optimizer's defaults (``lightning_sync.config.outer``): the sweep's rule, and the paper one knob away."""

from __future__ import annotations

import pytest

from lightning_sync import ParameterServerStrategy, PeriodicSyncStrategy
from lightning_sync.algorithms import ps_settings
from lightning_sync.config import ParameterServerConfig, PeriodicConfig, knob_docs
from lightning_sync.config.outer import PAPER_OUTER_LR, PAPER_OUTER_MOMENTUM, SGD_OUTER_LR, default_outer_lr
from lightning_sync.errors import ConfigError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("config", [PeriodicConfig, ParameterServerConfig])
def test_the_default_is_outer_sgd_without_momentum_and_the_paper_is_one_knob_away(config):
    ours = config()
    assert (ours.outer_lr, ours.outer_momentum) == (SGD_OUTER_LR, 0.0)
    paper = config(outer_momentum=PAPER_OUTER_MOMENTUM)
    assert (paper.outer_lr, paper.outer_momentum, paper.outer_nesterov) == (0.7, 0.9, True)
    assert config(outer_lr=0.3, outer_momentum=0.9).outer_lr == 0.3  # an explicit lr is kept
    assert "outer_momentum=0.9" in knob_docs(config)["outer_lr"]


def test_the_rule_without_and_with_momentum():
    assert default_outer_lr(0) == default_outer_lr(0.0) == SGD_OUTER_LR
    assert default_outer_lr(0.5) == default_outer_lr(0.9) == PAPER_OUTER_LR
    assert SGD_OUTER_LR != PAPER_OUTER_LR  # else the rule could not be told from a constant


@pytest.mark.parametrize("momentum", [1.0, -0.1, "0.9", True])
def test_a_bad_momentum_is_named_before_the_rule_uses_it(momentum):
    with pytest.raises(
        ConfigError, match=rf"outer_momentum={momentum!r} is not allowed; it must be a number in \[0, 1\)"
    ):
        PeriodicConfig(mode="diloco", outer_momentum=momentum)


def test_the_strategies_build_their_outer_optimizers_with_the_resolved_defaults():
    averager = PeriodicSyncStrategy(mode="diloco", sync_every=16).averager
    assert averager is not None
    assert (averager.outer_lr, averager.outer_momentum) == (SGD_OUTER_LR, 0.0)
    paper = PeriodicSyncStrategy(mode="diloco", sync_every=16, outer_momentum=0.9).averager
    assert paper is not None
    assert (paper.outer_lr, paper.outer_momentum, paper.outer_nesterov) == (0.7, 0.9, True)
    ps = ParameterServerStrategy(mode="async", local_steps=8)
    assert (ps.config.outer_lr, ps.config.outer_momentum) == (SGD_OUTER_LR, 0.0)
    settings = ps_settings(ParameterServerConfig(mode="async", local_steps=8))
    assert (settings.outer_lr, settings.outer_momentum) == (SGD_OUTER_LR, 0.0)
