"""Each strategy's config dataclass as the Hydra schema of its ``strategy/`` option, so a knob has one home.

:func:`register_strategy_schemas` stores, for every registered strategy, its config dataclass (plus the
``_target_`` that Hydra instantiates) in Hydra's ConfigStore as ``schema/strategy/<mode>``. Each
``conf/strategy/<mode>.yaml`` starts from that schema (``defaults: [/schema/strategy/<mode>@_here_, _self_]``)
and holds only what differs, so every default and its documentation live in :mod:`lightning_sync.config`, and a
knob that is not a field is rejected when the config is composed.
"""

from __future__ import annotations

from dataclasses import field, make_dataclass

from hydra.core.config_store import ConfigStore

SCHEMA_GROUP = "schema/strategy"


def register_strategy_schemas() -> None:
    """Stores ``schema/strategy/<mode>`` for each strategy of :data:`lightning_sync.STRATEGIES` (idempotent)."""
    from lightning_sync import STRATEGIES

    store = ConfigStore.instance()
    for name, cls in STRATEGIES.items():
        target = f"{cls.__module__.split('.')[0]}.{cls.__name__}"
        schema = make_dataclass(
            f"{cls.config_class.__name__}Schema", [("_target_", str, field(default=target))], bases=(cls.config_class,)
        )
        store.store(group=SCHEMA_GROUP, name=name.removeprefix("sync_"), node=schema)
