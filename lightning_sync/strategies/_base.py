"""What every lightning_sync strategy shares: config, launcher, meter logging, consistency checks, checkpoint state.

Each sync mode subclasses :class:`SyncStrategyBase`, which is a Lightning ``DDPStrategy`` and so inherits process
group setup, sampler injection, launchers and teardown. The algorithms live in :mod:`lightning_sync.comm`; this
class only connects them to the Lightning lifecycle.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, ClassVar, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_sync.comm.compression import Compressor
from lightning_sync.comm.consistency import ReplicaMismatchError, replica_fingerprint_spread
from lightning_sync.comm.meter import CommMeter
from lightning_sync.config import _StrategyConfig
from lightning_sync.strategies._launcher import HydraJobSubprocessLauncher

# Constructor arguments of Lightning's DDPStrategy that our strategies pass through untouched.
_LIGHTNING_ARGS = (
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "process_group_backend",
)
_CHECKPOINT_KEY = "lightning_sync"


class SyncStrategyBase(DDPStrategy):
    """Base of the lightning_sync strategies.

    Args:
        **kwargs: the knobs of the strategy's config dataclass (``config_class``), plus Lightning's own
            ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``
            and ``process_group_backend``. Anything else is a :class:`~lightning_sync.config.ConfigError`.

    Attributes:
        config: the validated config.
        meter: the communication meter (made in :meth:`setup_environment`, once the process group exists).
    """

    config_class: ClassVar[type[_StrategyConfig]] = _StrategyConfig
    strategy_name: ClassVar[str] = "sync"

    def __init__(self, **kwargs: Any) -> None:
        config, lightning_args = self.config_class.split_kwargs(kwargs, passthrough=_LIGHTNING_ARGS)
        super().__init__(
            start_method=config.start_method,
            timeout=timedelta(seconds=config.timeout_s),
            **lightning_args,
            **self._ddp_kwargs(config),
        )
        self.config = config
        self.meter: Optional[CommMeter] = None
        self._sync_steps = 0
        self._comm_steps_unlogged = 0
        self._pending_sync_state: Optional[dict[str, Any]] = None

    def _ddp_kwargs(self, config: Any) -> dict[str, Any]:
        """Keyword arguments for torch's ``DistributedDataParallel`` (only the ``ddp`` mode wraps)."""
        return {}

    # ------------------------------------------------------------------ launch and setup
    @override
    def _configure_launcher(self) -> None:
        """Uses a Hydra-aware ``popen`` launcher; other start methods are Lightning's."""
        if self._start_method == "popen":
            assert self.cluster_environment is not None
            self._launcher = HydraJobSubprocessLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        """Joins the process group and makes the meter.

        With ``fork``, the child is first pinned to one OpenMP thread: a forked child deadlocks in libgomp when the
        parent had run a multi-threaded op.
        """
        if self._start_method == "fork":
            torch.set_num_threads(1)
        super().setup_environment()
        self.meter = CommMeter()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Sets up the model and optimizers, then restores sync state from a checkpoint being resumed, if any."""
        super().setup(trainer)
        if self._pending_sync_state is not None:
            self.load_sync_state_dict(self._pending_sync_state)
            self._pending_sync_state = None

    @override
    def on_train_start(self) -> None:
        """Starts the per-step meter count at the first step (setup traffic is not a step's)."""
        super().on_train_start()
        if self.meter is not None:
            self.meter.step()
            self._comm_steps_unlogged = 0

    # ------------------------------------------------------------------ optimizer step
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        """Runs the step, then books and logs the step's communication and checks replicas if asked to."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._end_sync_step()
        return output

    def _end_sync_step(self) -> None:
        self._sync_steps += 1
        self.on_sync_step_end()
        every = self.config.check_consistency_every
        if every and self._sync_steps % every == 0:
            self.check_replicas()
        self._log_comm()

    def on_sync_step_end(self) -> None:
        """Called after every optimizer step that the strategy took; subclasses advance their compressors here."""

    def _log_comm(self) -> None:
        """Logs ``comm/*`` as the mean per optimizer step since the last time the logger wrote.

        Lightning writes on-step metrics only every ``log_every_n_steps`` steps, and each ``self.log`` call costs
        about a millisecond per key, so the strategy logs only on the steps that will be written (every step with
        ``log_every_n_steps=1``). The meter itself counts every step either way.
        """
        if self.meter is None:
            return
        self._comm_steps_unlogged += 1
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is None or module._current_fx_name is None:
            return
        connector = getattr(trainer, "_logger_connector", None)
        if connector is not None and not connector.should_update_logs:
            return
        stats = self.meter.step()
        steps, self._comm_steps_unlogged = self._comm_steps_unlogged, 0
        metrics = {k: v / steps for k, v in stats.as_metrics().items()}
        module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)

    # ------------------------------------------------------------------ replica consistency
    def check_replicas(self, atol: float = 0.0) -> float:
        """Checks that every rank holds the same parameters and buffers.

        Returns:
            The spread of the replicas' fingerprints (0.0 when they are bitwise identical).

        Raises:
            ReplicaMismatchError: when the spread exceeds ``atol``.
        """
        module = self.lightning_module
        assert module is not None
        tensors = [t for t in module.state_dict().values() if torch.is_tensor(t) and t.is_floating_point()]
        spread = replica_fingerprint_spread(tensors)
        if spread > atol:
            raise ReplicaMismatchError(
                f"replicas differ after {self._sync_steps} sync steps: fingerprint spread {spread:.3e} > {atol}"
            )
        return spread

    # ------------------------------------------------------------------ checkpoint
    def _active_compressor(self) -> Optional[Compressor]:
        """The compressor whose memory belongs in checkpoints (``None``: none yet, or the mode has none)."""
        return None

    def sync_state_dict(self) -> dict[str, Any]:
        """This rank's sync state (counters, compressor memory; subclasses add e.g. outer optimizers)."""
        state: dict[str, Any] = {"sync_steps": self._sync_steps}
        compressor = self._active_compressor()
        if compressor is not None:
            state["compressor"] = compressor.state_dict()
        return state

    def load_sync_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`sync_state_dict` returned on this rank."""
        self._sync_steps = int(state["sync_steps"])
        compressor = self._active_compressor()
        if compressor is not None and "compressor" in state:
            compressor.load_state_dict(state["compressor"])

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None
    ) -> None:
        """Adds every rank's sync state to the checkpoint (gathered to rank 0, which writes the file)."""
        state = self.sync_state_dict()
        if dist.is_available() and dist.is_initialized():
            states: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(states, state)
        else:
            states = [state]
        checkpoint[_CHECKPOINT_KEY] = {"strategy": self.strategy_name, "ranks": states}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Loads the checkpoint and keeps this rank's sync state to restore once the strategy is set up."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=False)
        saved = checkpoint.get(_CHECKPOINT_KEY)
        if saved is not None and saved.get("strategy") == self.strategy_name:
            ranks = saved["ranks"]
            if len(ranks) != self.world_size:
                raise ValueError(
                    f"checkpoint has sync state for {len(ranks)} ranks, this run has {self.world_size}; "
                    "resume with the same number of ranks"
                )
            self._pending_sync_state = ranks[self.global_rank]
        return checkpoint
