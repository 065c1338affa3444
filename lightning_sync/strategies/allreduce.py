"""The ``allreduce`` sync mode: no DDP wrapper; gradients all-reduced by hand, bucketed and overlapped with backward."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_sync.algorithms import build_parts
from lightning_sync.comm.bucketing import GradientSynchronizer
from lightning_sync.comm.compression import Compressor
from lightning_sync.config import AllReduceConfig
from lightning_sync.strategies._base import SyncStrategyBase
from lightning_sync.strategies._fault_tolerance import (
    FaultTolerance,
    ReplicaGroupLink,
    as_fault_tolerance,
    average_gradients_across,
    replica_group_link,
    replica_group_shard,
    require_torchft,
)


class AllReduceStrategy(SyncStrategyBase):
    """Data parallel without torch DDP: the strategy averages gradients itself.

    At setup rank 0's parameters and buffers are broadcast, so ranks seeded differently still start identical.
    Gradients are averaged once per optimizer step, before gradient clipping and ``on_before_optimizer_step``; with
    ``bucketing="overlap"`` the communication runs during backward, and with ``"auto"`` (the default) during or
    right after backward, whichever the first sync rounds measure faster. Every launch point sends the same buckets,
    so the parameters come out bit for bit the same whichever it is. Non-final micro-batches of
    ``accumulate_grad_batches`` send nothing. Manual optimization, several optimizers and precision plugins work.

    Takes the fields of :class:`~lightning_sync.config.AllReduceConfig` and Lightning's own strategy arguments, as
    keyword arguments (``Args:`` below is filled in from the fields' help; see
    :class:`~lightning_sync.strategies._base.SyncStrategyBase`).
    """

    config_class = AllReduceConfig
    strategy_name = "sync_allreduce"
    synchronizer: GradientSynchronizer | None = None
    """The gradient all-reduce (built in :meth:`configure_ddp`)."""
    _synced = False

    def __init__(
        self,
        *,
        compression: str | Compressor = AllReduceConfig.compression,
        bucketing: str = AllReduceConfig.bucketing,
        bucket_cap_mb: float = AllReduceConfig.bucket_cap_mb,
        first_bucket_mb: float = AllReduceConfig.first_bucket_mb,
        find_unused_parameters: bool = AllReduceConfig.find_unused_parameters,
        gradient_as_bucket_view: bool = AllReduceConfig.gradient_as_bucket_view,
        broadcast_buffers: bool = AllReduceConfig.broadcast_buffers,
        fault_tolerance: Any = AllReduceConfig.fault_tolerance,
        start_method: str = AllReduceConfig.start_method,
        timeout_s: float = AllReduceConfig.timeout_s,
        check_consistency_every: int = AllReduceConfig.check_consistency_every,
        on_mismatch: str = AllReduceConfig.on_mismatch,
        skip_nonfinite: bool = AllReduceConfig.skip_nonfinite,
        freeze_gc: bool = AllReduceConfig.freeze_gc,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(locals())

    @override
    def _check_algorithm_knobs(self) -> None:
        self._parts = build_parts(self.config)
        self.fault_tolerance: FaultTolerance | None = as_fault_tolerance(self.config.fault_tolerance)
        if self.fault_tolerance is not None:
            require_torchft()
        self._gradient_link: ReplicaGroupLink | None = None
        self._ft_metrics: dict[str, float] = {}

    @property
    def _broadcasts_buffers(self) -> bool:
        """Whether rank 0's buffers are broadcast before every training step."""
        return self.config.broadcast_buffers

    @override
    def configure_ddp(self) -> None:
        """Keeps the module unwrapped: broadcasts rank 0's state and builds the gradient synchronizer.

        Guarantees: afterwards every rank holds rank 0's parameters and buffers, and each parameter with
        ``requires_grad`` belongs to exactly one bucket.
        """
        self._broadcast_rank0_state()
        self.synchronizer = self._build_synchronizer()
        if self.fault_tolerance is not None:
            self._gradient_link = replica_group_link(self, self.fault_tolerance)

    def _build_synchronizer(self) -> GradientSynchronizer:
        assert self.model is not None and self.meter is not None
        return GradientSynchronizer(
            list(self.model.parameters()),
            compressor=self._parts.new_compressor(),  # type: ignore[misc]  # set for every gradient-syncing mode
            meter=self.meter,
            check_finite=self.config.skip_nonfinite and self.skips_nonfinite_steps,
            same_host_cpu=self.num_nodes == 1,
            **self.config.arguments_for(GradientSynchronizer),
        )

    def _broadcast_rank0_state(self) -> None:
        """Every rank takes rank 0's parameters and buffers (ranks seeded differently start identical)."""
        assert self.model is not None
        self._broadcast_from_rank0([*self.model.parameters(), *self.model.buffers()])

    def _broadcast_from_rank0(self, tensors: Any) -> None:
        assert self.meter is not None
        with torch.no_grad():
            for tensor in tensors:
                self.meter.broadcast(tensor.data, src=0)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Opens a sync round before each backward that is not inside :meth:`block_backward_sync` (and whose step
        syncs gradients); with ``bucketing="auto"``, says on rank 0 where buckets launch once the ranks decided."""
        if self.synchronizer is None or not self._syncs_gradients:
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

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """Nothing: DDP's bookkeeping does not apply, and syncing happens once per optimizer step."""

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Non-final micro-batches of gradient accumulation: backward only accumulates locally."""
        if self.synchronizer is None:
            yield
            return
        with self.synchronizer.no_sync():
            yield

    @override
    def _closure_with_sync(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """Finishes the gradient sync right after the closure's backward, before clipping and the step.

        Guarantees: ``on_before_optimizer_step``, gradient clipping, the grad scaler's unscale and the optimizer all
        see the averaged gradients.
        """

        def _closure_then_sync() -> Any:
            result = closure()
            self._finish_sync()
            if self._gradient_link is not None:  # fault tolerance: across replica groups, or no step
                assert self.model is not None
                average_gradients_across(self._gradient_link, list(self.model.parameters()))
                if self.synchronizer is not None:
                    self.synchronizer.grads_finite = None  # check the averaged gradients themselves
            return result

        return _closure_then_sync

    @override
    def _synced_grads_finite(self, params: list[nn.Parameter]) -> bool:
        """The synchronizer's verdict on this round, taken once (it checked each bucket as it arrived); a step
        without a fresh verdict checks the gradients themselves."""
        verdict = None if self.synchronizer is None else self.synchronizer.grads_finite
        if verdict is None:
            return super()._synced_grads_finite(params)
        self.synchronizer.grads_finite = None  # type: ignore[union-attr]  # not None when verdict is not None
        return verdict

    def _finish_sync(self) -> None:
        self._synced = self.synchronizer is not None and self.synchronizer.finish()

    @override
    def on_sync_step_end(self) -> None:
        """Advances the compressor's step count, once per sync (a second optimizer on the same round adds none)."""
        if self._synced and self.synchronizer is not None:
            self.synchronizer.compressor.advance()
            self._synced = False
        if self._gradient_link is not None:
            self._ft_metrics = self._gradient_link.stats.metrics()

    @override
    def step_metrics(self, write: bool) -> dict[str, float]:
        """The base's metrics, plus ``ft/*`` with fault tolerance."""
        metrics = super().step_metrics(write)
        metrics.update(self._ft_metrics)
        self._ft_metrics = {}
        return metrics

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """With fault tolerance, this group's ranks read shard ``replica_group`` of ``num_replica_groups``."""
        return replica_group_shard(super().distributed_sampler_kwargs, self.fault_tolerance)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Broadcasts rank 0's buffers before the forward (as DDP's ``broadcast_buffers``), then runs the step."""
        if self._broadcasts_buffers and self.meter is not None and self.model is not None:
            self._broadcast_from_rank0(self.model.buffers())
        return super().training_step(*args, **kwargs)

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        """Adds the synchronizer's state (``bucketing="auto"``: its trials and decision) to the base state."""
        state = super().sync_state_dict()
        if self.synchronizer is not None:
            state["synchronizer"] = self.synchronizer.state_dict()
        return state

    @override
    def load_sync_state_dict(self, state: dict[str, Any]) -> None:
        """Restores the base state and the synchronizer's (a decided ``auto`` keeps its launch point, no re-tuning)."""
        super().load_sync_state_dict(state)
        if self.synchronizer is not None and "synchronizer" in state:
            self.synchronizer.load_state_dict(state["synchronizer"])

    @override
    def _active_compressor(self) -> Compressor | None:
        return None if self.synchronizer is None else self.synchronizer.compressor

    @override
    def teardown(self) -> None:
        """Removes the gradient hooks, then tears down as Lightning's DDP does."""
        if self.synchronizer is not None:
            self.synchronizer.remove_hooks()
            self.synchronizer = None
        if self._gradient_link is not None:
            self._gradient_link.close()
            self._gradient_link = None
        super().teardown()
