"""A test callback that holds a job's training at one step until a file exists: a test decides when the job goes
on (after another process has joined it, say) instead of racing it. Rank processes import it by name (the test puts
``tests/`` on ``PYTHONPATH``): ``+callbacks.gate._target_=gate.FileGate +callbacks.gate.path=<file>``.
"""

from __future__ import annotations

import time
from pathlib import Path

import lightning.pytorch as pl


class FileGate(pl.Callback):
    """Before training batch ``at_step`` (the global step), waits until ``path`` exists; raises ``TimeoutError``
    after ``timeout_s``."""

    def __init__(self, path: str, at_step: int = 10, timeout_s: float = 100.0) -> None:
        self.path, self.at_step, self.timeout_s = Path(path), at_step, timeout_s

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step != self.at_step:
            return
        deadline = time.monotonic() + self.timeout_s
        while not self.path.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.path} did not appear within {self.timeout_s} s")
            time.sleep(0.1)
