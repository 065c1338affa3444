"""A knob for experiments: make one worker slower by a factor, to study async, ssp and sync under a straggler."""

from __future__ import annotations

import time
from collections.abc import Callable

from lightning_sync.errors import check_range


class Straggler:
    """Makes the slow worker's steps take ``slowdown`` times as long (``slow_worker=2, slowdown=3.0``: worker 2 is 3x
    slower) by sleeping at :meth:`step_end`; nothing on the other workers.

    Args:
        worker: this process's worker rank.
        slow_worker: the rank of the worker to slow down, or ``None`` for none.
        slowdown: the factor, ``>= 1`` (``1`` does nothing).
        clock: returns the current time in seconds; ``sleep`` sleeps (a test passes fakes).

    Raises:
        ValueError: ``slowdown < 1`` or a rank is negative.
    """

    def __init__(
        self,
        worker: int,
        slow_worker: int | None = None,
        slowdown: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        check_range("worker", worker, low=0, integer=True)
        if slow_worker is not None:
            check_range("slow_worker", slow_worker, low=0, integer=True)
        check_range("slowdown", slowdown, low=1)  # 1: not slowed
        self.worker = worker
        self.slow_worker = slow_worker
        self.slowdown = float(slowdown)
        self.slept_s = 0.0
        self._clock, self._sleep = clock, sleep
        self._started: float | None = None

    def step_start(self) -> None:
        """Marks the start of a step."""
        self._started = self._clock()

    def step_end(self) -> float:
        """Sleeps ``(slowdown - 1) x`` the time since :meth:`step_start` if this is the slow worker; returns the seconds
        slept (``0`` on other workers, or without a :meth:`step_start`)."""
        started, self._started = self._started, None
        extra = 0.0 if started is None else (self.slowdown - 1.0) * (self._clock() - started)
        if extra <= 0 or self.slow_worker != self.worker:
            return 0.0
        self._sleep(extra)
        self.slept_s += extra
        return extra
