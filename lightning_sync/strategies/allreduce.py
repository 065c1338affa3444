"""The ``allreduce`` sync mode: no DDP wrapper; gradients all-reduced by hand, bucketed and overlapped with backward."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins import CheckpointIO, ClusterEnvironment, Precision
from typing_extensions import override

from lightning_sync.algorithms import build_parts
from lightning_sync.comm.compression import Compressor
from lightning_sync.config import AllReduceConfig
from lightning_sync.strategies._base import SyncStrategyBase
from lightning_sync.strategies._gradients import GradientAllReduce


class AllReduceStrategy(SyncStrategyBase):
    """Data parallel without torch DDP: the strategy averages gradients itself.

    Rank 0's parameters and buffers are broadcast at setup. Gradients are averaged once per optimizer step, before
    clipping and ``on_before_optimizer_step``, in buckets launched during or right after backward (``bucketing``;
    every launch point gives the same bits). Non-final micro-batches of ``accumulate_grad_batches`` send nothing.
    Manual optimization, several optimizers and precision plugins work.

    Example::

        >>> import lightning.pytorch as pl
        >>> from lightning_sync import TopKCompression
        >>> strategy = AllReduceStrategy(compression=TopKCompression(density=0.05), bucket_cap_mb=4)
        >>> trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
        >>> trainer.world_size
        2
    """

    config_class = AllReduceConfig
    strategy_name = "sync_allreduce"

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
        """Builds the gradient path (its compressor checks its knobs); with fault tolerance, checks for torchft."""
        cfg = self.config
        new_compressor = build_parts(cfg).new_compressor
        assert new_compressor is not None  # set for every gradient-syncing mode
        self.gradients = GradientAllReduce(cfg, new_compressor, self.fault_tolerance)

    @override
    def configure_ddp(self) -> None:
        """Keeps the module unwrapped (see :meth:`~lightning_sync.strategies._base.SyncStrategyBase._setup_gradients`)."""
        self._setup_gradients()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Broadcasts rank 0's buffers before the forward (as DDP's ``broadcast_buffers``), then runs the step."""
        if self.config.broadcast_buffers and self.meter is not None and self.model is not None:
            self._broadcast_from_rank0(self.model.buffers())
        return super().training_step(*args, **kwargs)
