"""lightning_sync: PyTorch Lightning strategies that keep data-parallel replicas in sync in different ways.

Importing the package registers the strategies with Lightning's ``StrategyRegistry`` (``sync_ddp``, ...), so
``Trainer(strategy="sync_ddp")`` works as well as passing an object.

One exception keeps the command-line tools quick to answer: while Python locates a ``python -m
lightning_sync.<tool>`` module (``sys.argv[0]`` is then ``"-m"``), the strategies, and with them torch and
Lightning, are not imported here. The tool checks its arguments first and imports what it needs after; the public
names below still resolve on first use (and register the strategies then).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

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


if sys.argv[:1] != ["-m"]:
    importlib.import_module("lightning_sync.strategies")  # registers the strategies with Lightning

__all__ = sorted(_PUBLIC)
