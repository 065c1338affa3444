"""Who takes part in a ``ps`` fit besides the ranks it started with: the strategy's elastic side.

In the elastic modes workers may be lost, and added in a spare slot with ``join`` (as a lost one comes back). An added
worker finds the running fit's PS group in the run's store, where rank 0 published it (:func:`publish_fit`,
:func:`running_fit`); at the end :meth:`Membership.take_at_end` asks the servers who was lost or added.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

from lightning_sync.errors import ConfigError
from lightning_sync.ps.elastic import servers_at_end

_PREFIX_KEY = "lightning_sync/ps/fit_prefix"  # the fit's PS group prefix
_LAYOUT_KEY = "lightning_sync/ps/fit_layout"  # "<worker ranks> <spare slots> <servers>"


def publish_fit(store: Any, prefix: str, workers: int, spare_workers: int, servers: int) -> None:
    """(Rank 0) Leaves the fit's PS group in the run's store for the workers that take part late."""
    store.set(_LAYOUT_KEY, f"{workers} {spare_workers} {servers}")
    store.set(_PREFIX_KEY, prefix)


def running_fit(store: Any) -> tuple[str, int, int, int]:
    """``(prefix, worker ranks, spare slots, servers)`` of the running fit (waits, within the store's timeout, for
    rank 0 to publish them)."""
    prefix = store.get(_PREFIX_KEY).decode()
    workers, spare_workers, servers = (int(n) for n in store.get(_LAYOUT_KEY).decode().split())
    return prefix, workers, spare_workers, servers


class Membership:
    """Who takes part in the ``ps`` fit: this worker's rank in the PS group, the workers the fit started with, and
    at the end, the workers the servers dropped (and why) and took in a spare slot, by worker rank.

    Args:
        elastic: whether a lost worker leaves the job running (then :meth:`take_at_end` asks the servers).
        late: whether this process is a worker added to a running fit with ``join``.
    """

    def __init__(self, elastic: bool, late: bool) -> None:
        self.elastic, self.late = elastic, late
        self.ps_rank = -1  # this worker's rank in the PS group: its global rank, or (join) the spare slot it took
        self.first_workers = 0  # the workers the fit started with (the PS group's worker ranks before the spare slots)
        self.lost: dict[int, str] = {}  # elastic modes: the workers the servers dropped, and why
        self.added: list[int] = []  # the workers added to the run in a spare slot (their ranks)

    @property
    def can_attach(self) -> bool:
        """Whether the ranks can meet again after the fit. After a lost worker the survivors stay apart: a collective
        would wait for the lost rank. A worker added in a spare slot is in no one's default process group: it stays
        apart, and the others attach as usual."""
        return not (self.lost or self.late)

    def take_at_end(self, client: Any, timeout_s: float) -> None:
        """After the stop, before the goodbye (elastic modes): who was lost once every worker is accounted for
        (:func:`~lightning_sync.ps.elastic.servers_at_end`), and the servers' joins: a join in a spare slot (a
        rank of ``first_workers`` or more) is an added worker. Worker 0 names each in a warning."""
        if not self.elastic:
            return
        grace = timeout_s + min(timeout_s / 4, 5.0) + 5.0
        self.lost, stats = servers_at_end(client, grace)
        joined = {int(worker) for server in stats for worker in server.get("joins", {})}
        self.added = sorted(w for w in joined if w >= self.first_workers)
        if self.ps_rank == 0:
            self._warn()

    def _warn(self) -> None:
        """One warning for each kind of change, naming the workers."""
        if self.lost:
            names = "; ".join(f"worker {w} (rank {w}): {why}" for w, why in self.lost.items())
            warnings.warn(f"the ps run ended on the live workers; lost: {names}", stacklevel=3)
        if self.added:
            names = ", ".join(f"worker {w}" for w in self.added)
            warnings.warn(f"the ps run took in workers added to it: {names}", stacklevel=3)


def check_join_address() -> None:
    """(``join``) The running job's rank 0 address must be in the environment, checked before anything starts."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ConfigError(
            f"strategy.join=true needs {' and '.join(missing)} in the environment: the address and port of "
            "the running job's rank 0 (start that job with MASTER_PORT set, and give this process the same)"
        )
