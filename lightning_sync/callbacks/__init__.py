"""Callbacks that measure a run, guard it and shape it, one per module: :class:`SyncReport` (step time and
communication per optimizer step, as a JSON summary that :func:`read_summary` reads back), :class:`DivergenceGuard`
(stops a diverging run), :class:`StragglerCallback` (slower workers, for experiments), :class:`FlushDenormal`
(subnormal floats are zero), :class:`StepPacer` (a minimum time per batch), :class:`StepClock` (each step's time
and loss on disk as it happens, read back by :func:`read_step_clock`). :class:`SyncMetricsLogger`, which every
strategy adds by itself, lives with the strategies and is importable from here.
"""

from lightning_sync.callbacks.divergence import DivergenceGuard
from lightning_sync.callbacks.flush_denormal import FlushDenormal
from lightning_sync.callbacks.pacer import StepPacer
from lightning_sync.callbacks.report import SyncReport
from lightning_sync.callbacks.step_clock import StepClock, read_step_clock
from lightning_sync.callbacks.straggler import StragglerCallback
from lightning_sync.callbacks.summary import read_summary
from lightning_sync.strategies._base import SyncMetricsLogger

__all__ = [
    "DivergenceGuard",
    "FlushDenormal",
    "StepClock",
    "StepPacer",
    "StragglerCallback",
    "SyncMetricsLogger",
    "SyncReport",
    "read_step_clock",
    "read_summary",
]
