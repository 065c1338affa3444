"""Time to accuracy: training wall time until a replica first reaches a target test accuracy (no Lightning)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class AccuracyClock:
    """Training wall time until a replica reaches a target test accuracy, with the clock stopped while testing.

    Args:
        inputs: the test split's inputs.
        labels: the test split's labels.
        target: the accuracy to reach.
        every: test every this many optimizer steps.
        broadcast: sends rank 0's accuracy to every rank (all ranks call it together).
    """

    def __init__(
        self, inputs: torch.Tensor, labels: torch.Tensor, target: float, every: int, broadcast: Callable[[float], float]
    ) -> None:
        self.inputs, self.labels = inputs, labels
        self.target, self.every, self.broadcast = target, every, broadcast
        self.trajectory: list[tuple[float, int, float]] = []  # (seconds, step, accuracy)
        self.seconds_to_target: float | None = None
        self.steps_to_target: int | None = None
        self._started = 0.0
        self._paused = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()

    def check(self, model: nn.Module, step: int) -> bool:
        """At every ``every``-th step: tests rank 0's replica; returns whether the target is reached (same answer
        on every rank)."""
        if step % self.every:
            return False
        paused_at = time.perf_counter()
        elapsed = paused_at - self._started - self._paused
        accuracy = 0.0
        if not dist.is_initialized() or dist.get_rank() == 0:
            was_training = model.training
            model.eval()
            with torch.no_grad():
                accuracy = float((model(self.inputs).argmax(dim=1) == self.labels).float().mean())
            model.train(was_training)
        accuracy = float(self.broadcast(accuracy))
        self.trajectory.append((elapsed, step, accuracy))
        reached = accuracy >= self.target
        if reached and self.seconds_to_target is None:
            self.seconds_to_target, self.steps_to_target = elapsed, step
        self._paused += time.perf_counter() - paused_at
        return reached

    def result(self) -> dict[str, Any]:
        return {
            "seconds_to_target": self.seconds_to_target,
            "steps_to_target": self.steps_to_target,
            "final_accuracy": self.trajectory[-1][2] if self.trajectory else None,
            "trajectory": self.trajectory,
        }
