"""What every lightning_sync strategy shares: config, launcher, meter, metrics, consistency checks, checkpoint state.

Each sync mode subclasses :class:`SyncStrategyBase`, which is a Lightning ``DDPStrategy`` and so inherits process
group setup, sampler injection, launchers and teardown. The algorithms live in :mod:`lightning_sync.comm`; this
class only connects them to the Lightning lifecycle. The Lightning internals it needs (the hooks that pick the
launcher and register DDP communication hooks, changes to the Trainer's loop limits) are reached through
:mod:`lightning_sync.strategies._lightning`, and nowhere else.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins import CheckpointIO, ClusterEnvironment, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sync.callbacks import SyncMetricsLogger
from lightning_sync.comm.compression import Compressor
from lightning_sync.comm.consistency import check_same_structure
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.nonfinite import NonFiniteStepWarning, drop_grads, grads_are_finite, skipped_step_message
from lightning_sync.config import StrategyConfig
from lightning_sync.errors import ConfigError
from lightning_sync.strategies._checkpoint import SyncStateCheckpointing
from lightning_sync.strategies._gc import freeze_startup_heap, release_startup_heap
from lightning_sync.strategies._launcher import configure_launcher
from lightning_sync.strategies._lightning import LightningDDPHooks, insert_callback_first
from lightning_sync.strategies._replicas import ReplicaChecking
from lightning_sync.strategies._torchelastic import join_restarted_torchelastic_group


class SyncStrategyBase(SyncStateCheckpointing, ReplicaChecking, LightningDDPHooks):
    """Base of the lightning_sync strategies.

    Args:
        config: the strategy's config dataclass (``config_class``); ``None`` for its defaults.
        accelerator: Lightning's own, as for ``DDPStrategy``; so are ``parallel_devices``, ``cluster_environment``,
            ``checkpoint_io``, ``precision_plugin`` and ``process_group_backend``.
        **knobs: fields of ``config_class``, overriding ``config``'s.

    Raises:
        ConfigError: an unknown knob or a bad value, named ``strategy.<knob>`` (raised here, in the launching
            process, before any rank starts).

    Attributes:
        config: the validated config.
        meter: the communication meter (made in :meth:`setup_environment`, once the process group exists).
    """

    config_class: ClassVar[type[StrategyConfig]] = StrategyConfig
    skips_nonfinite_steps: ClassVar[bool] = True
    """Whether ``skip_nonfinite`` applies to this mode (see :mod:`lightning_sync.comm.nonfinite`)."""
    strategy_name: ClassVar[str] = ""
    """The name registered with Lightning's ``StrategyRegistry`` (the first docstring line is its description)."""

    def __init__(
        self,
        config: StrategyConfig | None = None,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        **knobs: Any,
    ) -> None:
        try:
            self.config = self.config_class.with_knobs(config, knobs)
            self._check_algorithm_knobs()
        except ConfigError as error:
            raise error.under("strategy") from None
        super().__init__(
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend=process_group_backend, start_method=self.config.start_method,
            timeout=timedelta(seconds=self.config.timeout_s), **self._torch_ddp_kwargs(),
        )  # fmt: skip
        self.meter: CommMeter | None = None
        self._sync_steps = 0
        self._steps_unlogged = 0
        self.skipped_steps = 0
        """Optimizer steps skipped because the gradients held a NaN or Inf (``skip_nonfinite``)."""
        self._heap_frozen = False

    def _check_algorithm_knobs(self) -> None:
        """Checks the knobs that the mode's algorithms own, by building what can be built before launch."""

    def _torch_ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for torch's ``DistributedDataParallel`` (only the ``ddp`` mode wraps)."""
        return {}

    # ------------------------------------------------------------------ launch and setup
    @override
    def configure_launcher(self) -> None:
        """Lightning's launcher for the start method, Hydra-aware for ``popen`` (see ``_launcher``)."""
        configure_launcher(self, super().configure_launcher)

    @override
    def setup_distributed(self) -> None:
        """Joins the process group as Lightning does; after a torchrun restart, through a store of the attempt's
        own (see :func:`~lightning_sync.strategies._torchelastic.join_restarted_torchelastic_group`)."""
        self.set_world_ranks()
        join_restarted_torchelastic_group(self)
        super().setup_distributed()

    @override
    def setup_environment(self) -> None:
        """Joins the process group and makes the meter.

        With ``fork``, the child is first pinned to one OpenMP thread: a forked child deadlocks in libgomp when the
        parent had run a multi-threaded op.
        """
        if self.config.start_method == "fork":
            torch.set_num_threads(1)
        super().setup_environment()
        self.meter = CommMeter(timeout_s=self.config.timeout_s)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Sets up the model and optimizers, restores sync state from a checkpoint being resumed, and adds the
        :class:`~lightning_sync.callbacks.SyncMetricsLogger` callback (first, so that the other callbacks' batch-end
        hooks see this step's ``comm/*`` and ``sync/*``).

        Raises:
            ReplicaMismatchError: the ranks' models have different parameters or buffers (names, shapes, dtypes);
                checked first, as a collective on them would fail or hang.
        """
        if self.world_size > 1 and self.model is not None:
            check_same_structure([*self.model.named_parameters(), *self.model.named_buffers()])
        super().setup(trainer)
        if self._pending_sync_state is not None:
            self.load_sync_state_dict(self._pending_sync_state)
            self._pending_sync_state = None
        if not any(isinstance(cb, SyncMetricsLogger) for cb in trainer.callbacks):  # type: ignore[attr-defined]
            insert_callback_first(trainer, SyncMetricsLogger())  # other callbacks see this step's metrics

    @override
    def on_train_start(self) -> None:
        """Starts the per-step meter count at the first step (setup traffic is not a step's), and freezes the
        start-up heap if ``freeze_gc`` (see :mod:`~lightning_sync.strategies._gc`)."""
        super().on_train_start()
        self._start_counting_training_comm()
        if self.meter is not None:
            self.meter.step()
            self._steps_unlogged = 0
        if self.config.freeze_gc and not self._heap_frozen:
            freeze_startup_heap()
            self._heap_frozen = True

    @override
    def teardown(self) -> None:
        """Lightning's teardown, and the heap frozen at train start is returned to the garbage collector."""
        if self._heap_frozen:
            release_startup_heap()
            self._heap_frozen = False
        super().teardown()

    # ------------------------------------------------------------------ optimizer step
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Runs the step (on :meth:`_optimizer_to_step`, the closure wrapped by :meth:`_closure_with_sync`), then the
        mode's end-of-step work, and checks replicas if asked to."""
        stepping = self._optimizer_to_step(optimizer)
        output = super().optimizer_step(
            stepping, self._skipping_nonfinite(self._closure_with_sync(closure), optimizer), model, **kwargs
        )
        self._sync_steps += 1
        self._steps_unlogged += 1
        self.on_sync_step_end()
        every = self.config.check_consistency_every
        if every and self._sync_steps % every == 0:
            self.check_replicas()
        return output

    def _optimizer_to_step(self, optimizer: Optimizer) -> Any:
        """What Lightning's step calls ``step(closure)`` on: the optimizer, or a mode's stand-in for it."""
        return optimizer

    def _closure_with_sync(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The closure to step with (forward, backward); a mode that syncs gradients finishes the sync in it."""
        return closure

    def _skipping_nonfinite(self, closure: Callable[[], Any], optimizer: Optimizer) -> Callable[[], Any]:
        """``closure``, then, if the (synced) gradients hold a NaN or Inf, the step is skipped and counted (see
        :mod:`lightning_sync.comm.nonfinite`; with a GradScaler the scaler skips it)."""
        if not (self.config.skip_nonfinite and self.skips_nonfinite_steps):
            return closure

        def run() -> Any:
            output = closure()
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if not self._synced_grads_finite(params):
                self._count_skipped_step(alone=not self._syncs_gradients)
                if getattr(self.precision_plugin, "scaler", None) is None:
                    drop_grads(params)
                compressor = self._active_compressor()
                if compressor is not None:
                    compressor.forget_nonfinite()
            return output

        return run

    @property
    def _syncs_gradients(self) -> bool:
        """Whether the coming optimizer step all-reduces gradients (a mode with local steps says no for those)."""
        return True

    def _count_skipped_step(self, alone: bool) -> None:
        """Counts an optimizer step skipped for a NaN or Inf gradient and warns, naming the mode and the step: on
        rank 0 for a step every rank skipped together, on this rank for one it skipped ``alone``."""
        self.skipped_steps += 1
        mode = self.strategy_name.removeprefix("sync_")
        if getattr(self.config, "mode", None):
            mode += f" ({self.config.mode})"
        step = self.lightning_module.trainer.global_step
        if alone:
            warnings.warn(skipped_step_message(mode, step, self.global_rank), NonFiniteStepWarning, stacklevel=2)
        else:
            rank_zero_warn(skipped_step_message(mode, step), category=NonFiniteStepWarning)

    def _synced_grads_finite(self, params: list[nn.Parameter]) -> bool:
        """Whether the (synced) gradients of ``params`` hold no NaN or Inf; a mode whose sync already checked them
        answers from that."""
        return grads_are_finite(params)

    def on_sync_step_end(self) -> None:
        """Called after every optimizer step that the strategy took; subclasses advance their compressors here."""

    # ------------------------------------------------------------------ metrics
    def step_metrics(self, write: bool) -> dict[str, float]:
        """The metrics to log after a training batch (called by :class:`~lightning_sync.callbacks.SyncMetricsLogger`).

        Args:
            write: whether the logger writes this step. Only then are ``comm/*`` returned, as the mean per
                optimizer step since the last write (each logged key costs Lightning about a millisecond).
        """
        if not write or self.meter is None or self._steps_unlogged == 0:
            return {}
        steps, self._steps_unlogged = self._steps_unlogged, 0
        metrics = {key: value / steps for key, value in self.meter.step().as_metrics().items()}
        if self.config.skip_nonfinite and self.skips_nonfinite_steps:
            metrics["sync/skipped_steps"] = float(self.skipped_steps)
        return metrics

    # ------------------------------------------------------------------ checkpoint (see _checkpoint)
    def _active_compressor(self) -> Compressor | None:
        """The compressor whose memory belongs in checkpoints (``None``: none yet, or the mode has none)."""
        return None
