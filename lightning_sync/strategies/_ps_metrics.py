"""The ``ps`` strategy's metrics of the servers' replies (private helper of :mod:`lightning_sync.strategies.ps`)."""

from __future__ import annotations

from typing import Any


class ReplyMetrics:
    """``ps/*`` metrics of each logged reply: ``ps/version``; ``ps/staleness`` (async, ssp); each server's ingress
    per update since the last logged reply; and in the elastic modes, the workers each server counts as live, has
    dropped, and the rejoins it accepted.

    Args:
        staleness: log ``ps/staleness`` (async and ssp; in sync it is always 0).
        elastic: log ``ps/server<i>_live_workers``, ``ps/server<i>_lost_workers`` and ``ps/server<i>_joins``.
    """

    def __init__(self, staleness: bool, elastic: bool) -> None:
        self.staleness, self.elastic = staleness, elastic
        self._logged: tuple[int, tuple[int, ...]] | None = None  # version and servers' ingress at the last one

    def of(self, reply: Any) -> dict[str, float]:
        """The metrics of ``reply`` (a :class:`~lightning_sync.ps.reply.PSReply`), to be logged now."""
        metrics = {"ps/version": float(reply.version)}
        if reply.stalest >= 0 and self.staleness:
            metrics["ps/staleness"] = float(reply.stalest)
        if self.elastic:
            for i, (live, lost, joins) in enumerate(zip(reply.live_workers, reply.lost_workers, reply.joins)):
                metrics[f"ps/server{i}_live_workers"] = float(live)
                metrics[f"ps/server{i}_lost_workers"] = float(lost)
                metrics[f"ps/server{i}_joins"] = float(joins)
        if self._logged is not None and reply.version > self._logged[0]:
            for i, (now, then) in enumerate(zip(reply.server_bytes_recv, self._logged[1])):
                metrics[f"ps/server{i}_ingress_per_update"] = (now - then) / (reply.version - self._logged[0])
        self._logged = (reply.version, reply.server_bytes_recv)
        return metrics
