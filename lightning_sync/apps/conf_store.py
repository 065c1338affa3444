"""Each strategy's config dataclass as the Hydra schema of its ``strategy/`` option, so a knob has one home.

:func:`register_strategy_schemas` stores, for every registered strategy, its config dataclass (plus the
``_target_`` that Hydra instantiates) in Hydra's ConfigStore as ``schema/strategy/<mode>``. Each
``conf/strategy/<mode>.yaml`` starts from that schema (``defaults: [/schema/strategy/<mode>@_here_, _self_]``)
and holds only what differs, so every default and its documentation live in :mod:`lightning_sync.config`, and a
knob that is not a field is rejected when the config is composed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field, make_dataclass
from typing import Any

from hydra.core.config_store import ConfigStore

from lightning_sync.algorithms import build_parts
from lightning_sync.config import AllReduceConfig, DDPConfig, ParameterServerConfig, PeriodicConfig, StrategyConfig
from lightning_sync.errors import ConfigError

SCHEMA_GROUP = "schema/strategy"

# Hydra option -> (the strategy class Hydra instantiates, its config dataclass); a test checks that it matches
# lightning_sync.STRATEGIES.
MODES: dict[str, tuple[str, type[StrategyConfig]]] = {
    "ddp": ("lightning_sync.DDPSyncStrategy", DDPConfig),
    "allreduce": ("lightning_sync.AllReduceStrategy", AllReduceConfig),
    "periodic": ("lightning_sync.PeriodicSyncStrategy", PeriodicConfig),
    "ps": ("lightning_sync.ParameterServerStrategy", ParameterServerConfig),
}


def register_strategy_schemas() -> None:
    """Stores ``schema/strategy/<mode>`` for each of :data:`MODES` (idempotent)."""
    store = ConfigStore.instance()
    for mode, (target, config_class) in MODES.items():
        schema = make_dataclass(
            f"{config_class.__name__}Schema", [("_target_", str, field(default=target))], bases=(config_class,)
        )
        store.store(group=SCHEMA_GROUP, name=mode, node=schema)


def check_strategy_knobs(strategy: Any) -> None:
    """Checks a composed ``strategy`` node as the strategy's constructor would, in the launching process before
    any rank starts: its config dataclass first, then the algorithms the knobs configure
    (:func:`lightning_sync.algorithms.build_parts`).

    Raises:
        ConfigError: naming ``strategy.<knob>``, the value and what is allowed.
    """
    target = strategy.get("_target_")
    config_class = next((cls for name, cls in MODES.values() if name == target), None)
    if config_class is None:  # another strategy class: its own constructor checks it
        return
    knobs = {key: value for key, value in strategy.items() if key != "_target_"}
    known = {field.name for field in dataclasses.fields(config_class)}
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise ConfigError(
            f"strategy.{unknown[0]} is not a knob of {config_class.__name__}; known knobs: {', '.join(sorted(known))}"
        )
    try:
        build_parts(config_class(**knobs))
    except ConfigError as error:
        raise error.under("strategy") from None
