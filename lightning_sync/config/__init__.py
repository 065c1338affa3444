"""Structured configs: one plain dataclass per strategy; each field is a knob, with its default and its help.

This package is a leaf: it imports nothing from :mod:`lightning_sync.comm` (the strategies build the comm objects
from these configs). The dataclasses are the one schema behind every way of setting a knob:

- a strategy's constructor lists the fields of its dataclass as keyword arguments, whose defaults are read off the
  dataclass (``sync_every: int | str = PeriodicConfig.sync_every``), builds the dataclass from them, and fills its
  ``Args:`` documentation from the fields' help (:func:`knob_docs`), so IDEs, type checkers and LightningCLI see
  every knob, and a unit test checks that the signatures and the fields agree;
- the Hydra app uses them as the schema of the ``strategy/`` group (:mod:`lightning_sync.apps.conf_store`), so a
  knob's default lives here only and ``conf/strategy/*.yaml`` holds just what differs, and its ``--help`` prints
  :func:`knob_docs`.

Validation is split by ownership, and each check is made in one place, in the launching process, before any rank
starts: ``__post_init__`` checks the knobs that belong to the strategy (start method, timeouts, placement, how the
knobs combine with the mode); the knobs that belong to an algorithm (a codec's density or rank, the bucketing, the
averager's period, warmup, streaming and adaptive bounds, the ``ps`` mode, staleness bound, push scale and local
steps) are checked by that algorithm's constructor, which the strategy's constructor calls. The algorithm classes are
usable alone, and default each knob as the dataclass does (``tests/test_schema_defaults.py``). Either way a bad value
raises :class:`~lightning_sync.errors.ConfigError` naming the field, the value and what is allowed
(``strategy.<knob>`` once a strategy or the Hydra app reports it).
"""

from lightning_sync.config.common import (
    ON_MISMATCH,
    START_METHODS,
    GradientSyncKnobs,
    StrategyConfig,
)
from lightning_sync.config.gradient import AllReduceConfig, DDPConfig
from lightning_sync.config.knobs import knob, knob_docs
from lightning_sync.config.periodic import PERIODIC_MODES, PeriodicConfig
from lightning_sync.config.ps import PS_PLACEMENTS, ParameterServerConfig

__all__ = [
    "ON_MISMATCH",
    "PERIODIC_MODES",
    "PS_PLACEMENTS",
    "START_METHODS",
    "AllReduceConfig",
    "DDPConfig",
    "GradientSyncKnobs",
    "ParameterServerConfig",
    "PeriodicConfig",
    "StrategyConfig",
    "knob",
    "knob_docs",
]
