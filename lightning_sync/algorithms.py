"""The comm algorithms a strategy config asks for, built (and so checked) from its knobs: torch only, no Lightning.

A strategy's constructor builds them, and the Hydra app once more before it starts any process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lightning_sync.comm.bucketing import GradientSynchronizer
from lightning_sync.comm.compression import Compressor, resolve_codec
from lightning_sync.comm.periodic import AdaptiveOptions, PeriodicAverager, StreamingOptions
from lightning_sync.config import (
    DDPConfig,
    GradientSyncKnobs,
    ParameterServerConfig,
    PeriodicConfig,
    StrategyConfig,
)
from lightning_sync.errors import ConfigError
from lightning_sync.ft.averager import FaultTolerantAverager
from lightning_sync.ps.settings import PSConfig


@dataclass
class AlgorithmParts:
    """What a mode's algorithms need beyond the process group, built (and so checked) from the config.

    Attributes:
        new_compressor: builds a fresh gradient compressor (one per bucket group); ``None`` for ``ps``, whose
            codec is built by the servers from :func:`ps_settings`.
        averager: the ``periodic`` averager of ``local_sgd``/``diloco``; ``None`` otherwise.
        fault_tolerant_averager: ``averager`` itself where it also syncs across replica groups
            (``fault_tolerance``); the strategy connects it to the other groups once its process group exists.
    """

    new_compressor: Callable[[], Compressor] | None = None
    averager: PeriodicAverager | None = None
    fault_tolerant_averager: FaultTolerantAverager | None = None


def ps_settings(cfg: ParameterServerConfig, max_updates: int | None = None) -> PSConfig:
    """The :class:`~lightning_sync.ps.settings.PSConfig` of a ``ps`` strategy config.

    The knobs were checked with each other by the config itself; this converts them.

    Raises:
        ConfigError: a setting the ps package refuses.
    """
    try:
        return PSConfig(
            cfg.mode,
            cfg.max_staleness if cfg.mode == "ssp" else 0,
            max_updates,
            codec=resolve_codec(cfg.compression, "compression", needs=("point_to_point",))().spec(),
            skip_nonfinite=cfg.skip_nonfinite,
            push_scale=None if cfg.push_scale == "auto" else cfg.push_scale,
            local_steps=cfg.max_local_steps if cfg.local_steps == "auto" else cfg.local_steps,
            outer_optimizer=cfg.outer_optimizer,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None


def build_parts(cfg: StrategyConfig) -> AlgorithmParts:
    """The algorithms of ``cfg``'s mode, built from its knobs.

    Raises:
        ConfigError: an algorithm refused a knob; the message names the field (without the ``strategy.`` prefix).
    """
    if isinstance(cfg, DDPConfig):
        return AlgorithmParts(resolve_codec(cfg.comm_hook, "comm_hook"))
    if isinstance(cfg, ParameterServerConfig):
        ps_settings(cfg)  # checked now; built with max_updates once training starts
        return AlgorithmParts()
    assert isinstance(cfg, GradientSyncKnobs)  # allreduce and periodic
    GradientSynchronizer.check_settings(cfg.bucketing, cfg.bucket_cap_mb, cfg.first_bucket_mb)
    parts = AlgorithmParts(resolve_codec(cfg.compression))
    if isinstance(cfg, PeriodicConfig) and cfg.mode != "gradient":
        # FaultTolerantAverager's constructor refuses the knobs that cannot be made fault tolerant
        averager_class = PeriodicAverager if cfg.fault_tolerance is None else FaultTolerantAverager
        parts.averager = averager_class(
            outer=cfg.mode == "diloco",
            new_compressor=parts.new_compressor,
            streaming=StreamingOptions(**cfg.arguments_for(StreamingOptions)),
            adaptive=AdaptiveOptions(**cfg.arguments_for(AdaptiveOptions)),
            **cfg.arguments_for(PeriodicAverager),
        )
        if isinstance(parts.averager, FaultTolerantAverager):
            parts.fault_tolerant_averager = parts.averager
    return parts
