"""The server loop that serves the workers one shard (:class:`~lightning_sync.ps.shard.ServerShard`, the state and the
arithmetic, without communication).

:class:`ParameterServer` is the loop, the same for every placement (a dedicated process started by ``python -m lightning_sync.ps``, or a thread of a
worker process) and every mode:

* ``sync``: the server collects one gradient per live worker for its current version ``t`` (a push for another
  version is refused), averages them in fp32 (sum in worker order 0..W-1, divided by the number of contributions,
  ``W`` while every worker is live), steps once (version ``t+1``), then replies to every contributor with the new
  parameters.
* ``async``: each push is one optimizer step scaled by ``push_scale`` (its gradient, or for the Adam family its
  learning rate: :func:`~lightning_sync.ps.optim_spec.scales_learning_rate`), answered at once with the new
  parameters.
* ``ssp`` (``max_staleness = s``): applied as in async, but the reply to a worker is withheld while its clock
  (pushes applied) is more than ``s`` ahead of the slowest live worker's clock; ``s = 0`` is lockstep.

In every mode a push's staleness is the server version when it is applied minus the version it was computed on
(``0`` in sync); the server counts the values per worker and keeps the last one
(:meth:`~lightning_sync.ps.shard.ServerShard.stats`).

Stop: once the version reaches ``max_updates``, or a worker sends a stop request, later pushes are not applied and
every reply carries the stop flag and its reason; pending sync gradients and withheld ssp replies are answered with
it at once. The server keeps serving pulls, state and stats requests until every worker has said goodbye
(:meth:`PSClient.close`), then the loop returns. In async/ssp with several servers, the push that reaches
``max_updates`` on one server may arrive after it on another, so the last round can be applied to some shards and
not to others; every worker still sees the stop at its next reply.

Failure: no worker can stall the loop. Each worker has a receiving thread of its own, which takes that worker's
requests (header, then data) and hands the loop only complete ones; the loop launches replies without waiting for
them to be taken (a worker takes a reply before it sends its next request). So a worker that freezes between
requests, in the middle of one, or before taking its reply holds up nothing but itself, and the loop goes on
serving the others. A live worker that the server is not itself holding back (a pending sync gradient, a withheld
ssp reply) and that completes no request for ``timeout_s`` is declared lost, once; so is a worker whose connection
closes. What follows depends on the mode:

* ``async``, ``ssp`` and ``sync`` with ``elastic`` (:attr:`~lightning_sync.ps.settings.PSConfig.drops_lost_workers`):
  the worker is dropped (said on stderr). It no longer counts as live: ssp's slowest-worker bound and a sync
  round are over the live workers, and with ``withdraw_lost_share`` its unused share of ``max_updates`` is
  withdrawn. Each worker has a link of its own to each server (:mod:`lightning_sync.ps.group`), so no other worker
  sees an error. The server's ``stats`` lists the lost workers and why. Only if every worker
  is lost does the loop fail. A dropped worker's rank may come back: a new member of that rank built with
  ``PSGroup(..., rejoin=True)`` takes the next generation of its links, which the server connects (it looks every
  :data:`JOIN_POLL_S` while a worker is dropped); at its first request the worker is live again, its clock raised
  to the slowest live worker's, its withdrawn share given back, and ``stats["joins"]`` counts it.
* ``sync`` otherwise: the loop raises an error naming it, leaves the message in the store for the peers, and
  returns control (a dedicated process exits with code 1). A sync step needs every worker; a run that would go on
  without one must say so (``elastic``).

The loop also fails when no request arrives for ``timeout_s`` after its last request or reply
(``connect_timeout_s`` before the initial parameters). :mod:`~lightning_sync.ps.liveness` keeps that bookkeeping.
"""

from __future__ import annotations

import math
import queue
import sys
import time
from typing import Any

import torch

from lightning_sync.ps._dispatch import RequestDispatch, _Refused
from lightning_sync.ps._protocol import Request
from lightning_sync.ps.errors import PSPeerLostError
from lightning_sync.ps.group import DEFAULT_PREFIX, PSGroup, connect_store, server_ps_rank

#: Seconds between two looks, while a worker is dropped, at whether it rejoined.
JOIN_POLL_S = 0.25


