"""When a parameter server declares a worker lost: a live worker it is not itself holding back (a pending sync
gradient, a withheld ssp reply, a deferred pull) that completes no request for ``timeout_s``; every worker once no
request or reply went for that long (``connect_timeout_s`` before the initial parameters). The server loop acts."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from lightning_sync.ps.errors import PSTimeoutError


class WorkerLiveness:
    """Who is live, when each worker was last heard from, and when the server last heard a request or sent a reply.

    Args:
        num_workers: number of workers.
        timeout_s: the longest silence of a worker once the server holds the initial parameters.
        connect_timeout_s: the longest wait for any request before them.
        name: the group's name of a worker (``name(w)``) or, with ``None``, of this server.
        clock: seconds, monotonic (injectable for tests).
    """

    def __init__(
        self,
        num_workers: int,
        timeout_s: float,
        connect_timeout_s: float,
        name: Callable[[int | None], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._name = name
        self._clock = clock
        now = clock()
        self.live = [True] * num_workers
        self.last_contact = [now] * num_workers
        self.last_exchange = now

    def heard(self, worker: int) -> None:
        """``worker`` completed a request now, or (as :meth:`answered`) the server answered it (a worker whose reply
        was held back sent nothing meanwhile): its silence, and the wait for the next request, count from here."""
        self.last_contact[worker] = self.last_exchange = self._clock()

    answered = heard

    def restart(self) -> None:
        """The initial parameters arrived: every worker's silence counts from now."""
        now = self._clock()
        self.last_contact = [now] * len(self.live)

    def bound(self, initialized: bool) -> float:
        """The longest wait for any request after the last request or reply."""
        return self.timeout_s if initialized else self.connect_timeout_s

    def patience(self, initialized: bool, held: Collection[int]) -> float:
        """Seconds until a worker not in ``held`` would be lost, or the wait for any request would end."""
        deadlines = [self.last_exchange + self.bound(initialized)]
        if initialized:
            deadlines += [
                self.last_contact[w] + self.timeout_s for w in range(len(self.live)) if self.live[w] and w not in held
            ]
        return max(min(deadlines) - self._clock(), 0.0) + 0.01

    def waited(self) -> float:
        """Seconds since the last request or reply."""
        return self._clock() - self.last_exchange

    def silent(self, initialized: bool, held: Collection[int]) -> dict[int, float]:
        """``{worker: seconds silent}`` of the live workers not in ``held`` silent for more than ``timeout_s`` (none
        before the initial parameters)."""
        if not initialized:
            return {}
        now = self._clock()
        return {
            w: now - self.last_contact[w]
            for w in range(len(self.live))
            if self.live[w] and w not in held and now - self.last_contact[w] > self.timeout_s
        }

    def check(self, initialized: bool, held: Collection[int]) -> None:
        """Raises :class:`PSTimeoutError` naming each worker :meth:`silent` finds, and for how long."""
        silent = self.silent(initialized, held)
        if silent:
            names = "; ".join(f"{self._name(w)} sent nothing for {s:.1f} s" for w, s in silent.items())
            raise PSTimeoutError(
                f"{names} ({self._name(None)} heard from other workers meanwhile: frozen, dead, or slower than "
                f"timeout_s={self.timeout_s:g})"
            )

    def silence_error(self, held: Collection[int], context: str) -> PSTimeoutError:
        """The error once no request at all arrived within :meth:`bound`, naming the live workers not in ``held`` (all
        if every one is), longest silent first; ``context``: what the server waited for."""
        now = self._clock()
        live = [w for w in range(len(self.live)) if self.live[w]]
        suspects = sorted([w for w in live if w not in held] or live, key=lambda w: self.last_contact[w])
        parts = [f"{self._name(w)} sent nothing for {now - self.last_contact[w]:.1f} s" for w in suspects]
        return PSTimeoutError(
            f"{'; '.join(parts)} ({self._name(None)} {context}; no request at all for {self.waited():.1f} s: "
            "frozen, dead, or slower than timeout_s)"
        )
