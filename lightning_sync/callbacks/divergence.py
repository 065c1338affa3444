"""Stopping a run whose training loss diverges, and recording it in the run summary."""

from __future__ import annotations

import math
import sys
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
from tqdm import tqdm
from typing_extensions import override

from lightning_sync.callbacks.report import merge_summary
from lightning_sync.errors import check_range


class DivergenceGuard(pl.Callback):
    """Stops a run whose training loss diverges, says so in one line and marks it ``"diverged"`` in the summary.

    The rule, on the loss of each training batch, against the first finite loss ``L0`` this rank saw in the fit
    (an untrained model's: about 2.3 for cross-entropy on 10 classes):

    - **not finite**: the loss is nan or inf;
    - **exploded**: the loss exceeds ``factor * L0`` (1e3 by default, so 2300 for cross-entropy);
    - **collapsed**: the mean loss over the last ``window`` batches is back at ``L0`` or above, after that mean had
      fallen to ``learned_fraction * L0`` or below: the model has unlearned everything, as DiLoCo's outer momentum
      0.9 over an inner SGD with momentum 0.9 does to the example model (with no nan on the way).

    Each rank checks its own losses. Every ``check_every`` batches the ranks all-gather their first bad step (an
    all-gather of 5 numbers, outside the communication meter), so all stop after the same batch (Lightning does not
    reduce ``should_stop``, and a rank left training would wait forever in its next collective). List it after
    :class:`SyncReport`, which then times the batch without the exchange.

    The summary gets ``diverged`` (bool), and for a diverged run the keys of :attr:`verdict`.

    Args:
        path: summary JSON to merge the verdict into (``None``: don't write).
        run_name: names the run in the message (e.g. its folder).
        factor: the explosion threshold over the first loss; ``None``: no explosion rule.
        window: batches averaged by the collapse rule; ``None``: no collapse rule.
        learned_fraction: how far (as a share of the first loss) the window's mean must have fallen before a
            return to the first loss counts as a collapse.
        check_every: batches between the ranks' exchanges: the run stops at most ``check_every - 1`` batches after
            the bad one (the step reported is the bad one's), and a last exchange follows the last batch.
        monitor: logged metric to check when ``training_step`` returns no loss (manual optimization).

    Attributes:
        verdict: ``None`` until the run diverged; then ``diverged_at_step`` (the optimizer step whose loss was bad,
            as ``trainer.global_step`` counts after it), ``diverged_loss`` (the loss, or the window's mean for a
            collapse), ``diverged_rank`` and ``diverged_reason`` (``not finite``, ``exploded`` or ``collapsed``).
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
        monitor: str = "train/loss",
    ) -> None:
        check_range("check_every", check_every, low=1, integer=True)
        if window is not None:
            check_range("window", window, low=1, integer=True)
        self.path = path
        self.run_name = run_name
        self.factor = factor
        self.window = window
        self.learned_fraction = learned_fraction
        self.check_every = check_every
        self.monitor = monitor
        self._recent: deque[float] = deque(maxlen=window or 1)
        self._start()

    def _start(self) -> None:
        """A new fit: no verdict, no loss seen."""
        self.verdict: dict[str, Any] | None = None
        self._first_loss: float | None = None
        self._lowest_mean = math.inf
        self._recent.clear()
        self._bad: tuple[int, float, int] | None = None  # this rank's first bad (step, loss, reason index)
        self.checked_batches = 0  # training batches seen in the current fit (0 where the ranks were forked off)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start()

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
        if self.verdict is not None:
            return
        loss = self._batch_loss(trainer, outputs)
        if self._bad is None and loss is not None:
            verdict = self._judge(loss)
            if verdict is not None:
                self._bad = (trainer.global_step, *verdict)
        self.checked_batches += 1
        if self.checked_batches % self.check_every == 0:
            self._agree(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.verdict is None:
            self._agree(trainer)  # the last batches (on every rank: in ps async/ssp their counts differ)
        if self.verdict is None and trainer.is_global_zero:
            merge_summary(self.path, {"diverged": False})

    def _agree(self, trainer: pl.Trainer) -> None:
        """Exchanges every rank's first bad step; on any, records the earliest and stops every rank."""
        step, value, reason = self._bad if self._bad is not None else (math.inf, 0.0, 0)
        first = self._first_loss if self._first_loss is not None else math.nan
        mine = torch.tensor(
            [step, value, reason, first, self._lowest_mean], dtype=torch.float64, device=trainer.strategy.root_device
        )
        # through the strategy, so that a mode whose ranks must not wait for each other (ps async) keeps them apart
        rows = list(trainer.strategy.all_gather(mine)) if trainer.world_size > 1 else [mine]
        rank = min(range(len(rows)), key=lambda r: float(rows[r][0]))
        step, value, reason, first, lowest = rows[rank].tolist()
        if not math.isfinite(step):
            return
        self.verdict = dict(
            diverged_at_step=int(step),
            diverged_loss=value,
            diverged_rank=rank,
            diverged_reason=self._REASONS[int(reason)],
        )
        trainer.should_stop = True
        if trainer.is_global_zero:
            self._report(first, lowest)

    def _report(self, first: float, lowest: float) -> None:
        """The one line on stderr (above any progress bar), and the verdict in the summary."""
        assert self.verdict is not None
        step, loss, rank, reason = self.verdict.values()
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
        tqdm.write(
            f"DIVERGED ({reason}): {name}, step {step} (rank {rank}): {what}; training stopped.", file=sys.stderr
        )
        merge_summary(self.path, {"diverged": True, **self.verdict})
