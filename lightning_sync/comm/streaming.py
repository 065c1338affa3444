"""Streaming DiLoCo's parts (Douillard et al. 2025, arXiv 2501.18512): strided fragments, outer syncs that stay in
flight while inner steps run, and the apply that mixes the local and the global copy.

Nothing here knows of Lightning; :class:`~lightning_sync.comm.periodic.PeriodicAverager` owns the schedule.

Fragments are strided by layer: the parameters are grouped by the module that holds them (``net.4.weight`` and
``net.4.bias`` form layer ``net.4``), layers are numbered in model order, and layer ``i`` joins fragment
``i % fragments``. Each fragment then spans the whole depth of the network, so every outer step moves shallow and
deep layers together and no part of the network waits a whole period for its first outer step; the paper found
strided fragments better than contiguous ones. Layers are never split, so a fragment holds about ``1/fragments``
of the model when the layers are of similar size.

An outer sync in flight: :meth:`StreamingAverager.launch_` packs the pseudo-gradients at step ``t`` and hands the
averaging to a :class:`OuterSyncWorker`, a thread that runs the compressor's collectives (and waits for them) on a
process group of its own, in launch order; inner steps go on meanwhile. :meth:`StreamingAverager.apply_` at step
``t + sync_delay`` waits for the result (at most ``timeout_s``), steps the outer optimizer and sets the fragment's
parameters to ``alpha * local + (1 - alpha) * global``. The main thread and the worker never issue collectives on
the same process group, so every rank sees each group's collectives in the same order, which gloo needs; and a
compressor whose second collective needs the first one's result (int8/int4) runs entirely off the training thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_sync.comm.averaging import ModelAverager, _pack, _unpack
from lightning_sync.comm.compression import FlatBucket
from lightning_sync.comm.meter import PeerError, wait_future
from lightning_sync.comm.nonfinite import ends_are_finite, extremes

WAIT_GRACE_S = 5.0
"""Seconds a wait for an outer sync's result may exceed ``timeout_s``: the collective itself fails after
``timeout_s`` (its process group's timeout) with an error naming the silent peer; the grace lets that error come
first."""


# ------------------------------------------------------------------------------------------------ fragments
def layer_of(name: str) -> str:
    """The module holding parameter (or buffer) ``name``: ``net.4.weight`` -> ``net.4``."""
    return name.rsplit(".", 1)[0] if "." in name else ""


def strided_fragments(names: Sequence[str], fragments: int) -> list[list[int]]:
    """Splits parameters into fragments strided by layer: layer ``i`` (in order of first appearance) goes to
    fragment ``i % k``, with ``k = min(fragments, layers)``.

    Returns:
        For each fragment, the indices into ``names`` of its parameters (one empty fragment for no names).
    """
    layers: dict[str, int] = {}
    for name in names:
        layers.setdefault(layer_of(name), len(layers))
    k = max(1, min(fragments, len(layers)))
    out: list[list[int]] = [[] for _ in range(k)]
    for index, name in enumerate(names):
        out[layers[layer_of(name)] % k].append(index)
    return out


def stagger_offsets(period: int, fragments: int) -> list[int]:
    """Each fragment's starting count of steps since its last sync, so that fragment ``f`` first syncs after
    ``(f + 1) * period // fragments`` steps and the fragments take turns every ``period / fragments`` steps
    (the last one syncs after ``period`` steps, as an unfragmented model does)."""
    return [period - (f + 1) * period // fragments for f in range(fragments)]


# ------------------------------------------------------------------------------------------------ worker
class OuterSyncWorker:
    """A daemon thread that runs jobs one at a time, in submission order (their collectives stay in that order).

    A daemon, so that a job stuck on a frozen peer never keeps the process from exiting.
    """

    def __init__(self, name: str = "outer-sync") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], Any]) -> concurrent.futures.Future:
        """Queues ``job``; the returned future holds its result or its error."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((job, future))
        return future

    def _run(self) -> None:
        while True:
            job, future = self._jobs.get()
            if job is None:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except BaseException as error:  # noqa: BLE001 - handed to the waiting thread
                future.set_exception(error)

    def close(self) -> None:
        """Lets the thread end after the jobs already queued."""
        self._jobs.put((None, None))


def new_stream_group(group: dist.ProcessGroup | None, timeout_s: float | None) -> dist.ProcessGroup:
    """A process group with the ranks of ``group`` (``None``: all), for the worker's collectives (every rank must
    call it, in the same order, as for any ``new_group``)."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    return dist.new_group(ranks=ranks, timeout=timeout)


# ------------------------------------------------------------------------------------------------ one fragment
@dataclass
class InFlight:
    """An outer sync between its launch and its apply.

    Attributes:
        launched_at: the averager's step count when it was launched.
        mine: this rank's pseudo-gradient buckets at launch (for the divergence); ``None`` once complete.
        futures: the compressor's futures (launched on the calling thread), or
        job: the worker's future (launched on the worker).
        divergence_sq: this rank's squared divergence from the average, once complete.
    """

    launched_at: int
    mine: list[torch.Tensor] | None = None
    futures: list[torch.futures.Future] | None = None
    job: concurrent.futures.Future | None = None
    divergence_sq: float | None = None


class StreamingAverager(ModelAverager):
    """A :class:`~lightning_sync.comm.averaging.ModelAverager` whose sync is split in two: :meth:`launch_` and
    :meth:`apply_`. Back to back, with no worker and ``alpha=0``, they do what ``outer_step_`` (DiLoCo) or
    ``average_`` (local SGD) does, operation for operation, so the result is the same bit for bit.
    """

    def launch_(self, sign: float, step: int, worker: OuterSyncWorker | None = None) -> InFlight:
        """Packs ``sign * (local - global copy)`` and starts averaging it (on ``worker``, or from this thread).

        Args:
            sign: ``-1``: DiLoCo's pseudo-gradient ``global - local``; ``+1``: local SGD's delta.
            step: the owner's step count, kept in the result.
            worker: runs the averaging off this thread (``None``: the compressor's collectives are issued now, from
                this thread).
        """
        flight = InFlight(launched_at=step, mine=[], futures=[] if worker is None else None)
        buckets = []
        for index, (anchor, delta, bucket_params) in enumerate(zip(self.anchors, self._deltas, self._bucket_params)):
            _pack(bucket_params, delta)
            delta.sub_(anchor)
            if sign < 0:
                delta.neg_()
            flight.mine.append(delta.clone())
            bucket = FlatBucket(index=index, buffer=delta, shapes=[p.shape for p in bucket_params])
            if flight.futures is not None:
                flight.futures.append(self.compressor.average(bucket, self.meter, self.group))
            else:
                buckets.append(bucket)
        if worker is not None:
            flight.job = worker.submit(lambda: self._average_buckets(buckets))
        return flight

    def _average_buckets(self, buckets: Sequence[FlatBucket]) -> None:
        """The worker's job: average every bucket and wait (on a GPU, with the buckets' device current in the
        worker thread, where the current device is not inherited)."""
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
        squared = 0.0
        for mine, delta in zip(flight.mine or [], self._deltas):
            squared += float((mine - delta).double().pow(2).sum())
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
        the global copy, then the parameters become ``alpha * local + (1 - alpha) * global``.

        With ``skip_nonfinite`` an average holding a NaN or Inf (identical on every rank, so every rank decides the
        same) skips the outer step: the global copy and the outer optimizer stay as they are and the parameters
        return to the global copy.

        Returns:
            Whether the outer step was taken (``False``: skipped).
        """
        self.complete_(flight, timeout_s)
        if skip_nonfinite and not ends_are_finite([extremes(d) for d in self._deltas if d.numel()]):
            self.compressor.forget_nonfinite()
            for anchor, bucket_params in zip(self.anchors, self._bucket_params):
                _unpack(anchor, bucket_params)
            return False
        if outer is None:
            for anchor, delta in zip(self.anchors, self._deltas):
                anchor.add_(delta)
        else:
            for anchor, delta in zip(self.anchors, self._deltas):
                anchor.grad = delta
            outer.step()
        for anchor, delta, bucket_params in zip(self.anchors, self._deltas, self._bucket_params):
            anchor.grad = None
            if alpha == 0.0:
                _unpack(anchor, bucket_params)
            else:  # the delta bucket is free again: mix in it
                _unpack(_pack(bucket_params, delta).lerp_(anchor, 1.0 - alpha), bucket_params)
        return True

    def flight_state(self, flight: InFlight, timeout_s: float | None = None) -> dict[str, Any]:
        """``flight`` for a checkpoint: it is drained first (its collective finished), and its average is saved
        unapplied, so a resumed run applies it at the step the uninterrupted run would."""
        squared = self.complete_(flight, timeout_s)
        return {
            "launched_at": flight.launched_at,
            "divergence_sq": squared,
            "deltas": [d.clone() for d in self._deltas],
        }

    def load_flight_state(self, state: dict[str, Any]) -> InFlight:
        """The completed :class:`InFlight` that :meth:`flight_state` saved (its average back in the delta buckets)."""
        deltas = state["deltas"]
        if [d.numel() for d in deltas] != [d.numel() for d in self._deltas]:
            raise ValueError("StreamingAverager: saved outer sync has a different bucket layout than this model")
        for delta, saved in zip(self._deltas, deltas):
            delta.copy_(saved)
        return InFlight(launched_at=int(state["launched_at"]), divergence_sq=float(state["divergence_sq"]))
