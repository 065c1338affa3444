"""Time to a target: training wall time until a replica first scores a target (no Lightning).

Two scores: test accuracy (digits, higher is better) and validation loss (char_lm, lower is better). The clock is
stopped while a replica is scored, so scoring costs no training time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn


def accuracy_of(inputs: torch.Tensor, labels: torch.Tensor) -> Callable[[nn.Module], float]:
    """A scorer: the model's accuracy on ``inputs`` against ``labels``."""

    def score(model: nn.Module) -> float:
        return float((model(inputs).argmax(dim=1) == labels).float().mean())

    return score


def loss_of(batches: list[Any]) -> Callable[[nn.Module], float]:
    """A scorer: the mean of ``model.loss(batch)`` over ``batches`` (equal-sized batches weigh alike)."""

    def score(model: nn.Module) -> float:
        # nn.Module.__getattr__ types every attribute as Tensor | Module; the models' loss is a method
        loss = cast("Callable[[Any], torch.Tensor]", model.loss)
        return sum(float(loss(batch)) for batch in batches) / len(batches)

    return score


def first_reaching(
    trajectory: list[tuple[float, int, float]], target: float, lower_is_better: bool
) -> tuple[float, int] | None:
    """``(seconds, step)`` of the first point of ``trajectory`` (``(seconds, step, score)``) at the target."""
    for seconds, step, value in trajectory:
        if (value <= target) if lower_is_better else (value >= target):
            return seconds, step
    return None


def window_step_seconds(trajectory: list[tuple[float, int, float]], from_step: int = 0) -> float | None:
    """Training seconds per step from the first point of ``trajectory`` (``(seconds, step, score)``) at or past
    ``from_step`` to its last: over whole sync periods when the points are at syncs; ``None`` without two such
    points."""
    points = [p for p in trajectory if p[1] >= from_step]
    if len(points) < 2 or points[-1][1] <= points[0][1]:
        return None
    (first_s, first_step, _), (last_s, last_step, _) = points[0], points[-1]
    return (last_s - first_s) / (last_step - first_step)


class TargetClock:
    """Training wall time until a replica reaches a target score, with the clock stopped while scoring.

    Every ``every`` optimizer steps all ranks meet (the wait counts as training time: a rank that is ahead waits
    for the others, as it would at a collective), rank 0 scores its replica, and its score is broadcast, so every
    rank takes the same decision. Where each rank is a world of its own (``ps`` async), each is its own rank 0: it
    scores its own replica and decides alone.

    Args:
        score: rank 0's score of a model (accuracy, or a validation loss).
        target: the score to reach; ``None``: run the whole budget (the score is still recorded).
        every: score every this many optimizer steps.
        broadcast: sends rank 0's value to every rank (all ranks call it together).
        lower_is_better: a loss (``True``) or an accuracy (``False``).
        give_up_s: stop when this much training time has passed without reaching the target (``None``: never).
    """

    def __init__(
        self,
        score: Callable[[nn.Module], float],
        target: float | None,
        every: int,
        broadcast: Callable[[float], float],
        lower_is_better: bool = False,
        give_up_s: float | None = None,
    ) -> None:
        self.score, self.target, self.every, self.broadcast = score, target, every, broadcast
        self.lower_is_better = lower_is_better
        self.give_up_s = give_up_s
        self.trajectory: list[tuple[float, int, float]] = []  # (seconds, step, score)
        self.seconds_to_target: float | None = None
        self.steps_to_target: int | None = None
        self.gave_up = False
        self._started = 0.0
        self._paused = 0.0

    def start(self) -> None:
        self._started = time.perf_counter()

    def check(self, model: nn.Module, step: int) -> bool:
        """At every ``every``-th step: scores rank 0's replica; returns whether to stop (the target is reached,
        or ``give_up_s`` has passed); the same answer on every rank."""
        if step % self.every:
            return False
        self.broadcast(0.0)  # the ranks meet, clock running
        paused_at = time.perf_counter()
        elapsed = paused_at - self._started - self._paused
        value = 0.0
        if not dist.is_initialized() or dist.get_rank() == 0:
            was_training = model.training
            model.eval()
            with torch.no_grad():
                value = self.score(model)
            model.train(was_training)
        value = float(self.broadcast(value))
        # rank 0's training time too: each rank's own clock differs a little, and a give-up decided on it would
        # let one rank stop a step before another (which then waits in a collective for a rank that is gone)
        elapsed = float(self.broadcast(elapsed))
        self.trajectory.append((elapsed, step, value))
        reached = self.target is not None and first_reaching(
            [(elapsed, step, value)], self.target, self.lower_is_better
        )
        if reached and self.seconds_to_target is None:
            self.seconds_to_target, self.steps_to_target = elapsed, step
        give_up = self.give_up_s is not None and elapsed > self.give_up_s
        self.gave_up = self.gave_up or (give_up and not reached)
        self._paused += time.perf_counter() - paused_at
        return bool(reached) or give_up

    def result(self) -> dict[str, Any]:
        final = self.trajectory[-1][2] if self.trajectory else None
        return {
            "seconds_to_target": self.seconds_to_target,
            "steps_to_target": self.steps_to_target,
            "final_loss" if self.lower_is_better else "final_accuracy": final,
            "gave_up": self.gave_up,
            "trajectory": self.trajectory,
        }
