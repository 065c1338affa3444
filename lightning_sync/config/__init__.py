"""Structured configs: one plain dataclass per strategy; each field is a knob, with its default and its help.

A leaf package (it imports nothing from :mod:`lightning_sync.comm`), and the one schema behind every way of setting a
knob: a strategy's constructor takes each field as a keyword argument defaulting to the field
(``sync_every: int | str = PeriodicConfig.sync_every``) and its ``Args:`` come from :func:`knob_docs`; the Hydra
app's ``strategy/`` group (:mod:`lightning_sync.apps.conf_store`) uses the dataclasses as its schema, so
``conf/strategy/*.yaml`` holds only what differs.

Each check is made once, in the launching process, before any rank starts: ``__post_init__`` checks the knobs that
belong to the strategy (start method, timeouts, placement, how the knobs combine with the mode); an algorithm's own
knobs (a codec's density, the bucketing, the averager's schedule, the ``ps`` settings) are checked by that
algorithm's constructor, which the strategy's constructor calls, and default as the dataclass does
(``tests/test_schema_defaults.py``). A bad value raises :class:`~lightning_sync.errors.ConfigError` naming the
field, the value and what is allowed.
"""

from lightning_sync.config.common import GradientSyncKnobs, StrategyConfig
from lightning_sync.config.gradient import AllReduceConfig, DDPConfig
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
