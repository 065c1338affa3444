"""Periodic model averaging: local SGD and DiLoCo's pseudo-gradient, plus buffers and optimizer state.

:class:`ModelAverager` keeps the *global copy* ("anchor") of a fixed list of parameters, identical on every rank, in
flat buckets. At a sync each rank's delta from the anchor (so that a sparsifying or low-rank codec sees small
deltas) is averaged through a :class:`~lightning_sync.comm.compression.Compressor`. Local SGD adds the mean delta to
the anchor; DiLoCo makes the mean pseudo-gradient ``anchor - local`` the anchor's gradient and steps an outer
optimizer (:data:`OUTER_OPTIMIZER` by default; SGD at ``lr=1`` without momentum equals local SGD). Every replica
then loads the anchor. Buffers (:func:`average_buffers`; torch's ``PeriodicModelAverager`` skips them) and the
optimizer's floating state (:func:`average_optimizer_state`) are averaged exactly.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_sync.comm.bucketing import plan_buckets
from lightning_sync.comm.compression import Compressor, FlatBucket, NoCompression
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.nonfinite import all_finite, probe
from lightning_sync.comm.peer_errors import PeerError, wait_future
from lightning_sync.comm.tuning import MIB
from lightning_sync.errors import ConfigError

WAIT_GRACE_S = 5.0
"""Seconds a wait for an outer sync's result may exceed ``timeout_s``, so that the collective's own error, naming the
silent peer, comes first."""


@dataclass
class InFlight:
    """An outer sync between its launch and its apply.

    Attributes:
        launched_at: the averager's step count when it was launched.
        mine: this rank's pseudo-gradient buckets at launch (for the divergence); ``None`` once complete.
        futures: the compressor's futures (launched on the calling thread), or ``job``'s (on the worker).
        divergence_sq: this rank's squared divergence from the average, once complete.
    """

    launched_at: int
    mine: list[torch.Tensor] | None = None
    futures: list[torch.futures.Future] | None = None
    job: concurrent.futures.Future | None = None
    divergence_sq: float | None = None


def _pack(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).to(out.device) for t in tensors], out=out)


def _unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))


def _load_buckets(buckets: Sequence[torch.Tensor], saved: Sequence[torch.Tensor], what: str) -> None:
    if [s.numel() for s in saved] != [b.numel() for b in buckets]:
        raise ValueError(f"ModelAverager: saved {what} has a different bucket layout than this model")
    for bucket, values in zip(buckets, saved):
        bucket.copy_(values)


def average_buffers(tensors: Sequence[torch.Tensor], meter: CommMeter, group: ProcessGroup | None = None) -> None:
    """Replaces floating ``tensors`` (the same list on every rank) by their exact mean over the group, in place,
    packed per dtype; non-floating ones (``num_batches_tracked``) are broadcast from the group's first rank."""
    if meter.world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() or t.is_complex():
            by_dtype.setdefault(t.dtype, []).append(t)
        else:
            meter.broadcast(t.data, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    pending = []
    for index, (dtype, members) in enumerate(by_dtype.items()):
        numel = sum(t.numel() for t in members)
        if numel:
            flat = _pack(members, torch.empty(numel, dtype=dtype, device=members[0].device))
            future = NoCompression().average(FlatBucket(index, flat, [t.shape for t in members]), meter, group)
            pending.append((members, flat, future))
    for members, flat, future in pending:
        wait_future(future, "all_reduce", group)
        _unpack(flat, members)


def optimizer_state_tensors(
    optimizers: Iterable[torch.optim.Optimizer], params: Iterable[torch.Tensor]
) -> list[torch.Tensor]:
    """The floating per-parameter state tensors (shaped like their parameter) of ``params``, in a fixed order;
    scalar state such as Adam's ``step`` is left out."""
    params = list(params)
    return [
        value
        for optimizer in optimizers
        for p in params
        for _, value in sorted(optimizer.state.get(p, {}).items(), key=lambda item: str(item[0]))
        if torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape
    ]


def average_optimizer_state(
    optimizers: Iterable[torch.optim.Optimizer],
    params: Iterable[torch.Tensor],
    meter: CommMeter,
    group: ProcessGroup | None = None,
) -> int:
    """Averages the floating per-parameter optimizer state of ``params`` over the group (exact mean, in place),
    once the ranks agree on its size (a flat all-reduce of different sizes would hang).

    Returns:
        The number of tensors averaged.

    Raises:
        RuntimeError: the ranks hold different amounts of optimizer state.
    """
    tensors = optimizer_state_tensors(optimizers, params)
    if meter.world_size(group) == 1:
        return len(tensors)
    numel = sum(t.numel() for t in tensors)
    sizes = torch.tensor([numel, -numel], dtype=torch.int64, device=meter.control_device(group))
    meter.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    if int(sizes[0]) != numel or int(-sizes[1]) != numel:
        raise RuntimeError(
            f"average_optimizer_state: ranks hold different optimizer state sizes (this rank {numel}, "
            f"max {int(sizes[0])}, min {int(-sizes[1])}); a parameter got a gradient on some ranks only"
        )
    average_buffers(tensors, meter, group)
    return len(tensors)


class ModelAverager:
    """The global copy of a fixed list of parameters, and the two ways of syncing replicas to it.

    Args:
        params: the parameters (every rank must pass the same list, identical at construction).
        compressor: averages the delta buckets (its own: its memory is keyed by bucket index).
        meter: counts the traffic.
        bucket_cap_mb: size of the flat buckets the deltas travel in.
        group: the process group (``None``: default).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        compressor: Compressor,
        meter: CommMeter,
        bucket_cap_mb: float = 4.0,
        group: ProcessGroup | None = None,
    ) -> None:
        self.params = list(params)
        self.compressor = compressor
        self.meter = meter
        self.group = group
        plans = plan_buckets(self.params, bucket_cap_mb * MIB, bucket_cap_mb * MIB)
        self._bucket_params = [[self.params[i] for i in plan] for plan in plans]
        self.anchors = [torch.cat([p.detach().reshape(-1) for p in params]) for params in self._bucket_params]
        # the delta buckets: after complete_, the average a sync will apply (a caller may average it further first)
        self.deltas = [torch.zeros_like(anchor) for anchor in self.anchors]

    def reset_anchor_(self) -> None:
        """Makes the current parameters the global copy (call when all replicas are identical)."""
        for anchor, bucket_params in zip(self.anchors, self._bucket_params):
            _pack(bucket_params, anchor)

    def sync_(self, outer: torch.optim.Optimizer | None = None) -> float:
        """Syncs now: local SGD's plain average (``outer=None``), or DiLoCo's step of ``outer``, an optimizer over
        :attr:`anchors`, on the pseudo-gradient ``mean(anchor - local)``; every replica then loads the anchor.

        Returns:
            This rank's squared divergence from the average, ``||local - average||^2``.
        """
        flight = self.launch_(1.0 if outer is None else -1.0, 0)
        squared = self.complete_(flight)
        self.apply_(flight, outer, skip_nonfinite=False)
        return squared

    # The same sync in steps, so that its collectives can run while inner steps do (streaming DiLoCo).
    def launch_(self, sign: float, step: int, worker: concurrent.futures.Executor | None = None) -> InFlight:
        """Packs ``sign * (local - global copy)`` and starts averaging it (on ``worker``, or from this thread).

        Args:
            sign: ``-1``: DiLoCo's pseudo-gradient ``global - local``; ``+1``: local SGD's delta.
            step: the owner's step count, kept in the result.
            worker: runs the averaging off this thread (``None``: the collectives are issued now, from this thread).
        """
        buckets = self.delta_buckets()
        mine = []
        for anchor, bucket, bucket_params in zip(self.anchors, buckets, self._bucket_params):
            delta = _pack(bucket_params, bucket.buffer).sub_(anchor)
            if sign < 0:
                delta.neg_()
            mine.append(delta.clone())
        if worker is not None:
            return InFlight(step, mine, job=worker.submit(self._average_buckets, buckets))
        return InFlight(step, mine, futures=[self.compressor.average(b, self.meter, self.group) for b in buckets])

    def _average_buckets(self, buckets: Sequence[FlatBucket]) -> None:
        """The worker's job: average every bucket and wait (with the buckets' CUDA device current in the thread)."""
        device = buckets[0].buffer.device if buckets else torch.device("cpu")
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            for future in [self.compressor.average(bucket, self.meter, self.group) for bucket in buckets]:
                wait_future(future, "outer sync", self.group)

    def complete_(self, flight: InFlight, timeout_s: float | None = None) -> float:
        """Waits for ``flight``'s average (at most ``timeout_s`` plus a grace, when run on the worker); idempotent.

        Returns:
            This rank's squared divergence from the average at launch time.

        Raises:
            PeerError: a peer did not answer within ``timeout_s`` (or is gone).
        """
        if flight.divergence_sq is not None:
            return flight.divergence_sq
        if flight.job is not None:
            limit = None if timeout_s is None else timeout_s + WAIT_GRACE_S
            try:
                flight.job.result(timeout=limit)
            except concurrent.futures.TimeoutError:
                raise PeerError(
                    f"outer sync on rank {dist.get_rank()} failed: no result within timeout_s={timeout_s:g} s "
                    "(a peer is frozen or gone)"
                ) from None
        for future in flight.futures or []:
            wait_future(future, "outer sync", self.group)
        mine = zip(flight.mine or [], self.deltas)  # dropped below, so subtracted in place
        squared = sum((float(m.sub_(delta).square_().sum(dtype=torch.float64)) for m, delta in mine), 0.0)
        self.compressor.advance()
        flight.mine, flight.futures, flight.job, flight.divergence_sq = None, None, None, squared
        return squared

    def apply_(
        self,
        flight: InFlight,
        outer: torch.optim.Optimizer | None,
        alpha: float = 0.0,
        skip_nonfinite: bool = True,
        timeout_s: float | None = None,
    ) -> bool:
        """Completes ``flight`` and applies it: the outer step (``outer``; ``None``: local SGD's plain average) on
        the global copy, then the parameters become ``global.lerp(local, alpha)``, rounded as torchft's ``DiLoCo``
        rounds it. With ``skip_nonfinite`` an average holding a NaN or Inf (on every rank alike) skips the outer
        step, and the parameters return to the global copy.

        Returns:
            Whether the outer step was taken (``False``: skipped).
        """
        self.complete_(flight, timeout_s)
        deltas = [d for d in self.deltas if d.numel()]
        if skip_nonfinite and not all_finite([probe(d) for d in deltas], deltas):
            self.compressor.forget_nonfinite()
            self.restore_()
            return False
        if outer is None:
            for anchor, delta in zip(self.anchors, self.deltas):
                anchor.add_(delta)
        else:
            for anchor, delta in zip(self.anchors, self.deltas):
                anchor.grad = delta
            outer.step()
        for anchor, delta, bucket_params in zip(self.anchors, self.deltas, self._bucket_params):
            anchor.grad = None
            if alpha == 0.0:
                _unpack(anchor, bucket_params)
            else:  # the delta bucket is free again: mix in it, global.lerp(local, alpha) as torchft rounds it
                local = _pack(bucket_params, delta)
                _unpack(torch.lerp(anchor, local, alpha, out=local), bucket_params)
        return True

    def delta_buckets(self) -> list[FlatBucket]:
        """:attr:`deltas` as buckets, with their index and their parameters' shapes (what a codec takes)."""
        return [
            FlatBucket(index=i, buffer=delta, shapes=[p.shape for p in params])
            for i, (delta, params) in enumerate(zip(self.deltas, self._bucket_params))
        ]

    def restore_(self) -> None:
        """Drops a sync: every parameter loads the global copy, which stays as it was."""
        for anchor, bucket_params in zip(self.anchors, self._bucket_params):
            _unpack(anchor, bucket_params)

    def flight_state(self, flight: InFlight, timeout_s: float | None = None) -> dict[str, Any]:
        """``flight`` for a checkpoint: drained, its average saved unapplied (a resumed run applies it on time)."""
        squared = self.complete_(flight, timeout_s)
        return {
            "launched_at": flight.launched_at,
            "divergence_sq": squared,
            "deltas": [d.clone() for d in self.deltas],
        }

    def load_flight_state(self, state: dict[str, Any]) -> InFlight:
        """The completed :class:`InFlight` that :meth:`flight_state` saved (its average back in the delta buckets)."""
        _load_buckets(self.deltas, state["deltas"], "outer sync")
        return InFlight(launched_at=int(state["launched_at"]), divergence_sq=float(state["divergence_sq"]))

    def state_dict(self) -> dict[str, Any]:
        """The global copy and the compressor's memory (cloned)."""
        return {"anchors": [a.clone() for a in self.anchors], "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _load_buckets(self.anchors, state["anchors"], "global copy")
        self.compressor.load_state_dict(state["compressor"])


OptimizerCallable = Callable[[Iterable[Any]], torch.optim.Optimizer]
"""A callable from parameters to an optimizer over them (Lightning's ``OptimizerCallable``)."""

OUTER_OPTIMIZER: functools.partial[torch.optim.SGD] = functools.partial(torch.optim.SGD, lr=0.7)
"""The outer optimizer that ``outer_optimizer=None`` stands for, everywhere: SGD at lr 0.7 without momentum."""


def check_optimizer_callable(factory: OptimizerCallable | None, name: str = "outer_optimizer") -> torch.optim.Optimizer:
    """Builds ``factory`` (``None``: :data:`OUTER_OPTIMIZER`) once over a placeholder parameter, so that a value it
    refuses fails before any process starts.

    Example::

        >>> import functools, torch
        >>> check_optimizer_callable(functools.partial(torch.optim.Adam, lr=1e-3)).defaults["lr"]
        0.001

    Returns:
        The optimizer it built (over the placeholder).

    Raises:
        ConfigError: ``factory`` is not callable, raises ``TypeError``/``ValueError``, or returns no optimizer.
    """
    factory = OUTER_OPTIMIZER if factory is None else factory
    allowed = "it must be a callable from parameters to a torch.optim.Optimizer"
    if not callable(factory):
        raise ConfigError(
            f"{name}={factory!r} is not allowed; {allowed}, as functools.partial(torch.optim.SGD, lr=0.7)"
        )
    try:
        built = factory([torch.nn.Parameter(torch.zeros(1))])
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{name}={factory!r} is not allowed: {error}") from None
    if not isinstance(built, torch.optim.Optimizer):
        raise ConfigError(f"{name}={factory!r} is not allowed: it returned a {type(built).__name__}; {allowed}")
    return built