class ParameterServer(RequestDispatch):
    """The server loop of one PS-group member (see the module docstring for the modes and the stop).

    It takes the workers' complete requests, one at a time, and watches their liveness; what it answers to each is
    :class:`~lightning_sync.ps._dispatch.RequestDispatch`'s.

    Args:
        group: this server's member of the PS group (``group.is_server``).

    Raises:
        ValueError: ``group`` is a worker's member.
    """

    # ---------------------------------------------------------------- public
    def run(self) -> dict[str, Any]:
        """Serves until every worker has said goodbye; returns the final stats.

        Raises:
            PSTimeoutError: no request for ``timeout_s`` (``connect_timeout_s`` before the initial parameters), or a
                live worker silent that long; the message names the worker(s).
            PSPeerLostError: a worker's connection closed while the server was talking to it.
        """
        try:
            self.channels.start(w for w in range(self.num_workers) if w not in self.vacant)
            while any(self.live):
                got = self._next_request()
                if got is None:  # a worker was dropped meanwhile (elastic modes)
                    continue
                worker, request, payload = got
                self.liveness.heard(worker)
                self.channels.settle(worker)  # a worker only sends again once it has taken our previous reply
                try:
                    self._handle(request, worker, payload)
                except _Refused as refusal:
                    self.channels.send([(worker, self._error_reply(request.kind, str(refusal)))])
                self._check_silent_workers()
            self.channels.settle_all()
            if len(self.lost) == self.num_workers - len(self.vacant):
                reasons = "; ".join(f"{self.group.name(w)}: {why}" for w, why in sorted(self.lost.items()))
                raise PSPeerLostError(f"every worker was lost ({reasons})")
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
            self.group.report_failure(message)
            raise
        return self.stats()

    # ---------------------------------------------------------------- membership (the elastic modes)
    def drop(self, worker: int, why: str) -> None:
        """Drops lost ``worker`` (elastic modes): it no longer counts as live (ssp's slowest worker, a sync round),
        its unanswered requests are forgotten, and with ``withdraw_lost_share`` its unused share of ``max_updates``
        is withdrawn. Said on stderr."""
        if not self.live[worker]:
            return
        self.live[worker] = False
        self.lost[worker] = why
        self.pending.pop(worker, None)
        self.withheld.discard(worker)
        self.deferred_pulls.pop(worker, None)
        self.channels.forget(worker)
        config, shard = self.config, self.shard
        if config is not None and shard is not None and config.withdraw_lost_share and config.max_updates:
            self._withdrawn[worker] = max(config.max_updates / self.initial_workers - shard.clocks[worker], 0.0)
            self._update_max_updates()
        live = sum(self.live)
        print(
            f"warning: lightning_sync.ps {self.group.name()} dropped {self.group.name(worker)}: {why}; it goes on "
            f"with the {live} live worker(s)",
            file=sys.stderr,
            flush=True,
        )
        if self.shard is not None:
            self._check_max_updates()
        self._after_change()

    def rejoin(self, worker: int) -> None:
        """Takes dropped ``worker`` back (its rank restarted, on new links), or in a spare slot a worker added to the
        run: live, its clock raised to the slowest live worker's (so ssp does not hold the others back for it), and
        a dropped worker's share of ``max_updates`` given back. Said on stderr."""
        added = worker in self.vacant
        self.vacant.discard(worker)
        self.live[worker] = True
        self.lost.pop(worker, None)
        self.seen_stop.discard(worker)
        self.joins[worker] = self.joins.get(worker, 0) + 1
        self.liveness.heard(worker)
        if self.shard is not None:
            others = [self.shard.clocks[w] for w in range(self.num_workers) if self.live[w] and w != worker]
            if others:
                self.shard.clocks[worker] = max(self.shard.clocks[worker], min(others))
        if self._withdrawn.pop(worker, None) is not None:
            self._update_max_updates()
        how = "joined (a spare slot: a worker added to the run)" if added else f"rejoined (join {self.joins[worker]})"
        print(
            f"warning: lightning_sync.ps {self.group.name()}: {self.group.name(worker)} {how}; it serves "
            f"{sum(self.live)} live worker(s)",
            file=sys.stderr,
            flush=True,
        )

    def _update_max_updates(self) -> None:
        assert self.config is not None and self.config.max_updates is not None
        withdrawn = sum(self._withdrawn.values())
        self.max_updates = max(math.ceil(self.config.max_updates - withdrawn - 1e-9), 1)

    # ---------------------------------------------------------------- receiving
    def _next_request(self) -> tuple[int, Request, torch.Tensor | None] | None:
        """The next complete request of a live worker; ``None`` once a worker was dropped meanwhile (elastic modes:
        a lost worker is dropped, see the module docstring); otherwise raises once a worker is lost."""
        while True:
            initialized, held = self.shard is not None, self._waiting_on_us()
            patience = self.liveness.patience(initialized, held)
            try:
                worker, generation, request, payload, error = self.channels.next(
                    min(patience, JOIN_POLL_S) if self.lost or self.vacant else patience
                )
            except queue.Empty:
                if self._check_silent_workers():
                    return None
                self._watch_joins()
                if self.liveness.waited() >= self.liveness.bound(initialized):
                    raise self.liveness.silence_error(held, self._waiting_for()) from None
                continue
            self._watch_joins()
            if generation != self.generation[worker]:
                continue  # a request or error of an earlier generation of a rejoined worker's links
            if not self.live[worker] and (worker in self.lost or worker in self.vacant):
                if error is not None or request is None or generation == 0:
                    continue  # a dropped worker's late request or error (or a failed join): it is not served
                self.rejoin(worker)  # the first request on the new links of a worker that (re)joined
            if error is not None:
                if self.elastic and self.live[worker]:
                    self.drop(worker, f"{type(error).__name__}: {error}")
                    return None
                raise error
            assert request is not None
            return worker, request, payload

    def _waiting_on_us(self) -> set[int]:
        """The workers the server itself holds back (their silence is not theirs)."""
        return set(self.pending) | self.withheld | set(self.deferred_pulls)

    def _waiting_for(self) -> str:
        if self.shard is None:
            return "waiting for the initial parameters (INIT)"
        if self.config is not None and self.config.mode == "sync" and not self.stopped:
            return f"waiting for gradients of version {self.shard.version}"
        return "waiting for requests"

    def _watch_joins(self) -> None:
        """Listens on the new links of each dropped worker that rejoined since, and of each spare slot a worker took
        (asked at most every :data:`JOIN_POLL_S`)."""
        now = time.monotonic()
        waiting = sorted(set(self.lost) | self.vacant)
        if not waiting or now - self._joins_checked < JOIN_POLL_S:
            return
        self._joins_checked = now
        for worker in waiting:
            generation = self.group.join_generation(worker)
            if generation > self.generation[worker]:
                self.generation[worker] = generation
                self.channels.listen(worker, generation)

    def _check_silent_workers(self) -> bool:
        """Drops (elastic modes) or raises for (the others) a live worker silent for ``timeout_s``; whether one was
        dropped."""
        initialized, held = self.shard is not None, self._waiting_on_us()
        if not self.elastic:
            self.liveness.check(initialized, held)
            return False
        silent = self.liveness.silent(initialized, held)
        for worker, seconds in silent.items():
            self.drop(worker, f"sent nothing for {seconds:.1f} s (frozen, dead, or slower than timeout_s)")
        return bool(silent)


