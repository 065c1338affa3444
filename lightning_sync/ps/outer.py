"""Async local SGD on the parameter server (Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling"):
each worker takes ``local_steps`` steps of its own optimizer, then pushes its pseudo-gradient (its change since its last
pull, :class:`LocalSteps`); the servers step their outer optimizer (e.g. :class:`DelayedNesterov`) on it."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_sync.errors import check_range
from lightning_sync.ps.client import PSClient, PSReply


class DelayedNesterov(torch.optim.Optimizer):
    """The outer SGD of async local SGD, with its momentum applied once per ``delay`` steps.

    Per step with pseudo-gradient ``g``: ``p -= lr * g`` at once, and ``g`` joins a sum ``a``; every ``delay``-th step
    the momentum ``m`` takes the sum, ``m = momentum * m + a``, and the parameters get the momentum part: ``p -= lr *
    momentum * m`` (Nesterov), or ``p -= lr * momentum * m_before`` (heavy ball). With ``delay=1`` this is
    ``torch.optim.SGD(lr, momentum, nesterov)`` without dampening or weight decay (in ``sync``: DiLoCo). With
    ``delay=W`` a round in which each of ``W`` workers pushes once moves the parameters exactly as one sync Nesterov
    step on the average; momentum at every push would count each stale pseudo-gradient ``W`` times per round, which
    the paper found unstable.

    Example::

        >>> import functools
        >>> from lightning_sync import ParameterServerStrategy
        >>> W = 4  # workers: momentum once per round of W pushes
        >>> outer = functools.partial(DelayedNesterov, lr=0.7, momentum=0.9, delay=W)
        >>> strategy = ParameterServerStrategy(mode="async", local_steps=8, outer_optimizer=outer)

    Args:
        params: the parameters (or param groups).
        lr: the outer learning rate (> 0).
        momentum: in ``[0, 1)``.
        nesterov: Nesterov momentum.
        delay: steps per momentum update (>= 1); the number of workers in async.
    """

    def __init__(
        self, params: Any, lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True, delay: int = 1
    ) -> None:
        if not lr > 0:
            raise ValueError(f"lr={lr!r} must be > 0")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum={momentum!r} must be in [0, 1)")
        check_range("delay", delay, low=1, integer=True)
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "delay": delay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            lr, beta, nesterov, delay = group["lr"], group["momentum"], group["nesterov"], group["delay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                p.add_(g, alpha=-lr)
                if beta == 0:
                    continue
                state = self.state[p]
                if not state:
                    state.update(pending=torch.zeros_like(p), count=0)
                if "momentum_buffer" not in state:  # zero: the first is the first sum, as torch's SGD (an older state
                    state["momentum_buffer"] = torch.zeros_like(p)  # has none before its first)
                pending, buf = state["pending"].add_(g), state["momentum_buffer"]
                state["count"] += 1
                if state["count"] < delay:
                    continue
                state["count"] = 0
                if not nesterov:
                    p.add_(buf, alpha=-lr * beta)
                buf.mul_(beta).add_(pending)
                if nesterov:
                    p.add_(buf, alpha=-lr * beta)
                pending.zero_()
        return loss


class LocalSteps:
    """A worker's side of async local SGD: every ``local_steps`` of its own optimizer steps, push the pseudo-gradient
    (parameters at the last pull minus now) and load the servers' reply.

    Args:
        client: the worker's client; its servers run an outer optimizer (``PSConfig.local_steps > 1``).
        local_steps: inner steps per push (>= 1).
        lrs: returns the learning rates a push carries (the servers' outer optimizer ignores them).
        adaptive: (``local_steps: auto``, the paper's dynamic local updates) after each push, scale this worker's
            interval to push about as often as the fastest worker: ``round(local_steps * fastest / own seconds per
            step)``, in ``[1, local_steps]`` (speeds posted in the store, timed with ``clock``).
    """

    def __init__(
        self,
        client: PSClient,
        local_steps: int,
        lrs: Callable[[], Sequence[float]],
        adaptive: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_range("local_steps", local_steps, low=1, integer=True)
        self.client, self.max_steps, self._lrs, self.adaptive = client, local_steps, lrs, adaptive
        self.local_steps = local_steps  # this worker's count for the current interval
        self.steps = 0  # inner steps since the last push
        self.anchor: list[torch.Tensor] = []
        self._clock = clock
        self._started = clock()

    def start(self) -> None:
        """Starts an interval from the parameters the model holds now (call after every pull)."""
        self.anchor = [p.detach().clone() for p in self.client.params]
        self.steps = 0
        self._started = self._clock()

    def after_step(self) -> PSReply | None:
        """Counts one inner step; at the end of an interval pushes the pseudo-gradient and returns the reply (the
        model then holds the servers' parameters and the next interval starts)."""
        self.steps += 1
        if self.steps < self.local_steps:
            return None
        seconds_per_step = (self._clock() - self._started) / self.steps
        grads = [p.grad for p in self.client.params]
        for p, start in zip(self.client.params, self.anchor):
            p.grad = start - p.detach()
        try:
            reply = self.client.push(self._lrs())
        finally:
            for p, g in zip(self.client.params, grads):
                p.grad = g
        self.start()
        if self.adaptive:
            self._adapt(seconds_per_step)
        return reply

    def _adapt(self, seconds_per_step: float) -> None:
        group = self.client.group
        group.post("seconds_per_step", seconds_per_step)
        posted = group.posted("seconds_per_step", range(group.num_workers))
        fastest = min(posted.values(), default=seconds_per_step)
        self.local_steps = max(1, min(self.max_steps, round(self.max_steps * fastest / max(seconds_per_step, 1e-9))))
