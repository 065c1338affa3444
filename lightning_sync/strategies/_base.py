"""What every lightning_sync strategy shares: config, launcher, meter, metrics, consistency checks, checkpoint state.

Each sync mode subclasses :class:`SyncStrategyBase`, which is a Lightning ``DDPStrategy`` and so inherits process
group setup, sampler injection, launchers and teardown. The algorithms live in :mod:`lightning_sync.comm`; this
class only connects them to the Lightning lifecycle. The Lightning internals it needs (the hooks that pick the
launcher and register DDP communication hooks, changes to the Trainer's loop limits) are reached through
:mod:`lightning_sync.strategies._lightning`, and nowhere else.
"""

from __future__ import annotations

import inspect
import textwrap
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import Self, override

from lightning_sync.comm.compression import Compressor
from lightning_sync.comm.consistency import check_same_structure
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.nonfinite import NonFiniteStepWarning, drop_grads, grads_are_finite, skipped_step_message
from lightning_sync.config import StrategyConfig, knob_docs
from lightning_sync.errors import ConfigError
from lightning_sync.strategies._checkpoint import SyncStateCheckpointing
from lightning_sync.strategies._collectives import NamedPeerCollectives
from lightning_sync.strategies._gc import freeze_startup_heap, release_startup_heap
from lightning_sync.strategies._launcher import configure_launcher
from lightning_sync.strategies._lightning import insert_callback_first
from lightning_sync.strategies._metrics import SyncMetricsLogger
from lightning_sync.strategies._replicas import ReplicaChecking
from lightning_sync.strategies._torchelastic import join_restarted_torchelastic_group

LIGHTNING_ARGUMENTS: dict[str, str] = {
    "accelerator": "Lightning's accelerator (``None``: the Trainer's).",
    "parallel_devices": "The devices of this node's ranks (``None``: the Trainer's).",
    "cluster_environment": "How the ranks find each other (``None``: the one the Trainer detects).",
    "checkpoint_io": "The plugin that writes and reads checkpoints (``None``: Lightning's).",
    "precision_plugin": "The precision plugin (``None``: the one of the Trainer's ``precision``).",
    "process_group_backend": "The torch.distributed backend (``None``: ``nccl`` on CUDA, else ``gloo``).",
}
"""Lightning's own strategy arguments, which every mode's constructor takes as ``DDPStrategy`` does, with their
documentation."""


def _args_section(strategy: type) -> str:
    """The Google-style ``Args:`` section of ``strategy``'s constructor: each parameter, in signature order, with its
    help (a field's of the strategy's ``config_class``, or a Lightning argument's; ``""`` for any other)."""
    docs = {**knob_docs(strategy.config_class), **LIGHTNING_ARGUMENTS}  # type: ignore[attr-defined]
    lines = ["Args:"]
    for name in list(inspect.signature(strategy.__init__).parameters)[1:]:  # type: ignore[misc]  # after self
        lines += textwrap.wrap(
            f"{name}: {docs.get(name, '')}", 116, initial_indent="    ", subsequent_indent="        ",
            break_long_words=False, break_on_hyphens=False,
        )  # fmt: skip
    return "\n".join(lines)


class SyncStrategyBase(SyncStateCheckpointing, ReplicaChecking, NamedPeerCollectives):
    """Base of the lightning_sync strategies.

    A mode's constructor lists the fields of its config dataclass (``config_class``) as keyword arguments, each
    defaulting to the field's default (``comm_hook: str = DDPConfig.comm_hook``), then Lightning's own strategy
    arguments (:data:`LIGHTNING_ARGUMENTS`), and passes them all on as its ``locals()``. So IDEs, type checkers and
    LightningCLI (``--trainer.strategy.sync_every=8``) see every knob, while the dataclass stays the one place that
    holds the defaults and validates them. The constructor's ``Args:`` documentation is filled in from the fields'
    help when the class is defined (:meth:`__init_subclass__`), so a knob is documented once, in
    :mod:`lightning_sync.config`. ``tests/test_config.py`` checks that every constructor's parameters are its
    config's fields plus Lightning's arguments, with the same defaults, each documented.

    Args:
        arguments: the mode's constructor arguments, by name: one per field of ``config_class`` and one per
            Lightning argument (other names, such as ``self``, are ignored).

    Raises:
        ConfigError: a bad value, named ``strategy.<knob>`` (raised here, in the launching process, before any rank
            starts).

    Attributes:
        config: the validated config.
        meter: the communication meter (made in :meth:`setup_environment`, once the process group exists).
    """

    config_class: ClassVar[type[StrategyConfig]] = StrategyConfig
    skips_nonfinite_steps: ClassVar[bool] = True
    """Whether ``skip_nonfinite`` applies to this mode (see :mod:`lightning_sync.comm.nonfinite`)."""
    strategy_name: ClassVar[str] = ""
    """The name registered with Lightning's ``StrategyRegistry`` (the first docstring line is its description)."""

    def __init__(self, arguments: Mapping[str, Any]) -> None:
        try:
            self.config = self.config_class.from_arguments(arguments)
            self._check_algorithm_knobs()
        except ConfigError as error:
            raise error.under("strategy") from None
        lightning = {name: arguments[name] for name in LIGHTNING_ARGUMENTS}
        super().__init__(
            **lightning, start_method=self.config.start_method, timeout=timedelta(seconds=self.config.timeout_s),
            **self._torch_ddp_kwargs(),
        )  # fmt: skip
        self.meter: CommMeter | None = None
        self._sync_steps = 0
        self._steps_unlogged = 0
        self.skipped_steps = 0
        """Optimizer steps skipped because the gradients held a NaN or Inf (``skip_nonfinite``)."""
        self._heap_frozen = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Appends the ``Args:`` of a mode that defines its constructor to its docstring (unless it has one): each
        field of its ``config_class`` with the field's help, then Lightning's arguments."""
        super().__init_subclass__(**kwargs)
        doc = inspect.cleandoc(cls.__doc__ or "")
        if "__init__" in vars(cls) and doc and "\nArgs:\n" not in doc:
            cls.__doc__ = doc + "\n\n" + _args_section(cls)

    @classmethod
    def from_config(cls, config: StrategyConfig, **lightning: Any) -> Self:
        """The strategy with ``config``'s knobs (a ``config_class`` instance) and Lightning's arguments ``lightning``."""
        return cls(**config.knobs(), **lightning)

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
        :class:`~lightning_sync.strategies._metrics.SyncMetricsLogger` callback (first, so that the other callbacks' batch-end
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
        """The metrics to log after a training batch (called by :class:`~lightning_sync.strategies._metrics.SyncMetricsLogger`).

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
