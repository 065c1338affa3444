"""The ``ddp`` sync mode: torch DistributedDataParallel, with comm hooks that also run on CPU/gloo."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins import CheckpointIO, ClusterEnvironment, Precision
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_sync.algorithms import build_parts
from lightning_sync.comm.compression import Compressor
from lightning_sync.comm.ddp_hook import DDPHookState, compressed_allreduce_hook
from lightning_sync.config import DDPConfig
from lightning_sync.strategies._base import SyncStrategyBase

# torch 2.13 renamed DDP's ``broadcast_buffers`` to ``forward_sync_buffers`` (and deprecated the old name).
_BUFFER_SYNC_ARG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)


class DDPSyncStrategy(SyncStrategyBase):
    """Lightning's DDP, with every bucket averaged by a lightning_sync compressor through the meter.

    Lightning registers ``ddp_comm_hook`` only on CUDA, so on CPU a hook is silently dropped. This strategy always
    registers its hook, on gloo as on NCCL. ``comm_hook="none"`` registers a plain metered all-reduce, so every mode
    reports bytes the same way.

    Example::

        >>> import lightning.pytorch as pl
        >>> trainer = pl.Trainer(strategy=DDPSyncStrategy(comm_hook="bf16"), accelerator="cpu", devices=2, logger=False)
        >>> pl.Trainer(strategy="sync_ddp", accelerator="cpu", devices=2, logger=False).strategy.config.comm_hook
        'none'
    """

    config_class = DDPConfig
    strategy_name = "sync_ddp"

    def __init__(
        self,
        *,
        comm_hook: str | Compressor = DDPConfig.comm_hook,
        bucket_cap_mb: float = DDPConfig.bucket_cap_mb,
        find_unused_parameters: bool = DDPConfig.find_unused_parameters,
        gradient_as_bucket_view: bool = DDPConfig.gradient_as_bucket_view,
        static_graph: bool = DDPConfig.static_graph,
        broadcast_buffers: bool = DDPConfig.broadcast_buffers,
        start_method: str = DDPConfig.start_method,
        timeout_s: float = DDPConfig.timeout_s,
        check_consistency_every: int = DDPConfig.check_consistency_every,
        on_mismatch: str = DDPConfig.on_mismatch,
        skip_nonfinite: bool = DDPConfig.skip_nonfinite,
        freeze_gc: bool = DDPConfig.freeze_gc,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(locals())
        self.hook_state: DDPHookState | None = None

    @override
    def _torch_ddp_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "bucket_cap_mb": cfg.bucket_cap_mb,
            "find_unused_parameters": cfg.find_unused_parameters,
            "gradient_as_bucket_view": cfg.gradient_as_bucket_view,
            "static_graph": cfg.static_graph,
            _BUFFER_SYNC_ARG: cfg.broadcast_buffers,
        }

    @override
    def _check_algorithm_knobs(self) -> None:
        self._new_compressor = build_parts(self.config).new_compressor

    @override
    def register_ddp_hooks(self) -> None:
        """Registers the metered compressor hook on the DDP model, whatever the device: every bucket DDP reduces goes
        through ``hook_state.compressor`` and is counted by the meter (``hook_state.calls``: the buckets)."""
        assert isinstance(self.model, DistributedDataParallel)
        assert self.meter is not None
        assert self._new_compressor is not None
        self.hook_state = DDPHookState(compressor=self._new_compressor(), meter=self.meter)
        self.model.register_comm_hook(self.hook_state, compressed_allreduce_hook)

    @override
    def on_sync_step_end(self) -> None:
        """Advances the compressor's step count (PowerSGD switches on at its ``start_iter``)."""
        if self.hook_state is not None:
            self.hook_state.compressor.advance()

    @override
    def _active_compressor(self) -> Compressor | None:
        return None if self.hook_state is None else self.hook_state.compressor
