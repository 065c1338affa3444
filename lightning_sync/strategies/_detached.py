"""What a ``ps`` fit changes while its workers run apart, and puts back after (private helper of
:mod:`lightning_sync.strategies.ps`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from torchmetrics import Metric

from lightning_sync.strategies._lightning import loop_limits, set_loop_limits


class Detachment:
    """Whether this rank's Lightning collectives act on it alone now, and what the fit changed for that.

    Lightning ties the ranks together through the strategy's collectives (``barrier``, ``broadcast``,
    ``all_gather``, ``reduce``, ``reduce_boolean_decision``) and a per-batch SIGTERM-flag broadcast whenever
    ``world_size > 1``. While :attr:`detached` (the parameter server's async and ssp), the collectives return the
    rank's own value and ``world_size`` reads 1, so no rank issues one the others would have to match; every rank
    leaves the phase at the same point of the program.
    """

    def __init__(self) -> None:
        self.detached = False  # the strategy's collectives act on this rank alone
        self.alone = False  # this rank is a world of its own for the rest of the job (joined late, or a rank was lost)
        self._loop_limits: tuple[pl.Trainer, Any, int | None] | None = None  # the fit's own, while the mode ends it
        self._metric_syncs: list[tuple[Metric, Callable[[], bool]]] = []  # each metric's own distributed_available_fn

    @property
    def in_fit(self) -> bool:
        """Whether a fit whose ranks run apart is under way (from :meth:`hand_the_end_to_the_mode` to :meth:`restore`)."""
        return self._loop_limits is not None

    @property
    def max_epochs(self) -> int | None:
        """The fit's own ``max_epochs`` while the mode ends the run (``None`` otherwise)."""
        return None if self._loop_limits is None else self._loop_limits[2]

    def hand_the_end_to_the_mode(self, trainer: pl.Trainer) -> None:
        """For a fit whose ranks will detach: no epoch limit (the mode ends the run by setting ``should_stop``), and
        the module's torchmetrics keep their values local while detached. :meth:`restore` undoes both."""
        self._loop_limits = (trainer, *loop_limits(trainer))
        set_loop_limits(trainer, limit_val_batches=self._loop_limits[1], max_epochs=-1)
        self._keep_metrics_local(trainer.lightning_module)

    def restore(self) -> None:
        """Puts back the loop limits and the metrics' own ``distributed_available_fn``."""
        if self._loop_limits is not None:
            trainer, limit_val, max_epochs = self._loop_limits
            set_loop_limits(trainer, limit_val, max_epochs)
            self._loop_limits = None
        for metric, available in self._metric_syncs:
            metric.distributed_available_fn = available
        self._metric_syncs = []

    def _keep_metrics_local(self, module: pl.LightningModule) -> None:
        """A torchmetrics ``Metric`` syncs its state across ranks in ``compute()`` through ``torch.distributed``
        itself, not through the strategy: while detached, each of the module's metrics reads as not distributed
        (through its documented ``distributed_available_fn``), so it computes this rank's value and waits for no
        one."""
        self._metric_syncs = [(m, m.distributed_available_fn) for m in module.modules() if isinstance(m, Metric)]
        for metric, available in self._metric_syncs:
            metric.distributed_available_fn = functools.partial(_unless_detached, self, available)

    def go_alone(self) -> None:
        """For the rest of the job this rank is a world of its own: the default process group, which holds the lost
        rank, is replaced by a one-member group (Lightning's own calls on it, e.g. a test's module-state broadcast,
        then wait for no one), collectives stay local and every dataloader covers the whole dataset."""
        self.alone = True
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _unless_detached(detachment: Detachment, available: Callable[[], bool]) -> bool:
    return not detachment.detached and available()
