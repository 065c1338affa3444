"""Streaming DiLoCo's parts (Douillard et al. 2025, arXiv 2501.18512): strided fragments, outer syncs that stay in
flight while inner steps run, and the apply that mixes the local and the global copy.

Nothing here knows of Lightning; :class:`~lightning_sync.comm.periodic.PeriodicAverager` owns the schedule.

Fragments are formed by block (:mod:`lightning_sync.comm.fragments`): block ``i`` of the model's repeated blocks
joins fragment ``i % fragments``, so each fragment spans the whole depth of the network and every outer step moves
shallow and deep layers together; the paper found strided fragments better than contiguous ones.

An outer sync in flight: :meth:`ModelAverager.launch_ <lightning_sync.comm.averaging.ModelAverager.launch_>` packs the pseudo-gradients at step ``t`` and hands the
averaging to a :class:`OuterSyncWorker`, a thread that runs the compressor's collectives (and waits for them) on a
process group of its own, in launch order; inner steps go on meanwhile. ``ModelAverager.apply_`` at step
``t + sync_delay`` waits for the result (at most ``timeout_s``), steps the outer optimizer and sets the fragment's
parameters to ``alpha * local + (1 - alpha) * global``. The main thread and the worker never issue collectives on
the same process group, so every rank sees each group's collectives in the same order, which gloo needs; and a
compressor whose second collective needs the first one's result (int8/int4) runs entirely off the training thread.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_sync.comm.averaging import InFlight, ModelAverager
from lightning_sync.comm.compression import Compressor, resolve_codec
from lightning_sync.comm.fragments import normalize_fragment_modules
from lightning_sync.errors import ConfigError, check_range


# ------------------------------------------------------------------------------------------------ options
@dataclass(frozen=True)
class StreamingOptions:
    """Streaming DiLoCo: each sync group split into fragments that sync in turn, each in the background.

    Args:
        fragments: split each sync group into this many fragments, strided by block, that sync in turn (at most
            one per block, or per layer without repeated blocks; ``<=`` every period).
        sync_delay: steps between the launch of a fragment's outer all-reduce and its apply (``0 <= sync_delay <
            period // fragments`` for every period).
        fragment_alpha: on apply, the parameters become ``global.lerp(local, alpha)``, in [0, 1] (1: they keep
            the local weights, and only the global copy takes the outer step).
        outer_compression: codec of the pseudo-gradients, an object or a registry name (``"none"``: the
            averager's ``new_compressor``'s).
        fragment_modules: explicit fragments in sync order, each a module-name pattern or a list of them
            (:mod:`lightning_sync.comm.fragments`); ``None``: by block. Their number is the number of fragments.

    The :class:`PeriodicAverager` checks them, against each other and against its periods; ``fragment_modules`` is
    checked here, when the options are made.

    Raises:
        ConfigError: ``fragment_modules`` is not a list of patterns or lists of patterns, or ``fragments`` is
            neither 1 nor its length.
    """

    fragments: int = 1
    sync_delay: int = 0
    fragment_alpha: float = 0.0
    outer_compression: str | Compressor = "none"
    fragment_modules: tuple[tuple[str, ...], ...] | None = None

    def __post_init__(self) -> None:
        patterns = normalize_fragment_modules(self.fragment_modules)
        object.__setattr__(self, "fragment_modules", patterns)  # frozen: the normalized form, once
        if patterns is not None:
            if self.fragments not in (1, len(patterns)):
                raise ConfigError(
                    f"fragments={self.fragments!r} is not allowed with fragment_modules of {len(patterns)} "
                    f"fragments; leave it at 1 or set it to {len(patterns)}"
                )
            object.__setattr__(self, "fragments", len(patterns))


def check_streaming_options(
    streaming: StreamingOptions, new_compressor: Callable[[], Compressor], periods: Sequence[tuple[str, int]]
) -> None:
    """Checks the streaming knobs against each other and against every period.

    Args:
        streaming: the knobs.
        new_compressor: makes the compressor of the pseudo-gradients when ``outer_compression`` is ``none``.
        periods: ``(knob, period)`` for every period a sync group may have (fixed ones, or the smallest adaptive
            one), named as the knob that sets it.

    Raises:
        ConfigError: a knob out of range, or one that does not fit a period, named as the knob.
    """
    fragments, sync_delay, outer_compression = (
        streaming.fragments,
        streaming.sync_delay,
        streaming.outer_compression,
    )
    fragment_alpha = streaming.fragment_alpha
    check_range("fragments", fragments, low=1, integer=True)
    check_range("sync_delay", sync_delay, low=0, integer=True)
    check_range("fragment_alpha", fragment_alpha, low=0, high=1)
    resolve_codec(outer_compression, "outer_compression")
    base = new_compressor().name
    if outer_compression != "none" and base != "none":
        raise ConfigError(
            f"outer_compression={outer_compression!r} is not allowed with compression={base!r}; the "
            "pseudo-gradients take one codec: set compression=none, or outer_compression=none"
        )
    for field, period in periods:
        if fragments > period:
            raise ConfigError(
                f"fragments={fragments} is not allowed with {field}={period}; it must be <= {field} (each "
                "fragment syncs at its own step of the period)"
            )
        if sync_delay >= period // fragments:  # fragment 0 first syncs after period // fragments steps
            raise ConfigError(
                f"sync_delay={sync_delay} is not allowed with {field}={period} and fragments={fragments}; it "
                f"must be >= 0 and < {field} // fragments = {period // fragments} (fragment 0 first syncs "
                f"{period // fragments} steps in, and its outer sync launches sync_delay steps before)"
            )


# ------------------------------------------------------------------------------------------------ schedule
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

    def close(self, timeout_s: float | None = None) -> None:
        """Lets the thread end after the jobs already queued, and waits for that up to ``timeout_s`` (``None``: 60 s),
        so that the caller can destroy the process group once no job uses it (a job still in a collective when its
        group is destroyed aborts the process). A job stuck on a frozen peer is left to the daemon thread."""
        self._jobs.put((None, None))
        self._thread.join(60.0 if timeout_s is None else timeout_s)


def new_stream_group(group: dist.ProcessGroup | None, timeout_s: float | None) -> dist.ProcessGroup:
    """A process group with the ranks of ``group`` (``None``: all), for the worker's collectives (every rank must
    call it, in the same order, as for any ``new_group``)."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    return dist.new_group(ranks=ranks, timeout=timeout)


# ------------------------------------------------------------------------------------------------ one fragment
class StreamingAverager(ModelAverager):
    """A :class:`~lightning_sync.comm.averaging.ModelAverager` whose in-flight sync can be saved in a checkpoint
    and loaded back (its split sync, :meth:`launch_` / :meth:`apply_`, is the base class's).
    """

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
