"""The server: one shard's authoritative parameters and optimizer, and the loop that serves the workers.

:class:`ServerShard` is the state and the arithmetic (no communication); :class:`ParameterServer` is the loop, the
same for every placement (a dedicated process started by ``python -m lightning_sync.ps``, or a thread of a
worker process) and every mode:

* ``sync``: the server collects one gradient per live worker for its current version ``t`` (a push for another
  version is refused), averages them in fp32 (sum in worker order 0..W-1, divided by the number of contributions,
  ``W`` while every worker is live), steps once (version ``t+1``), then replies to every contributor with the new
  parameters.
* ``async``: each push is one optimizer step with that gradient times ``push_scale`` (see
  :func:`~lightning_sync.ps.optim_spec.default_push_scale`), answered at once with the new parameters.
* ``ssp`` (``max_staleness = s``): applied as in async, but the reply to a worker is withheld while its clock
  (pushes applied) is more than ``s`` ahead of the slowest live worker's clock; ``s = 0`` is lockstep.

In every mode a push's staleness is the server version when it is applied minus the version it was computed on
(``0`` in sync); the server counts the values per worker and keeps the last one (:meth:`ServerShard.stats`).

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
ssp reply) and that completes no request for ``timeout_s`` is declared lost, once: the loop raises an error naming
it, leaves the message in the store for the peers, and returns control (a dedicated process exits with code 1).
The same happens when no request at all arrives for ``timeout_s`` (``connect_timeout_s`` before the initial
parameters), or a worker's connection closes.
"""

from __future__ import annotations

