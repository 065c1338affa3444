"""What a worker tells the parameter server about the run. Worker 0 sends it to each server with the initial
parameters; every later request carries a checksum of it, so a worker started with other settings is refused."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from lightning_sync.comm.averaging import OUTER_OPTIMIZER, check_optimizer_callable
from lightning_sync.comm.compression import Compressor, NoCompression
from lightning_sync.errors import ConfigError, check_choice, check_range
from lightning_sync.ps.optim_spec import OptimizerSpec, build_shard_optimizer, optimizer_spec

MODES = ("sync", "async", "ssp")


@dataclass(frozen=True)
class PSConfig:
    """Settings of one parameter-server run, identical on every worker.

    ``mode``, ``max_staleness``, ``skip_nonfinite``, ``local_steps`` and ``elastic`` are the knobs of
    :class:`~lightning_sync.config.ParameterServerConfig` of those names (``local_steps`` a number here).

    Args:
        max_updates: the server version (optimizer steps applied) at which training ends, or ``None`` for no limit.
            In async and ssp every push is one update, so ``W`` workers doing ``n`` steps each make ``W * n``.
        codec: how pushed gradients travel: a ``point_to_point`` codec's
            :meth:`~lightning_sync.comm.compression.Compressor.spec` (``None``: uncompressed fp32).
        push_scale: the knob, with ``None`` for ``auto`` (``1/W``): it multiplies the pushed gradient of SGD-family
            optimizers and the learning rate of scale-invariant ones
            (:func:`~lightning_sync.ps.optim_spec.scales_learning_rate`).
        outer_optimizer: the knob, kept as the :class:`~lightning_sync.ps.optim_spec.OptimizerSpec` dict of what it
            builds, which the servers rebuild over their shards.
        withdraw_lost_share: a lost worker's unused share of ``max_updates`` (``max_updates / W`` minus its pushes) is
            withdrawn, for an end given in epochs; without it the live workers make its updates (an end in steps).

    Raises:
        ConfigError: a field is out of range; the message names the field, the value and what is allowed.
    """

    mode: str = "sync"
    max_staleness: int = 2
    max_updates: int | None = None
    codec: dict[str, Any] | None = None
    skip_nonfinite: bool = True
    push_scale: float | None = None
    local_steps: int = 1
    outer_optimizer: Any = None
    elastic: bool = False
    withdraw_lost_share: bool = False

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES)
        check_range("max_staleness", self.max_staleness, low=0, integer=True)
        if self.max_updates is not None:
            check_range("max_updates", self.max_updates, low=1, integer=True)
        if self.push_scale is not None:
            check_range("push_scale", self.push_scale, low=0, low_open=True)
        check_range("local_steps", self.local_steps, low=1, integer=True)
        if self.outer_optimizer is not None and not isinstance(self.outer_optimizer, dict):
            built = check_optimizer_callable(self.outer_optimizer)
            params = [p for group in built.param_groups for p in group["params"]]
            object.__setattr__(self, "outer_optimizer", optimizer_spec(built, params).as_dict())
        for name in ("skip_nonfinite", "elastic", "withdraw_lost_share"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is not allowed; it must be True or False")

    @property
    def drops_lost_workers(self) -> bool:
        """Whether the servers drop a lost worker and go on with the others (``async``, ``ssp``, elastic ``sync``)."""
        return self.mode != "sync" or self.elastic

    def new_codec(self) -> Compressor:
        """A fresh codec of :attr:`codec` (uncompressed fp32 without one)."""
        return NoCompression() if self.codec is None else Compressor.from_spec(self.codec)

    def new_outer_optimizer(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """A fresh outer optimizer of :attr:`outer_optimizer` over ``params`` (a server's shard)."""
        if self.outer_optimizer is None:
            return OUTER_OPTIMIZER(params)
        spec = OptimizerSpec.from_dict(self.outer_optimizer)
        built, _ = build_shard_optimizer(spec, params, [0] * len(params))
        assert built is not None  # every parameter is in the spec's one group
        return built

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what travels to the servers)."""
        return asdict(self)
