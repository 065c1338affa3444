"""The server loop that serves the workers one shard (:class:`~lightning_sync.ps.shard.ServerShard`, the state and the
arithmetic); the same for every placement (a dedicated process, ``python -m lightning_sync.ps``, or a worker's thread).

* ``sync``: one gradient per live worker for the current version, averaged in fp32 (in worker order), one step, then
  every contributor gets the new parameters (a push for another version is refused).
* ``async``: each push is one step, scaled by ``push_scale``
  (:func:`~lightning_sync.ps.optim_spec.scales_learning_rate`), answered at once.
* ``ssp``: as async, but a worker's reply is withheld while its clock is more than ``max_staleness`` ahead of the
  slowest live worker's.

Stop: at ``max_updates`` or a worker's request; later pushes are not applied, every reply carries it, and the loop
returns after every worker's goodbye (with several async servers the last round may reach only some shards).

Failure: each worker has a receiving thread of its own (:class:`WorkerChannels`) and replies are never waited for, so
no worker can stall the loop. A worker silent for ``timeout_s`` that the server is not itself holding back
(:class:`WorkerLiveness`), or whose connection closes, is lost: in the elastic modes
(:attr:`~lightning_sync.ps.settings.PSConfig.drops_lost_workers`) it is dropped and the run goes on with the live ones
(only losing all fails the loop); its rank may come back on new links (``PSGroup(..., rejoin=True)``), its clock raised
to the slowest live worker's. Otherwise the loop raises naming it and leaves the message in the store.
"""

from __future__ import annotations

import contextlib
import math
import queue
import sys
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import torch

from lightning_sync.comm.compression import Compressor
from lightning_sync.errors import check_range
from lightning_sync.ps._protocol import (
    FLAG_NONFINITE,
    FLAG_NOT_APPLIED,
    FLAG_SKIPPED,
    FLAG_STOP,
    HEADER_SLOTS,
    TAG_REPLY,
    TAG_REPLY_DATA,
    TAG_REQUEST,
    TAG_REQUEST_DATA,
    Clip,
    Kind,
    ReplyHeader,
    Request,
    Status,
    StopCode,
    from_blob,
    stop_reason,
    to_blob,
)
from lightning_sync.ps.errors import PSError, PSPeerLostError, PSTimeoutError
from lightning_sync.ps.group import DEFAULT_PREFIX, PSGroup, connect_store
from lightning_sync.ps.optim_spec import OptimizerSpec
from lightning_sync.ps.settings import PSConfig
from lightning_sync.ps.shard import ServerShard

#: Seconds between two looks, while a worker is dropped, at whether it rejoined.
JOIN_POLL_S = 0.25


class WorkerLiveness:
    """When the server declares a worker lost: a live worker it is not itself holding back (a pending sync gradient,
    a withheld ssp reply, a deferred pull) that completes no request for ``timeout_s``; every worker once no request
    or reply went for that long (``connect_timeout_s`` before the initial parameters). A frozen worker thus stalls
    neither the server nor, chained, the others (``test_a_frozen_worker_neither_stalls_the_server_nor_chains_waits``).

    Args:
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
        self.timeout_s, self.connect_timeout_s, self._name, self._clock = timeout_s, connect_timeout_s, name, clock
        self.live = [True] * num_workers
        self.last_contact = [clock()] * num_workers
        self.last_exchange = clock()  # the last request heard or reply sent

    def heard(self, worker: int) -> None:
        """``worker`` completed a request now, or (as :meth:`answered`) the server answered it (a worker whose reply
        was held back sent nothing meanwhile): its silence, and the wait for the next request, count from here."""
        self.last_contact[worker] = self.last_exchange = self._clock()

    answered = heard

    def restart(self) -> None:
        """The initial parameters arrived: every worker's silence counts from now."""
        self.last_contact = [self._clock()] * len(self.live)

    def bound(self, initialized: bool) -> float:
        """The longest wait for any request after the last request or reply."""
        return self.timeout_s if initialized else self.connect_timeout_s

    def patience(self, initialized: bool, held: Collection[int]) -> float:
        """Seconds until a worker not in ``held`` would be lost, or the wait for any request would end."""
        deadlines = [self.last_exchange + self.bound(initialized)]
        if initialized:
            deadlines += [t + self.timeout_s for w, t in enumerate(self.last_contact) if self.live[w] and w not in held]
        return max(min(deadlines) - self._clock(), 0.0) + 0.01

    def waited(self) -> float:
        """Seconds since the last request or reply."""
        return self._clock() - self.last_exchange

    def silent(self, initialized: bool, held: Collection[int]) -> dict[int, float]:
        """``{worker: seconds silent}`` of the live workers not in ``held`` silent for more than ``timeout_s`` (none
        before the initial parameters)."""
        now = self._clock()
        return {
            w: now - t
            for w, t in enumerate(self.last_contact)
            if initialized and self.live[w] and w not in held and now - t > self.timeout_s
        }

    def check(self, initialized: bool, held: Collection[int]) -> None:
        """Raises :class:`PSTimeoutError` naming each worker :meth:`silent` finds, and for how long."""
        if silent := self.silent(initialized, held):
            raise self._error(silent, "heard from other workers meanwhile")

    def silence_error(self, held: Collection[int], context: str) -> PSTimeoutError:
        """The error once no request at all arrived within :meth:`bound`, naming the live workers not in ``held`` (all
        if every one is), longest silent first; ``context``: what the server waited for."""
        live = [w for w in range(len(self.live)) if self.live[w]]
        suspects = sorted([w for w in live if w not in held] or live, key=lambda w: self.last_contact[w])
        return self._error(suspects, f"{context}; no request at all for {self.waited():.1f} s")

    def _error(self, workers: Collection[int], context: str) -> PSTimeoutError:
        parts = (f"{self._name(w)} sent nothing for {self._clock() - self.last_contact[w]:.1f} s" for w in workers)
        why = f"frozen, dead, or slower than timeout_s={self.timeout_s:g}"
        return PSTimeoutError(f"{'; '.join(parts)} ({self._name(None)} {context}: {why})")


