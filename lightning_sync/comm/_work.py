"""The handle of an asynchronous collective issued through :class:`~lightning_sync.comm.meter.CommMeter`: it books the
collective's time in flight once, and restates a failure a peer caused (:mod:`~lightning_sync.comm.peer_errors`)."""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_sync.comm.peer_errors import Peers, naming_peer


class TimedWork:
    """An async work handle whose completion time is booked exactly once.

    Args:
        work: the torch.distributed work.
        book: called once with the seconds from ``started`` until the work completed.
        started: ``time.perf_counter()`` at launch.
        op: a collective's name: its failure names the peer (point-to-point errors are the caller's).
        group: the collective's process group; only its :class:`~lightning_sync.comm.peer_errors.Peers` are kept,
            never the group (the completion callback runs on the backend's thread, see ``Peers``).
        timeout_s: the group's timeout, named in a :class:`~lightning_sync.comm.peer_errors.PeerError`.
    """

    def __init__(
        self,
        work: Any,
        book: Callable[[float], None],
        started: float,
        op: str | None = None,
        group: Any = None,
        timeout_s: float | None = None,
    ) -> None:
        self._work = work
        self._book_seconds = book
        self._started = started
        self._timeout_s = timeout_s
        self._op = op
        self._peers = Peers.of(group) if op is not None else None
        self._booked = False
        self._lock = threading.Lock()  # the future's callback and wait() may both book
        try:
            self._future: torch.futures.Future | None = work.get_future().then(self._on_done)
        except RuntimeError:  # some backends' point-to-point works have no future: book the time at wait()
            self._future = None

    def _on_done(self, fut: torch.futures.Future) -> Any:
        self._book()
        with naming_peer(self._op, self._peers, self._timeout_s):
            return fut.value()

    def _book(self) -> None:
        with self._lock:
            if self._booked:
                return
            self._booked = True
        self._book_seconds(time.perf_counter() - self._started)

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the collective is done; ``timeout`` (seconds) bounds the wait on the work itself."""
        if self._future is None:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(datetime.timedelta(seconds=timeout))
            self._book()
        elif timeout is None:
            self._future.wait()
        else:
            deadline = time.monotonic() + timeout
            while not self._future.done():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"collective not done after {timeout} s")
                time.sleep(0.0005)
            self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        """A future that completes after the collective and after its time is booked."""
        if self._future is None:
            raise RuntimeError("this work handle has no future; call wait()")
        return self._future

    def source_rank(self) -> int:
        """The group rank that a completed receive from any source (``CommMeter.recv_from(..., None)``) came from."""
        return int(self._work._source_rank())
