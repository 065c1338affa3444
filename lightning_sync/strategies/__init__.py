"""Lightning adapters, one file per sync mode. Importing this package registers them with Lightning's
``StrategyRegistry``."""

from lightning_sync.strategies._base import SyncStrategyBase
from lightning_sync.strategies.allreduce import AllReduceStrategy
from lightning_sync.strategies.ddp import DDPSyncStrategy
from lightning_sync.strategies.periodic import PeriodicSyncStrategy
from lightning_sync.strategies.ps import ParameterServerStrategy

# registry name -> class (each class carries its name; its docstring's first line is the description)
STRATEGIES = {
    cls.strategy_name: cls
    for cls in (DDPSyncStrategy, AllReduceStrategy, PeriodicSyncStrategy, ParameterServerStrategy)
}


def _register_strategies() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for name, cls in STRATEGIES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=(cls.__doc__ or name).strip().splitlines()[0])


_register_strategies()

__all__ = [
    "AllReduceStrategy",
    "DDPSyncStrategy",
    "ParameterServerStrategy",
    "PeriodicSyncStrategy",
    "STRATEGIES",
    "SyncStrategyBase",
]
