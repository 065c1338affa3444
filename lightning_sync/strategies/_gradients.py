"""The all-reduce gradient path that ``allreduce`` and ``periodic`` (``mode="gradient"``, warmup) hold: a
:class:`~lightning_sync.comm.bucketing.GradientSynchronizer` (and, with fault tolerance, a torchft link across replica
groups, :func:`replica_group_link`) behind the hooks :class:`~lightning_sync.strategies._base.SyncStrategyBase`
forwards to it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_sync.comm.bucketing import GradientSynchronizer
from lightning_sync.comm.compression import Compressor
from lightning_sync.comm.meter import CommMeter
from lightning_sync.config import AllReduceConfig, PeriodicConfig
from lightning_sync.ft.config import FaultTolerance
from lightning_sync.ft.replica import ReplicaGroupLink, average_gradients_across


def replica_group_link(strategy: ParallelStrategy, config: FaultTolerance) -> ReplicaGroupLink:
    """This rank's link to the other replica groups (joins the lighthouse; rank 0 of the group first checks that one
    answers within ``timeout_s``); a healing group pulls the LightningModule's and the optimizers' state."""
    link = ReplicaGroupLink(config, group_rank=strategy.global_rank, group_world_size=strategy.world_size)
    module = strategy.lightning_module
    assert module is not None

    def save() -> dict[str, Any]:
        return {"model": module.state_dict(), "optimizers": [o.state_dict() for o in strategy.optimizers]}

    def load(state: dict[str, Any]) -> None:
        module.load_state_dict(state["model"])
        for optimizer, saved in zip(strategy.optimizers, state["optimizers"]):
            optimizer.load_state_dict(saved)

    link.register_state("training", save, load)
    return link


class GradientAllReduce:
    """Averages the gradients of a strategy's model once per optimizer step.

    Args:
        config: the bucketing knobs (``bucketing``, ``bucket_cap_mb``, ...) and ``skip_nonfinite`` (then the
            synchronizer checks each averaged bucket for a NaN or Inf).
        new_compressor: builds the gradient compressor.
        fault_tolerance: averages the gradients across replica groups too (``None``: within the strategy's ranks).

    Attributes:
        synchronizer: the all-reduce (built in :meth:`setup`).
        link: the link to the other replica groups (with fault tolerance, built in :meth:`setup`).
    """

    def __init__(
        self,
        config: AllReduceConfig | PeriodicConfig,
        new_compressor: Callable[[], Compressor],
        fault_tolerance: FaultTolerance | None = None,
    ) -> None:
        self.config = config
        self.new_compressor = new_compressor
        self.fault_tolerance = fault_tolerance
        self.synchronizer: GradientSynchronizer | None = None
        self.link: ReplicaGroupLink | None = None
        self._synced = False
        self._ft_metrics: dict[str, float] = {}

    def setup(self, strategy: DDPStrategy, meter: CommMeter) -> None:
        """Builds the synchronizer over the strategy's model (each parameter with ``requires_grad`` in exactly one
        bucket) and, with fault tolerance, joins the other replica groups."""
        assert strategy.model is not None
        self.synchronizer = GradientSynchronizer(
            list(strategy.model.parameters()),
            compressor=self.new_compressor(),
            meter=meter,
            check_finite=self.config.skip_nonfinite,
            same_host_cpu=strategy.num_nodes == 1,
            **self.config.arguments_for(GradientSynchronizer),
        )
        if self.fault_tolerance is not None:
            self.link = replica_group_link(strategy, self.fault_tolerance)

    @property
    def compressor(self) -> Compressor | None:
        """The gradient compressor (``None`` before :meth:`setup`)."""
        return None if self.synchronizer is None else self.synchronizer.compressor

    def start_round(self) -> None:
        """Opens a sync round (before a backward); with ``bucketing="auto"``, says on rank 0 where buckets launch
        once the ranks decided."""
        if self.synchronizer is None:
            return
        tuner = self.synchronizer.tuner
        was_deciding = tuner is not None and tuner.deciding
        self.synchronizer.start_round()
        if was_deciding and tuner is not None and not tuner.deciding:
            times = ", ".join(f"{k.replace('_', ' ')} {v:.2f} ms" for k, v in tuner.medians_ms.items())
            point = self.synchronizer.launch_point.replace("_", " ")
            rank_zero_info(
                f"lightning_sync: bucketing=auto launches buckets {point} (median step, mean over ranks: {times})"
            )

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward inside only accumulates locally (non-final micro-batches)."""
        with nullcontext() if self.synchronizer is None else self.synchronizer.no_sync():
            yield

    def finish(self, params: list[nn.Parameter]) -> None:
        """Finishes the round (waits for its buckets, writes the averages to ``.grad``); with fault tolerance,
        averages ``params``' gradients across the replica groups too (or the step is not taken)."""
        self._synced = self.synchronizer is not None and self.synchronizer.finish()
        if self.link is not None:
            average_gradients_across(self.link, params)
            if self.synchronizer is not None:
                self.synchronizer.grads_finite = None  # check the averaged gradients themselves

    def take_finite_verdict(self) -> bool | None:
        """The synchronizer's verdict on this round's gradients, taken once (``None``: no fresh verdict)."""
        if self.synchronizer is None:
            return None
        verdict, self.synchronizer.grads_finite = self.synchronizer.grads_finite, None
        return verdict

    def end_step(self) -> bool:
        """After the optimizer step: advances the compressor's step count, once per round (a second optimizer on the
        same round adds none).

        Returns:
            Whether a round was finished since the last call.
        """
        synced, self._synced = self._synced, False
        if synced and self.synchronizer is not None:
            self.synchronizer.compressor.advance()
        if self.link is not None:
            self._ft_metrics = self.link.stats.metrics()
        return synced

    def pop_metrics(self) -> dict[str, float]:
        """``ft/*`` since the last call (with fault tolerance)."""
        metrics, self._ft_metrics = self._ft_metrics, {}
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The synchronizer's state (``bucketing="auto"``: its trials and decision, kept on resume)."""
        return {} if self.synchronizer is None else self.synchronizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.synchronizer is not None:
            self.synchronizer.load_state_dict(state)

    def close(self) -> None:
        """Removes the gradient hooks and leaves the other replica groups."""
        if self.synchronizer is not None:
            self.synchronizer.remove_hooks()
            self.synchronizer = None
        if self.link is not None:
            self.link.close()
            self.link = None
