"""The worker side: push gradients to every server, receive fresh parameters into the model in place.

Typical use on worker ``r`` of ``W`` (the adapter does this around Lightning's loop)::

    group = PSGroup(store, r, W, k, timeout_s)              # rank r of the PS group
    client = PSClient(group, params, optimizer_spec(optimizer, params), PSConfig(mode="ssp", max_staleness=2))
    if r == 0:
        client.init_servers()                               # servers start from worker 0's model
    client.pull()                                           # every replica starts identical
    for batch in data:
        loss(batch).backward()
        reply = client.push(current_lrs(optimizer))         # gradients out, new parameters in (in place)
        if reply.stop:
            break
    client.close()                                          # goodbye to every server

The servers hold the optimizer. Every request goes to all servers at once (:func:`exchange`), every wait bounded; a
lost or silent server raises a :class:`~lightning_sync.ps.errors.PSError` naming it (quoting its own report, if any).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_sync.comm.nonfinite import grads_are_finite
from lightning_sync.errors import check_range
from lightning_sync.ps._layout import ShardLayout, as_bytes
from lightning_sync.ps._protocol import (
    CLIP_NORM,
    FLAG_NONFINITE,
    FLAG_NOT_APPLIED,
    FLAG_SKIPPED,
    FLAG_STOP,
    HEADER_BYTES,
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
from lightning_sync.ps.errors import PSError, PSPeerLostError, PSServerError, PSTimeoutError
from lightning_sync.ps.group import PSGroup
from lightning_sync.ps.optim_spec import OptimizerSpec
from lightning_sync.ps.settings import PSConfig


@dataclass(frozen=True)
class PSReply:
    """What the servers answered to a pull or a push; each tuple has one entry per server.

    Attributes:
        versions: each server's version (optimizer steps applied to its shard).
        stop: training is over (``max_updates`` reached or a worker asked to stop); ``stop_reason`` says which.
        applied: a push was applied by every server (``False`` for a pull, or a push after the stop or skipped).
        skipped: the push was skipped for a NaN or Inf gradient: in sync some worker's, for every worker; in async
            and ssp this worker's.
        staleness: of this push, the server version when applied minus the version it was computed on; ``-1``: a pull.
        clocks: this worker's pushes applied; ``min_clocks``: the slowest live worker's.
        server_bytes_recv: everything the server received so far (its ingress).
        live_workers: the workers the server counts as live; ``lost_workers``: dropped; ``joins``: rejoins.
    """

    versions: tuple[int, ...]
    stop: bool
    stop_reason: str
    applied: bool
    staleness: tuple[int, ...]
    clocks: tuple[int, ...]
    min_clocks: tuple[int, ...]
    server_bytes_recv: tuple[int, ...]
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


def shard_by_bytes(sizes: Sequence[int], num_servers: int) -> list[int]:
    """For each parameter (by its size in bytes), the server that holds it: whole tensors, largest first, each to the
    server holding the fewest bytes so far (ties: fewer tensors, then lower server). Deterministic; every server gets
    one at least; the fullest and the emptiest differ by at most the largest parameter.

    Raises:
        ValueError: ``num_servers`` is not an integer in ``[1, len(sizes)]``, or a size is negative.
    """
    check_range("num_servers", num_servers, low=1, integer=True)
    sizes = [int(s) for s in sizes]
    if num_servers > len(sizes):
        raise ValueError(
            f"num_servers={num_servers} exceeds the number of parameter tensors ({len(sizes)}); tensors are not "
            f"split across servers, so use num_servers <= {len(sizes)}"
        )
    if any(s < 0 for s in sizes):
        raise ValueError(f"parameter sizes must be >= 0 bytes, got {sizes}")
    load = [0] * num_servers
    count = [0] * num_servers
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        server = min(range(num_servers), key=lambda k: (load[k], count[k], k))
        owner[index] = server
        load[server] += sizes[index]
        count[server] += 1
    return owner


def exchange(
    group: PSGroup,
    kind: Kind,
    requests: Sequence[Request],
    payloads: Sequence[torch.Tensor | None] | None,
    reply_buffers: Sequence[torch.Tensor],
    reply_timeout: float,
    servers_only: bool = False,
) -> list[tuple[ReplyHeader, torch.Tensor | None]]:
    """Sends ``requests[i]`` (and ``payloads[i]``, if any) to server ``i``, for every server; returns each one's
    ``(reply header, reply data or None)``, the data in ``reply_buffers[i]`` where it fits.

    The receives of the replies are launched first. A peer that already gave up left its reason in the store: the
    exchange stops on it at once (only the servers' reasons with ``servers_only``, the elastic modes).

    Raises:
        PSPeerLostError: a peer had already reported a failure, or a server's connection closed.
        PSTimeoutError: a server did not take the request, or did not reply within ``reply_timeout``.
        PSServerError: a server refused the request (its message quoted).
    """
    ranks = [group.server_rank(i) for i in range(len(requests))]
    headers = [torch.zeros(HEADER_SLOTS, dtype=torch.int64) for _ in ranks]
    what = kind.name
    graced = False  # whether the wait that failed already included the grace for a server's report
    failed: tuple[int, str] | None = None  # (ps rank, report) of a peer that had already given up
    try:
        reply_works = [group.recv(header, rank, TAG_REPLY) for header, rank in zip(headers, ranks)]
        header_sends = [group.send(request.header(), rank, TAG_REQUEST) for request, rank in zip(requests, ranks)]
        data_sends = [
            (rank, group.send(payload, rank, TAG_REQUEST_DATA))
            for payload, request, rank in zip(payloads or [None] * len(ranks), requests, ranks)
            if payload is not None and request.payload_nbytes
        ]
        # asked while the sends are in flight, so a healthy step pays no latency
        failed = group.first_reported_failure(servers_only)
        if failed is not None:
            raise PSPeerLostError(f"{group.name(failed[0])} failed before this {what}: {failed[1]}")
        deadline = time.monotonic() + group.timeout_s
        for rank, work in data_sends:  # a frozen server does not take the data: named after timeout_s
            group.wait(work, rank, f"it to take the {what}", receiving=False, timeout_s=_left(deadline))
        deadline = time.monotonic() + reply_timeout
        graced = True
        for rank, work in zip(ranks, reply_works):
            group.wait(work, rank, f"the reply to the {what}", receiving=True, timeout_s=_left(deadline))
        # Each header was taken (its server replied). Waited after the replies: gloo fails every posted receive when
        # a peer's connection closes, but not a send being written, which would wait out timeout_s.
        deadline = time.monotonic() + group.timeout_s
        for rank, work in zip(ranks, header_sends):
            group.wait(work, rank, f"it to take the {what}", receiving=False, timeout_s=_left(deadline))
        replies = [ReplyHeader.parse(h) for h in headers]
        buffers: list[torch.Tensor | None] = []
        for reply, buffer in zip(replies, reply_buffers):
            if reply.status != Status.OK or reply.payload_nbytes != buffer.numel():
                buffer = torch.empty(reply.payload_nbytes, dtype=torch.uint8)
            buffers.append(buffer if reply.payload_nbytes > 0 else None)
        data_works = [(rank, group.recv(b, rank, TAG_REPLY_DATA)) for b, rank in zip(buffers, ranks) if b is not None]
        for rank, work in data_works:
            group.wait(work, rank, f"the data of the reply to the {what}", receiving=True)
    except PSError as exc:
        if failed is not None:
            raise  # it quotes the peer's own report already
        # a server that gave up writes why just as our wait ends: a grace, unless the reply timeout included it
        patience_s = 0.0 if graced and isinstance(exc, PSTimeoutError) else min(group.timeout_s / 4, 5.0)
        peer = ranks[0] if exc.peer is None else exc.peer
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
    """How long to wait for replies: ``connect_timeout_s`` before this worker's first pull (a reply may wait for
    worker 0's INIT); else ``timeout_s`` plus a grace in which a server that gave up on a silent worker reports why;
    twice ``timeout_s`` where the servers drop a lost worker (a reply held for the slowest live worker may wait for
    its drop, ``timeout_s`` after its last request)."""
    if kind == Kind.INIT or (kind == Kind.PULL and not initialized):
        return group.connect_timeout_s
    grace = min(group.timeout_s / 4, 5.0)
    return (2 if drops_lost_workers else 1) * group.timeout_s + grace


def report_of(group: PSGroup, ps_rank: int, patience_s: float, servers_only: bool = False) -> tuple[int, str | None]:
    """``(rank, message)``: the failure server ``ps_rank`` reported in the store, waiting up to ``patience_s`` for it;
    failing that, another member's (``None`` if none)."""
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


class ServerStepOptimizer:
    """The worker's optimizer whose ``step(closure)`` runs the closure, then ``push(optimizer)`` (e.g. ``lambda opt:
    client.push(current_lrs(opt))``) instead of stepping; every other attribute is the optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, push: Callable[[torch.optim.Optimizer], Any]) -> None:
        self._optimizer, self._push = optimizer, push

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        result = closure() if closure is not None else None
        self._push(self._optimizer)
        return result


_SET_BY_THE_INIT = ("max_updates", "withdraw_lost_share")  # PSConfig fields the servers take from the INIT only


class PSClient:
    """A worker's client of the parameter servers (the module docstring shows its use).

    Args:
        group: this worker's member of the PS group.
        params: the ordered parameters the servers train (sharded by :func:`shard_by_bytes`, updated in place by every
            reply; identical shapes and dtypes on every worker).
        spec: :func:`~lightning_sync.ps.optim_spec.optimizer_spec` of the same ``params``.
        config: the run's settings (identical on every worker).

    Raises:
        ValueError: ``group`` is a server's member, ``params`` is empty or not floating point, ``spec`` describes
            another number of parameters, or there are more servers than parameter tensors.
    """

    def __init__(self, group: PSGroup, params: Sequence[torch.Tensor], spec: OptimizerSpec, config: PSConfig) -> None:
        if group.is_server:
            raise ValueError(f"{group.name()} is a server; PSClient needs a worker's member of the group")
        params = list(params)
        if not params:
            raise ValueError("params is empty; the parameter server needs at least one parameter")
        bad = [i for i, p in enumerate(params) if not p.is_floating_point()]
        if bad:
            raise ValueError(f"params{bad} are not floating point; only floating-point parameters can be trained")
        if len(spec.group_of) != len(params):
            raise ValueError(f"spec describes {len(spec.group_of)} parameters, params has {len(params)}")
        self.group = group
        self.worker = group.ps_rank
        self.params = params
        self.spec = spec
        self.config = config
        self.num_servers = group.num_servers
        self.owner = shard_by_bytes([p.numel() * p.element_size() for p in params], self.num_servers)
        self.indices = [[j for j, k in enumerate(self.owner) if k == i] for i in range(self.num_servers)]
        self.layouts = [ShardLayout.of([params[j] for j in idx]) for idx in self.indices]
        self.codec = config.new_codec()
        # what every worker must agree on: not the end, worker 0's alone (a worker added to the run counts its own)
        agreed = sorted((k, v) for k, v in config.as_dict().items() if k not in _SET_BY_THE_INIT)
        settings = repr(agreed) + f"|{spec.classes}|{spec.num_groups}|{spec.owner}"
        self.checksums = [
            zlib.crc32(f"{settings}|{idx}|{layout.signature()}".encode())
            for idx, layout in zip(self.indices, self.layouts)
        ]
        self.versions = [-1] * self.num_servers
        self.stopped = False
        self.stop_reason = ""
        self.last_reply: PSReply | None = None
        self._replies = [torch.empty(lay.nbytes, dtype=torch.uint8) for lay in self.layouts]
        self._closed = False
        self._broken: BaseException | None = None

    @property
    def shard_nbytes(self) -> list[int]:
        """Bytes of parameters each server holds."""
        return [lay.nbytes for lay in self.layouts]

    def push_nbytes(self, server: int) -> int:
        """Exact bytes one push puts on the wire to ``server``: header, learning rates and encoded gradient."""
        return HEADER_BYTES + 8 * self.spec.num_groups + self.codec.packed_nbytes(self.layouts[server].numel)

    def init_servers(self, states: Sequence[dict[str, Any]] | None = None) -> None:
        """Sends each server its shard of this worker's parameters, the optimizer spec and the settings; once, by
        worker 0. With ``states`` (:meth:`server_states` of a checkpoint) each server loads its state in the same
        request, so no worker can pull the un-restored parameters.

        Raises:
            PSServerError: a server was already initialized, or refused the state.
            ValueError: ``states`` does not have one entry per server.
        """
        if states is not None and len(states) != self.num_servers:
            raise ValueError(f"states has {len(states)} entries, expected one per server ({self.num_servers})")
        init = {"config": self.config.as_dict(), "optimizer": self.spec.as_dict()}
        payloads = [
            to_blob(
                init
                | {
                    "indices": self.indices[i],
                    "layout": self.layouts[i].signature(),
                    "params": [self.params[j].detach().to("cpu").clone() for j in self.indices[i]],
                    "checksum": self.checksums[i],
                    "state": None if states is None else states[i],
                }
            )
            for i in range(self.num_servers)
        ]
        self._exchange(Kind.INIT, payloads)

    def pull(self) -> PSReply:
        """Copies every server's current parameters into ``params`` (in place); before worker 0's
        :meth:`init_servers` it waits for it."""
        return self._to_reply(self._exchange(Kind.PULL), push=False)

    def push(self, lrs: Sequence[float], optimizer: int = 0, clip: Clip | None = None) -> PSReply:
        """Pushes the gradients (``p.grad``; ``None`` counts as zeros) and receives the new parameters in place: sync,
        the step that averaged every worker's; async, the step with this gradient or newer; ssp, the same, held back
        while this worker leads by more than ``max_staleness``. With ``skip_nonfinite`` a NaN or Inf gradient is not
        sent (nor fed to the codec's error feedback), and the servers skip the update.

        Args:
            lrs: the current learning rate of each param group of every optimizer (:func:`~lightning_sync.ps.
                optim_spec.current_lrs`), set on the servers' groups before they step.
            optimizer: with several optimizers, the index of the one that steps (the others' gradients are ignored).
            clip: the clipping the servers apply to that optimizer's gradient (in sync to the average, as DDP's);
                ``norm`` needs one server: a shard's norm is not the model's.

        Raises:
            RuntimeError: no :meth:`pull` before the first push, or the client is closed.
            ValueError: a bad ``lrs``, ``optimizer`` or ``clip``.
            PSServerError: a server refused the push (e.g. a sync push on an old version).
        """
        lrs = [float(lr) for lr in lrs]
        if len(lrs) != self.spec.num_groups:
            raise ValueError(f"lrs has {len(lrs)} values, the optimizer {self.spec.num_groups} param groups")
        if min(self.versions) < 0:
            raise RuntimeError("push() before the first pull(): pull the initial parameters first")
        if not 0 <= optimizer < self.spec.num_optimizers:
            raise ValueError(f"optimizer={optimizer} does not exist; the spec has {self.spec.num_optimizers}")
        if clip is not None and clip.algorithm == CLIP_NORM and self.num_servers > 1:
            raise ValueError(
                f"gradient clipping by norm needs num_servers=1 (this run has {self.num_servers}): each server holds "
                "a shard, and a shard's norm is not the model's; clip by value, or use one server"
            )
        lr_bytes = as_bytes(torch.tensor(lrs, dtype=torch.float64))
        stepped = [p for p, g in zip(self.params, self.spec.group_of) if self.spec.owner[g] == optimizer]
        if self.config.skip_nonfinite and not grads_are_finite(stepped):
            payloads = [lr_bytes] * self.num_servers
            answers = self._exchange(Kind.PUSH, payloads, FLAG_NONFINITE, optimizer=optimizer)
            return self._to_reply(answers, push=True)
        payloads = []
        for i in range(self.num_servers):
            grads = [self.params[j].grad for j in self.indices[i]]
            payloads.append(torch.cat([lr_bytes, self.codec.pack(self.layouts[i].flat_fp32(grads), i)]))
        return self._to_reply(self._exchange(Kind.PUSH, payloads, optimizer=optimizer, clip=clip), push=True)

    def request_stop(self) -> PSReply:
        """Ends the run for every worker (e.g. early stopping): every server has stopped when this returns; the other
        workers learn it at their next request."""
        return self._to_reply(self._exchange(Kind.STOP), push=False)

    def server_states(self) -> list[dict[str, Any]]:
        """Every server's shard state, for a checkpoint (fetched by worker 0 between steps; in sync it resumes bit for
        bit)."""
        return [from_blob(payload) for _, payload in self._exchange(Kind.GET_STATE) if payload is not None]

    def server_stats(self) -> list[dict[str, Any]]:
        """Each server's :meth:`~lightning_sync.ps.server.ParameterServer.stats`."""
        return [from_blob(payload) for _, payload in self._exchange(Kind.STATS) if payload is not None]

    def close(self) -> None:
        """Says goodbye to every server (skipped after a transport error) and leaves the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._broken is None:
                self._exchange(Kind.BYE, check_open=False)
        finally:
            self.group.close()

    def state_dict(self) -> dict[str, Any]:
        """The worker-side state to checkpoint: the codec's error-feedback residuals."""
        return {"codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`."""
        self.codec.load_state_dict(state["codec"])

    def _exchange(
        self,
        kind: Kind,
        payloads: Sequence[torch.Tensor | None] | None = None,
        flags: int = 0,
        check_open: bool = True,
        optimizer: int = 0,
        clip: Clip | None = None,
    ) -> list[tuple[ReplyHeader, torch.Tensor | None]]:
        if check_open and self._closed:
            raise RuntimeError(f"{kind.name} on a closed PSClient")
        if self._broken is not None:
            raise RuntimeError(f"{kind.name} after an earlier error of this PSClient: {self._broken}")
        sizes = [0 if p is None else p.numel() for p in payloads or [None] * self.num_servers]
        requests = [
            Request(kind, self.worker, version, nbytes, check, flags, optimizer, clip)
            for version, nbytes, check in zip(self.versions, sizes, self.checksums)
        ]
        timeout = reply_timeout_s(
            self.group, kind, initialized=min(self.versions) >= 0, drops_lost_workers=self.config.drops_lost_workers
        )
        try:
            return exchange(
                self.group, kind, requests, payloads, self._replies, timeout, self.config.drops_lost_workers
            )
        except PSServerError:
            raise  # a refusal: the transport is fine, the client stays usable
        except PSError as exc:
            self._broken = exc
            self.group.report_failure(f"{type(exc).__name__}: {exc}")
            raise

    def _to_reply(self, answers: list[tuple[ReplyHeader, torch.Tensor | None]], push: bool) -> PSReply:
        applied, skipped = push, False
        stop_code, stop_worker = StopCode.NONE, -1
        for i, (header, payload) in enumerate(answers):
            if payload is not None and header.payload_nbytes == self.layouts[i].nbytes:
                self.layouts[i].unpack_into(payload, [self.params[j] for j in self.indices[i]])
            self.versions[i] = header.version
            if header.flags & (FLAG_NOT_APPLIED | FLAG_SKIPPED):
                applied = False
            skipped = skipped or bool(header.flags & FLAG_SKIPPED)
            if header.flags & FLAG_STOP and stop_code == StopCode.NONE:
                stop_code, stop_worker = header.stop_code, header.stop_worker
        if stop_code != StopCode.NONE:
            self.stopped = True
            self.stop_reason = stop_reason(stop_code, stop_worker, self.config.max_updates)
        reply = PSReply(
            versions=tuple(h.version for h, _ in answers),
            stop=self.stopped,
            stop_reason=self.stop_reason,
            applied=applied,
            staleness=tuple(h.staleness if push else -1 for h, _ in answers),
            clocks=tuple(h.clock for h, _ in answers),
            min_clocks=tuple(h.min_clock for h, _ in answers),
            server_bytes_recv=tuple(h.bytes_recv for h, _ in answers),
            skipped=skipped,
            live_workers=tuple(h.live_workers for h, _ in answers),
            lost_workers=tuple(h.lost_workers for h, _ in answers),
            joins=tuple(h.joins for h, _ in answers),
        )
        self.last_reply = reply
        return reply
