"""One request to every server and their replies: the client's waits, and its rule for a lost or silent peer.

:func:`exchange` launches the receives of the replies, then every request (header, then data), and waits for them
all, each wait bounded by the group's ``timeout_s`` (the replies by :func:`reply_timeout_s`). A peer that already gave
up left its reason in the store: the exchange stops on it at once rather than wait out ``timeout_s``. A wait that
fails quotes the report a server leaves just as it closes its connections (:func:`report_of`), waiting a short grace
for it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from lightning_sync.ps._protocol import (
    HEADER_SLOTS,
    TAG_REPLY,
    TAG_REPLY_DATA,
    TAG_REQUEST,
    TAG_REQUEST_DATA,
    Kind,
    ReplyHeader,
    Request,
    Status,
)
from lightning_sync.ps.errors import PSError, PSPeerLostError, PSServerError, PSTimeoutError
from lightning_sync.ps.group import PSGroup


def exchange(
    group: PSGroup,
    kind: Kind,
    requests: Sequence[Request],
    payloads: Sequence[torch.Tensor | None] | None,
    reply_buffers: Sequence[torch.Tensor],
    reply_timeout: float,
    servers_only: bool = False,
) -> list[tuple[ReplyHeader, torch.Tensor | None]]:
    """Sends ``requests[i]`` (and ``payloads[i]``) to server ``i``, for every server, and returns each one's reply.

    Args:
        group: the worker's member of the PS group.
        kind: the requests' kind (names the request in errors).
        requests: one request per server, its ``payload_nbytes`` that of its payload.
        payloads: one payload per server (``None``: none), or ``None`` for no payload at all.
        reply_buffers: one buffer per server that a successful reply of that size is received into.
        reply_timeout: seconds to wait for the replies once the requests are taken (:func:`reply_timeout_s`).
        servers_only: heed only the servers' failure reports (elastic modes: the servers drop a lost worker, and the
            other workers go on).

    Returns:
        ``(reply header, reply data or None)`` per server.

    Raises:
        PSPeerLostError: a peer had already reported a failure, or a server's connection closed.
        PSTimeoutError: a server did not take the request or did not reply in time.
        PSServerError: a server refused the request (its message quoted).
    """
    ranks = [group.server_rank(i) for i in range(len(requests))]
    headers = [torch.zeros(HEADER_SLOTS, dtype=torch.int64) for _ in ranks]
    what = kind.name
    peer = ranks[0]  # the server being dealt with when an error strikes
    graced = False  # whether the wait that failed already included the grace for a server's report
    failed: tuple[int, str] | None = None  # (ps rank, report) of a peer that had already given up
    try:
        reply_works = []
        for i, rank in enumerate(ranks):
            peer = rank
            reply_works.append(group.recv(headers[i], rank, TAG_REPLY))
        header_sends, data_sends = [], []
        for i, rank in enumerate(ranks):
            peer = rank
            payload = payloads[i] if payloads is not None else None
            header_sends.append((i, group.send(requests[i].header(), rank, TAG_REQUEST)))
            if payload is not None and requests[i].payload_nbytes:
                data_sends.append((i, group.send(payload, rank, TAG_REQUEST_DATA)))
        # A peer that already gave up left its reason in the store: stop now rather than wait out timeout_s on
        # the servers it gave up on (asked while the sends are in flight, so a healthy step pays no latency).
        failed = group.first_reported_failure(servers_only)
        if failed is not None:
            raise PSPeerLostError(f"{group.name(failed[0])} failed before this {what}: {failed[1]}")
        deadline = time.monotonic() + group.timeout_s
        for i, work in data_sends:  # a frozen server does not take the data: named after timeout_s
            peer = ranks[i]
            group.wait(work, peer, f"it to take the {what}", receiving=False, timeout_s=_left(deadline))
        deadline = time.monotonic() + reply_timeout
        graced = True
        for i, work in enumerate(reply_works):
            peer = ranks[i]
            group.wait(work, peer, f"the reply to the {what}", receiving=True, timeout_s=_left(deadline))
        # Each header was taken (its server replied): these waits return at once. They come after the replies
        # because gloo does not fail a send that was being written when the peer's connection closed (one
        # queued after a reset write) when it sees the close, while it fails every posted receive: waited
        # first, a header sent to a killed server would wait out timeout_s instead of raising at once.
        deadline = time.monotonic() + group.timeout_s
        for i, work in header_sends:
            peer = ranks[i]
            group.wait(work, peer, f"it to take the {what}", receiving=False, timeout_s=_left(deadline))
        replies = [ReplyHeader.parse(h) for h in headers]
        data_works = []
        buffers: list[torch.Tensor | None] = []
        for i, reply in enumerate(replies):
            if reply.payload_nbytes <= 0:
                buffers.append(None)
                continue
            peer = ranks[i]
            usable = reply.status == Status.OK and reply.payload_nbytes == reply_buffers[i].numel()
            buffer = reply_buffers[i] if usable else torch.empty(reply.payload_nbytes, dtype=torch.uint8)
            buffers.append(buffer)
            data_works.append((i, group.recv(buffer, peer, TAG_REPLY_DATA)))
        for i, work in data_works:
            peer = ranks[i]
            group.wait(work, peer, f"the data of the reply to the {what}", receiving=True)
    except PSError as exc:
        if failed is not None:
            raise  # it quotes the peer's own report already
        # A server that gave up on another worker writes why just as our own wait ends: give it the grace,
        # unless a timed-out wait for replies has just given it (waiting twice only delays the error).
        patience_s = 0.0 if graced and isinstance(exc, PSTimeoutError) else min(group.timeout_s / 4, 5.0)
        reporter, report = report_of(group, peer, patience_s=patience_s, servers_only=servers_only)
        raise type(exc)(f"{exc}; {group.name(reporter)} reported: {report}" if report else str(exc)) from exc
    errors = [
        f"{group.name(ranks[i])} refused the {what}: {bytes(buffer.tolist()).decode(errors='replace')}"
        for i, (reply, buffer) in enumerate(zip(replies, buffers))
        if reply.status == Status.ERROR and buffer is not None
    ]
    if errors:
        raise PSServerError("; ".join(errors))
    return list(zip(replies, buffers))


def reply_timeout_s(group: PSGroup, kind: Kind, initialized: bool, drops_lost_workers: bool = False) -> float:
    """How long to wait for replies.

    Before the servers hold parameters (INIT, first pulls: ``initialized`` is ``False`` while this worker has
    pulled no version yet) a reply may wait for worker 0's INIT: ``connect_timeout_s``. Otherwise ``timeout_s`` plus
    a grace of a quarter of it (at most 5 s): a server that gives up on a silent worker after ``timeout_s`` then
    closes its connections, and the waiting workers hear its reason instead of timing out at the same moment.

    Where the servers drop a lost worker and go on (``drops_lost_workers``: ssp's bound and an elastic sync round
    hold a reply until the slowest live worker pushes), the reply may wait for that worker's drop: ``timeout_s``
    after its last request, which may come up to ``timeout_s`` after this request was sent. So the wait is twice
    ``timeout_s`` plus the grace.
    """
    if kind == Kind.INIT or (kind == Kind.PULL and not initialized):
        return group.connect_timeout_s
    grace = min(group.timeout_s / 4, 5.0)
    return (2 if drops_lost_workers else 1) * group.timeout_s + grace


def report_of(group: PSGroup, ps_rank: int, patience_s: float, servers_only: bool = False) -> tuple[int, str | None]:
    """``(rank, message)``: the failure message server ``ps_rank`` left in the store (it may write it just after
    closing its connections), waiting up to ``patience_s`` for it; failing that, another member's, which ends
    the wait at once (e.g. a lost worker reported by the launcher, which then stopped the servers)."""
    deadline = time.monotonic() + patience_s
    while True:
        report = group.reported_failure(ps_rank)
        if report:
            return ps_rank, report
        other = group.first_reported_failure(servers_only)
        if other is not None or time.monotonic() > deadline:
            return other if other is not None else (ps_rank, None)
        time.sleep(0.05)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)
