"""Subnormal floats flushed to zero on every rank's CPU while it fits, tests or predicts."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from typing_extensions import override


class FlushDenormal(pl.Callback):
    """Has every rank's CPU treat subnormal floats as zero while it fits, tests or predicts.

    x86 CPUs compute on subnormal floats (below about ``1e-38`` in float32) far slower than on normal ones, and a
    confident softmax fills backward's matrix products with them; ``torch.set_flush_denormal(True)`` rounds them to
    zero. The setting is per thread (and the threads it starts), so it is set in each rank at ``setup``.
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Subnormal floats are zero on this rank from here on (if this CPU supports it)."""
        torch.set_flush_denormal(True)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Back to torch's default, which keeps subnormal floats."""
        torch.set_flush_denormal(False)