# -------------------------------------------------------------------------------------------------- entry points
def run_server(
    host: str,
    port: int,
    server: int,
    num_workers: int,
    num_servers: int,
    *,
    timeout_s: float,
    connect_timeout_s: float | None = None,
    prefix: str = DEFAULT_PREFIX,
    spare_workers: int = 0,
) -> dict[str, Any]:
    """Joins the PS group as server ``server`` through the store at ``host:port`` and serves until the end.

    This is the loop both placements run (a dedicated process, a worker's thread). ``num_workers`` counts every
    worker rank, the ``spare_workers`` slots included (see :class:`ParameterServer`).

    Returns:
        The server's final stats (:meth:`ParameterServer.stats`).

    Raises:
        ValueError: ``server`` is not in ``[0, num_servers)`` (or another argument is out of range).
        PSError: the rendezvous or the loop failed (see :meth:`ParameterServer.run`).
    """
    if isinstance(server, bool) or not isinstance(server, int) or not 0 <= server < num_servers:
        raise ValueError(f"server={server!r} must be an integer in [0, {num_servers - 1}] (num_servers={num_servers})")
    connect = max(timeout_s, 60.0) if connect_timeout_s is None else connect_timeout_s
    store = connect_store(host, port, is_host=False, timeout_s=connect)
    group = PSGroup(
        store,
        server_ps_rank(server, num_workers),
        num_workers,
        num_servers,
        timeout_s,
        connect_timeout_s=connect,
        prefix=prefix,
    )
    try:
        return ParameterServer(group, spare_workers).run()
    finally:
        group.close()
