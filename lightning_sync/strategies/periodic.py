"""The ``periodic`` sync mode: communicate every N steps instead of every step."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from lightning_sync.algorithms import build_parts
from lightning_sync.comm.averaging import OptimizerCallable, average_buffers
from lightning_sync.comm.compression import Compressor
from lightning_sync.comm.consistency import named_replicated_state
from lightning_sync.comm.fragments import explicit_fragments, normalize_fragment_modules
from lightning_sync.comm.module_policy import validate_module_policy
from lightning_sync.comm.periodic import PeriodicAverager
from lightning_sync.config import PeriodicConfig
from lightning_sync.errors import CheckpointError, ConfigError
from lightning_sync.strategies._base import SyncStrategyBase
from lightning_sync.strategies._gradients import GradientAllReduce, replica_group_link
from lightning_sync.strategies._lightning import set_accumulate_grad_batches


class PeriodicSyncStrategy(SyncStrategyBase):
    """Data parallel that communicates every ``sync_every`` steps, in one of three ``mode`` s.

    ``gradient`` is ``allreduce``'s gradient path with the Trainer's ``accumulate_grad_batches`` multiplied by
    ``sync_every`` during ``fit``: Lightning DDP with that accumulation (same loss scaling, steps, schedulers) at
    ``1/sync_every`` of its bytes; buffers are averaged at each sync instead of broadcast at each forward.

    ``local_sgd`` and ``diloco`` step every rank alone; a Lightning-free
    :class:`~lightning_sync.comm.periodic.PeriodicAverager` owns the schedule (period, ``warmup_steps``, per-module
    and adaptive periods, streaming DiLoCo's fragments) and the averaging (plain average, or DiLoCo's outer
    optimizer). The end of ``fit`` syncs every group with unsynced steps, so the model returned is the common one.

    Logged: ``sync/period`` (first step, on change, at every sync), ``sync/divergence`` (this rank's distance from
    the average, at every sync) and ``sync/skipped_outer_steps`` (outer steps skipped for a non-finite
    pseudo-gradient).

    Example::

        >>> import functools
        >>> import lightning.pytorch as pl
        >>> import torch
        >>> outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)  # DiLoCo's outer step
        >>> strategy = PeriodicSyncStrategy(mode="diloco", sync_every=16, outer_optimizer=outer)
        >>> trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
        >>> pl.Trainer(strategy="sync_periodic", accelerator="cpu", devices=2, logger=False).strategy.period
        8
    """

    config_class = PeriodicConfig
    strategy_name = "sync_periodic"

    def __init__(
        self,
        *,
        mode: str = PeriodicConfig.mode,
        sync_every: int | str = PeriodicConfig.sync_every,
        warmup_steps: int = PeriodicConfig.warmup_steps,
        average_optimizer_state: bool = PeriodicConfig.average_optimizer_state,
        outer_optimizer: OptimizerCallable | None = PeriodicConfig.outer_optimizer,
        target_comm_fraction: float = PeriodicConfig.target_comm_fraction,
        min_sync_every: int = PeriodicConfig.min_sync_every,
        max_sync_every: int = PeriodicConfig.max_sync_every,
        module_sync_every: dict[str, int] | list[Any] | None = PeriodicConfig.module_sync_every,
        fragments: int = PeriodicConfig.fragments,
        fragment_modules: list[Any] | None = PeriodicConfig.fragment_modules,
        sync_delay: int = PeriodicConfig.sync_delay,
        fragment_alpha: float = PeriodicConfig.fragment_alpha,
        outer_compression: str | Compressor = PeriodicConfig.outer_compression,
        fault_tolerance: Any = PeriodicConfig.fault_tolerance,
        compression: str | Compressor = PeriodicConfig.compression,
        bucketing: str = PeriodicConfig.bucketing,
        bucket_cap_mb: float = PeriodicConfig.bucket_cap_mb,
        first_bucket_mb: float = PeriodicConfig.first_bucket_mb,
        find_unused_parameters: bool = PeriodicConfig.find_unused_parameters,
        gradient_as_bucket_view: bool = PeriodicConfig.gradient_as_bucket_view,
        start_method: str = PeriodicConfig.start_method,
        timeout_s: float = PeriodicConfig.timeout_s,
        check_consistency_every: int = PeriodicConfig.check_consistency_every,
        on_mismatch: str = PeriodicConfig.on_mismatch,
        skip_nonfinite: bool = PeriodicConfig.skip_nonfinite,
        freeze_gc: bool = PeriodicConfig.freeze_gc,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
    ) -> None:
        super().__init__(locals())
        self._accumulating: tuple[pl.Trainer, int] | None = None
        self._logged_period: int | None = None
        self._logged_skips = 0
        self._sync_metrics: dict[str, float] = {}
        self._quorums = 0

    @override
    def _check_algorithm_knobs(self) -> None:
        """Checks the bucketing and compression knobs, and builds the averager (``local_sgd``/``diloco``), whose
        constructor checks the schedule, and the gradient path (``gradient`` mode, the averager's warmup)."""
        self._parts = build_parts(self.config)
        self.averager: PeriodicAverager | None = self._parts.averager
        if self.averager is None or self.averager.warmup_steps > 0:
            assert self._parts.new_compressor is not None  # set for every gradient-syncing mode
            self.gradients = GradientAllReduce(self.config, self._parts.new_compressor)

    @property
    @override
    def _syncs_gradients(self) -> bool:
        """``gradient`` mode, and the averager's warmup steps, all-reduce gradients; local steps do not."""
        return self.averager is None or self.averager.in_warmup

    @property
    def period(self) -> int:
        """The current period of the default group (micro-batches per sync in ``gradient`` mode)."""
        return int(self.config.sync_every) if self.averager is None else self.averager.period

    @property
    def last_divergence(self) -> float | None:
        """This rank's divergence from the average at the last step's sync (``None``: no sync then)."""
        return None if self.averager is None else self.averager.last_divergence

    def validate_model(self, model: nn.Module) -> dict[str, int]:
        """Checks ``module_sync_every`` and ``fragment_modules`` against ``model`` (e.g. in the launching process,
        before ranks start).

        Returns:
            ``{parameter name: period}`` for the parameters a pattern matches.

        Raises:
            ConfigError: a pattern matching no parameter, or a parameter matched by two patterns (or, for
                ``fragment_modules``, in no fragment).
        """
        periods = validate_module_policy(model, self.config.module_sync_every, "strategy.module_sync_every")
        patterns = normalize_fragment_modules(self.config.fragment_modules, "strategy.fragment_modules")
        if patterns is not None:
            names = [name for name, p in model.named_parameters() if p.requires_grad]
            explicit_fragments(names, patterns, "strategy.fragment_modules")
        return periods

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """In ``gradient`` mode, multiplies the Trainer's ``accumulate_grad_batches`` by ``sync_every`` (for fit)."""
        if self.averager is None and self.config.sync_every > 1 and trainer.state.fn == TrainerFn.FITTING:
            self._multiply_accumulation(trainer)
        super().setup(trainer)

    def _multiply_accumulation(self, trainer: pl.Trainer) -> None:
        module = trainer.lightning_module
        if module is not None and not module.automatic_optimization:
            raise ConfigError(
                f"strategy.sync_every={self.config.sync_every} is not allowed with mode='gradient' and manual "
                "optimization (Lightning does not accumulate there); accumulate in training_step yourself, use "
                "sync_every=1, or mode local_sgd or diloco"
            )
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):  # type: ignore[attr-defined]
            raise ConfigError(
                "strategy.mode='gradient' is not allowed with a GradientAccumulationScheduler callback; set the "
                "period with strategy.sync_every (effective period = accumulate_grad_batches * sync_every)"
            )
        if self._accumulating is None:
            self._accumulating = (trainer, int(trainer.accumulate_grad_batches))
            set_accumulate_grad_batches(trainer, self._accumulating[1] * int(self.config.sync_every))

    @override
    def configure_ddp(self) -> None:
        """Broadcasts rank 0's state, builds the gradient synchronizer (``gradient`` mode, warmup) and sets up the
        averager's groups (a bad ``module_sync_every`` pattern raises ``ConfigError``, as :meth:`validate_model`)."""
        self._setup_gradients()
        assert self.model is not None and self.meter is not None
        if self._parts.fault_tolerant_averager is not None:
            assert self.fault_tolerance is not None
            self._parts.fault_tolerant_averager.connect(replica_group_link(self, self.fault_tolerance))
        if self.averager is not None:
            try:
                self.averager.setup(self.model.named_parameters(), self.model.named_buffers(), self.meter)
            except ConfigError as error:
                raise error.under("strategy") from None

    # ------------------------------------------------------------------ per-step hooks
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Starts timing the compute of the current optimizer step (for ``sync_every: auto``)."""
        super().on_train_batch_start(batch, batch_idx)
        if self.averager is not None:
            self.averager.start_step()

    @override
    def on_sync_step_end(self) -> None:
        """After every optimizer step: the averager's work, or (``gradient`` mode) the buffers after a sync."""
        grad_synced = self.gradients is not None and self.gradients.end_step()
        if self.averager is not None:
            self.averager.step(self.optimizers)
        elif grad_synced:
            assert self.model is not None and self.meter is not None
            average_buffers(list(self.model.buffers()), self.meter)
        period, divergence = self.period, self.last_divergence
        if period != self._logged_period or divergence is not None:
            self._sync_metrics["sync/period"] = float(period)
            self._logged_period = period
        if divergence is not None:
            self._sync_metrics["sync/divergence"] = divergence
        fault_tolerant = self._parts.fault_tolerant_averager
        if fault_tolerant is not None:
            # a group that healed took a live group's step count, ahead of its own loop: all end at the same sync
            trainer = self.lightning_module.trainer
            if trainer.max_steps is not None and 0 <= trainer.max_steps <= fault_tolerant.steps:
                trainer.should_stop = True
            if fault_tolerant.link.stats.quorums != self._quorums:
                self._quorums = fault_tolerant.link.stats.quorums
                self._sync_metrics.update(fault_tolerant.link.stats.metrics())
        skips = 0 if self.averager is None else self.averager.skipped_outer_steps
        if skips != self._logged_skips:
            self._sync_metrics["sync/skipped_outer_steps"] = float(skips)
            self._logged_skips = skips

    @override
    def step_metrics(self, write: bool) -> dict[str, float]:
        """``comm/*`` as the base logs them, plus ``sync/period`` and ``sync/divergence`` of the steps since."""
        metrics = super().step_metrics(write)
        metrics.update(self._sync_metrics)
        self._sync_metrics = {}
        return metrics

    @override
    def on_train_end(self) -> None:
        """Syncs every group that has unsynced local steps, so all ranks end with the common model."""
        super().on_train_end()
        if self.averager is not None:
            self.averager.finish(self.optimizers)

    @override
    def tensors_to_check(self) -> dict[str, torch.Tensor]:
        """Everything after a gradient-synced step, optimizer state included; after a local step only the groups
        (fragments) just synced, if any: their global copy, and their parameters unless ``fragment_alpha`` mixed
        them (with their optimizer state if ``average_optimizer_state``)."""
        if self.averager is None:
            return super().tensors_to_check()
        synced = self.averager.synced_tensors(self.optimizers)
        named = named_replicated_state(self.lightning_module, self.optimizers, only=synced)
        named.update(self.averager.synced_global_copies())
        return named

    # ------------------------------------------------------------------ checkpoint
    @property
    @override
    def keeps_replicas_identical(self) -> bool:
        """Only in ``gradient`` mode: local steps leave each rank its own model and optimizer state (saved per
        rank)."""
        return self.averager is None

    @override
    def sync_state_dict(self) -> dict[str, Any]:
        """Adds the mode and the averager's state (steps, global copies, outer optimizers, adaptive period)."""
        state = super().sync_state_dict()
        state["mode"] = self.config.mode
        if self.averager is not None:
            state["averager"] = self.averager.state_dict()
        return state

    @override
    def load_sync_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`sync_state_dict` saved (the groups must have the same labels and sizes)."""
        if state.get("mode", self.config.mode) != self.config.mode:
            raise CheckpointError(
                f"checkpoint was saved with strategy.mode={state['mode']!r}, this run uses {self.config.mode!r}"
            )
        super().load_sync_state_dict(state)
        if self.averager is not None and "averager" in state:
            self.averager.load_state_dict(state["averager"])

    @override
    def teardown(self) -> None:
        """Restores the Trainer's ``accumulate_grad_batches`` (``gradient`` mode), stops the outer-sync worker, then
        tears down as usual."""
        if self.averager is not None:
            self.averager.close()
        if self._accumulating is not None:
            trainer, accumulate = self._accumulating
            set_accumulate_grad_batches(trainer, accumulate)
            self._accumulating = None
        super().teardown()
