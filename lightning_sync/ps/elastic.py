"""The end of an elastic run, seen from a worker: which workers were lost, once every other one is accounted for.

In the elastic modes the servers drop a lost worker and the run goes on. At the end the survivors must agree on
whether anyone was lost before they meet in a collective of their own (a barrier on the default process group would
wait forever for a lost rank); :func:`servers_at_end` gives every survivor the same answer.
"""

from __future__ import annotations

import time
from typing import Any


def lost_workers_at_end(client: Any, timeout_s: float, poll_s: float = 0.1) -> dict[int, str]:
    """``{worker: why}`` of the workers the servers dropped, once every other worker is accounted for (the first
    half of :func:`servers_at_end`, which takes the same arguments)."""
    return servers_at_end(client, timeout_s, poll_s)[0]


def servers_at_end(client: Any, timeout_s: float, poll_s: float = 0.1) -> tuple[dict[int, str], list[dict[str, Any]]]:
    """``({worker: why}, stats)``: the workers the servers dropped, once every other worker is accounted for, and
    the servers' stats that told so (one ``server_stats()`` per server: their joins, counts and clocks at the end).

    Call after the stop (the run's end reached or requested) and before :meth:`~lightning_sync.ps.client.PSClient.
    close`. A worker is accounted for on a server once that server dropped it, sent it a reply carrying the stop, or
    had its goodbye; the answer is the union of every server's drops.

    Args:
        client: this worker's :class:`~lightning_sync.ps.client.PSClient` (after the stop).
        timeout_s: the longest wait for the others (a frozen worker is dropped ``timeout_s`` after its last request).
        poll_s: seconds between two asks.

    Returns:
        The workers dropped, and why; a worker still unaccounted for after ``timeout_s`` (the servers neither sent it
        the stop nor dropped it) counts as lost too, its reason saying so. Then the servers' last stats.
    """
    deadline = time.monotonic() + timeout_s
    me = client.worker
    while True:
        stats = client.server_stats()
        lost: dict[int, str] = {}
        for server in stats:
            for worker, why in server.get("lost_reasons", {}).items():
                lost.setdefault(int(worker), str(why))
        pending = sorted(
            w
            for w in range(client.group.num_workers)
            if w != me
            and w not in lost
            and any(s["live"][w] and w not in s.get("seen_stop", []) for s in stats)  # live: no goodbye yet
        )
        if not pending:
            return dict(sorted(lost.items())), stats
        if time.monotonic() > deadline:
            why = f"neither took the stop nor was dropped by the servers within {timeout_s:g} s of this worker's end"
            lost.update({w: why for w in pending})
            return dict(sorted(lost.items())), stats
        time.sleep(poll_s)
