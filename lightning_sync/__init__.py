"""lightning_sync: PyTorch Lightning strategies that keep data-parallel replicas in sync in different ways.

Pass a strategy object, ``Trainer(strategy=lightning_sync.AllReduceStrategy(...))``, or a registry name: importing
the package registers ``sync_ddp``, ``sync_allreduce``, ``sync_periodic`` and ``sync_ps`` with Lightning's
``StrategyRegistry``. A dedicated parameter server (``python -m lightning_sync.ps``, started with
``LIGHTNING_SYNC_SERVER_PROCESS=1``) skips that import, which would cost it seconds of CPU importing Lightning; the
strategy names are then imported on first use.
"""

from __future__ import annotations

from typing import Any

from lightning_sync._server_process import is_server_process
from lightning_sync.comm.averaging import OUTER_OPTIMIZER
from lightning_sync.comm.compression import (
    CODECS,
    BF16Compression,
    Compressor,
    FP16Compression,
    Int4Compression,
    Int8Compression,
    NoCompression,
    PowerSGDCompression,
    SparseLoCo,
    TopKCompression,
)
from lightning_sync.comm.meter import CommMeter, CommStats
from lightning_sync.errors import CheckpointError, ConfigError
from lightning_sync.ps.outer import DelayedNesterov

if not is_server_process():
    from lightning_sync.strategies import (
        STRATEGIES,
        AllReduceStrategy,
        DDPSyncStrategy,
        ParameterServerStrategy,
        PeriodicSyncStrategy,
    )


def __getattr__(name: str) -> Any:
    """The strategy names, imported on first use in a process that skipped them (a parameter server's)."""
    if name in __all__:  # only the strategy names can be missing
        import lightning_sync.strategies

        return getattr(lightning_sync.strategies, name)
    raise AttributeError(f"module 'lightning_sync' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "CODECS",
    "STRATEGIES",
    "AllReduceStrategy",
    "BF16Compression",
    "Compressor",
    "FP16Compression",
    "Int4Compression",
    "Int8Compression",
    "NoCompression",
    "PowerSGDCompression",
    "SparseLoCo",
    "TopKCompression",
    "CheckpointError",
    "CommMeter",
    "CommStats",
    "ConfigError",
    "DDPSyncStrategy",
    "DelayedNesterov",
    "OUTER_OPTIMIZER",
    "ParameterServerStrategy",
    "PeriodicSyncStrategy",
]