import argparse
import copy
import os
import queue
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from lightning_sync.ps._layout import ShardLayout
from lightning_sync.ps._protocol import (
    CLIP_NORM,
    CLIP_VALUE,
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
from lightning_sync.ps.codec import GradientCodec
from lightning_sync.ps.errors import PSError, PSTimeoutError
from lightning_sync.ps.group import DEFAULT_PREFIX, PSGroup, connect_store, server_ps_rank
from lightning_sync.ps.optim_spec import OptimizerSpec, build_shard_optimizer, default_push_scale
from lightning_sync.ps.outer import DelayedNesterov
from lightning_sync.ps.settings import PSConfig

#: Staleness values from this one up are counted together under it (a histogram of bounded size, whatever the run).
STALENESS_CAP = 1024


class ServerShard:
    """The authoritative parameters of one shard, their optimizer, the version clock and the worker clocks.

    Args:
        params: initial values of the shard's parameters (copied to CPU; shard order).
        indices: for each, its index in the workers' ordered parameter list.
        spec: the workers' optimizer (:func:`~lightning_sync.ps.optim_spec.optimizer_spec`).
        num_workers: number of workers (size of the clocks).

    Raises:
        ValueError: ``params`` and ``indices`` differ in length, or ``num_workers < 1``.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        indices: Sequence[int],
        spec: OptimizerSpec,
        num_workers: int,
        outer: dict[str, Any] | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r} must be >= 1")
        self.indices = [int(i) for i in indices]
        self.params = [torch.nn.Parameter(p.detach().to("cpu").clone()) for p in params]
        self.layout = ShardLayout.of(self.params)
        if outer is not None:  # async local SGD: one outer optimizer over the whole shard, its own learning rate
            self.optimizers: list[torch.optim.Optimizer | None] = [DelayedNesterov(self.params, **outer)]
            self.group_maps: list[list[int]] = [[]]
            self.owner = [0] * len(self.params)
        else:  # one shard optimizer per worker optimizer (None where it holds none of this shard's parameters)
            built = [build_shard_optimizer(spec, self.params, self.indices, k) for k in range(spec.num_optimizers)]
            self.optimizers = [opt for opt, _ in built]
            self.group_maps = [mirrored for _, mirrored in built]
            self.owner = [spec.owner_of(spec.group_of[i]) for i in self.indices]  # each shard parameter's optimizer
        self.num_workers = num_workers
        self.version = 0
        self.clocks = [0] * num_workers
        self.staleness_counts: list[Counter[int]] = [Counter() for _ in range(num_workers)]
        self.last_staleness = [-1] * num_workers
        self._packed: torch.Tensor | None = None
        self._packed_version = -1

    # ---------------------------------------------------------------- arithmetic
    def apply(
        self,
        grad: torch.Tensor,
        lrs: Sequence[float],
        optimizer: int = 0,
        clip: Clip | None = None,
        scale: float = 1.0,
    ) -> None:
        """One step of the worker's optimizer number ``optimizer`` with ``grad`` (fp32, layout order) at the workers'
        learning rates ``lrs`` (every group of every optimizer).

        Guarantees: each param group's ``lr`` is set to ``lrs[g]`` of the worker group it mirrors before the step;
        the gradient of that optimizer's parameters is clipped as ``clip`` says (``torch.nn.utils``' own functions,
        as Lightning's precision plugins call them), then multiplied by ``scale``; only that optimizer's parameters
        change; ``version`` increases by one (also when this shard holds none of its parameters); gradients are
        cleared after the step.
        """
        if grad.numel() != self.layout.numel:
            raise ValueError(f"gradient has {grad.numel()} entries, the shard {self.layout.numel}")
        if not 0 <= optimizer < len(self.optimizers):
            raise ValueError(f"optimizer {optimizer} does not exist; the worker has {len(self.optimizers)}")
        stepping = self.optimizers[optimizer]
        if stepping is not None:
            for group, spec_group in zip(stepping.param_groups, self.group_maps[optimizer]):
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(float(lrs[spec_group]))
                else:
                    group["lr"] = float(lrs[spec_group])
            for p, g in zip(self.params, self.layout.split(grad)):
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
            stepped = [p for p, k in zip(self.params, self.owner) if k == optimizer]
            if clip is not None and clip.algorithm == CLIP_NORM:
                torch.nn.utils.clip_grad_norm_(stepped, clip.value)
            elif clip is not None and clip.algorithm == CLIP_VALUE:
                torch.nn.utils.clip_grad_value_(stepped, clip.value)
            if scale != 1.0:
                for p in stepped:
                    assert p.grad is not None  # set for every parameter above
                    p.grad.mul_(scale)
            stepping.step()
            for p in self.params:
                p.grad = None
        self.version += 1

    def packed(self) -> torch.Tensor:
        """The current parameters as one byte buffer (made once per version; do not modify it)."""
        if self._packed is None or self._packed_version != self.version:
            self._packed = self.layout.pack(self.params)
            self._packed_version = self.version
        return self._packed

    def record(self, worker: int, staleness: int) -> None:
        """Books one applied push of ``worker`` with its staleness (counted under :data:`STALENESS_CAP` from there
        up; the last value is kept as it is)."""
        self.clocks[worker] += 1
        self.last_staleness[worker] = int(staleness)
        self.staleness_counts[worker][min(int(staleness), STALENESS_CAP)] += 1

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Parameters, optimizer state, version, worker clocks and the staleness record (all copies; its size does
        not grow with the number of pushes)."""
        return {
            "indices": list(self.indices),
            "params": [p.detach().clone() for p in self.params],
            "optimizers": [None if opt is None else copy.deepcopy(opt.state_dict()) for opt in self.optimizers],
            "version": self.version,
            "clocks": list(self.clocks),
            "staleness_counts": [dict(sorted(c.items())) for c in self.staleness_counts],
            "last_staleness": list(self.last_staleness),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` in place (bit for bit).

        Raises:
            ValueError: the state belongs to another shard (other parameter indices, shapes or worker count).
        """
        if list(state["indices"]) != self.indices:
            raise ValueError(f"state holds parameters {list(state['indices'])}, this shard {self.indices}")
        if len(state["clocks"]) != self.num_workers:
            raise ValueError(f"state has {len(state['clocks'])} worker clocks, this run {self.num_workers} workers")
        with torch.no_grad():
            for p, saved in zip(self.params, state["params"]):
                if saved.shape != p.shape or saved.dtype != p.dtype:
                    raise ValueError(
                        f"saved parameter {tuple(saved.shape)} {saved.dtype} vs {tuple(p.shape)} {p.dtype}"
                    )
                p.copy_(saved)
        saved = state["optimizers"] if "optimizers" in state else [state["optimizer"]]  # one optimizer, older form
        if len(saved) != len(self.optimizers):
            raise ValueError(f"state holds {len(saved)} optimizers, this run {len(self.optimizers)}")
        for opt, opt_state in zip(self.optimizers, saved):
            if opt is not None:
                opt.load_state_dict(copy.deepcopy(opt_state))
        self.version = int(state["version"])
        self.clocks = [int(c) for c in state["clocks"]]
        if "staleness_history" in state:  # older form: every value
            history = state["staleness_history"]
            self.staleness_counts = [Counter(min(int(s), STALENESS_CAP) for s in h) for h in history]
            self.last_staleness = [int(h[-1]) if h else -1 for h in history]
        else:
            self.staleness_counts = [Counter({int(s): int(n) for s, n in c.items()}) for c in state["staleness_counts"]]
            self.last_staleness = [int(s) for s in state["last_staleness"]]
        self._packed = None

    def stats(self) -> dict[str, Any]:
        """Version, clocks, and per worker the last staleness (``-1`` before its first push) and a histogram
        ``{staleness: pushes}`` in increasing staleness (:data:`STALENESS_CAP` counts that value and all above)."""
        return {
            "version": self.version,
            "clocks": list(self.clocks),
            "last_staleness": list(self.last_staleness),
            "staleness_histogram": [dict(sorted(c.items())) for c in self.staleness_counts],
        }


class _Refused(Exception):
    """A request the server answers with an error reply (the run goes on)."""


class ParameterServer:
    """The server loop of one PS-group member (see the module docstring for the modes and the stop).

    Args:
        group: this server's member of the PS group (``group.is_server``).

    Raises:
        ValueError: ``group`` is a worker's member.
    """

    def __init__(self, group: PSGroup) -> None:
        if not group.is_server:
            raise ValueError(f"{group.name()} is a worker; a ParameterServer needs a server's member of the group")
        self.group = group
        self.server = group.ps_rank - group.num_workers
        self.num_workers = group.num_workers
        self.shard: ServerShard | None = None
        self.config: PSConfig | None = None
        self.codec: GradientCodec | None = None
        self.checksum = 0
        self.num_groups = 0
        self.push_scales = [1.0]  # async and ssp: factor of a pushed gradient, per worker optimizer (from the INIT)
        self.initialized_by = -1
        self.live = [True] * self.num_workers
        self.last_contact = [time.monotonic()] * self.num_workers
        self.pending: dict[int, tuple[Any, list[float], int, Clip | None]] = {}  # sync: grad, lrs, optimizer, clip
        self.withheld: set[int] = set()  # ssp: workers whose push reply is held back
        self.deferred_pulls: dict[int, int] = {}  # worker -> settings checksum of pulls before the initial parameters
        self.stop_code = StopCode.NONE
        self.stop_worker = -1
        self.rejected_pushes = 0
        self.skipped_updates = 0  # sync steps or async/ssp pushes skipped for a NaN or Inf gradient
        self._inflight: dict[int, list[tuple[Kind, Any]]] = {}  # worker -> sends of its last reply
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (worker, request, data, error) of each receiver
        self._last_request = time.monotonic()

    # ---------------------------------------------------------------- public
    @property
    def stopped(self) -> bool:
        return self.stop_code != StopCode.NONE

    def run(self) -> dict[str, Any]:
        """Serves until every worker has said goodbye; returns the final stats.

        Raises:
            PSTimeoutError: no request for ``timeout_s`` (``connect_timeout_s`` before the initial parameters), or a
                live worker silent that long; the message names the worker(s).
            PSPeerLostError: a worker's connection closed while the server was talking to it.
        """
        try:
            self._start_receivers()
            while any(self.live):
                worker, request, payload = self._next_request()
                self.last_contact[worker] = self._last_request = time.monotonic()
                self._settle(worker)  # a worker only sends again once it has taken our previous reply
                try:
                    self._handle(request, worker, payload)
                except _Refused as refusal:
                    self._send_replies([(worker, self._error_reply(request.kind, str(refusal)))])
                self._check_silent_workers()
            for worker in list(self._inflight):
                try:
                    self._settle(worker)
                except PSError:
                    pass  # only goodbye acknowledgements are left: a worker gone right after its goodbye is fine
        except BaseException as exc:
            message = f"{type(exc).__name__}: {exc}"
            self.group.report_failure(message)
            raise
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """What a STATS request returns: the shard's clocks and staleness, stop state and this server's traffic."""
        total = self.group.meter.total
        out: dict[str, Any] = {
            "server": self.server,
            "mode": self.config.mode if self.config else None,
            "push_scale": self.push_scales[0] if len(self.push_scales) == 1 else list(self.push_scales),
            "initialized": self.shard is not None,
            "stopped": self.stopped,
            "stop_reason": self._stop_reason(),
            "live": list(self.live),
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

    # ---------------------------------------------------------------- receiving
    def _start_receivers(self) -> None:
        for worker in range(self.num_workers):
            name = f"lightning_sync-ps-server{self.server}-recv{worker}"
            threading.Thread(target=self._receive_from, args=(worker,), name=name, daemon=True).start()

    def _receive_from(self, worker: int) -> None:
        """Receiving thread of ``worker``: its requests, each complete (header and data), into the inbox, until its
        goodbye or an error.

        The loop, not this thread, decides when the worker is lost (after ``timeout_s`` of silence it is not itself
        the cause of); this thread's waits are only a backstop, longer than any silence the loop tolerates (a gloo
        wait that times out closes every connection of the member, so it must not end one the loop still serves).
        """
        backstop = max(self.group.connect_timeout_s, self.group.timeout_s) + 2 * self.group.timeout_s
        try:
            while True:
                header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
                self.group.receive(header, worker, TAG_REQUEST, "a request", timeout_s=backstop)
                request, payload = Request.parse(header), None
                if request.payload_nbytes > 0:
                    payload = torch.empty(request.payload_nbytes, dtype=torch.uint8)
                    what = f"the data of its {request.kind.name} request"
                    self.group.receive(payload, worker, TAG_REQUEST_DATA, what, timeout_s=backstop)
                self._inbox.put((worker, request, payload, None))
                if request.kind == Kind.BYE:
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the loop, which raises it
            self._inbox.put((worker, None, None, exc))

    def _next_request(self) -> tuple[int, Request, torch.Tensor | None]:
        """The next complete request of any worker; raises once a worker is lost (see the module docstring)."""
        while True:
            try:
                worker, request, payload, error = self._inbox.get(timeout=self._patience())
            except queue.Empty:
                self._check_silent_workers()
                waited = time.monotonic() - self._last_request
                if waited >= self._bound():
                    raise PSTimeoutError(self._silence_message(waited)) from None
                continue
            if error is not None:
                raise error
            assert request is not None
            return worker, request, payload

    def _bound(self) -> float:
        return self.group.timeout_s if self.shard is not None else self.group.connect_timeout_s

    def _patience(self) -> float:
        """Seconds until a worker would be declared lost, or the server would give up waiting for any request."""
        deadlines = [self._last_request + self._bound()]
        if self.shard is not None:
            held = self._waiting_on_us()
            deadlines += [
                self.last_contact[w] + self.group.timeout_s
                for w in range(self.num_workers)
                if self.live[w] and w not in held
            ]
        return max(min(deadlines) - time.monotonic(), 0.0) + 0.01

    def _waiting_on_us(self) -> set[int]:
        return set(self.pending) | self.withheld | set(self.deferred_pulls)

    def _suspects(self) -> list[int]:
        held = self._waiting_on_us()
        live = [w for w in range(self.num_workers) if self.live[w]]
        return [w for w in live if w not in held] or live

    def _silence_message(self, waited: float) -> str:
        now = time.monotonic()
        suspects = sorted(self._suspects(), key=lambda w: self.last_contact[w])
        parts = [f"{self.group.name(w)} sent nothing for {now - self.last_contact[w]:.1f} s" for w in suspects]
        if self.shard is None:
            context = "waiting for the initial parameters (INIT)"
        elif self.config is not None and self.config.mode == "sync" and not self.stopped:
            context = f"waiting for gradients of version {self.shard.version}"
        else:
            context = "waiting for requests"
        return (
            f"{'; '.join(parts)} ({self.group.name()} {context}; no request at all for {waited:.1f} s: "
            "frozen, dead, or slower than timeout_s)"
        )

    def _check_silent_workers(self) -> None:
        if self.shard is None:
            return
        now = time.monotonic()
        held = self._waiting_on_us()
        silent = [
            w
            for w in range(self.num_workers)
            if self.live[w] and w not in held and now - self.last_contact[w] > self.group.timeout_s
        ]
        if silent:
            names = "; ".join(
                f"{self.group.name(w)} sent nothing for {now - self.last_contact[w]:.1f} s" for w in silent
            )
            raise PSTimeoutError(
                f"{names} ({self.group.name()} heard from other workers meanwhile: frozen, dead, or slower than "
                f"timeout_s={self.group.timeout_s:g})"
            )

    # ---------------------------------------------------------------- replying
    def _reply(
        self, kind: Kind, worker: int, *, payload: torch.Tensor | None = None, flags: int = 0, staleness: int = -1
    ) -> tuple[ReplyHeader, torch.Tensor | None]:
        total = self.group.meter.total
        clocks = self.shard.clocks if self.shard is not None else [0] * self.num_workers
        live_clocks = [clocks[w] for w in range(self.num_workers) if self.live[w]]
        if self.stopped:
            flags |= FLAG_STOP
        header = ReplyHeader(
            kind=kind,
            status=Status.OK,
            version=self.shard.version if self.shard is not None else 0,
            flags=flags,
            payload_nbytes=0 if payload is None else payload.numel(),
            bytes_recv=int(total.bytes_recv),
            bytes_sent=int(total.bytes_sent),
            staleness=staleness,
            stop_code=self.stop_code,
            stop_worker=self.stop_worker,
            clock=clocks[worker],
            min_clock=min(live_clocks) if live_clocks else clocks[worker],
        )
        return header, payload

    def _error_reply(self, kind: Kind, message: str) -> tuple[ReplyHeader, torch.Tensor | None]:
        payload = torch.frombuffer(bytearray(message.encode()), dtype=torch.uint8)
        return ReplyHeader(kind=kind, status=Status.ERROR, payload_nbytes=payload.numel()), payload

    def _send_replies(self, replies: list[tuple[int, tuple[ReplyHeader, torch.Tensor | None]]]) -> None:
        """Launches the replies without waiting for them to be taken.

        A worker takes a reply's data only once it has every server's reply header, so waiting here could stall
        this server behind another one (e.g. one holding an ssp reply back). The sends are waited for when the worker
        sends its next request (:meth:`_settle`), by which time it has taken the reply; the tensors sent are never
        modified meanwhile (packed parameters are a new buffer per version).
        """
        for worker, (header, payload) in replies:
            self._settle(worker)
            works = [(header.kind, self.group.send(header.header(), worker, TAG_REPLY))]
            if payload is not None and payload.numel() > 0:
                works.append((header.kind, self.group.send(payload, worker, TAG_REPLY_DATA)))
            self._inflight[worker] = works

    def _settle(self, worker: int) -> None:
        """Waits (bounded) for the sends of the previous reply to ``worker``."""
        for kind, work in self._inflight.pop(worker, []):
            self.group.wait(work, worker, f"it to take the reply to its {kind.name}", receiving=False)

    def _params_reply(self, kind: Kind, worker: int, flags: int = 0, staleness: int = -1) -> Any:
        assert self.shard is not None
        return self._reply(kind, worker, payload=self.shard.packed(), flags=flags, staleness=staleness)

    # ---------------------------------------------------------------- requests
    def _handle(self, request: Request, worker: int, payload: torch.Tensor | None) -> None:
        kind = request.kind
        if kind == Kind.INIT:
            self._on_init(worker, payload)
        elif kind == Kind.BYE:
            self.live[worker] = False
            self.deferred_pulls.pop(worker, None)
            self._send_replies([(worker, self._reply(kind, worker))])
            self._after_change()
        elif kind == Kind.STATS:
            blob = to_blob(self.stats())
            self._send_replies([(worker, self._reply(kind, worker, payload=blob))])
        elif self.shard is None:
            if kind != Kind.PULL:
                raise _Refused(f"{kind.name} before the initial parameters; worker 0 must call init_servers() first")
            self.deferred_pulls[worker] = request.checksum
        else:
            self._check_checksum(request, worker)
            if kind == Kind.PULL:
                self._send_replies([(worker, self._params_reply(kind, worker))])
            elif kind == Kind.PUSH:
                self._on_push(request, worker, payload)
            elif kind == Kind.STOP:
                if not self.stopped:
                    self.stop_code, self.stop_worker = StopCode.REQUESTED, worker
                self._send_replies([(worker, self._reply(kind, worker))])
                self._after_change()
            elif kind == Kind.GET_STATE:
                self._send_replies([(worker, self._reply(kind, worker, payload=to_blob(self.shard.state_dict())))])
            else:
                raise _Refused(f"unknown request kind {kind!r}")

    def _check_checksum(self, request: Request, worker: int) -> None:
        message = self._checksum_mismatch(request.checksum, worker)
        if message:
            raise _Refused(message)

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
            outer = None
            if config.local_steps > 1:
                delay = 1 if config.mode == "sync" else self.num_workers
                outer = {"lr": config.outer_lr, "momentum": config.outer_momentum}
                outer.update(nesterov=config.outer_nesterov, delay=delay)
            shard = ServerShard(init["params"], init["indices"], spec, self.num_workers, outer)
            if shard.layout.signature() != ShardLayout.from_dict(init["layout"]).signature():
                raise ValueError("the parameters do not match their announced layout")
            if init.get("state") is not None:
                shard.load_state_dict(init["state"])
        except (ValueError, KeyError, TypeError, RuntimeError, AttributeError, ImportError) as exc:
            raise _Refused(f"cannot initialize from worker {worker}'s INIT: {type(exc).__name__}: {exc}") from exc
        self.config, self.codec, self.shard = config, GradientCodec.from_config(config), shard
        scale = config.push_scale
        if config.local_steps > 1:  # the outer SGD: 1/W per push, as any SGD (one pseudo-gradient of W per round)
            self.push_scales = [1.0 / self.num_workers if scale is None else float(scale)]
        else:
            self.push_scales = [
                default_push_scale(spec, self.num_workers, k) if scale is None else float(scale)
                for k in range(spec.num_optimizers)
            ]
        self.num_groups = spec.num_groups
        self.checksum = int(init["checksum"])
        self.initialized_by = worker
        now = time.monotonic()
        self.last_contact = [now] * self.num_workers
        replies = [(worker, self._reply(Kind.INIT, worker))]
        for w, checksum in sorted(self.deferred_pulls.items()):
            mismatch = self._checksum_mismatch(checksum, w)
            reply = self._error_reply(Kind.PULL, mismatch) if mismatch else self._params_reply(Kind.PULL, w)
            replies.append((w, reply))
        self.deferred_pulls = {}
        self._send_replies(replies)

    def _on_push(self, request: Request, worker: int, payload: torch.Tensor | None) -> None:
        assert self.shard is not None and self.config is not None and self.codec is not None
        if self.stopped:
            self.rejected_pushes += 1
            self._send_replies([(worker, self._params_reply(Kind.PUSH, worker, flags=FLAG_NOT_APPLIED))])
            return
        lr_bytes = 8 * self.num_groups
        if payload is None or payload.numel() < lr_bytes:
            raise _Refused(f"a push must carry {self.num_groups} learning rates and a gradient")
        lrs = payload[:lr_bytes].view(torch.float64).tolist()
        if not 0 <= request.optimizer < len(self.push_scales):
            raise _Refused(f"a push for optimizer {request.optimizer}; the workers have {len(self.push_scales)}")
        grad = None  # a NaN or Inf gradient stays on its worker: the update is skipped
        if not request.flags & FLAG_NONFINITE:
            try:
                grad = self.codec.decode(payload[lr_bytes:], self.shard.layout)
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
            self._send_replies([(worker, self._params_reply(Kind.PUSH, worker, FLAG_SKIPPED, staleness))])
            return
        # One push is one worker's gradient, where a sync step averages W of them: push_scale (by default 1/W for
        # SGD-family optimizers, 1 for scale-invariant ones; see default_push_scale) is what one push counts for.
        k = request.optimizer
        self.shard.apply(grad, lrs, k, request.clip, self.push_scales[k])
        self.shard.record(worker, staleness)
        self._check_max_updates()
        if self.config.mode == "ssp" and not self.stopped and self._lead(worker) > self.config.max_staleness:
            self.withheld.add(worker)
        else:
            self._send_replies([(worker, self._params_reply(Kind.PUSH, worker, staleness=staleness))])
        self._after_change()

    # ---------------------------------------------------------------- mode logic
    def _lead(self, worker: int) -> int:
        assert self.shard is not None
        live = [self.shard.clocks[w] for w in range(self.num_workers) if self.live[w]]
        return self.shard.clocks[worker] - min(live) if live else 0

    def _check_max_updates(self) -> None:
        assert self.shard is not None and self.config is not None
        if not self.stopped and self.config.max_updates is not None and self.shard.version >= self.config.max_updates:
            self.stop_code = StopCode.MAX_UPDATES

    def _stop_reason(self) -> str:
        return stop_reason(self.stop_code, self.stop_worker, self.config.max_updates if self.config else None)

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
            self._send_replies(replies)

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
) -> dict[str, Any]:
    """Joins the PS group as server ``server`` through the store at ``host:port`` and serves until the end.

    This is the loop both placements run (a dedicated process, a worker's thread).

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
        return ParameterServer(group).run()
    finally:
        group.close()


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_sync.ps", description="One parameter server of a lightning_sync PS group."
    )
    parser.add_argument("--host", required=True, help="host of the run's TCPStore (worker 0)")
    parser.add_argument("--port", type=int, required=True, help="port of the run's TCPStore")
    parser.add_argument("--server", type=int, required=True, help="index of this server, 0 .. num_servers-1")
    parser.add_argument("--num-workers", type=int, required=True)
    parser.add_argument("--num-servers", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, required=True, help="bound of every wait after the rendezvous")
    parser.add_argument("--connect-timeout-s", type=float, default=None, help="bound of the rendezvous")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="store prefix of the PS group")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit as soon as this process is gone")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_sync.ps``: exit code 0 after a clean end, 1 after an error."""
    args = _parse_args(argv)
    if args.parent_pid is not None:
        from lightning_sync.ps._parent_watch import die_with_parent

        die_with_parent(args.parent_pid)
    # The loop waits inside gloo, where Python cannot run a KeyboardInterrupt: let Ctrl-C and SIGTERM end the
    # process at once instead.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    try:
        stats = run_server(
            args.host,
            args.port,
            args.server,
            args.num_workers,
            args.num_servers,
            timeout_s=args.timeout_s,
            connect_timeout_s=args.connect_timeout_s,
            prefix=args.prefix,
        )
    except (PSError, ValueError) as exc:
        print(f"lightning_sync.ps server {args.server}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(
        f"lightning_sync.ps server {args.server}: done at version {stats.get('version', 0)} "
        f"({stats['bytes_recv']} bytes in, {stats['bytes_sent']} bytes out)",
        file=sys.stderr,
        flush=True,
    )
    return 0


def exit_after(argv: Sequence[str] | None = None) -> None:
    """Runs :func:`main` and ends the process with its exit code at once.

    A dedicated server has nothing to clean up once the loop returned; skipping the interpreter's teardown (seconds
    once torch.optim has loaded torch._dynamo) lets it leave as soon as the last worker said goodbye.
    """
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_after()
