"""Fault tolerance across replica groups: its settings, their checks, and the timeouts derived from them.

A *replica group* is one ordinary world (one or more ranks, started as a job of its own). This module imports
torchft only when asked to (:func:`require_torchft`).

The timeouts derive from ``timeout_s`` in an order that holds:
``collective_timeout_s < heartbeat_timeout_s + join_timeout_s + sync_period_s < quorum_timeout_s``. A collective with
a lost peer gives up after ``collective_timeout_s`` (torchft's gloo and RPC timeout); the lighthouse then drops the
lost group once its heartbeat is ``heartbeat_timeout_s`` old (torchft's 5 s), and waits up to ``join_timeout_s`` for
stragglers (the guide's 5 s; torchft's binary says 60 s); a survivor may also reach the quorum one sync period
before the slowest one. So a quorum call must wait longer than all of those, or a survivor gives up on a quorum
that was about to form. A live group later than the join timeout misses the sync and heals at the next one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from types import ModuleType
from typing import Any

from lightning_sync.errors import ConfigError, check_range

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""The environment variable holding the default lighthouse address (torchft's own)."""


class FaultToleranceUnavailable(ImportError):
    """Fault tolerance was asked for, and torchft (the ``lightning-sync[ft]`` extra) is not installed."""


def require_torchft() -> ModuleType:
    """Imports torchft, or raises a one-line error naming the extra that installs it.

    Raises:
        FaultToleranceUnavailable: torchft cannot be imported.
    """
    try:
        import torchft
    except ImportError as error:
        raise FaultToleranceUnavailable(
            f"fault tolerance needs torchft, which is not installed ({error}); install the extra: pip install 'lightning-sync[ft]'"
        ) from None
    return torchft


def lighthouse_url(address: str) -> str:
    """``host:port`` (or a URL) as the URL torchft's clients take."""
    return address if "://" in address else f"http://{address}"


