"""A clock that moves only when a test moves it: timing logic is fed exact durations instead of racing sleeps."""

from __future__ import annotations


class FakeClock:
    """``clock()`` reads the time; :meth:`advance` (or :meth:`sleep`, for code that sleeps) moves it forward.

    Pass it where the code takes ``clock=`` (and ``sleep=``): every duration the code measures is then exactly what
    the test advanced, on any machine and under any load.
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = float(start)
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, f"a clock does not go back ({seconds} s)"
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        """Records the sleep and moves the clock by it, at once."""
        self.slept.append(seconds)
        self.advance(seconds)
