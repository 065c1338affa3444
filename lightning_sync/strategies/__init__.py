"""Lightning adapters, one file per sync mode."""

from lightning_sync.strategies._base import SyncStrategyBase
from lightning_sync.strategies.allreduce import AllReduceStrategy
from lightning_sync.strategies.ddp import DDPSyncStrategy
from lightning_sync.strategies.periodic import PeriodicSyncStrategy
from lightning_sync.strategies.ps import ParameterServerStrategy

__all__ = [
    "AllReduceStrategy",
    "DDPSyncStrategy",
    "ParameterServerStrategy",
    "PeriodicSyncStrategy",
    "SyncStrategyBase",
]
