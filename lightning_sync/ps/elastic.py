"""The end of an elastic run, seen from a worker: the survivors must agree on who was lost before they meet in a
collective of their own (one on the default process group would wait forever for a lost rank)."""

from __future__ import annotations

import time
from typing import Any


def servers_at_end(client: Any, timeout_s: float, poll_s: float = 0.1) -> tuple[dict[int, str], list[dict[str, Any]]]:
    """``({worker: why}, stats)``: the workers every server dropped, once each other worker is accounted for (dropped,
    sent the stop, or said goodbye; after ``timeout_s`` one still unaccounted for counts as lost), and the servers'
    last :meth:`~lightning_sync.ps.client.PSClient.server_stats`. Call with this worker's client after the stop and
    before its goodbye, asking every ``poll_s``."""
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
