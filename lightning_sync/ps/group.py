"""The parameter-server process group: ``W`` worker ranks, then ``k`` server ranks, on a c10d store.

Workers talk only to servers, so the group is a set of links, one per (worker, server) pair: a two-member
``ProcessGroupGloo`` on a ``PrefixStore`` of its own, never the default process group; losing a worker breaks only its
own links. Messages are CPU tensors matched by tag, metered by a :class:`CommMeter`; every wait is bounded and raises
an error naming the peer. A gloo wait that times out closes its link, so a timeout is reported, never retried.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.peer_errors import rendezvous_timeout_s
from lightning_sync.errors import check_range
from lightning_sync.ps.errors import PSError, PSPeerLostError, PSTimeoutError

#: Default store prefix of the PS group (a second group on the same store needs another prefix).
DEFAULT_PREFIX = "lightning_sync/ps"
_FAILURE_COUNT_KEY = "count"  # how many members have reported a failure (member reports are keyed by ps rank)


def _seconds(value: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(value))


def _check_timeout(name: str, value: Any) -> float:
    check_range(name, value, low=0, low_open=True)  # finite: every wait is bounded
    return float(value)


def check_counts(num_workers: int, num_servers: int) -> None:
    """Raises ``ValueError`` unless both counts are integers >= 1."""
    check_range("num_workers", num_workers, low=1, integer=True)
    check_range("num_servers", num_servers, low=1, integer=True)


def connect_store(host: str, port: int, *, is_host: bool, timeout_s: float = 60.0) -> dist.TCPStore:
    """The run's ``TCPStore`` at ``host:port``: hosted by worker 0 (``is_host=True``), joined by everyone else; its
    operations (the group rendezvous) wait up to ``timeout_s``.

    Raises:
        ValueError: bad ``port`` or ``timeout_s``.
    """
    check_range("port", port, low=0, high=65535, integer=True)
    timeout_s = _check_timeout("timeout_s", timeout_s)
    return dist.TCPStore(host, port, None, bool(is_host), _seconds(timeout_s), wait_for_workers=False)


def claim_spare_slot(store: dist.Store, num_workers: int, spare_workers: int, prefix: str = DEFAULT_PREFIX) -> int:
    """The worker rank of a spare slot (the last ``spare_workers`` of ``num_workers``) that no other process has claimed
    (one store ``add``), for a worker added to a running group; it then builds ``PSGroup(..., rejoin=True)``.

    Raises:
        PSError: every spare slot is taken.
        ValueError: ``spare_workers`` out of ``[1, num_workers - 1]``.
    """
    check_range("spare_workers", spare_workers, low=1, high=num_workers - 1, integer=True)
    claimed = int(store.add(prefix + "/spare_claims", 1))
    if claimed > spare_workers:
        raise PSError(
            f"no spare worker slot left: the {spare_workers} of group {prefix!r} are taken (start the run with more "
            "spare slots to add more workers)"
        )
    return num_workers - spare_workers + claimed - 1


class PSGroup:
    """One member's handle on the PS group. A worker's construction connects its link to every server; a server
    connects each worker's with :meth:`connect`. One process may hold several members (a colocated server).

    Args:
        store: the run's store (e.g. from :func:`connect_store`).
        ps_rank: this member's rank among the ``num_workers`` workers, then the ``num_servers`` servers.
        timeout_s: bound of every send/receive wait after the rendezvous.
        connect_timeout_s: bound of the rendezvous; ``None``: :func:`~lightning_sync.comm.peer_errors.
            rendezvous_timeout_s`.
        prefix: store prefix of the group; distinct groups on one store need distinct prefixes.
        meter: meter of this member's traffic; a new one if ``None``.
        rejoin: (a worker) this member takes the place of a lost worker of its rank in a running group, on the next
            generation of that rank's links (:meth:`join_generation`).

    Raises:
        ValueError: an argument is out of range.
        PSTimeoutError: (a worker) some server did not connect within ``connect_timeout_s``.
    """

    def __init__(
        self,
        store: dist.Store,
        ps_rank: int,
        num_workers: int,
        num_servers: int,
        timeout_s: float,
        *,
        connect_timeout_s: float | None = None,
        prefix: str = DEFAULT_PREFIX,
        meter: CommMeter | None = None,
        rejoin: bool = False,
    ) -> None:
        check_counts(num_workers, num_servers)
        check_range("ps_rank", ps_rank, low=0, high=num_workers + num_servers - 1, integer=True)
        self.timeout_s = _check_timeout("timeout_s", timeout_s)
        if connect_timeout_s is None:
            connect_timeout_s = rendezvous_timeout_s(self.timeout_s)
        self.connect_timeout_s = _check_timeout("connect_timeout_s", connect_timeout_s)
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix={prefix!r} must be a non-empty string")
        self.ps_rank = ps_rank
        self.num_workers = num_workers
        self.num_servers = num_servers
        self.prefix = prefix
        self.meter = meter if meter is not None else CommMeter()
        self._reports = dist.PrefixStore(prefix + "/failures", store)
        self._notes = dist.PrefixStore(prefix + "/notes", store)
        self._store_lost = False  # a store call failed (its host is gone): stop asking it (each try logs a warning)
        self._store = store
        self._links: dict[int, Any] = {}  # peer ps rank -> the two-member gloo group of this member and that peer
        self._dropped: list[Any] = []  # links of peers dropped while an operation may still wait on them
        self._closed = False
        self._joins = dist.PrefixStore(prefix + "/joins", store)
        self.generation = 0  # (a worker) which generation of this rank's links it holds: 0, +1 per rejoin
        if rejoin and not self.is_server:
            self.generation = int(self._joins.add(f"w{ps_rank}", 1))
        if not self.is_server:
            for server in range(num_servers):
                self.connect(self.server_rank(server), self.generation)

    def connect(self, peer: int, generation: int = 0) -> None:
        """Builds the link of ``generation`` (0, +1 per rejoin of the worker's rank) to ``peer``, on the other side;
        returns once both ends joined.

        Raises:
            ValueError: ``peer`` is not on the other side (a worker links to servers only, a server to workers).
            PSTimeoutError: the peer did not join within ``connect_timeout_s``.
        """
        if (peer >= self.num_workers) == self.is_server or not 0 <= peer < self.world_size:
            raise ValueError(f"{self.name()} cannot link to {self.name(peer)}: links join a worker and a server")
        worker, server = (peer, self.ps_rank) if self.is_server else (self.ps_rank, peer)
        name = f"{self.prefix}/gloo/w{worker}/s{server - self.num_workers}" + (f"/g{generation}" if generation else "")
        store = dist.PrefixStore(name, self._store)
        try:
            pg = dist.ProcessGroupGloo(store, int(self.is_server), 2, _seconds(self.connect_timeout_s))
        except RuntimeError as exc:
            raise PSTimeoutError(
                f"{self.name()} could not link to {self.name(peer)} ({self.num_workers} workers + "
                f"{self.num_servers} servers, prefix {self.prefix!r}) within {self.connect_timeout_s:.1f} s: {exc}"
            ) from exc
        if self._closed:
            pg.shutdown()
            raise PSError(f"{self.name()} has left the PS group (closed)")
        self._links[peer] = pg

    def join_generation(self, worker: int) -> int:
        """The generation of ``worker``'s newest links: how many times its rank rejoined (``0`` once the store is
        gone)."""
        return int(self._best_effort(lambda: self._joins.add(f"w{worker}", 0), 0))

    def drop(self, peer: int) -> None:
        """Forgets the link to ``peer`` (a lost worker), without shutting it down: a receive may still wait on it."""
        pg = self._links.pop(peer, None)
        if pg is not None:
            self._dropped.append(pg)

    @property
    def world_size(self) -> int:
        return self.num_workers + self.num_servers

    @property
    def is_server(self) -> bool:
        return self.ps_rank >= self.num_workers

    def server_rank(self, server: int) -> int:
        """PS rank of server ``server``."""
        return self.num_workers + server

    def name(self, ps_rank: int | None = None) -> str:
        """How errors name a member (this one by default): ``"worker 1 (ps rank 1)"``, ``"server 0 (ps rank 2)"``."""
        rank = self.ps_rank if ps_rank is None else ps_rank
        if rank < self.num_workers:
            return f"worker {rank} (ps rank {rank})"
        return f"server {rank - self.num_workers} (ps rank {rank})"

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Launches a metered send of a CPU tensor to PS rank ``dst``; wait with :meth:`wait` (whose errors it raises
        if the link is already broken)."""
        try:
            return self.meter.send_to(tensor, 1 - int(self.is_server), self._link(dst), tag)
        except RuntimeError as exc:
            raise self._translate(exc, dst, "a send", False, 0.0) from exc

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> Any:
        """Launches a metered receive from PS rank ``src``; as :meth:`send`."""
        try:
            return self.meter.recv_from(tensor, 1 - int(self.is_server), self._link(src), tag)
        except RuntimeError as exc:
            raise self._translate(exc, src, "a receive", True, 0.0) from exc

    def receive(self, tensor: torch.Tensor, src: int, tag: int, what: str, *, timeout_s: float | None = None) -> None:
        """Receives a CPU tensor from PS rank ``src`` and waits for it (as :meth:`wait`); metered once it arrived, so a
        receive posted long before its message does not count it ahead."""
        started = time.perf_counter()
        try:
            work = self._link(src).recv([tensor], 1 - int(self.is_server), int(tag))
        except RuntimeError as exc:
            raise self._translate(exc, src, what, True, 0.0) from exc
        seconds = SimpleNamespace(wait=lambda timeout: work.wait(_seconds(timeout)))  # as the meter's works
        self.wait(seconds, src, what, receiving=True, timeout_s=timeout_s)
        self.meter.record(0.0, float(tensor.numel() * tensor.element_size()), time.perf_counter() - started)

    def _link(self, peer: int) -> Any:
        if self._closed:
            raise PSError(f"{self.name()} has left the PS group (closed)")
        pg = self._links.get(int(peer))
        if pg is None:
            raise PSError(f"{self.name()} has no link to {self.name(int(peer))} (not connected, or dropped)")
        return pg

    def wait(self, work: Any, peer: int | None, what: str, *, receiving: bool, timeout_s: float | None = None) -> None:
        """Waits for a send (``receiving=False``) or receive for at most ``timeout_s`` (default: the group's).

        Raises:
            PSTimeoutError: nothing happened in time (``peer`` named; any rank if ``peer`` is ``None``).
            PSPeerLostError: the peer's connection closed.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        try:
            work.wait(timeout=timeout)
        except (RuntimeError, TimeoutError) as exc:
            raise self._translate(exc, peer, what, receiving, time.monotonic() - started) from exc

    def _translate(self, exc: BaseException, peer: int | None, what: str, receiving: bool, waited: float) -> PSError:
        text = str(exc)
        who = "no member" if peer is None else self.name(peer)
        error: PSError
        if "Connection closed" in text or "closed by peer" in text or "Connection reset" in text:
            error = PSPeerLostError(f"{who} closed its connection to {self.name()} ({what}): its process is gone")
        elif "caused pair closure" in text:
            error = PSTimeoutError(f"{self.name()} cannot reach {who} ({what}): an earlier wait timed out")
        elif "imed out" in text or isinstance(exc, TimeoutError):
            verb = "sent nothing" if receiving else "took nothing"
            error = PSTimeoutError(f"{who} {verb} for {waited:.1f} s ({self.name()} waiting for {what})")
        else:
            error = PSError(f"{self.name()} failed talking to {who} ({what}): {text}")
        error.peer = peer
        return error

    def _best_effort(self, call: Callable[[], Any], default: Any = None) -> Any:
        """``call()`` on the store, or ``default`` once a store call failed (its host is gone; each try would log a
        warning): reports and notes are a courtesy, the waits' timeouts bound everything."""
        if self._store_lost:
            return default
        try:
            return call()
        except Exception:  # noqa: BLE001 - the store may be gone with its host
            self._store_lost = True
            return default

    def report_failure(self, message: str) -> None:
        """Best effort: leaves ``message`` in the store so that peers can quote why this member stopped."""

        def report() -> None:
            self._reports.set(str(self.ps_rank), message)
            self._reports.add(_FAILURE_COUNT_KEY, 1)

        self._best_effort(report)

    def first_reported_failure(self, servers_only: bool = False) -> tuple[int, str] | None:
        """``(ps_rank, message)`` of the lowest other member (server, with ``servers_only``) that reported a failure, if
        any; one store round trip when none has, so a member can ask before every exchange."""
        if not self._best_effort(lambda: self._reports.add(_FAILURE_COUNT_KEY, 0), 0):
            return None
        for rank in range(self.num_workers if servers_only else 0, self.world_size):
            report = self.reported_failure(rank) if rank != self.ps_rank else None
            if report:
                return rank, report
        return None

    def reported_failure(self, ps_rank: int) -> str | None:
        """The message a member left with :meth:`report_failure`, if any (best effort, never blocks long)."""
        key = str(ps_rank)
        return self._best_effort(
            lambda: self._reports.get(key).decode(errors="replace") if self._reports.check([key]) else None
        )

    def post(self, key: str, value: float) -> None:
        """Best effort: leaves ``value`` under ``key`` for this member (e.g. a worker's speed), for :meth:`posted`."""
        self._best_effort(lambda: self._notes.set(f"{key}/{self.ps_rank}", repr(float(value))))

    def posted(self, key: str, ps_ranks: range) -> dict[int, float]:
        """The values members of ``ps_ranks`` have posted under ``key`` so far (one store round trip each)."""
        out: dict[int, float] = {}

        def read() -> None:
            for rank in ps_ranks:
                if self._notes.check([f"{key}/{rank}"]):
                    out[rank] = float(self._notes.get(f"{key}/{rank}").decode())

        self._best_effort(read)
        return out

    def meet(self, what: str, workers: int) -> None:
        """Returns once the first ``workers`` workers have all called ``meet(what)``, within ``connect_timeout_s``: the
        job's workers start training together, so that no server counts one as silent while it is still starting
        (``test_elastic_sync_finishes_on_the_live_workers``).

        Raises:
            PSTimeoutError: not all of them came in time.
        """
        key = f"{self.prefix}/meet/{what}"
        if int(self._store.add(key, 1)) == workers:
            self._store.set(key + "/all", "1")
        try:
            self._store.wait([key + "/all"], _seconds(self.connect_timeout_s))
        except dist.DistStoreError as exc:
            came = int(self._store.add(key, 0))
            raise PSTimeoutError(
                f"{self.name()}: {came} of the {workers} workers reached {what} within {self.connect_timeout_s:.1f} s"
            ) from exc

    def close(self) -> None:
        """Shuts this member's links down (peers' pending operations on them fail), not the dropped ones."""
        self._closed = True
        links, self._links = self._links, {}
        for pg in links.values():
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001 - shutting down a broken group may raise; the group is dropped anyway
                pass