@dataclass(frozen=True)
class FaultTolerance:
    """Fault tolerance across replica groups, on torchft.

    Attributes:
        lighthouse: the lighthouse's ``host:port`` (default: the ``TORCHFT_LIGHTHOUSE`` environment variable).
        replica_group: this group's id, in ``[0, num_replica_groups)``; it also keys the group's data shard.
        num_replica_groups: how many groups the job has (the data is split in as many shards).
        min_replicas: a sync commits only with at least this many groups in its quorum.
        timeout_s: the one user-facing timeout; the others derive from it (see the module docstring).
        heartbeat_timeout_s: the lighthouse's heartbeat timeout (seconds without a heartbeat until a group counts as
            lost).
        join_timeout_s: the lighthouse's join timeout (how long a quorum waits for heartbeating stragglers).
        sync_period_s: the longest expected time between two syncs of one group (default: ``timeout_s``).
        collective_timeout_s: the timeout of a cross-group collective (default: ``timeout_s``).
        quorum_timeout_s: how long a group waits for a quorum (default: the sum of the four above).
    """

    lighthouse: str = field(default_factory=lambda: os.environ.get(LIGHTHOUSE_ENV, ""))
    replica_group: int = 0
    num_replica_groups: int = 1
    min_replicas: int = 1
    timeout_s: float = 10.0
    heartbeat_timeout_s: float = 5.0
    join_timeout_s: float = 5.0
    sync_period_s: float | None = None
    collective_timeout_s: float | None = None
    quorum_timeout_s: float | None = None

    def __post_init__(self) -> None:
        check_range("num_replica_groups", self.num_replica_groups, low=1, integer=True)
        check_range("replica_group", self.replica_group, low=0, integer=True)
        if self.replica_group >= self.num_replica_groups:
            raise ConfigError(
                f"replica_group={self.replica_group} is not allowed; it must be in [0, num_replica_groups) = "
                f"[0, {self.num_replica_groups})"
            )
        check_range("min_replicas", self.min_replicas, low=1, integer=True)
        if self.min_replicas > self.num_replica_groups:
            raise ConfigError(
                f"min_replicas={self.min_replicas} is not allowed; it must be <= num_replica_groups="
                f"{self.num_replica_groups}"
            )
        for name in ("timeout_s", "heartbeat_timeout_s"):
            check_range(name, getattr(self, name), low=0, low_open=True)
        check_range("join_timeout_s", self.join_timeout_s, low=0)
        for name in ("sync_period_s", "collective_timeout_s", "quorum_timeout_s"):
            if getattr(self, name) is not None:
                check_range(name, getattr(self, name), low=0, low_open=True)
        if not isinstance(self.lighthouse, str) or not self.lighthouse:
            raise ConfigError(
                f"lighthouse={self.lighthouse!r} is not allowed; give the lighthouse's host:port (or set "
                f"{LIGHTHOUSE_ENV})"
            )
        self.timeouts()  # checks their order

    @property
    def replica_id(self) -> str:
        """The id this group announces to the lighthouse (torchft keys ranks by its trailing digits)."""
        return f"replica_group_{self.replica_group}"

    def timeouts(self) -> tuple[timedelta, timedelta]:
        """The derived timeouts (see the module docstring).

        Returns:
            The collective timeout and the quorum timeout.

        Raises:
            ConfigError: they are not in the order ``collective < heartbeat + join + sync period < quorum``.
        """
        collective = self.collective_timeout_s if self.collective_timeout_s is not None else self.timeout_s
        period = self.sync_period_s if self.sync_period_s is not None else self.timeout_s
        lighthouse_wait = self.heartbeat_timeout_s + self.join_timeout_s + period
        quorum = self.quorum_timeout_s if self.quorum_timeout_s is not None else collective + lighthouse_wait
        if not collective < lighthouse_wait:
            raise ConfigError(
                f"collective_timeout_s={collective:g} is not allowed; it must be < heartbeat_timeout_s + "
                f"join_timeout_s + sync_period_s = {lighthouse_wait:g}, or a quorum forms while a survivor still "
                "waits in a collective"
            )
        if not quorum > lighthouse_wait:
            raise ConfigError(
                f"quorum_timeout_s={quorum:g} is not allowed; it must be > heartbeat_timeout_s + join_timeout_s + "
                f"sync_period_s = {self.heartbeat_timeout_s:g} + {self.join_timeout_s:g} + {period:g} = "
                f"{lighthouse_wait:g}, or a survivor gives up while the lighthouse still waits for a lost group"
            )
        return timedelta(seconds=collective), timedelta(seconds=quorum)

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> FaultTolerance:
        """From a Hydra ``ft`` group's keys (``None`` values take the defaults; unknown keys are an error)."""
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(f"{unknown[0]} is not allowed; the ft keys are: {', '.join(sorted(names))}")
        return cls(**{k: v for k, v in values.items() if v is not None})


def as_fault_tolerance(value: Any) -> FaultTolerance | None:
    """``value`` (a :class:`FaultTolerance`, a mapping of its fields, or ``None``) as a :class:`FaultTolerance`.

    Raises:
        ConfigError: a field out of range (named ``fault_tolerance.<field>``), or another type.
    """
    if value is None or isinstance(value, FaultTolerance):
        return value
    if hasattr(value, "items"):
        try:
            return FaultTolerance.from_mapping(dict(value.items()))
        except ConfigError as error:
            raise error.under("fault_tolerance") from None
    raise ConfigError(
        f"fault_tolerance={value!r} is not allowed; give a lightning_sync.ft.FaultTolerance, a mapping of its "
        "fields, or None"
    )


def check_lighthouse(config: FaultTolerance) -> None:
    """Connects to the lighthouse (no heartbeat, so it counts no one), within ``timeout_s``.

    Raises:
        FaultToleranceUnavailable: torchft is not installed.
        ConfigError: no lighthouse answers at the address within ``timeout_s``.
    """
    require_torchft()
    from torchft.coordination import LighthouseClient

    try:
        LighthouseClient(lighthouse_url(config.lighthouse), connect_timeout=timedelta(seconds=config.timeout_s))
    except Exception as error:  # torchft raises RuntimeError on a refused or silent address
        raise ConfigError(
            f"lighthouse={config.lighthouse!r}: no lighthouse answered there within timeout_s={config.timeout_s:g} s "
            f"({str(error).splitlines()[0][:160]}); start one (torchft_lighthouse --min_replicas 1 "
            "--join_timeout_ms 1000) or fix the address"
        ) from None
