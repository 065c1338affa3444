"""The Hydra app's ``ft`` group: ``ft=none`` (the default) or ``ft=torchft`` (one replica group of a fault-tolerant
job, :mod:`lightning_sync.ft`).

:func:`fault_tolerance_arguments` turns the composed ``ft`` node into the strategy's ``fault_tolerance`` argument,
after checking it in the launching process, before any rank starts: the keys (named ``ft.<key>``), the strategy
(``periodic`` and ``allreduce`` take it), torchft's presence, and a lighthouse answering at ``ft.lighthouse`` within
``ft.timeout_s``.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_sync.errors import ConfigError
from lightning_sync.ft.config import FaultTolerance, check_lighthouse

TARGETS = ("lightning_sync.PeriodicSyncStrategy", "lightning_sync.AllReduceStrategy")


def fault_tolerance_arguments(cfg: DictConfig) -> dict[str, Any]:
    """``{"fault_tolerance": {...}}`` for the strategy with ``ft=torchft``; ``{}`` with ``ft=none``.

    Raises:
        ConfigError: a bad ``ft.<key>``, a strategy other than ``periodic`` or ``allreduce``, or no lighthouse at ``ft.lighthouse``.
        FaultToleranceUnavailable: torchft is not installed (names the ``lightning-sync[ft]`` extra).
    """
    node = cfg.get("ft")
    if not node:
        return {}
    values = OmegaConf.to_container(node, resolve=True)
    assert isinstance(values, dict)
    target = cfg.strategy.get("_target_")
    if target not in TARGETS:
        raise ConfigError(
            f"ft=torchft is not allowed with strategy={target!r}; fault tolerance works with strategy=periodic "
            "(strategy.mode=local_sgd or diloco) and strategy=allreduce"
        )
    try:
        config = FaultTolerance.from_mapping({str(k): v for k, v in values.items()})
        check_lighthouse(config)
    except ConfigError as error:
        raise error.under("ft") from None
    return {"fault_tolerance": {k: v for k, v in values.items() if v is not None}}
