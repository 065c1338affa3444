"""Callbacks that measure a run: step time and communication per optimizer step.

And :class:`DivergenceGuard`, which stops a run whose training loss diverges and records it in the summary.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from tqdm import tqdm
from typing_extensions import override

# Core plumbing that every strategy adds by itself; it lives with the strategies and stays importable from here.
from lightning_sync.strategies._metrics import SyncMetricsLogger as SyncMetricsLogger


class SyncReport(pl.Callback):
    """Times every training batch and sums the strategy's communication; writes a JSON summary on rank 0.

    The step time of a batch is the wall time from ``on_train_batch_start`` to ``on_train_batch_end`` on rank 0
    (forward, backward, sync and optimizer step; data loading excluded). The first ``warmup_steps`` batches are
    left out of the median. Bytes per step divide what the meter counted during training (setup traffic
    excluded) by the optimizer steps taken; strategies without a lightning_sync meter (e.g. Lightning's own
    ``"ddp"``) report none.

    Args:
        path: where to write the summary JSON after fit/test (``None``: don't write); an existing file is updated.
        warmup_steps: batches left out of the step-time median.
    """

    def __init__(self, path: str | None = None, warmup_steps: int = 3) -> None:
        self.path = path
        self.warmup_steps = warmup_steps
        self.step_seconds: list[float] = []
        self.summary: dict[str, Any] = {}
        self._started = 0.0
        self._comm_at_start: Any = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A new fit starts a new summary: a file left by an earlier run in the same folder is removed."""
        if self.path is not None and trainer.is_global_zero:
            Path(self.path).unlink(missing_ok=True)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Notes where a resumed fit resumed (``resumed_from``, ``resumed_at_step``; said on rank 0's stderr)."""
        meter = getattr(trainer.strategy, "meter", None)
        self._comm_at_start = meter.total if meter is not None else None
        if trainer.ckpt_path:
            self.summary.update(resumed_from=str(trainer.ckpt_path), resumed_at_step=trainer.global_step)
            if trainer.is_global_zero:
                print(
                    f"resumed from {trainer.ckpt_path} at step {trainer.global_step} (epoch {trainer.current_epoch})",
                    file=sys.stderr,
                    flush=True,
                )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        self._started = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.step_seconds.append(time.perf_counter() - self._started)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        timed = self.step_seconds[self.warmup_steps :] or self.step_seconds
        steps = max(trainer.global_step, 1)
        self.summary.update(
            strategy=type(trainer.strategy).__name__,
            world_size=trainer.world_size,
            optimizer_steps=trainer.global_step,
            batches=len(self.step_seconds),
            step_time_ms=1000 * statistics.median(timed) if timed else None,
        )
        synchronizer = getattr(trainer.strategy, "synchronizer", None)
        if synchronizer is not None:
            self.summary["launch_point"] = synchronizer.launch_point
        meter = getattr(trainer.strategy, "meter", None)
        if meter is not None and self._comm_at_start is not None:
            # training only (setup broadcasts are not a step's), and across resumes, as global_step is
            total = getattr(trainer.strategy, "comm_totals", None) or meter.total - self._comm_at_start
            self.summary.update(
                bytes_sent_per_step=total.bytes_sent / steps,
                bytes_recv_per_step=total.bytes_recv / steps,
                calls_per_step=total.calls / steps,
                comm_seconds_per_step=total.seconds / steps,
            )
        self._write(trainer)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.summary["test"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("test/")}
        self._write(trainer)

    def _write(self, trainer: pl.Trainer) -> None:
        if trainer.is_global_zero:
            _merge_summary(self.path, self.summary)


def _merge_summary(path: str | None, part: dict[str, Any]) -> None:
    """Merges ``part`` into the JSON file at ``path`` (nothing if ``None``).

    With fork/spawn, fit and test run in different processes, and several callbacks write their own keys: each
    merges its part into what is there.
    """
    if path is None:
        return
    file = Path(path)
    merged = json.loads(file.read_text()) if file.is_file() else {}
    merged.update(part)
    file.write_text(json.dumps(merged, indent=2, sort_keys=True))


def read_summary(path: str) -> dict[str, Any]:
    """The summary JSON at ``path`` (``{}`` if there is none yet)."""
    file = Path(path)
    return json.loads(file.read_text()) if file.is_file() else {}


class DivergenceGuard(pl.Callback):
    """Stops a run whose training loss diverges, says so in one line and marks it ``"diverged"`` in the summary.

    The rule, on the loss of each training batch, against the first finite loss ``L0`` this rank saw in the fit
    (an untrained model's: about 2.3 for cross-entropy on 10 classes):

    - **not finite**: the loss is nan or inf;
    - **exploded**: the loss exceeds ``factor * L0`` (1e3 by default, so 2300 for cross-entropy);
    - **collapsed**: the mean loss over the last ``window`` batches is back at ``L0`` or above, after that mean had
      fallen to ``learned_fraction * L0`` or below: the model has unlearned everything, as DiLoCo's outer momentum
      0.9 over an inner SGD with momentum 0.9 does to the example model (its loss climbs back to ln 10 and the test
      accuracy to 10%, with no nan on the way).

    Each rank checks its own losses, which differ between ranks (their own batches, and in ``local_sgd``/``diloco``
    their own parameters between syncs). Every ``check_every`` batches the ranks all-gather their first bad step,
    so they all take the same decision after the same batch: the earliest bad step of any rank, then
    ``trainer.should_stop`` on every rank (Lightning does not reduce ``should_stop`` across ranks itself, and a
    rank left training would wait forever in its next collective). The exchange is plain ``torch.distributed``,
    outside the strategy's communication meter, so ``comm/*`` still counts only sync traffic; it runs after
    :class:`SyncReport` has timed the batch (list this callback after it). One exchange is an all-gather of 5
    numbers, a latency-bound collective: one every 10 batches by default keeps it off most steps.

    The summary gets ``diverged`` (bool), and for a diverged run ``diverged_at_step`` (the optimizer step whose
    loss was bad, as ``trainer.global_step`` counts after it), ``diverged_loss`` (the loss, or the window's mean
    for a collapse), ``diverged_rank`` and ``diverged_reason`` (``not finite``, ``exploded`` or ``collapsed``).

    Args:
        path: summary JSON to merge the verdict into (``None``: don't write).
        run_name: names the run in the message (e.g. its folder).
        factor: the explosion threshold over the first loss; ``None``: no explosion rule.
        window: batches averaged by the collapse rule; ``None``: no collapse rule.
        learned_fraction: how far (as a share of the first loss) the window's mean must have fallen before a
            return to the first loss counts as a collapse.
        check_every: batches between the ranks' exchanges: the run stops at most ``check_every - 1`` batches after
            the bad one (the step reported is the bad one's), and a last exchange follows the last batch.
        stop: stop training on divergence (``False``: report it and go on).
        monitor: logged metric to check when ``training_step`` returns no loss (manual optimization).
    """

    _REASONS = ("not finite", "exploded", "collapsed")

    def __init__(
        self,
        path: str | None = None,
        run_name: str = "",
        factor: float | None = 1e3,
        window: int | None = 20,
        learned_fraction: float = 0.5,
        check_every: int = 10,
        stop: bool = True,
        monitor: str = "train/loss",
    ) -> None:
        if check_every < 1:
            raise ValueError(f"check_every={check_every} is not allowed; it must be >= 1")
        if window is not None and window < 1:
            raise ValueError(f"window={window} is not allowed; it must be >= 1 (or None)")
        self.path = path
        self.run_name = run_name
        self.factor = factor
        self.window = window
        self.learned_fraction = learned_fraction
        self.check_every = check_every
        self.stop = stop
        self.monitor = monitor
        self.diverged_at_step: int | None = None
        self.diverged_loss: float | None = None
        self.diverged_rank: int | None = None
        self.diverged_reason: str | None = None
        self._first_loss: float | None = None
        self._lowest_mean = math.inf
        self._recent: deque[float] = deque(maxlen=window or 1)
        self._bad: tuple[int, float, int] | None = None  # this rank's first bad (step, loss, reason index)
        self._batches = 0
        self._verdict: tuple[float, float] | None = None  # the detecting rank's (first loss, lowest mean)

    @property
    def checked_batches(self) -> int:
        """Training batches this process's guard has seen in the current fit (0 where the ranks were forked off)."""
        return self._batches

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.diverged_at_step = self.diverged_loss = self.diverged_rank = self.diverged_reason = None
        self._first_loss, self._lowest_mean, self._bad, self._batches, self._verdict = None, math.inf, None, 0, None
        self._recent.clear()

    def _batch_loss(self, trainer: pl.Trainer, outputs: Any) -> float | None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not isinstance(loss, torch.Tensor):
            metrics = trainer.callback_metrics
            loss = metrics.get(f"{self.monitor}_step", metrics.get(self.monitor))
        return float(loss.detach()) if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None

    def _judge(self, loss: float) -> tuple[float, int] | None:
        """``(value, reason index)`` if ``loss`` (this rank's latest) shows a divergence, else ``None``."""
        if not math.isfinite(loss):
            return loss, 0
        if self._first_loss is None:
            self._first_loss = loss
        first = self._first_loss
        if self.factor is not None and first > 0 and loss > self.factor * first:
            return loss, 1
        if self.window is None:
            return None
        self._recent.append(loss)
        if len(self._recent) < self.window:
            return None
        mean = sum(self._recent) / self.window
        self._lowest_mean = min(self._lowest_mean, mean)
        if first > 0 and self._lowest_mean <= self.learned_fraction * first and mean >= first:
            return mean, 2
        return None

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.diverged_at_step is not None:
            return
        loss = self._batch_loss(trainer, outputs)
        if self._bad is None and loss is not None:
            verdict = self._judge(loss)
            if verdict is not None:
                self._bad = (trainer.global_step, *verdict)
        self._batches += 1
        if self._batches % self.check_every == 0:
            self._agree(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.diverged_at_step is None:
            self._agree(trainer)  # the last batches (on every rank: in ps async/ssp their counts differ)
        if self.diverged_at_step is None and trainer.is_global_zero:
            _merge_summary(self.path, {"diverged": False})

    def _agree(self, trainer: pl.Trainer) -> None:
        """Exchanges every rank's first bad step; on any, records the earliest and stops every rank."""
        step, value, reason = self._bad if self._bad is not None else (math.inf, 0.0, 0)
        first = self._first_loss if self._first_loss is not None else math.nan
        mine = torch.tensor([step, value, reason, first, self._lowest_mean], dtype=torch.float64)
        # through the strategy, so that a mode whose ranks must not wait for each other (ps async) keeps them apart
        rows = list(trainer.strategy.all_gather(mine)) if trainer.world_size > 1 else [mine]
        rank = min(range(len(rows)), key=lambda r: float(rows[r][0]))
        step, value, reason, first, lowest = rows[rank].tolist()
        if not math.isfinite(step):
            return
        self.diverged_at_step, self.diverged_loss, self.diverged_rank = int(step), value, rank
        self.diverged_reason = self._REASONS[int(reason)]
        self._verdict = (first, lowest)
        if self.stop:
            trainer.should_stop = True
        if trainer.is_global_zero:
            self._report()

    def _report(self) -> None:
        """The one line on stderr (above any progress bar), and the verdict in the summary."""
        assert self._verdict is not None and self.diverged_loss is not None
        first, lowest = self._verdict
        loss, reason = self.diverged_loss, self.diverged_reason
        if reason == "exploded":
            what = f"training loss {loss:.4g}, more than {self.factor:g}x the first loss {first:.4g}"
        elif reason == "collapsed":
            what = (
                f"mean training loss {loss:.4g} over the last {self.window} steps, back above the first loss "
                f"{first:.4g} after falling to {lowest:.4g}"
            )
        else:
            what = f"training loss {loss:.4g}"
        name = f"run {self.run_name}" if self.run_name else "the run"
        action = "training stopped" if self.stop else "training goes on"
        tqdm.write(
            f"DIVERGED ({reason}): {name}, step {self.diverged_at_step} (rank {self.diverged_rank}): {what}; {action}.",
            file=sys.stderr,
        )
        _merge_summary(
            self.path,
            {
                "diverged": True,
                "diverged_at_step": self.diverged_at_step,
                "diverged_loss": loss,
                "diverged_rank": self.diverged_rank,
                "diverged_reason": reason,
            },
        )


class StragglerCallback(pl.Callback):
    """Makes workers slower, for experiments with stragglers under any strategy: a slow batch sleeps, after the
    batch (its optimizer step and any sync or push included), ``slowdown - 1`` times the time the batch took.

    Two patterns, set by ``rank`` and ``chance``:

    * one worker slow all the time: ``rank=2, slowdown=3`` (``chance=1``);
    * stragglers that come and go: ``rank=None, chance=0.1``: every worker, independently, makes each batch slow
      with probability ``chance`` (a hiccup), drawn from its own generator seeded by ``seed`` and its rank.

    Args:
        rank: the slow worker's global rank, or ``None`` for every worker.
        slowdown: how many times as long a slow batch takes, ``>= 1``.
        chance: the probability that a batch of a slow worker is slow, in ``(0, 1]``.
        seed: seeds the draws (with the rank), so a pattern repeats from run to run.
        clock: returns the current time in seconds (a test passes a fake one).
        sleep: sleeps for the given seconds (a test passes one that advances its fake clock).

    Raises:
        ValueError: a value outside the ranges above, naming the field.
    """

    def __init__(
        self,
        rank: int | None = None,
        slowdown: float = 3.0,
        chance: float = 1.0,
        seed: int = 0,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        from lightning_sync.ps.straggler import Straggler

        Straggler(0, rank, slowdown)  # checks rank and slowdown
        if isinstance(chance, bool) or not isinstance(chance, (int, float)) or not 0.0 < chance <= 1.0:
            raise ValueError(f"chance={chance!r} is not allowed; it must be a probability in (0, 1]")
        self.rank, self.slowdown, self.chance, self.seed = rank, float(slowdown), float(chance), int(seed)
        self._clock, self._sleep = clock, sleep
        self.slow_batches = 0
        self._straggler: Any = None
        self._draws: Any = None

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Sets up this worker's sleeper and its draws (a worker that is never slow gets none)."""
        import random

        from lightning_sync.ps.straggler import Straggler

        rank = trainer.global_rank
        if self.rank is None or self.rank == rank:
            self._straggler = Straggler(rank, rank, self.slowdown, clock=self._clock, sleep=self._sleep)
            self._draws = random.Random(self.seed * 1_000_003 + rank)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        """Starts the batch's clock on a worker that may be slow."""
        if self._straggler is not None:
            self._straggler.step_start()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Sleeps if this batch is a slow one (``chance``)."""
        if self._straggler is None:
            return
        if self._draws.random() < self.chance:
            self.slow_batches += 1
            self._straggler.step_end()


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
