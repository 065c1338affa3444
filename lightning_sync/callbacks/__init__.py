"""Callbacks that measure a run, guard it and shape it: :class:`SyncReport` (step time and
communication per optimizer step, as a JSON summary that :func:`read_summary` reads back), :class:`DivergenceGuard`
(stops a diverging run), :class:`StragglerCallback` (slower workers, for experiments), :class:`FlushDenormal`
(subnormal floats are zero), :class:`StepPacer` (a minimum time per batch), :class:`StepClock` (each step's time
and loss on disk as it happens, read back by :func:`read_step_clock`).
"""

from lightning_sync.callbacks.divergence import DivergenceGuard
from lightning_sync.callbacks.flush_denormal import FlushDenormal
from lightning_sync.callbacks.report import SyncReport, read_summary
from lightning_sync.callbacks.step_clock import StepClock, read_step_clock
from lightning_sync.callbacks.straggler import StepPacer, StragglerCallback

__all__ = [
    "DivergenceGuard",
    "FlushDenormal",
    "StepClock",
    "StepPacer",
    "StragglerCallback",
    "SyncReport",
    "read_step_clock",
    "read_summary",
]
