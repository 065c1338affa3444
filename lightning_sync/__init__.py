"""lightning_sync: PyTorch Lightning strategies that keep data-parallel replicas in sync in different ways.

Importing the package registers the strategies with Lightning's ``StrategyRegistry`` (``sync_ddp``, ...), so
``Trainer(strategy="sync_ddp")`` works as well as passing an object.
"""

from lightning_sync.comm.meter import CommMeter, CommStats
from lightning_sync.config import ConfigError
from lightning_sync.strategies.allreduce import AllReduceStrategy
from lightning_sync.strategies.ddp import DDPSyncStrategy
from lightning_sync.strategies.periodic import PeriodicSyncStrategy

__version__ = "0.1.0"

# registry name -> (class, description)
STRATEGIES = {
    "sync_ddp": (DDPSyncStrategy, "torch DDP with metered comm hooks that also run on CPU/gloo"),
    "sync_allreduce": (AllReduceStrategy, "hand-written bucketed all-reduce overlapped with backward, no DDP wrapper"),
    "sync_periodic": (PeriodicSyncStrategy, "sync every N steps: cross-rank gradient accumulation, local SGD, DiLoCo"),
}


def _register_strategies() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for name, (cls, description) in STRATEGIES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=description)


_register_strategies()

__all__ = [
    "AllReduceStrategy",
    "CommMeter",
    "CommStats",
    "ConfigError",
    "DDPSyncStrategy",
    "PeriodicSyncStrategy",
    "STRATEGIES",
]
