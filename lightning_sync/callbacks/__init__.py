"""Callbacks that measure a run, guard it and shape it, one per module.

* :class:`SyncReport` (:mod:`~lightning_sync.callbacks.report`): step time and communication per optimizer step, as
  a JSON summary on rank 0 (:func:`read_summary` reads it back);
* :class:`DivergenceGuard` (:mod:`~lightning_sync.callbacks.divergence`): stops a run whose training loss diverges
  and records it in the summary;
* :class:`StragglerCallback` (:mod:`~lightning_sync.callbacks.straggler`): makes workers slower, for experiments
  with stragglers;
* :class:`FlushDenormal` (:mod:`~lightning_sync.callbacks.flush_denormal`): subnormal floats are zero on every
  rank's CPU;
* :class:`StepPacer` (:mod:`~lightning_sync.callbacks.pacer`): every batch takes at least a set time, so that
  workers sharing a machine's cores each train at a pace of their own;
* :class:`StepClock` (:mod:`~lightning_sync.callbacks.step_clock`): the wall time and loss of every step and
  validation, appended to a file as it happens, so that a killed process's record survives it
  (:func:`read_step_clock` reads it back);
* :class:`SyncMetricsLogger`: core plumbing that every strategy adds by itself; it lives with the strategies and
  stays importable from here.
"""

from lightning_sync.callbacks.divergence import DivergenceGuard
from lightning_sync.callbacks.flush_denormal import FlushDenormal
from lightning_sync.callbacks.pacer import StepPacer
from lightning_sync.callbacks.report import SyncReport
from lightning_sync.callbacks.step_clock import StepClock, read_step_clock
from lightning_sync.callbacks.straggler import StragglerCallback
from lightning_sync.callbacks.summary import read_summary
from lightning_sync.strategies._metrics import SyncMetricsLogger

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
