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

The client never calls ``optimizer.step()``: the servers hold the optimizer. Every request goes to all servers at
once (:func:`exchange`), every wait bounded by the group's ``timeout_s``; a lost or silent server raises
:class:`~lightning_sync.ps.errors.PSTimeoutError` or :class:`~lightning_sync.ps.errors.PSPeerLostError` naming it
(with the server's own last words when it left some, :func:`report_of`).
"""

from __future__ import annotations

import time
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
    checksum,
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
    """What the servers answered to a pull or a push (one entry per server where it is a tuple).

    Attributes:
        versions: each server's version (optimizer steps applied to its shard) when it replied.
        stop: training is over (``max_updates`` reached or a worker asked to stop): stop pushing, then
            :meth:`PSClient.close`.
        stop_reason: why, e.g. ``"max_updates=100 reached"`` or ``"worker 1 requested stop"``; ``""`` if not
            stopped.
        applied: a push was applied by every server (``False`` for a pull, a push that came after the stop, or
            a skipped one).
        skipped: the push was skipped for a NaN or Inf gradient (``skip_nonfinite``): in sync, some worker's, and
            the step was skipped for every worker; in async and ssp, this worker's. The parameters are unchanged
            by it.
        staleness: per server, the staleness of this push (server version when applied minus the version it was
            computed on; ``0`` in sync); ``-1`` for a pull.
        clocks: per server, this worker's clock (its pushes applied by that server).
        min_clocks: per server, the clock of the slowest live worker.
        server_bytes_recv: per server, everything it received so far (its ingress, all workers), as of the reply.
        server_bytes_sent: per server, everything it sent so far (its egress), as of the reply.
        live_workers: per server, the workers it counts as live (not dropped, no goodbye yet).
        lost_workers: per server, the workers it has dropped (the elastic modes).
        joins: per server, how many times a dropped worker rejoined it (the elastic modes).
    """

    versions: tuple[int, ...]
    stop: bool
    stop_reason: str
    applied: bool
    staleness: tuple[int, ...]
    clocks: tuple[int, ...]
    min_clocks: tuple[int, ...]
    server_bytes_recv: tuple[int, ...]
    server_bytes_sent: tuple[int, ...]
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
    """Assigns each parameter (by its size in bytes) to one of ``num_servers`` servers.

    Greedy "largest first": parameters are taken from the largest to the smallest (ties: lower index first) and
    each goes to the server holding the fewest bytes so far (ties: fewer tensors, then lower server). Whole tensors
    only.

    Guarantees:
        * deterministic: the same sizes give the same assignment on every process;
        * every server gets at least one parameter;
        * the gap between the fullest and the emptiest server is at most the size of the largest parameter, and the
          fullest holds at most ``4/3`` of what the best possible split of whole tensors would put there.

    Args:
        sizes: size in bytes of each parameter, in the order of the parameter list.
        num_servers: number of servers, ``1 <= num_servers <= len(sizes)``.

    Returns:
        For each parameter, in order, the index of its server.

    Raises:
        ValueError: ``num_servers`` is not an integer >= 1 or exceeds the number of parameters (a server would hold
            nothing), or a size is negative.
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
    """Sends ``requests[i]`` (and ``payloads[i]``) to server ``i``, for every server, and returns each one's reply.

    The receives of the replies are launched first, then every request (header, then data). A peer that already gave
    up left its reason in the store: the exchange stops on it at once rather than wait out ``timeout_s``.

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


class ServerStepOptimizer:
    """The worker's optimizer, with ``step`` replaced by a push: a drop-in for code that calls
    ``optimizer.step(closure)`` (a training loop, or Lightning's precision plugins).

    ``step(closure)`` runs the closure (forward, backward, and whatever the caller wraps in it, such as clipping),
    then calls ``push(optimizer)``; the local optimizer never steps. Every other attribute is the optimizer's.

    Args:
        optimizer: the worker's optimizer (its ``param_groups`` carry the learning rates to push).
        push: pushes the gradients, e.g. ``lambda opt: client.push(current_lrs(opt))``.
    """

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
    """A worker's client of the parameter servers.

    The parameters are sharded over the servers by :func:`shard_by_bytes` (the same
    split on every worker, so the models must be identical in shapes and dtypes).

    Args:
        group: this worker's member of the PS group (a worker rank).
        params: the ordered parameters the servers train (the model's tensors, updated in place by every reply).
        spec: the optimizer recipe, :func:`~lightning_sync.ps.optim_spec.optimizer_spec` of the same ``params``.
        config: the run's settings (identical on every worker).

    Raises:
        ValueError: ``group`` is a server's member, ``params`` is empty, a parameter is not floating point,
            ``spec`` describes another number of parameters, or there are more servers than parameter tensors.
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
        # What every worker must agree on; the run's end is worker 0's alone (its INIT sets it on the servers), so a
        # worker added to the run, with another share of the data and so another count of updates, still matches.
        agreed = sorted((k, v) for k, v in config.as_dict().items() if k not in _SET_BY_THE_INIT)
        settings = repr(agreed) + f"|{spec.classes}|{spec.num_groups}|{spec.owner}"
        self.checksums = [
            checksum(f"{settings}|{idx}|{layout.signature()}") for idx, layout in zip(self.indices, self.layouts)
        ]
        self.versions = [-1] * self.num_servers
        self.stopped = False
        self.stop_reason = ""
        self.last_reply: PSReply | None = None
        self._replies = [torch.empty(lay.nbytes, dtype=torch.uint8) for lay in self.layouts]
        self._closed = False
        self._broken: BaseException | None = None

    # ---------------------------------------------------------------- properties
    @property
    def meter(self) -> Any:
        """This worker's :class:`~lightning_sync.comm.meter.CommMeter`: every byte it exchanges with the servers."""
        return self.group.meter

    @property
    def shard_nbytes(self) -> list[int]:
        """Bytes of parameters each server holds."""
        return [lay.nbytes for lay in self.layouts]

    def push_nbytes(self, server: int) -> int:
        """Exact bytes one push puts on the wire to ``server``: header, learning rates and encoded gradient."""
        return HEADER_BYTES + 8 * self.spec.num_groups + self.codec.packed_nbytes(self.layouts[server].numel)

    # ---------------------------------------------------------------- requests
    def init_servers(self, states: Sequence[dict[str, Any]] | None = None) -> None:
        """Sends each server its shard of this worker's parameters, the optimizer spec and the settings.

        Called once, by worker 0, before training; pulls that other workers send earlier are answered right after.
        With ``states`` (from :meth:`server_states` of a checkpoint), each server then loads its state, in the
        same request, so no worker can pull the un-restored parameters.

        Raises:
            PSServerError: a server was already initialized, or refused the state.
            ValueError: ``states`` does not have one entry per server.
        """
        if states is not None and len(states) != self.num_servers:
            raise ValueError(f"states has {len(states)} entries, expected one per server ({self.num_servers})")
        payloads = []
        for i in range(self.num_servers):
            payloads.append(
                to_blob(
                    {
                        "config": self.config.as_dict(),
                        "optimizer": self.spec.as_dict(),
                        "indices": self.indices[i],
                        "layout": self.layouts[i].as_dict(),
                        "params": [self.params[j].detach().to("cpu").clone() for j in self.indices[i]],
                        "checksum": self.checksums[i],
                        "state": None if states is None else states[i],
                    }
                )
            )
        self._exchange(Kind.INIT, payloads)

    def pull(self) -> PSReply:
        """Copies every server's current parameters into ``params`` (in place) without pushing.

        Guarantees: on return the model holds the servers' parameters at the returned versions. A pull sent before
        worker 0's :meth:`init_servers` waits for it (up to the servers' ``connect_timeout_s``).
        """
        return self._to_reply(self._exchange(Kind.PULL), push=False)

    def push(self, lrs: Sequence[float], optimizer: int = 0, clip: Clip | None = None) -> PSReply:
        """Pushes the gradients (``p.grad``; ``None`` counts as zeros) and receives the new parameters in place.

        With ``skip_nonfinite`` (the default) a gradient holding a NaN or Inf is not sent (nor fed to the codec's
        error feedback): the push carries a flag instead, and the servers skip the update (see
        :attr:`PSReply.skipped`).

        Guarantees: on return the model holds the parameters the servers replied with (sync: the step that
        averaged every worker's gradient; async: the step with this gradient, or newer; ssp: the same, possibly held
        back until the slowest worker is within ``max_staleness``). If the run had stopped, the push was not
        applied (``applied`` is ``False``) and the parameters are the final ones.

        Args:
            lrs: the worker's current learning rate of each param group (:func:`~lightning_sync.ps.optim_spec.
                current_lrs`; every optimizer's), written into the servers' param groups before they step.
            optimizer: with several optimizers (see :func:`~lightning_sync.ps.optim_spec.optimizer_spec`), the index
                of the one that steps: the servers step only its parameters (the others' gradients are ignored).
            clip: gradient clipping for the servers to apply to that optimizer's gradient before the step (in sync
                to the average, as DDP clips the all-reduced gradient). ``norm`` needs one server: a shard's norm is
                not the model's.

        Raises:
            RuntimeError: no :meth:`pull` before the first push, or the client is closed.
            ValueError: ``lrs`` does not have one value per param group.
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
        if self.config.skip_nonfinite and not grads_are_finite(self._stepped_params(optimizer)):
            payloads = [lr_bytes] * self.num_servers
            answers = self._exchange(Kind.PUSH, payloads, FLAG_NONFINITE, optimizer=optimizer)
            return self._to_reply(answers, push=True)
        payloads = []
        for i in range(self.num_servers):
            grads = [self.params[j].grad for j in self.indices[i]]
            payloads.append(torch.cat([lr_bytes, self.codec.pack(self.layouts[i].flat_fp32(grads), i)]))
        return self._to_reply(self._exchange(Kind.PUSH, payloads, optimizer=optimizer, clip=clip), push=True)

    def _stepped_params(self, optimizer: int) -> list[torch.Tensor]:
        spec = self.spec
        if spec.num_optimizers == 1:
            return self.params
        return [p for p, g in zip(self.params, spec.group_of) if spec.owner[g] == optimizer]

    def request_stop(self) -> PSReply:
        """Ends the run for every worker (e.g. early stopping); they learn it at their next push or pull.

        Guarantees: every server has stopped when this returns; no later push is applied.
        """
        return self._to_reply(self._exchange(Kind.STOP), push=False)

    def server_states(self) -> list[dict[str, Any]]:
        """Every server's shard state (parameters, optimizer state, version, worker clocks), for a checkpoint.

        Called by one worker (worker 0) between steps. In sync mode, a state fetched after every worker's reply
        to the same step resumes bit for bit.
        """
        return [from_blob(_payload(answer)) for answer in self._exchange(Kind.GET_STATE)]

    def server_stats(self) -> list[dict[str, Any]]:
        """Each server's stats: version, worker clocks, staleness (last value and histogram per worker), stop state,
        and its traffic (``bytes_recv``, ``bytes_sent``, ``calls``, ``seconds``)."""
        return [from_blob(_payload(answer)) for answer in self._exchange(Kind.STATS)]

    def close(self) -> None:
        """Says goodbye to every server (they stop waiting for this worker) and leaves the group. Idempotent.

        After a transport error the goodbye is skipped (the servers are gone or will time out) and only the group
        is left.
        """
        if self._closed:
            return
        self._closed = True
        try:
            if self._broken is None:
                self._exchange(Kind.BYE, check_open=False)
        finally:
            self.group.close()

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The worker-side state to checkpoint: the codec's error-feedback residuals."""
        return {"codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`."""
        self.codec.load_state_dict(state["codec"])

    # ---------------------------------------------------------------- transport
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
        requests = []
        for i in range(self.num_servers):
            payload = payloads[i] if payloads is not None else None
            nbytes = 0 if payload is None else payload.numel()
            requests.append(
                Request(kind, self.worker, self.versions[i], nbytes, self.checksums[i], flags, optimizer, clip)
            )
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
            server_bytes_sent=tuple(h.bytes_sent for h, _ in answers),
            skipped=skipped,
            live_workers=tuple(h.live_workers for h, _ in answers),
            lost_workers=tuple(h.lost_workers for h, _ in answers),
            joins=tuple(h.joins for h, _ in answers),
        )
        self.last_reply = reply
        return reply


def _payload(answer: tuple[ReplyHeader, torch.Tensor | None]) -> torch.Tensor:
    """The payload of a reply that always carries one (a server's state or stats)."""
    payload = answer[1]
    assert payload is not None, f"a {answer[0].kind.name} reply without payload"
    return payload
