"""lightning_sync: PyTorch Lightning strategies that keep data-parallel replicas in sync in different ways.

Pass a strategy object, ``Trainer(strategy=lightning_sync.AllReduceStrategy(...))``; the registry names work too:
importing the package imports :mod:`lightning_sync.strategies` (and so Lightning), whose import registers ``sync_ddp``,
``sync_allreduce``, ``sync_periodic`` and ``sync_ps`` with Lightning's ``StrategyRegistry``, as Lightning registers
its own strategies, so ``Trainer(strategy="sync_allreduce")`` works after a plain ``import lightning_sync``.
"""

from __future__ import annotations

from lightning_sync.comm.meter import CommMeter, CommStats
from lightning_sync.errors import CheckpointError, ConfigError
from lightning_sync.strategies import (
    STRATEGIES,
    AllReduceStrategy,
    DDPSyncStrategy,
    ParameterServerStrategy,
    PeriodicSyncStrategy,
)

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "AllReduceStrategy",
    "CheckpointError",
    "CommMeter",
    "CommStats",
    "ConfigError",
    "DDPSyncStrategy",
    "ParameterServerStrategy",
    "PeriodicSyncStrategy",
]
