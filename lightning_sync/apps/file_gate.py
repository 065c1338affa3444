"""A callback that holds a run at one step until a file exists (:class:`FileGate`)."""

from __future__ import annotations

import time
from pathlib import Path

import lightning.pytorch as pl
from typing_extensions import override


class FileGate(pl.Callback):
    """Holds training before global step ``at_step`` until ``path`` exists: whoever started the job decides when it
    goes on (notebook 07 holds the surviving replica groups until the restarted one trains; a test holds a ps job
    until an added worker trains) instead of racing a fresh interpreter's start against the job's end.

    Raises ``TimeoutError`` naming the file after ``timeout_s``.

    Example::

        python -m lightning_sync.train +callbacks.gate._target_=lightning_sync.apps.file_gate.FileGate \\
            +callbacks.gate.path=/tmp/go +callbacks.gate.at_step=10
    """

    def __init__(self, path: str | Path, at_step: int = 10, timeout_s: float = 300.0) -> None:
        self.path, self.at_step, self.timeout_s = Path(path), at_step, timeout_s

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        """Waits for the file at step ``at_step`` (checked every 0.1 s)."""
        deadline = time.monotonic() + self.timeout_s
        while trainer.global_step == self.at_step and not self.path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"FileGate: {self.path} did not appear within timeout_s={self.timeout_s:g} s")
            time.sleep(0.1)
