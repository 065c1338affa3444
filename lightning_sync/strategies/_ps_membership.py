"""Who took part in a ``ps`` fit besides the ranks it started with, and where a late worker finds the running fit.

The elastic modes let workers go (lost), come back (rejoined: a restarted rank) and come in (added: a spare slot
taken with ``join``). :meth:`Membership.at_end` reads that from the servers once the run is over; rank 0 names each
in a warning and ``summary.json``. A worker that takes part late (restarted or added) reads the fit's PS group from
the run's store, where rank 0 published it (:func:`publish_fit`, :func:`running_fit`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from lightning_sync.ps.elastic import lost_workers_at_end

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


@dataclass
class Membership:
    """The workers the servers dropped (and why), took back after a loss (how many times), and took in a spare
    slot, by worker rank."""

    lost: dict[int, str] = field(default_factory=dict)
    rejoined: dict[int, int] = field(default_factory=dict)
    added: list[int] = field(default_factory=list)

    @classmethod
    def at_end(cls, client: Any, first_workers: int, grace_s: float) -> Membership:
        """After the stop, before the goodbye: who was lost once every worker is accounted for
        (:func:`~lightning_sync.ps.elastic.lost_workers_at_end`), and the servers' joins. A join in a spare slot (a
        rank of ``first_workers`` or more) is an added worker; its later joins, and the others', are rejoins."""
        out = cls(lost=lost_workers_at_end(client, grace_s))
        added: set[int] = set()
        for server in client.server_stats():
            for worker, joins in server.get("joins", {}).items():
                worker, joins = int(worker), int(joins)
                if worker >= first_workers:
                    added.add(worker)
                    joins -= 1
                if joins > 0:
                    out.rejoined[worker] = max(out.rejoined.get(worker, 0), joins)
        out.added = sorted(added)
        return out

    def warn(self) -> None:
        """(Rank 0) One warning for each kind of change, naming the workers."""
        if self.lost:
            names = "; ".join(f"worker {w} (rank {w}): {why}" for w, why in self.lost.items())
            warnings.warn(f"the ps run ended on the live workers; lost: {names}", stacklevel=3)
        if self.rejoined:
            names = "; ".join(f"worker {w} (rank {w}) {n} time(s)" for w, n in self.rejoined.items())
            warnings.warn(f"the ps run took back lost workers: {names}", stacklevel=3)
        if self.added:
            names = ", ".join(f"worker {w}" for w in self.added)
            warnings.warn(f"the ps run took in workers added to it: {names}", stacklevel=3)
