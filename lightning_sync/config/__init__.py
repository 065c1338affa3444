"""Structured configs: one plain dataclass per strategy; each field is a knob, with its default and its help.

The one schema behind every way of setting a knob: a strategy's constructor takes each field as a keyword argument
defaulting to the field, with its ``Args:`` from :func:`knob_docs`; the Hydra app's ``strategy/`` group uses the
dataclasses as its schema. ``__post_init__`` checks the strategy's own knobs; an algorithm's knobs (a codec, the
bucketing, the averager's schedule, the ``ps`` settings) are checked by that algorithm's constructor, which defaults
them as the dataclass does (``tests/test_schema_defaults.py``). A leaf package: it imports only
:mod:`lightning_sync.errors`.
"""

from lightning_sync.config.common import AllReduceConfig, DDPConfig, GradientSyncKnobs, StrategyConfig
from lightning_sync.config.knobs import knob, knob_docs
from lightning_sync.config.periodic import PeriodicConfig
from lightning_sync.config.ps import ParameterServerConfig

__all__ = [
    "AllReduceConfig",
    "DDPConfig",
    "GradientSyncKnobs",
    "ParameterServerConfig",
    "PeriodicConfig",
    "StrategyConfig",
    "knob",
    "knob_docs",
]
