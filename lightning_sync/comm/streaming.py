"""Streaming DiLoCo's parts (Douillard et al. 2025, arXiv 2501.18512): the knobs, the fragments' stagger, the
outer-sync worker thread and its process group. Nothing here knows of Lightning;
:class:`~lightning_sync.comm.periodic.PeriodicAverager` owns the schedule, :mod:`lightning_sync.comm.fragments` the
strided fragments.

:meth:`ModelAverager.launch_ <lightning_sync.comm.averaging.ModelAverager.launch_>` packs the pseudo-gradients at step
``t`` and hands the averaging to an :class:`OuterSyncWorker`, which runs the codec's collectives on a process group
of its own, in launch order, while inner steps go on; ``apply_`` at step ``t + sync_delay`` waits for the result (at
most ``timeout_s``), steps the outer optimizer and mixes the parameters by ``fragment_alpha``. The main thread and
the worker never share a process group, so every rank sees each group's collectives in the same order (gloo needs
it), and a codec whose second collective needs the first one's result (int8/int4) runs off the training thread.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from lightning_sync.comm.compression import Compressor
from lightning_sync.comm.fragments import normalize_fragment_modules
from lightning_sync.errors import ConfigError


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
