"""What a parameter server answers: one server's state and its handling of each request, in every mode.

:class:`RequestDispatch` holds the shard, the settings the INIT brought, the pending sync gradients, the withheld ssp
replies and the stop, and answers each complete request (:meth:`RequestDispatch._handle`) through the workers'
channels. The loop that takes those requests and watches the workers' liveness is
:class:`~lightning_sync.ps.server.ParameterServer`, which the module docstring of :mod:`lightning_sync.ps.server`
describes with the modes and the stop.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_sync.comm.compression import Compressor
from lightning_sync.ps._channels import WorkerChannels
from lightning_sync.ps._layout import ShardLayout
from lightning_sync.ps._protocol import (
    FLAG_NONFINITE,
    FLAG_NOT_APPLIED,
    FLAG_SKIPPED,
    FLAG_STOP,
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
from lightning_sync.ps.group import PSGroup
from lightning_sync.ps.liveness import WorkerLiveness
from lightning_sync.ps.optim_spec import OptimizerSpec
from lightning_sync.ps.settings import PSConfig
from lightning_sync.ps.shard import ServerShard


class _Refused(Exception):
    """A request the server answers with an error reply (the run goes on)."""


class RequestDispatch:
    """One server's state and its answer to each request (the loop: ``lightning_sync.ps.server.ParameterServer``).

    Args:
        group: this server's member of the PS group (``group.is_server``).
        spare_workers: how many of the group's worker ranks, the last ones, are spare slots: no worker holds them at
            the start, and a worker added to the running job takes one (elastic modes; see
            :func:`~lightning_sync.ps.group.claim_spare_slot`).

    Raises:
        ValueError: ``group`` is a worker's member, or ``spare_workers`` leaves no worker to start with.
    """

    def __init__(self, group: PSGroup, spare_workers: int = 0) -> None:
        if not group.is_server:
            raise ValueError(f"{group.name()} is a worker; a ParameterServer needs a server's member of the group")
        if isinstance(spare_workers, bool) or not isinstance(spare_workers, int):
            raise ValueError(f"spare_workers={spare_workers!r} must be an integer")
        if not 0 <= spare_workers < group.num_workers:
            raise ValueError(
                f"spare_workers={spare_workers!r} must be in [0, {group.num_workers - 1}]: the group's "
                f"{group.num_workers} worker ranks include the spare slots, and at least one worker starts the run"
            )
        self.group = group
        self.server = group.ps_rank - group.num_workers
        self.num_workers = group.num_workers  # worker slots, the spare ones included
        self.initial_workers = group.num_workers - spare_workers  # the workers the run starts with
        self.shard: ServerShard | None = None
        self.config: PSConfig | None = None
        self.codec: Compressor | None = None
        self.checksum = 0
        self.num_groups = 0
        self.push_scales = [1.0]  # async and ssp: factor of a push's step, per worker optimizer (from the INIT)
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
        self.generation = [0] * self.num_workers  # per worker, the generation of its links (0, +1 per rejoin)
        self.vacant = set(range(self.initial_workers, self.num_workers))  # spare slots no worker has taken yet
        for worker in self.vacant:
            self.live[worker] = False
        self._joins_checked = 0.0
        self.channels = WorkerChannels(group, self.server)

    # ---------------------------------------------------------------- public
    @property
    def stopped(self) -> bool:
        return self.stop_code != StopCode.NONE

    @property
    def elastic(self) -> bool:
        """Whether a lost worker is dropped (the run goes on) rather than ending the run: known from the INIT on."""
        return self.config is not None and self.config.drops_lost_workers

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

    # ---------------------------------------------------------------- replying
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
            bytes_sent=int(total.bytes_sent),
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

    # ---------------------------------------------------------------- requests
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
            self._check_checksum(request, worker)
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
            outer = config.new_outer_optimizer if config.local_steps > 1 else None
            shard = ServerShard(init["params"], init["indices"], spec, self.num_workers, outer)
            if shard.layout.signature() != ShardLayout.from_dict(init["layout"]).signature():
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
        scale = 1.0 / self.initial_workers if config.push_scale is None else float(config.push_scale)  # auto: 1/W
        self.push_scales = [scale] * (1 if config.local_steps > 1 else spec.num_optimizers)  # > 1: the outer SGD
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
        if not 0 <= request.optimizer < len(self.push_scales):
            raise _Refused(f"a push for optimizer {request.optimizer}; the workers have {len(self.push_scales)}")
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
        # One push is one worker's gradient, where a sync step averages W of them: push_scale (auto: 1/W) is what
        # one push's step counts for, on the gradient or the learning rate (see scales_learning_rate).
        k = request.optimizer
        self.shard.apply(grad, lrs, k, request.clip, self.push_scales[k])
        self.shard.record(worker, staleness)
        self._check_max_updates()
        if self.config.mode == "ssp" and not self.stopped and self._lead(worker) > self.config.max_staleness:
            self.withheld.add(worker)
        else:
            self.channels.send([(worker, self._params_reply(Kind.PUSH, worker, staleness=staleness))])
        self._after_change()

    # ---------------------------------------------------------------- mode logic
    def _lead(self, worker: int) -> int:
        assert self.shard is not None
        live = [self.shard.clocks[w] for w in range(self.num_workers) if self.live[w]]
        return self.shard.clocks[worker] - min(live) if live else 0

    def _check_max_updates(self) -> None:
        assert self.shard is not None and self.config is not None
        if not self.stopped and self.max_updates is not None and self.shard.version >= self.max_updates:
            self.stop_code = StopCode.MAX_UPDATES

    def _stop_reason(self) -> str:
        return stop_reason(self.stop_code, self.stop_worker, self.max_updates)

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
