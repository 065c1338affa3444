"""lightning_sync: PyTorch Lightning strategies that keep data-parallel replicas in sync in different ways.

Importing the package registers the strategies with Lightning's ``StrategyRegistry`` (``sync_ddp``,
``sync_allreduce``, ``sync_periodic``, ``sync_ps``), so ``Trainer(strategy="sync_allreduce")`` works as well as
passing an object. The import itself stays light: if Lightning is already imported, the strategies are registered
at once; otherwise they are registered the moment ``lightning.pytorch`` finishes importing (see
:mod:`lightning_sync._registration`), which is always before a ``Trainer`` can read the registry. That keeps the
command-line tools' argument checks quick without ever skipping the registry.
"""

from __future__ import annotations

import importlib
from typing import Any

from lightning_sync._registration import register_when_lightning_loads

__version__ = "0.1.0"

# public name -> the module that defines it
_PUBLIC = {
    "AllReduceStrategy": "lightning_sync.strategies",
    "DDPSyncStrategy": "lightning_sync.strategies",
    "ParameterServerStrategy": "lightning_sync.strategies",
    "PeriodicSyncStrategy": "lightning_sync.strategies",
    "STRATEGIES": "lightning_sync.strategies",
    "CommMeter": "lightning_sync.comm.meter",
    "CommStats": "lightning_sync.comm.meter",
    "CheckpointError": "lightning_sync.errors",
    "ConfigError": "lightning_sync.errors",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_sync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


register_when_lightning_loads()

__all__ = sorted(_PUBLIC)  # noqa: PLE0605
