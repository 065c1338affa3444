"""The wall time of every training step and validation, on disk as it happens: a record that survives a SIGKILL
(for runs killed on purpose). The Hydra app adds it with ``callbacks=[default,step_clock]``; :func:`read_step_clock`
reads it back.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override


@dataclass
class ClockRecord:
    """What :class:`StepClock` wrote: ``(unix time, global step, training loss)`` per training batch and
    ``(unix time, global step, val/loss)`` per validation."""

    steps: list[tuple[float, int, float]] = field(default_factory=list)
    vals: list[tuple[float, int, float]] = field(default_factory=list)


class StepClock(pl.Callback):
    """On global rank 0, appends ``<unix time> step <global step> <training loss>`` after every training batch and
    ``<unix time> val <global step> <val/loss>`` after every validation (the sanity check left out) to ``path``.

    Args:
        path: the file to append to (a restarted process appends to the same file); ``None``: ``step_clock.txt`` in
            the Trainer's ``default_root_dir``.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = None if path is None else Path(path)

    def _write(self, trainer: pl.Trainer, line: str) -> None:
        if trainer.global_rank != 0:
            return
        if self.path is None:
            self.path = Path(trainer.default_root_dir) / "step_clock.txt"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as file:  # closed at once: on disk before the next batch
            file.write(f"{time.time():.3f} {line}\n")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Appends the batch's line: the time, the global step after it, and the training loss it returned (``nan``
        when ``training_step`` returned none)."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        value = float(loss) if isinstance(loss, torch.Tensor) else math.nan
        self._write(trainer, f"step {trainer.global_step} {value:.6f}")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Appends the validation's ``val/loss`` (nothing for the sanity check or a run that logs none)."""
        loss = trainer.callback_metrics.get("val/loss")
        if trainer.sanity_checking or loss is None or not math.isfinite(float(loss)):
            return
        self._write(trainer, f"val {trainer.global_step} {float(loss):.6f}")


def read_step_clock(path: str | Path) -> ClockRecord:
    """The lines a :class:`StepClock` appended to ``path`` (an empty record if there is no file; a line cut short by
    a kill is skipped)."""
    record, file = ClockRecord(), Path(path)
    for line in file.read_text().splitlines() if file.exists() else []:
        parts = line.split()
        if len(parts) != 4 or parts[1] not in ("step", "val"):
            continue
        try:
            row = (float(parts[0]), int(parts[2]), float(parts[3]))
        except ValueError:
            continue
        (record.steps if parts[1] == "step" else record.vals).append(row)
    return record
