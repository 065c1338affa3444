"""What the servers answered to a worker's pull or push."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PSReply:
    """What the servers answered to a pull or a push (one entry per server where it is a tuple).

    Attributes:
        versions: each server's version (optimizer steps applied to its shard) when it replied.
        stop: training is over (``max_updates`` reached or a worker asked to stop): stop pushing, then
            :meth:`PSClient.close`.
        stop_reason: why, e.g. ``"max_updates=100 reached"`` or ``"worker 1 requested stop"``; ``""`` if not
            stopped.
        applied: a push was applied by every server (``False`` for a pull, a push that came after the stop, or
            a skipped one).
        skipped: the push was skipped for a NaN or Inf gradient (``skip_nonfinite``): in sync, some worker's, and
            the step was skipped for every worker; in async and ssp, this worker's. The parameters are unchanged
            by it.
        staleness: per server, the staleness of this push (server version when applied minus the version it was
            computed on; ``0`` in sync); ``-1`` for a pull.
        clocks: per server, this worker's clock (its pushes applied by that server).
        min_clocks: per server, the clock of the slowest live worker.
        server_bytes_recv: per server, everything it received so far (its ingress, all workers), as of the reply.
        server_bytes_sent: per server, everything it sent so far (its egress), as of the reply.
        live_workers: per server, the workers it counts as live (not dropped, no goodbye yet).
        lost_workers: per server, the workers it has dropped (the elastic modes).
        joins: per server, how many times a dropped worker rejoined it (the elastic modes).
    """

    versions: tuple[int, ...]
    stop: bool
    stop_reason: str
    applied: bool
    staleness: tuple[int, ...]
    clocks: tuple[int, ...]
    min_clocks: tuple[int, ...]
    server_bytes_recv: tuple[int, ...]
    server_bytes_sent: tuple[int, ...]
    skipped: bool = False
    live_workers: tuple[int, ...] = ()
    lost_workers: tuple[int, ...] = ()
    joins: tuple[int, ...] = ()

    @property
    def version(self) -> int:
        """The oldest server version (all equal in sync)."""
        return min(self.versions)

    @property
    def stalest(self) -> int:
        """The largest per-server staleness of this push (what to log as ``ps/staleness``); ``-1`` for a pull."""
        return max(self.staleness)
