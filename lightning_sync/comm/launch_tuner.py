"""``bucketing=auto``: choosing by measurement whether gradient buckets launch during backward or right after it.

Nothing here knows of Lightning. :class:`~lightning_sync.comm.bucketing.GradientSynchronizer` asks a
:class:`LaunchTuner` where each sync round launches, reports each round's duration, and has it decide once the
trials are complete. Overlap pays off when communication runs on its own hardware (a GPU's copy engines, a slow
network that leaves the CPU idle); on a CPU backend with few cores, gloo's transfers compete with backward for the
same cores and memory bandwidth, and launching after backward is faster. The decision is identical on every rank:
the ranks sum their medians in one all-reduce and apply the same rule to the same numbers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ProcessGroup

from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.tuning import LAUNCH_MARGIN, LAUNCH_TRIAL_ROUNDS, LAUNCH_WARMUP_ROUNDS


class LaunchTuner:
    """Chooses, by measurement, whether buckets launch during backward or right after it.

    The first ``warmup_rounds`` sync rounds are not timed (allocator and gloo warm-up). The next
    ``2 * trial_rounds`` alternate the two launch points, timing each round's whole period, from the start of its
    backward to the start of the next round's backward: overlap trades a slower backward (and whatever else the
    transfers slow down) against a shorter wait, so only the whole step shows which wins. Then every rank
    contributes its median per launch point to one all-reduce, and all ranks decide alike on the sums: a launch
    point that is faster by more than ``margin`` wins; a closer call, within the noise of a shared machine, goes to
    the ``prefer_after_backward`` prior.

    Args:
        warmup_rounds: rounds left out before the trials.
        trial_rounds: timed rounds per launch point.
        margin: the relative lead a launch point needs to overrule the prior.
        prefer_after_backward: the prior (``None``: :class:`GradientSynchronizer` sets it from ``same_host_cpu``).
        clock: returns the current time in seconds; :class:`GradientSynchronizer` reads it at the start of every
            round (a test passes a fake one and feeds it the rounds' durations).
    """

    def __init__(
        self,
        warmup_rounds: int = LAUNCH_WARMUP_ROUNDS,
        trial_rounds: int = LAUNCH_TRIAL_ROUNDS,
        margin: float = LAUNCH_MARGIN,
        prefer_after_backward: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        assert warmup_rounds >= 0 and trial_rounds >= 1 and margin >= 0
        self.clock = clock
        self.warmup_rounds = warmup_rounds
        self.trial_rounds = trial_rounds
        self.margin = margin
        self.prefer_after_backward = prefer_after_backward
        self.rounds = 0
        self.times: dict[bool, list[float]] = {False: [], True: []}
        self.after_backward: bool | None = None  # the decision, once made
        self.medians_ms: dict[str, float] = {}

    def state_dict(self) -> dict[str, Any]:
        """The trials so far and the decision (so a resumed run keeps its launch point instead of re-tuning)."""
        return {
            "rounds": self.rounds,
            "times": {k: list(v) for k, v in self.times.items()},
            "after_backward": self.after_backward,
            "medians_ms": dict(self.medians_ms),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rounds = int(state["rounds"])
        self.times = {bool(k): list(v) for k, v in state["times"].items()}
        self.after_backward = state["after_backward"]
        self.medians_ms = dict(state["medians_ms"])

    @property
    def deciding(self) -> bool:
        return self.after_backward is None

    def next_after_backward(self) -> bool:
        """Where the coming round launches: decided, or the trial's alternation (during backward first)."""
        if self.after_backward is not None:
            return self.after_backward
        return max(self.rounds - self.warmup_rounds, 0) % 2 == 1

    def record(self, after_backward: bool, seconds: float) -> bool:
        """Books one round's time; returns whether the trials are complete (time to :meth:`decide`)."""
        if self.rounds >= self.warmup_rounds:
            self.times[after_backward].append(seconds)
        self.rounds += 1
        return all(len(v) >= self.trial_rounds for v in self.times.values())

    def decide(self, meter: CommMeter, group: ProcessGroup | None) -> bool:
        """Sums the ranks' medians (one small all-reduce) and fixes the launch point; returns it."""
        medians = torch.tensor(
            [statistics.median(self.times[False]), statistics.median(self.times[True])],
            dtype=torch.float64,
            device=meter.control_device(group),
        )
        meter.all_reduce(medians, group=group)
        n = meter.world_size(group)
        during, after = (1e3 * medians / n).tolist()
        self.medians_ms = {"during_backward": during, "after_backward": after}
        if after < (1.0 - self.margin) * during:
            self.after_backward = True
        elif during < (1.0 - self.margin) * after:
            self.after_backward = False
        else:
            self.after_backward = bool(self.prefer_after_backward)
        return self.after_backward
