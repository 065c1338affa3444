"""Choosing the sync period from measured compute and communication time (``sync_every: auto``).

Nothing here knows of Lightning. With ``t_step`` seconds of compute per optimizer step and ``t_sync`` seconds of
communication per sync, a period of ``P`` steps spends the fraction ``t_sync / (P * t_step + t_sync)`` of its time
communicating. The smallest period that keeps this at or below ``target`` is

    ``P = ceil(t_sync * (1 - target) / (target * t_step))``

clamped to ``[min_every, max_every]`` (:func:`choose_period`), on measurements smoothed by an exponential moving
average (:class:`AdaptivePeriod`). Every rank must choose the same period, so the ranks first agree on the inputs
(:func:`agree_max`: the slowest rank's) and run the same deterministic update.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.tuning import ADAPTIVE_SMOOTHING, ROUNDING_SLACK
from lightning_sync.errors import check_range


@dataclass(frozen=True)
class AdaptiveOptions:
    """``sync_every="auto"``: the bounds and the target of the adaptive period (checked by :class:`AdaptivePeriod`).

    Args:
        target_comm_fraction: the share of time to spend communicating, in (0, 1].
        min_sync_every: the smallest (and first) period.
        max_sync_every: the largest period.
    """

    target_comm_fraction: float = 0.1
    min_sync_every: int = 1
    max_sync_every: int = 64


class ComputeTimer:
    """Measures the compute seconds per optimizer step, by ``clock``: each step's wall time less the communication
    the meter booked during it."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._started: float | None = None
        self._comm_start = 0.0
        self._seconds = 0.0
        self._steps = 0

    def start(self, comm_seconds: float) -> None:
        """Marks the start of a step's compute (a no-op while one runs); ``comm_seconds``: the meter's total now."""
        if self._started is None:
            self._started = self.clock()
            self._comm_start = comm_seconds

    def stop(self, comm_seconds: float, overlapped: bool) -> None:
        """Books the step started by :meth:`start` (nothing if none was); ``comm_seconds``: the meter's total now;
        ``overlapped``: the communication booked meanwhile ran beside this compute, so none of it is taken off."""
        if self._started is None:
            return
        comm = 0.0 if overlapped else comm_seconds - self._comm_start
        self._seconds += max(self.clock() - self._started - comm, 0.0)
        self._steps += 1
        self._started = None

    @property
    def mean(self) -> float:
        """The mean compute seconds per step booked since the last :meth:`reset` (0 for none)."""
        return self._seconds / self._steps if self._steps else 0.0

    def reset(self) -> None:
        """Starts over (the step running now, if any, is still booked by :meth:`stop`)."""
        self._seconds, self._steps = 0.0, 0


def choose_period(
    compute_seconds_per_step: float,
    comm_seconds_per_sync: float,
    target_comm_fraction: float,
    min_every: int,
    max_every: int,
) -> int:
    """The smallest period in ``[min_every, max_every]`` whose share of time spent communicating is at most
    ``target_comm_fraction`` (a compute time of 0 means "unknown, go long"; :class:`AdaptivePeriod` checks the
    bounds)."""
    comm = max(float(comm_seconds_per_sync), 0.0)
    compute = max(float(compute_seconds_per_step), 0.0)
    if comm == 0.0:
        return min_every
    if compute == 0.0:
        return max_every
    needed = comm * (1.0 - target_comm_fraction) / (target_comm_fraction * compute)
    if not math.isfinite(needed) or needed >= max_every:
        return max_every
    # an exact fit (e.g. needed == 3.0000000000000004) is not pushed to the next integer
    return int(min(max(math.ceil(needed - ROUNDING_SLACK), min_every), max_every))


class AdaptivePeriod:
    """Tracks smoothed compute and communication times and the period chosen from them (deterministically).

    Args:
        target_comm_fraction: the share of time to spend communicating, in (0, 1].
        min_every: smallest period; also the starting period (>= 1).
        max_every: largest period (>= ``min_every``).
        smoothing: weight of the newest measurement in the moving averages, in (0, 1] (1: no smoothing).

    Raises:
        ConfigError: an argument out of range, named by its knob (``min_sync_every`` for ``min_every``, ...).
    """

    def __init__(
        self, target_comm_fraction: float, min_every: int, max_every: int, smoothing: float = ADAPTIVE_SMOOTHING
    ) -> None:
        check_range("target_comm_fraction", target_comm_fraction, low=0, high=1, low_open=True)
        check_range("min_sync_every", min_every, low=1, integer=True)
        check_range("max_sync_every", max_every, low=min_every, integer=True)
        check_range("smoothing", smoothing, low=0, high=1, low_open=True)
        self.target_comm_fraction = float(target_comm_fraction)
        self.min_every = int(min_every)
        self.max_every = int(max_every)
        self.smoothing = float(smoothing)
        self.period = self.min_every
        self.compute_seconds: float | None = None
        self.comm_seconds: float | None = None
        self.updates = 0

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else (1.0 - self.smoothing) * old + self.smoothing * new

    def update(self, compute_seconds_per_step: float, comm_seconds_per_sync: float) -> int:
        """Folds in one sync's measurements and returns the (possibly new) period."""
        self.compute_seconds = self._smooth(self.compute_seconds, float(compute_seconds_per_step))
        self.comm_seconds = self._smooth(self.comm_seconds, float(comm_seconds_per_sync))
        self.updates += 1
        self.period = choose_period(
            self.compute_seconds, self.comm_seconds, self.target_comm_fraction, self.min_every, self.max_every
        )
        return self.period

    def state_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in ("period", "compute_seconds", "comm_seconds", "updates")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(state)


def agree_max(values: Sequence[float], meter: CommMeter, group: ProcessGroup | None = None) -> list[float]:
    """The element-wise maximum of ``values`` over the group (one small all-reduce through the meter)."""
    tensor = torch.tensor([float(v) for v in values], dtype=torch.float64, device=meter.control_device(group))
    if meter.world_size(group) > 1:
        meter.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()
