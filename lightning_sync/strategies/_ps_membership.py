"""Who takes part in a ``ps`` fit besides the ranks it started with: the strategy's elastic side.

The elastic modes (``async``, ``ssp``, ``sync`` with ``elastic``) let workers go (lost) and come in (added: a spare
slot taken with ``join``; a lost worker comes back the same way, its supervisor running the ``join`` command again).
:class:`ElasticWorkers` holds what the strategy does about them: an added worker is a world of its own for
Lightning's collectives and finds the running fit's PS group in the run's store, where rank 0 published it
(:func:`publish_fit`, :func:`running_fit`); at the end :meth:`Membership.at_end` reads from the servers who was lost
or added, and rank 0 names each in a warning and ``summary.json``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from typing_extensions import override

from lightning_sync.config import ParameterServerConfig
from lightning_sync.errors import ConfigError
from lightning_sync.ps.elastic import servers_at_end
from lightning_sync.strategies._detached import DetachableCollectives

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
    """The workers the servers dropped (and why) and took in a spare slot, by worker rank."""

    lost: dict[int, str] = field(default_factory=dict)
    added: list[int] = field(default_factory=list)

    @classmethod
    def at_end(cls, client: Any, first_workers: int, grace_s: float) -> Membership:
        """After the stop, before the goodbye: who was lost once every worker is accounted for
        (:func:`~lightning_sync.ps.elastic.servers_at_end`), and the servers' joins: a join in a spare slot (a
        rank of ``first_workers`` or more) is an added worker."""
        lost, stats = servers_at_end(client, grace_s)
        joined = {int(worker) for server in stats for worker in server.get("joins", {})}
        return cls(lost=lost, added=sorted(w for w in joined if w >= first_workers))

    def warn(self) -> None:
        """(Rank 0) One warning for each kind of change, naming the workers."""
        if self.lost:
            names = "; ".join(f"worker {w} (rank {w}): {why}" for w, why in self.lost.items())
            warnings.warn(f"the ps run ended on the live workers; lost: {names}", stacklevel=3)
        if self.added:
            names = ", ".join(f"worker {w}" for w in self.added)
            warnings.warn(f"the ps run took in workers added to it: {names}", stacklevel=3)


class ElasticWorkers(DetachableCollectives):
    """The ps strategy's elastic side: whether a lost rank leaves the job running, and how a worker added with
    ``join`` takes part in the running fit."""

    config: ParameterServerConfig

    def _init_membership(self) -> None:
        self.lost_workers: dict[int, str] = {}  # elastic modes: the workers the servers dropped, and why
        self.added_workers: list[int] = []  # the workers added to the run in a spare slot (their ranks)
        self._ps_rank = -1  # this worker's rank in the PS group: its global rank, or (join) the spare slot it took
        self._first_workers = 0  # the workers the fit started with (the PS group's worker ranks before the spare slots)

    @property
    def tolerates_lost_ranks(self) -> bool:
        """Whether losing a worker rank other than 0 leaves the job running (``async`` and ``ssp``: the servers drop
        it and the others go on); the launcher's child observer and the app's end of job ask this. Rank 0 hosts the
        store and the dedicated servers: losing it always ends the job, as losing a server does."""
        return self.config.mode != "sync" or self.config.elastic

    @property
    def _runs_apart(self) -> bool:
        """Whether the workers run apart from each other during the fit (no Lightning collective among them): in
        async and ssp, and in elastic sync, where a lost rank must not hang a collective of the others."""
        return self.tolerates_lost_ranks

    @property
    def _late(self) -> bool:
        """Whether this process takes part in a running fit: a worker added with ``join``."""
        return bool(self.config.join)

    def _check_join_address(self) -> None:
        """(``join``) The running job's rank 0 address must be in the environment, checked before anything starts."""
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise ConfigError(
                f"strategy.join=true needs {' and '.join(missing)} in the environment: the address and port of "
                "the running job's rank 0 (start that job with MASTER_PORT set, and give this process the same)"
            )

    @override
    def setup_distributed(self) -> None:
        """Joins the process group as the base does. A worker added with ``join`` is a world of its own instead:
        Lightning's default process group needs every rank at once, so its collectives act on itself; it samples
        the whole training set."""
        if self._late and not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self._alone = self.config.join
        super().setup_distributed()

    def _take_membership(self, client: Any) -> None:
        """At the end of the fit: who was lost or added (elastic modes; rank 0 names them)."""
        membership = Membership()
        if self.tolerates_lost_ranks:
            grace = self.config.timeout_s + min(self.config.timeout_s / 4, 5.0) + 5.0
            membership = Membership.at_end(client, self._first_workers, grace)
        self.lost_workers, self.added_workers = membership.lost, membership.added
        if self._ps_rank == 0:
            membership.warn()

    @override
    def _can_attach(self) -> bool:
        """After a lost worker the survivors stay apart: a collective would wait for the lost rank. A worker added in
        a spare slot is in no one's default process group: it stays apart, and the others attach as usual."""
        return not (self.lost_workers or self._late)
