"""Keeps Python's full garbage collections off the training steps (the ``freeze_gc`` knob).

A full (generation 2) collection walks every tracked object. Once Lightning, torch, the model and the data are
loaded that is hundreds of thousands of objects: one pass can take longer than many small optimizer steps, and it
falls on a random step of a random rank, so in a synchronous mode every other rank waits for it at the next
collective. Moving everything alive when training starts into the
permanent generation (``gc.freeze``, which only splices lists: it costs nothing) leaves the collector only what
training allocates itself; cyclic garbage made by training is still collected. The objects frozen here are the
ones that live for the whole fit anyway; whatever garbage is among them waits until the fit ends and
:func:`release_startup_heap` hands it back (collecting it first would cost the very pass this avoids). Nothing
here knows of Lightning.
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
