"""Each strategy's config dataclass as the Hydra schema of its ``strategy/`` option, so a knob has one home.

:func:`register_strategy_schemas` stores, for every registered strategy, its config dataclass (plus the
``_target_`` that Hydra instantiates) in Hydra's ConfigStore as ``schema/strategy/<mode>``. Each
``conf/strategy/<mode>.yaml`` starts from that schema (``defaults: [/schema/strategy/<mode>@_here_, _self_]``)
and holds only what differs, so every default and its documentation live in :mod:`lightning_sync.config`, and a
knob that is not a field is rejected when the config is composed.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
from dataclasses import field, make_dataclass
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from lightning_sync.algorithms import build_parts
from lightning_sync.comm.averaging import OUTER_OPTIMIZER
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


def hydra_node(factory: functools.partial[Any]) -> dict[str, Any]:
    """``functools.partial(cls, **kwargs)`` as the Hydra node that builds it, ``{_target_, _partial_: true,
    **kwargs}``, ``_target_`` by its shortest import path (``torch.optim.SGD``, not ``torch.optim.sgd.SGD``)."""
    func, parts = factory.func, factory.func.__module__.split(".")
    modules = (".".join(parts[:i]) for i in range(1, len(parts) + 1))
    module = next(m for m in modules if getattr(importlib.import_module(m), func.__qualname__, None) is func)
    return {"_target_": f"{module}.{func.__qualname__}", "_partial_": True, **factory.keywords}


SCHEMA_DEFAULTS: dict[str, dict[str, Any]] = {"outer_optimizer": hydra_node(OUTER_OPTIMIZER)}
"""Knobs whose ``None`` stands for an object (:data:`~lightning_sync.comm.averaging.OUTER_OPTIMIZER`): their schema
default is the node that builds that object, so that Hydra can override one of its arguments
(``strategy.outer_optimizer.lr=0.5``) or its class (``strategy.outer_optimizer._target_=torch.optim.Adam``)."""


def register_strategy_schemas() -> None:
    """Stores ``schema/strategy/<mode>`` for each of :data:`MODES` (idempotent)."""
    store = ConfigStore.instance()
    for mode, (target, config_class) in MODES.items():
        names = {f.name for f in dataclasses.fields(config_class)}
        nodes = [
            (name, Any, field(default_factory=functools.partial(copy.deepcopy, node)))
            for name, node in SCHEMA_DEFAULTS.items()
            if name in names
        ]
        schema = make_dataclass(
            f"{config_class.__name__}Schema",
            [("_target_", str, field(default=target)), *nodes],
            bases=(config_class,),
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
    knobs = {key: _built(key, value) for key, value in strategy.items() if key != "_target_"}
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


def _built(key: str, value: Any) -> Any:
    """A knob given as an object (a codec, an optimizer callable: a node with ``_target_``) built as Hydra builds it
    for the strategy; any other value as it is.

    Raises:
        ConfigError: the object's constructor refused an argument, named ``strategy.<key>.<argument>``.
    """
    if not (isinstance(value, (dict, DictConfig)) and "_target_" in value):
        return value
    value = OmegaConf.create(value)  # the app passes plain containers (OmegaConf.to_container)
    try:
        return hydra.utils.instantiate(value)
    except InstantiationException as error:
        if isinstance(error.__cause__, ConfigError):
            raise ConfigError(f"strategy.{key}.{error.__cause__}") from None
        raise ConfigError(f"strategy.{key}={value!r} cannot be built: {error}") from None