#: One reply: the worker it goes to, its header and its data (``None``: none).
Reply = tuple[int, tuple[ReplyHeader, torch.Tensor | None]]


class WorkerChannels:
    """The requests of the workers of ``group`` (a receiving thread each, :meth:`listen`) and the replies to them;
    ``server``, the server's index, names the threads."""

    def __init__(self, group: PSGroup, server: int) -> None:
        self.group = group
        self.server = server
        self._inflight: dict[int, list[tuple[Kind, Any]]] = {}  # worker -> sends of its last reply
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (worker, request, data, error) of each receiver
        self.generation = [0] * group.num_workers  # per worker, the generation of its links (0, +1 per rejoin)

    def listen(self, worker: int, generation: int) -> None:
        """Starts the receiving thread of ``worker``'s links of ``generation`` (0 at the start, more for a rejoin); it
        first connects them."""
        self.generation[worker] = generation
        name = f"lightning_sync-ps-server{self.server}-recv{worker}-g{generation}"
        threading.Thread(target=self._receive_from, args=(worker, generation), name=name, daemon=True).start()

    def next(self, timeout_s: float) -> tuple[int, int, Request | None, torch.Tensor | None, BaseException | None]:
        """The next ``(worker, generation, request, data, None)``, or ``(worker, generation, None, None, error)`` once
        that worker's receiving failed; raises ``queue.Empty`` after ``timeout_s``."""
        return self._inbox.get(timeout=timeout_s)

    def _receive_from(self, worker: int, generation: int) -> None:
        """Receiving thread of ``worker``: its complete requests into the inbox, until its goodbye or an error.

        The loop decides when the worker is lost; these waits are only a backstop, longer than any silence the loop
        tolerates (a gloo wait that times out closes every connection of the member)."""
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
        """Launches the replies without waiting for them to be taken: a worker takes a reply's data only once it has
        every server's header, so waiting could stall this server behind another (one holding an ssp reply back).
        They are waited for at the worker's next request (:meth:`settle`); the tensors sent are never modified
        meanwhile. A worker whose connection closed is reported through :meth:`next`, as its receiving thread would,
        and the other replies still go."""
        for worker, (header, payload) in replies:
            try:
                self.settle(worker)
                works = [(header.kind, self.group.send(header.header(), worker, TAG_REPLY))]
                if payload is not None and payload.numel() > 0:
                    works.append((header.kind, self.group.send(payload, worker, TAG_REPLY_DATA)))
            except PSPeerLostError as exc:
                self._inflight.pop(worker, None)
                self._inbox.put((worker, self.generation[worker], None, None, exc))
                continue
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
            with contextlib.suppress(PSError):
                self.settle(worker)


