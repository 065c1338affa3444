"""Gradient clipping in the ``ps`` mode (private helper of :mod:`lightning_sync.strategies.ps`).

The clipping a Trainer asks for (``gradient_clip_val``, or ``self.clip_gradients`` in manual optimization) is not
done on the worker: it goes with the optimizer's next push, and the servers clip what they step with, in sync the
average of the workers' gradients, as DDP clips the all-reduced gradient.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer

from lightning_sync.ps import CLIP_ALGORITHMS, Clip


class ServerClips:
    """The clipping each optimizer's next push asks the servers for."""

    def __init__(self) -> None:
        self._by_optimizer: dict[int, Clip] = {}

    def record(self, optimizer: Any, clip_val: Any = 0.0, gradient_clip_algorithm: Any = "norm") -> None:
        """Stands in for the precision plugin's ``clip_gradients``: keeps the clipping for ``optimizer``'s next push
        (none for ``clip_val`` ``None`` or ``<= 0``)."""
        if clip_val is None or float(clip_val) <= 0:
            return
        algorithm = CLIP_ALGORITHMS[str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm))]
        if isinstance(optimizer, LightningOptimizer):  # manual optimization hands the wrapper in
            optimizer = optimizer.optimizer
        self._by_optimizer[id(optimizer)] = Clip(algorithm, float(clip_val))

    def pop(self, optimizer: Any) -> Clip | None:
        """The clipping for ``optimizer``'s push now (``None``: none asked), forgotten after."""
        return self._by_optimizer.pop(id(optimizer), None)
