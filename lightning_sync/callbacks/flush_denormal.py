"""Subnormal floats flushed to zero on every rank's CPU while it fits, tests or predicts."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from typing_extensions import override


class FlushDenormal(pl.Callback):
    """Has every rank's CPU treat subnormal floats as zero while it fits, tests or predicts.

    x86 CPUs run arithmetic on subnormal floats (magnitudes below about ``1e-38`` in float32) far slower than on
    normal ones, and a model can make many: a confident softmax, whose smallest probabilities underflow, fills the
    backward pass's matrix products with them. ``torch.set_flush_denormal(True)`` rounds them to zero instead (the
    flush-to-zero and denormals-are-zero modes of the floating-point unit), which changes only values that small.
    The setting belongs to a thread and the threads it starts, so the callback sets it in each rank's process at
    ``setup`` (after Lightning has launched the ranks) and clears it at ``teardown``.
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Subnormal floats are zero on this rank from here on (if this CPU supports it)."""
        torch.set_flush_denormal(True)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Back to torch's default, which keeps subnormal floats."""
        torch.set_flush_denormal(False)
