"""The config of the parameter server strategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_sync.config.common import StrategyConfig
from lightning_sync.config.knobs import knob
from lightning_sync.errors import ConfigError, check_choice, check_range

PS_PLACEMENTS = ("dedicated", "colocated")


@dataclass
class ParameterServerConfig(StrategyConfig):
    """The ``ps`` strategy: workers push gradients to parameter servers, which step and send parameters back."""

    mode: str = knob(
        "sync",
        """``sync``: every step, each server averages one gradient from every worker, steps once, and every worker pulls
        (= DDP with plain SGD); ``async``: each push is applied as it arrives and its worker gets the result at once;
        ``ssp``: as async, but no worker runs more than ``max_staleness`` steps ahead of the slowest.""",
    )
    max_staleness: int = knob(2, """``ssp``: how many steps the fastest worker may lead the slowest (0: lockstep).""")
    num_servers: int = knob(
        1,
        "Servers the parameters are sharded over, balanced by bytes (whole tensors per server).",
    )
    placement: str = knob(
        "dedicated",
        """``dedicated``: the strategy starts ``num_servers`` server processes on node 0, watches them and stops them;
        ``colocated``: each of the first ``num_servers`` worker ranks also runs one server, in a thread.""",
    )
    compression: Any = knob(
        "none",
        """How pushed gradients travel: a codec that can ride point_to_point, as an object or a registry name
        (``none``, ``fp16``, ``bf16``, ``topk``). Parameters come back uncompressed.""",
    )
    slow_worker: int = knob(-1, """For experiments: the worker rank to slow down (-1: none).""")
    slowdown: float = knob(
        1.0,
        "For experiments: ``slow_worker``'s batches take this many times as long (a ``StragglerCallback``; >= 1).",
    )
    push_scale: Any = knob(
        "auto",
        """``async``/``ssp``: the factor of one push's step, a number > 0 or ``auto``: ``1/W`` (W workers), so W pushes
        move about as far as one sync step. It scales the gradient for SGD-family optimizers, the learning rate for
        scale-invariant ones (Adam family, RMSprop, Adagrad).""",
    )
    local_steps: Any = knob(
        1,
        """Async local SGD: each worker steps its own optimizer this many times, then pushes its pseudo-gradient (its
        change since its last pull) and the servers step ``outer_optimizer`` on it. 1: push gradients.
        ``auto``: each worker its own count from its measured speed, ``max_local_steps`` for the fastest.""",
    )
    max_local_steps: int = knob(
        8,
        "``local_steps: auto``: the fastest worker's local steps; a worker k times slower takes about 1/k of them.",
    )
    outer_optimizer: Any = knob(
        None,
        """``local_steps > 1``: the servers' outer optimizer, as ``periodic``'s, rebuilt by each server over its shard
        (its class must be importable there). In async and ssp, momentum belongs in ``lightning_sync.DelayedNesterov``
        with ``delay`` the number of workers. ``None``: ``lightning_sync.OUTER_OPTIMIZER``.""",
    )
    elastic: bool = knob(
        False,
        """``sync``: a lost worker (killed, crashed, or silent for ``timeout_s``) is dropped and each step averages the
        live workers' pushes, instead of ending the job. ``async`` and ``ssp`` always drop a lost worker.""",
    )
    spare_workers: int = knob(
        0,
        """``async``/``ssp``: worker slots the servers keep free, beyond the job's ranks, for workers added to the
        running job (``join``); each trains on the whole training set, and its pushes count towards the end.""",
    )
    join: bool = knob(
        False,
        """Run this process as a worker added to a running ``ps`` job (``async``/``ssp``, started with
        ``spare_workers``), found at ``MASTER_ADDR``:``MASTER_PORT``: it takes a spare slot, pulls the parameters and
        step count, and trains until the servers stop. Give the job's own command with ``strategy.join=true``.""",
    )

    def __post_init__(self) -> None:
        """Checks the knobs and how they combine; ``mode``, and ``max_staleness``, ``push_scale`` and ``local_steps`` as
        numbers, are :class:`~lightning_sync.ps.settings.PSConfig`'s to check (``algorithms.ps_settings``)."""
        super().__post_init__()
        for name in ("elastic", "join"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}={getattr(self, name)!r} is not allowed; it must be True or False")
        check_range("spare_workers", self.spare_workers, low=0, integer=True)
        check_range("num_servers", self.num_servers, low=1, integer=True)
        check_choice("placement", self.placement, PS_PLACEMENTS)
        check_range("slow_worker", self.slow_worker, low=-1, integer=True)
        check_range("slowdown", self.slowdown, low=1)
        for name, value in (("push_scale", self.push_scale), ("local_steps", self.local_steps)):
            if isinstance(value, str) and value != "auto":
                raise ConfigError(f"{name}={value!r} is not allowed; it must be a number, or 'auto'")
        if self.local_steps == "auto":
            check_range("max_local_steps", self.max_local_steps, low=2, integer=True)
            if self.mode == "sync":
                raise ConfigError(
                    "local_steps='auto' is not allowed with mode='sync' (sync workers keep in step, so the slowest "
                    "sets the pace whatever the counts); it is for async and ssp"
                )
        for name, modes, why in _FOR_MODES:  # a knob set away from its default, in a mode that has no use for it
            value = getattr(self, name)
            if self.mode not in modes and value != getattr(ParameterServerConfig, name):
                raise ConfigError(f"{name}={value!r} is not allowed with mode={self.mode!r}; {why}")
        if self.join and not self.spare_workers:
            raise ConfigError(
                "join=True is not allowed with spare_workers=0; a worker joins a job started with spare_workers "
                ">= 1: give that job's command, spare_workers included"
            )


#: ``(knob, the modes it is for, why)``: each knob that only those modes may set away from its default.
_FOR_MODES = (
    ("max_staleness", ("ssp",), "it is for ssp"),
    ("push_scale", ("async", "ssp"), "a sync step averages the gradients; it is for async and ssp"),
    ("elastic", ("sync",), "it is for sync (async and ssp always drop a lost worker)"),
    ("spare_workers", ("async", "ssp"), "a worker is added to a running job in async or ssp"),
    ("join", ("async", "ssp"), "a worker is added to a running job in async or ssp"),
)
