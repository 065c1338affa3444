"""Streaming DiLoCo's parts (Douillard et al. 2025, arXiv 2501.18512): the knobs, the fragments' stagger and the
process group of the outer syncs in flight.

:class:`~lightning_sync.comm.periodic.PeriodicAverager` owns the schedule, :mod:`lightning_sync.comm.fragments` the
fragments. With ``sync_delay > 0`` it launches a fragment's outer sync at step ``t`` on a daemon worker thread
(:class:`~lightning_sync._exit.DaemonWorker`: the exit does not wait for one stuck on a frozen peer), which runs the
codec's collectives on a process group of its own, in launch order, while inner steps go on; at step
``t + sync_delay`` it waits for the result (at most ``timeout_s``), steps the outer optimizer and mixes the
parameters by ``fragment_alpha``. The training thread and the worker never share a process group, so every rank
sees each group's collectives in the same order (gloo needs it).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist

from lightning_sync.comm.compression import Compressor
from lightning_sync.comm.fragments import normalize_fragment_modules
from lightning_sync.errors import ConfigError


@dataclass(frozen=True)
class StreamingOptions:
    """Streaming DiLoCo: each sync group split into fragments that sync in turn, each in the background.

    Args:
        fragments: split each sync group into this many fragments, strided by block (at most one per block, or per
            layer without repeated blocks; ``<=`` every period).
        sync_delay: steps between the launch of a fragment's outer sync and its apply (``< period // fragments``).
        fragment_alpha: on apply, the parameters become ``global.lerp(local, alpha)``, in [0, 1].
        outer_compression: codec of the pseudo-gradients, an object or a registry name (``"none"``: the
            averager's ``new_compressor``'s).
        fragment_modules: explicit fragments in sync order (:mod:`lightning_sync.comm.fragments`); ``None``: by
            block.

    The :class:`PeriodicAverager` checks them against its periods; ``fragment_modules`` is checked here.

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


def stagger_offsets(period: int, fragments: int) -> list[int]:
    """Each fragment's starting count of steps since its last sync: fragment ``f`` first syncs after
    ``(f + 1) * period // fragments`` steps, so the fragments take turns every ``period / fragments`` steps."""
    return [period - (f + 1) * period // fragments for f in range(fragments)]


def new_stream_group(group: dist.ProcessGroup | None, timeout_s: float | None) -> dist.ProcessGroup:
    """A process group with the ranks of ``group`` (``None``: all), for the worker's collectives (a collective call)."""
    ranks = None if group is None else dist.get_process_group_ranks(group)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    return dist.new_group(ranks=ranks, timeout=timeout)
