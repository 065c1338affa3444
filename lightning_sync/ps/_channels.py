"""A parameter server's side of its connections to the workers: complete requests in, replies out, nothing stalls.

Each worker has a receiving thread of its own, which takes that worker's requests (header, then data) and hands the
server loop only complete ones. Replies are launched without waiting for them to be taken (a worker takes a reply
before it sends its next request). So a worker that freezes between requests, in the middle of one, or before
taking its reply holds up nothing but itself.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from typing import Any

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
)
from lightning_sync.ps.errors import PSError
from lightning_sync.ps.group import PSGroup

#: One reply: the worker it goes to, its header and its data (``None``: none).
Reply = tuple[int, tuple[ReplyHeader, torch.Tensor | None]]


class WorkerChannels:
    """The requests of every worker of ``group`` (from :meth:`start` on) and the replies to them.

    Args:
        group: the server's member of the PS group.
        server: the server's index (names the receiving threads).
    """

    def __init__(self, group: PSGroup, server: int) -> None:
        self.group = group
        self.server = server
        self._inflight: dict[int, list[tuple[Kind, Any]]] = {}  # worker -> sends of its last reply
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (worker, request, data, error) of each receiver

    def start(self, workers: Iterable[int]) -> None:
        """Starts one receiving thread per worker of ``workers`` (each first connects its link to that worker)."""
        for worker in workers:
            self.listen(worker, 0)

    def listen(self, worker: int, generation: int) -> None:
        """Starts the receiving thread of ``worker``'s links of ``generation`` (0 at the start, more for a rejoin)."""
        name = f"lightning_sync-ps-server{self.server}-recv{worker}-g{generation}"
        threading.Thread(target=self._receive_from, args=(worker, generation), name=name, daemon=True).start()

    def next(self, timeout_s: float) -> tuple[int, int, Request | None, torch.Tensor | None, BaseException | None]:
        """The next complete request of any worker, as ``(worker, generation, request, data, None)``, or ``(worker,
        generation, None, None, error)`` once that worker's receiving failed.

        Raises:
            queue.Empty: nothing arrived within ``timeout_s``.
        """
        return self._inbox.get(timeout=timeout_s)

    def _receive_from(self, worker: int, generation: int) -> None:
        """Receiving thread of ``worker``: its requests, each complete (header and data), into the inbox, until its
        goodbye or an error.

        The server loop, not this thread, decides when the worker is lost (after ``timeout_s`` of silence it is not
        itself the cause of); this thread's waits are only a backstop, longer than any silence the loop tolerates (a
        gloo wait that times out closes every connection of the member, so it must not end one the loop still
        serves).
        """
        backstop = max(self.group.connect_timeout_s, self.group.timeout_s) + 2 * self.group.timeout_s
        try:
            self.group.connect(worker, generation)
            while True:
                header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
                self.group.receive(header, worker, TAG_REQUEST, "a request", timeout_s=backstop)
                request, payload = Request.parse(header), None
                if request.payload_nbytes > 0:
                    payload = torch.empty(request.payload_nbytes, dtype=torch.uint8)
                    what = f"the data of its {request.kind.name} request"
                    self.group.receive(payload, worker, TAG_REQUEST_DATA, what, timeout_s=backstop)
                self._inbox.put((worker, generation, request, payload, None))
                if request.kind == Kind.BYE:
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which raises it
            self._inbox.put((worker, generation, None, None, exc))

    def send(self, replies: list[Reply]) -> None:
        """Launches the replies without waiting for them to be taken.

        A worker takes a reply's data only once it has every server's reply header, so waiting here could stall
        this server behind another one (e.g. one holding an ssp reply back). The sends are waited for when the worker
        sends its next request (:meth:`settle`), by which time it has taken the reply; the tensors sent are never
        modified meanwhile (packed parameters are a new buffer per version).
        """
        for worker, (header, payload) in replies:
            self.settle(worker)
            works = [(header.kind, self.group.send(header.header(), worker, TAG_REPLY))]
            if payload is not None and payload.numel() > 0:
                works.append((header.kind, self.group.send(payload, worker, TAG_REPLY_DATA)))
            self._inflight[worker] = works

    def forget(self, worker: int) -> None:
        """A lost worker: its replies in flight are not waited for, and its link is dropped."""
        self._inflight.pop(worker, None)
        self.group.drop(worker)

    def settle(self, worker: int) -> None:
        """Waits (bounded) for the sends of the previous reply to ``worker``."""
        for kind, work in self._inflight.pop(worker, []):
            self.group.wait(work, worker, f"it to take the reply to its {kind.name}", receiving=False)

    def settle_all(self) -> None:
        """At the end of the loop: waits for every reply still in flight (only goodbye acknowledgements are left; a
        worker gone right after its goodbye is fine)."""
        for worker in list(self._inflight):
            try:
                self.settle(worker)
            except PSError:
                pass