class _Refused(Exception):
    """A request the server answers with an error reply (the run goes on)."""


class ParameterServer:
    """The server loop of one PS-group member: one server's state, and its answer to each request.

    Example::

        >>> stats = ParameterServer(group).run()  # group: a server's PSGroup; returns after every worker's goodbye

    Args:
        group: this server's member of the PS group (``group.is_server``).
        spare_workers: the last worker ranks of the group, free for workers added to the running job (elastic modes,
            :func:`~lightning_sync.ps.group.claim_spare_slot`).

    Raises:
        ValueError: ``group`` is a worker's member, or ``spare_workers`` leaves no worker to start with.
    """

    def __init__(self, group: PSGroup, spare_workers: int = 0) -> None:
        if not group.is_server:
            raise ValueError(f"{group.name()} is a worker; a ParameterServer needs a server's member of the group")
        check_range("spare_workers", spare_workers, low=0, high=group.num_workers - 1, integer=True)  # 1 starts
        self.group = group
        self.server = group.ps_rank - group.num_workers
        self.num_workers = group.num_workers  # worker slots, the spare ones included
        self.initial_workers = group.num_workers - spare_workers  # the workers the run starts with
        self.shard: ServerShard | None = None
        self.config: PSConfig | None = None
        self.codec: Compressor | None = None
        self.checksum = 0
        self.num_groups = 0
        self.push_scale = 1.0  # async and ssp: the factor of a push's step (from the INIT)
        self.initialized_by = -1
        self.liveness = WorkerLiveness(self.num_workers, group.timeout_s, group.connect_timeout_s, group.name)
        self.live = self.liveness.live  # the same list: a goodbye ends a worker's liveness
        self.pending: dict[int, tuple[Any, list[float], int, Clip | None]] = {}  # sync: grad, lrs, optimizer, clip
        self.withheld: set[int] = set()  # ssp: workers whose push reply is held back
        self.deferred_pulls: dict[int, int] = {}  # worker -> settings checksum of pulls before the initial parameters
        self.stop_code = StopCode.NONE
        self.stop_worker = -1
        self.rejected_pushes = 0
        self.skipped_updates = 0  # sync steps or async/ssp pushes skipped for a NaN or Inf gradient
        self.lost: dict[int, str] = {}  # elastic modes: the workers dropped, and why
        self.seen_stop: set[int] = set()  # the workers sent a reply that carries the stop
        self.max_updates: int | None = None  # the config's, less the lost workers' withdrawn shares
        self._withdrawn: dict[int, float] = {}  # worker -> its share of max_updates withdrawn while it is lost
        self.joins: dict[int, int] = {}  # worker -> how many times it rejoined
        self.vacant = set(range(self.initial_workers, self.num_workers))  # spare slots no worker has taken yet
        for worker in self.vacant:
            self.live[worker] = False
        self._joins_checked = 0.0
        self.channels = WorkerChannels(group, self.server)

    @property
    def stopped(self) -> bool:
        return self.stop_code != StopCode.NONE

    @property
    def elastic(self) -> bool:
        """Whether a lost worker is dropped (the run goes on) rather than ending the run: known from the INIT on."""
        return self.config is not None and self.config.drops_lost_workers

    def stats(self) -> dict[str, Any]:
        """What a STATS request returns: the shard's version, clocks and staleness, who is live, lost or joined, the
        stop, and this server's traffic (``bytes_recv``, ``bytes_sent``, ``calls``, ``seconds``)."""
        total = self.group.meter.total
        out: dict[str, Any] = {
            "server": self.server,
            "mode": self.config.mode if self.config else None,
            "push_scale": self.push_scale,
            "initialized": self.shard is not None,
            "stopped": self.stopped,
            "stop_reason": stop_reason(self.stop_code, self.stop_worker, self.max_updates),
            "live": list(self.live),
            "lost": sorted(self.lost),
            "lost_reasons": {w: why for w, why in sorted(self.lost.items())},
            "seen_stop": sorted(self.seen_stop),
            "joins": dict(sorted(self.joins.items())),
            "vacant": sorted(self.vacant),
            "max_updates": self.max_updates,
            "rejected_pushes": self.rejected_pushes,
            "skipped_updates": self.skipped_updates,
            "bytes_recv": int(total.bytes_recv),
            "bytes_sent": int(total.bytes_sent),
            "calls": total.calls,
            "seconds": total.seconds,
        }
        if self.shard is not None:
            out.update(self.shard.stats())
        return out

    def run(self) -> dict[str, Any]:
        """Serves until every worker has said goodbye; returns the final stats.

        Raises:
            PSTimeoutError: no request for ``timeout_s`` (``connect_timeout_s`` before the initial parameters), or a
                live worker silent that long; the message names the worker(s).
            PSPeerLostError: a worker's connection closed while the server was talking to it.
        """
        try:
            for worker in range(self.initial_workers):
                self.channels.listen(worker, 0)
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
        self._say(f"dropped {self.group.name(worker)}: {why}; it goes on with the {sum(self.live)} live worker(s)")
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
        self._say(f"{self.group.name(worker)} {how}; it serves {sum(self.live)} live worker(s)")

    def _say(self, news: str) -> None:
        print(f"warning: lightning_sync.ps {self.group.name()}: {news}", file=sys.stderr, flush=True)

    def _update_max_updates(self) -> None:
        assert self.config is not None and self.config.max_updates is not None
        withdrawn = sum(self._withdrawn.values())
        self.max_updates = max(math.ceil(self.config.max_updates - withdrawn - 1e-9), 1)

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
            if generation != self.channels.generation[worker]:
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
            if generation > self.channels.generation[worker]:
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

    def _reply(
        self, kind: Kind, worker: int, *, payload: torch.Tensor | None = None, flags: int = 0, staleness: int = -1
    ) -> tuple[ReplyHeader, torch.Tensor | None]:
        total = self.group.meter.total
        self.liveness.answered(worker)
        clocks = self.shard.clocks if self.shard is not None else [0] * self.num_workers
        live_clocks = [clocks[w] for w in range(self.num_workers) if self.live[w]]
        if self.stopped:
            flags |= FLAG_STOP
            self.seen_stop.add(worker)
        header = ReplyHeader(
            kind=kind,
            status=Status.OK,
            version=self.shard.version if self.shard is not None else 0,
            flags=flags,
            payload_nbytes=0 if payload is None else payload.numel(),
            bytes_recv=int(total.bytes_recv),
            staleness=staleness,
            stop_code=self.stop_code,
            stop_worker=self.stop_worker,
            clock=clocks[worker],
            min_clock=min(live_clocks) if live_clocks else clocks[worker],
            live_workers=sum(self.live),
            lost_workers=len(self.lost),
            joins=sum(self.joins.values()),
        )
        return header, payload

    def _error_reply(self, kind: Kind, message: str) -> tuple[ReplyHeader, torch.Tensor | None]:
        payload = torch.frombuffer(bytearray(message.encode()), dtype=torch.uint8)
        return ReplyHeader(kind=kind, status=Status.ERROR, payload_nbytes=payload.numel()), payload

    def _params_reply(self, kind: Kind, worker: int, flags: int = 0, staleness: int = -1) -> Any:
        assert self.shard is not None
        return self._reply(kind, worker, payload=self.shard.packed(), flags=flags, staleness=staleness)

    def _handle(self, request: Request, worker: int, payload: torch.Tensor | None) -> None:
        kind = request.kind
        if kind == Kind.INIT:
            self._on_init(worker, payload)
        elif kind == Kind.BYE:
            self.live[worker] = False
            self.deferred_pulls.pop(worker, None)
            self.channels.send([(worker, self._reply(kind, worker))])
            self._after_change()
        elif kind == Kind.STATS:
            blob = to_blob(self.stats())
            self.channels.send([(worker, self._reply(kind, worker, payload=blob))])
        elif self.shard is None:
            if kind != Kind.PULL:
                raise _Refused(f"{kind.name} before the initial parameters; worker 0 must call init_servers() first")
            self.deferred_pulls[worker] = request.checksum
        else:
            mismatch = self._checksum_mismatch(request.checksum, worker)
            if mismatch:
                raise _Refused(mismatch)
            if kind == Kind.PULL:
                self.channels.send([(worker, self._params_reply(kind, worker))])
            elif kind == Kind.PUSH:
                self._on_push(request, worker, payload)
            elif kind == Kind.STOP:
                if not self.stopped:
                    self.stop_code, self.stop_worker = StopCode.REQUESTED, worker
                self.channels.send([(worker, self._reply(kind, worker))])
                self._after_change()
            elif kind == Kind.GET_STATE:
                self.channels.send([(worker, self._reply(kind, worker, payload=to_blob(self.shard.state_dict())))])
            else:
                raise _Refused(f"unknown request kind {kind!r}")

    def _checksum_mismatch(self, checksum: int, worker: int) -> str:
        if checksum == self.checksum:
            return ""
        return (
            f"worker {worker}'s ps settings, optimizer groups or shard layout differ from those worker "
            f"{self.initialized_by} initialized {self.group.name()} with (checksum {checksum} vs "
            f"{self.checksum}); every worker must build PSClient with the same config, model and optimizer"
        )

    def _on_init(self, worker: int, payload: torch.Tensor | None) -> None:
        if self.shard is not None:
            raise _Refused(f"{self.group.name()} was already initialized by worker {self.initialized_by}")
        if payload is None:
            raise _Refused("INIT without parameters")
        try:
            init = from_blob(payload)
            config = PSConfig(**init["config"])
            spec = OptimizerSpec.from_dict(init["optimizer"])
            outer = config.new_outer_optimizer if config.local_steps > 1 else None
            shard = ServerShard(init["params"], init["indices"], spec, self.num_workers, outer)
            if shard.layout.signature() != init["layout"]:
                raise ValueError("the parameters do not match their announced layout")
            if init.get("state") is not None:
                shard.load_state_dict(init["state"])
        except (ValueError, KeyError, TypeError, RuntimeError, AttributeError, ImportError) as exc:
            raise _Refused(f"cannot initialize from worker {worker}'s INIT: {type(exc).__name__}: {exc}") from exc
        if self.vacant and not config.drops_lost_workers:
            raise _Refused(
                f"{len(self.vacant)} spare worker slot(s) in mode={config.mode!r}, which does not take a worker in "
                "during the run; use async or ssp (or sync with elastic)"
            )
        self.config, self.codec, self.shard = config, config.new_codec(), shard
        self.max_updates = config.max_updates
        self.push_scale = 1.0 / self.initial_workers if config.push_scale is None else float(config.push_scale)
        self.num_groups = spec.num_groups
        self.checksum = int(init["checksum"])
        self.initialized_by = worker
        self.liveness.restart()
        replies = [(worker, self._reply(Kind.INIT, worker))]
        for w, checksum in sorted(self.deferred_pulls.items()):
            mismatch = self._checksum_mismatch(checksum, w)
            reply = self._error_reply(Kind.PULL, mismatch) if mismatch else self._params_reply(Kind.PULL, w)
            replies.append((w, reply))
        self.deferred_pulls = {}
        self.channels.send(replies)

    def _on_push(self, request: Request, worker: int, payload: torch.Tensor | None) -> None:
        assert self.shard is not None and self.config is not None and self.codec is not None
        if self.stopped:
            self.rejected_pushes += 1
            self.channels.send([(worker, self._params_reply(Kind.PUSH, worker, flags=FLAG_NOT_APPLIED))])
            return
        lr_bytes = 8 * self.num_groups
        if payload is None or payload.numel() < lr_bytes:
            raise _Refused(f"a push must carry {self.num_groups} learning rates and a gradient")
        lrs = payload[:lr_bytes].view(torch.float64).tolist()
        if not 0 <= request.optimizer < len(self.shard.optimizers):
            raise _Refused(f"a push for optimizer {request.optimizer}; the workers have {len(self.shard.optimizers)}")
        grad = None  # a NaN or Inf gradient stays on its worker: the update is skipped
        if not request.flags & FLAG_NONFINITE:
            try:
                grad = self.codec.unpack(payload[lr_bytes:], self.shard.layout.numel)
            except ValueError as exc:
                raise _Refused(str(exc)) from exc
        if self.config.mode == "sync":
            if request.version != self.shard.version:
                raise _Refused(
                    f"sync push computed on version {request.version}, the server is at version "
                    f"{self.shard.version}; in sync mode each push must follow the reply to the previous one"
                )
            if worker in self.pending:
                raise _Refused(f"worker {worker} pushed twice for version {self.shard.version}")
            others = {k for _, _, k, _ in self.pending.values()}
            if others and others != {request.optimizer}:
                raise _Refused(
                    f"worker {worker} pushed for optimizer {request.optimizer} at version {self.shard.version}, the "
                    f"other workers for optimizer {others.pop()}; in sync every worker steps its optimizers in one order"
                )
            self.pending[worker] = (grad, lrs, request.optimizer, request.clip)
            self._after_change()
            return
        staleness = self.shard.version - request.version
        if grad is None:  # nothing applied, the worker's clock stays: its ssp lead cannot grow
            self.skipped_updates += 1
            self.channels.send([(worker, self._params_reply(Kind.PUSH, worker, FLAG_SKIPPED, staleness))])
            return
        # a push is one worker's gradient, where a sync step averages W of them: push_scale (auto: 1/W)
        self.shard.apply(grad, lrs, request.optimizer, request.clip, self.push_scale)
        self.shard.record(worker, staleness)
        self._check_max_updates()
        if self.config.mode == "ssp" and not self.stopped and self._lead(worker) > self.config.max_staleness:
            self.withheld.add(worker)
        else:
            self.channels.send([(worker, self._params_reply(Kind.PUSH, worker, staleness=staleness))])
        self._after_change()

    def _lead(self, worker: int) -> int:
        assert self.shard is not None
        live = [self.shard.clocks[w] for w in range(self.num_workers) if self.live[w]]
        return self.shard.clocks[worker] - min(live) if live else 0

    def _check_max_updates(self) -> None:
        assert self.shard is not None and self.config is not None
        if not self.stopped and self.max_updates is not None and self.shard.version >= self.max_updates:
            self.stop_code = StopCode.MAX_UPDATES

    def _after_change(self) -> None:
        """Steps a complete sync round, releases withheld ssp replies, answers everything once stopped."""
        if self.shard is None:
            return
        replies = []
        if self.pending:
            if self.stopped:
                replies += [(w, self._params_reply(Kind.PUSH, w, flags=FLAG_NOT_APPLIED)) for w in sorted(self.pending)]
                self.rejected_pushes += len(self.pending)
                self.pending = {}
            elif all(w in self.pending for w in range(self.num_workers) if self.live[w]):
                replies += self._sync_step()
        if self.withheld:
            assert self.config is not None  # set with the shard
            staleness = self.shard.last_staleness
            for w in sorted(self.withheld):
                if self.stopped or not self.live[w] or self._lead(w) <= self.config.max_staleness:
                    self.withheld.discard(w)
                    if self.live[w]:
                        replies.append((w, self._params_reply(Kind.PUSH, w, staleness=staleness[w])))
        if replies:
            self.channels.send(replies)

    def _sync_step(self) -> list[Any]:
        assert self.shard is not None
        contributors = sorted(self.pending)
        if any(self.pending[w][0] is None for w in contributors):  # every worker skips the step, at the same version
            self.skipped_updates += 1
            self.pending = {}
            return [(w, self._params_reply(Kind.PUSH, w, FLAG_SKIPPED, staleness=0)) for w in contributors]
        total = torch.zeros(self.shard.layout.numel, dtype=torch.float32)
        for w in contributors:
            total.add_(self.pending[w][0])
        total.div_(len(contributors))
        _, lrs, optimizer, clip = self.pending[contributors[0]]
        self.shard.apply(total, lrs, optimizer, clip)  # clipped after averaging, as DDP's all-reduced gradient
        for w in contributors:
            self.shard.record(w, 0)
        self.pending = {}
        self._check_max_updates()
        return [(w, self._params_reply(Kind.PUSH, w, staleness=0)) for w in contributors]


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
    """Joins the PS group as server ``server`` of ``num_servers`` through the store at ``host:port`` and serves until
    every worker's goodbye: the loop of both placements.

    Args:
        num_workers: the worker ranks, the last ``spare_workers`` of them free for workers added to the running job.
        timeout_s: bound of every wait after the rendezvous.
        connect_timeout_s: bound of the rendezvous and of the wait for the initial parameters (``None``:
            ``max(timeout_s, 60)``: a fresh interpreter takes seconds to import torch).
        prefix: the group's store prefix (as the workers' ``PSGroup``'s).

    Returns:
        The server's final stats (:meth:`ParameterServer.stats`).

    Raises:
        ValueError: ``server`` is not in ``[0, num_servers)`` (or another argument is out of range).
        PSError: the rendezvous or the loop failed (see :meth:`ParameterServer.run`).
    """
    check_range("server", server, low=0, high=num_servers - 1, integer=True)
    connect = max(timeout_s, 60.0) if connect_timeout_s is None else connect_timeout_s
    store = connect_store(host, port, is_host=False, timeout_s=connect)
    group = PSGroup(
        store,
        num_workers + server,
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
