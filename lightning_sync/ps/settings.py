"""What a worker tells the parameter server about the run: sync mode, staleness bound, end, compression.

:class:`PSConfig` is built on every worker (identically); worker 0 sends it to each server with the initial
parameters, and every later request carries a checksum of it, so a worker started with other settings is refused
with a message instead of corrupting the run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

#: Sync modes of the server loop.
MODES = ("sync", "async", "ssp")

#: Gradient encodings a worker may push with. PowerSGD is not among them: its factors are averaged by an
#: all-reduce across workers, which a point-to-point push to a server does not have.
COMPRESSIONS = ("none", "fp16", "bf16", "topk")


@dataclass(frozen=True)
class PSConfig:
    """Settings of one parameter-server run, identical on every worker.

    Args:
        mode: ``"sync"`` (the server averages one gradient from every worker, steps once, then replies to all),
            ``"async"`` (every push is applied as it arrives and answered at once) or ``"ssp"`` (applied as in
            async, but a worker's reply is withheld while it is more than ``max_staleness`` pushes ahead of the
            slowest live worker).
        max_staleness: the ssp bound ``s >= 0`` (``0`` is lockstep). Ignored by the other modes.
        max_updates: the server version (optimizer steps applied) at which training ends, or ``None`` for no limit.
            In async and ssp every push is one update, so ``W`` workers doing ``n`` steps each make ``W * n``.
        compression: how pushed gradients travel, one of :data:`COMPRESSIONS`.
        topk_density: fraction of each shard's gradient entries ``topk`` sends, in ``(0, 1]``.
        error_feedback: with ``topk``, keep what was not sent on the worker and add it to the next push.
        skip_nonfinite: a worker whose gradient holds a NaN or Inf pushes none (its codec's memory untouched) and
            the servers skip: in sync the whole step, for every worker; in async and ssp that push.
        push_scale: async and ssp: the factor of each push's step, a number > 0, or ``None`` for ``1/W``; it
            multiplies the pushed gradient of SGD-family optimizers and the learning rate of scale-invariant ones
            (:func:`~lightning_sync.ps.optim_spec.scales_learning_rate`). Ignored in sync, where a step averages the
            ``W`` gradients.
        local_steps: ``1``: workers push gradients and the servers step the workers' optimizer. ``H > 1`` (async
            local SGD, :mod:`~lightning_sync.ps.outer`): each worker steps its own optimizer ``H`` times, then pushes
            its pseudo-gradient, and the servers step an outer SGD (:class:`~lightning_sync.ps.outer.
            DelayedNesterov`) with ``outer_lr``, ``outer_momentum`` and ``outer_nesterov``; its momentum is applied
            once per ``W`` pushes in async and ssp, at every step in sync.
        outer_lr: ``local_steps > 1``: learning rate of the outer SGD (> 0).
        outer_momentum: ``local_steps > 1``: its momentum, in [0, 1).
        outer_nesterov: ``local_steps > 1``: Nesterov momentum.
        elastic: ``sync`` only: a lost worker is dropped and the step averages the live workers' pushes, rather than
            ending the run. ``async`` and ``ssp`` are always elastic (see :mod:`lightning_sync.ps.server`).
        withdraw_lost_share: when a worker is lost, its unused share of ``max_updates`` (``max_updates / W`` minus the
            pushes it made) is withdrawn, so the live workers still make their own share and no more (an end given in
            epochs); without it the live workers make the lost one's updates too (an end given in steps).

    Raises:
        ValueError: a field is out of range; the message names the field, the value and what is allowed.
    """

    mode: str = "sync"
    max_staleness: int = 0
    max_updates: int | None = None
    compression: str = "none"
    topk_density: float = 0.01
    error_feedback: bool = True
    skip_nonfinite: bool = True
    push_scale: float | None = None
    local_steps: int = 1
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    elastic: bool = False
    withdraw_lost_share: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not a parameter-server mode; choose one of {', '.join(MODES)}")
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness!r} must be an integer >= 0 (0 is lockstep)")
        if self.max_updates is not None and (
            isinstance(self.max_updates, bool) or not isinstance(self.max_updates, int) or self.max_updates < 1
        ):
            raise ValueError(f"max_updates={self.max_updates!r} must be an integer >= 1, or None for no limit")
        if self.compression == "powersgd":
            raise ValueError(
                "compression='powersgd' is not supported by ps (its factors need an all-reduce across workers, "
                f"a push to a server is point-to-point); choose one of {', '.join(COMPRESSIONS)}"
            )
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"compression={self.compression!r} is not supported by ps; choose one of {', '.join(COMPRESSIONS)}"
            )
        density = self.topk_density
        if (
            isinstance(density, bool)
            or not isinstance(density, (int, float))
            or not (math.isfinite(density) and 0.0 < density <= 1.0)
        ):
            raise ValueError(f"topk_density={density!r} must be a number in (0, 1]")
        scale = self.push_scale
        if scale is not None and (
            isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0)
        ):
            raise ValueError(f"push_scale={scale!r} must be a number > 0, or 'auto' for the optimizer's default")
        if isinstance(self.local_steps, bool) or not isinstance(self.local_steps, int) or self.local_steps < 1:
            raise ValueError(f"local_steps={self.local_steps!r} must be an integer >= 1 (1: no local steps)")
        lr, momentum = self.outer_lr, self.outer_momentum
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"outer_lr={lr!r} must be a number > 0")
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ValueError(f"outer_momentum={momentum!r} must be a number in [0, 1)")
        for name in ("error_feedback", "skip_nonfinite", "outer_nesterov", "elastic", "withdraw_lost_share"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")

    @property
    def drops_lost_workers(self) -> bool:
        """Whether the servers drop a lost worker and go on with the others (``async``, ``ssp``, elastic ``sync``)."""
        return self.mode != "sync" or self.elastic

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what travels to the servers)."""
        return asdict(self)
