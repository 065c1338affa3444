"""lightning_sync: PyTorch Lightning strategies that keep data-parallel replicas in sync in different ways.

Importing the package registers the strategies with Lightning's ``StrategyRegistry`` (``sync_ddp``, ...), so
``Trainer(strategy="sync_ddp")`` works as well as passing an object.
"""

from lightning_sync.comm.meter import CommMeter, CommStats
from lightning_sync.errors import ConfigError
from lightning_sync.strategies.allreduce import AllReduceStrategy
from lightning_sync.strategies.ddp import DDPSyncStrategy
from lightning_sync.strategies.periodic import PeriodicSyncStrategy
from lightning_sync.strategies.ps import ParameterServerStrategy

__version__ = "0.1.0"

# registry name -> class (each class carries its name; its docstring's first line is the description)
STRATEGIES = {
    cls.strategy_name: cls
    for cls in (DDPSyncStrategy, AllReduceStrategy, PeriodicSyncStrategy, ParameterServerStrategy)
}


def _register_strategies() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    for name, cls in STRATEGIES.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, cls, description=cls.__doc__.strip().splitlines()[0])


_register_strategies()

__all__ = [
    "AllReduceStrategy",
    "CommMeter",
    "CommStats",
    "ConfigError",
    "DDPSyncStrategy",
    "ParameterServerStrategy",
    "PeriodicSyncStrategy",
    "STRATEGIES",
]
