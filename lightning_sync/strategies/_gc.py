"""Keeps Python's full garbage collections off the training steps (the ``freeze_gc`` knob).

A full collection walks every tracked object (hundreds of thousands once torch and Lightning are loaded) and can
outlast many small steps; it falls on a random rank, and in a synchronous mode every other rank waits for it.
``gc.freeze`` at train start (free: it splices lists) leaves the collector only what training allocates; garbage
among the frozen objects waits for :func:`release_startup_heap` at the end of the fit.
"""

from __future__ import annotations

import gc

_frozen_fits = 0  # fits in this process that froze the heap and have not released it


def freeze_startup_heap() -> None:
    """Exempts everything alive from later collections (until :func:`release_startup_heap`)."""
    global _frozen_fits
    gc.freeze()
    _frozen_fits += 1


def release_startup_heap() -> None:
    """Returns the frozen objects to the collector, once the last fit that froze them has released them."""
    global _frozen_fits
    if _frozen_fits == 0:
        return
    _frozen_fits -= 1
    if _frozen_fits == 0:
        gc.unfreeze()
