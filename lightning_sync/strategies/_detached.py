"""Collectives that a strategy can switch off while its ranks run without waiting for each other."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from torchmetrics import Metric
from typing_extensions import override

from lightning_sync.strategies._base import SyncStrategyBase
from lightning_sync.strategies._lightning import loop_limits, set_loop_limits


class DetachableCollectives(SyncStrategyBase):
    """While ``_detached`` is set, the strategy's collectives act on this rank alone.

    Lightning ties the ranks together through the strategy: ``barrier``, ``broadcast``, ``all_gather``, ``reduce``
    (behind ``self.log(sync_dist=True)``), ``reduce_boolean_decision`` (EarlyStopping, ModelCheckpoint), and a per-batch
    broadcast of a SIGTERM flag that it issues whenever ``world_size > 1``. A mode whose ranks must not wait for each
    other (the parameter server's async and ssp) sets ``_detached`` for that phase: then each of these returns the
    rank's own value at once, and ``world_size`` reads 1, so no rank issues a collective the others would have to
    match. Every rank must leave the phase at the same point of the program, after which collectives pair up again.
    Checkpoints written meanwhile hold each rank's own sync state only (the one rank 0 writes is complete).
    """

    _detached = False
    _alone = False  # a rank was lost: this one stays detached for the rest of the job
    _loop_limits: tuple[pl.Trainer, Any, int | None] | None = None
    _metric_syncs: Sequence[tuple[Metric, Callable[[], bool]]] = ()  # each metric's own distributed_available_fn

    def _hand_the_end_to_the_mode(self, trainer: pl.Trainer) -> None:
        """For a fit whose ranks will detach: no epoch limit (the mode ends the run by setting ``should_stop``), and
        the module's torchmetrics keep their values local while detached (:meth:`_keep_metrics_local`).
        :meth:`_restore_loop_limits` undoes both."""
        self._loop_limits = (trainer, *loop_limits(trainer))
        set_loop_limits(trainer, limit_val_batches=self._loop_limits[1], max_epochs=-1)
        self._keep_metrics_local(trainer.lightning_module)

    def _restore_loop_limits(self) -> None:
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

    def end_detached_run(self) -> None:
        """Ends the mode's run, then the ranks meet and attach again (every rank, once its own loop ended). Called
        first thing in ``on_train_end`` (by :class:`~lightning_sync.callbacks.SyncMetricsLogger`, before the other
        callbacks, which may use collectives there), and by the strategy's ``on_train_end`` (then a no-op). Until
        then each rank ran its own batch and epoch ends, whose collectives would not pair across ranks."""
        self._end_mode_run()
        if self._detached and self._can_attach():
            self._detached = False
            self.barrier("lightning_sync.attach")
        elif self._detached:
            self._go_alone()

    def _end_mode_run(self) -> None:
        """The mode's own end of the run (``ps``: the final pull and goodbye); idempotent."""

    def _go_alone(self) -> None:
        """For the rest of the job this rank is a world of its own: the default process group, which holds the lost
        rank, is replaced by a one-member group (Lightning's own calls on it, e.g. a test's module-state broadcast,
        then wait for no one), collectives stay local and every dataloader covers the whole dataset."""
        self._alone = True
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def _can_attach(self) -> bool:
        """Whether the ranks can meet again after the mode's run (not when one was lost: each survivor then stays
        alone for the rest of the job, and tests the whole test set on its own)."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The whole dataset for each rank once it stays alone after a lost rank (see :meth:`_can_attach`)."""
        if self._alone:
            return {"num_replicas": 1, "rank": 0}
        return super().distributed_sampler_kwargs

    @property
    @override
    def world_size(self) -> int:
        """1 while detached."""
        return 1 if self._detached else super().world_size

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """No wait while detached."""
        if not self._detached:
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """This rank's own object while detached."""
        return obj if self._detached else super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """This rank's own value while detached."""
        return tensor if self._detached else super().reduce(tensor, *args, **kwargs)

    @override
    def all_gather(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """This rank's own tensor, as the only row, while detached."""
        return tensor.unsqueeze(0) if self._detached else super().all_gather(tensor, *args, **kwargs)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """This rank's own decision while detached."""
        return decision if self._detached else super().reduce_boolean_decision(decision, all=all)

    @override
    def check_replicas(self, atol: float = 0.0) -> list[Any]:
        """Nothing to compare in a fit whose ranks run apart: the replicas differ between pulls, and the ranks reach a
        step count at different times, so a check would pair collectives wrongly."""
        return [] if self._loop_limits is not None else super().check_replicas(atol)


def _unless_detached(strategy: DetachableCollectives, available: Callable[[], bool]) -> bool:
    return not strategy._detached and available()
