"""What every 2-rank Trainer in the tests shares: CPU, 2 devices, no logger files, no progress bars."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

WORLD = 2


def make_trainer(strategy: Any, **overrides: Any) -> pl.Trainer:
    """A quiet 2-rank CPU Trainer; ``comm/*`` is logged at every step (``log_every_n_steps=1``) unless overridden."""
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=WORLD,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    kwargs.update(overrides)
    return pl.Trainer(strategy=strategy, **kwargs)
