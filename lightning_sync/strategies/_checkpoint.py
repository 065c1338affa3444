"""Checkpoints that resume a lightning_sync run exactly: every rank's sync state, checked on load.

Lightning writes rank 0's view of the run (model, optimizer state, loops). This mixin adds, under the key
``"lightning_sync"``, the strategy's name and every rank's own :meth:`~SyncStateCheckpointing.sync_state_dict`,
gathered to rank 0: step counters, compressor memory (error-feedback residuals, PowerSGD factors), the mode's own
state, the communication totals, and, where the mode lets the replicas differ between syncs (local SGD, DiLoCo),
each rank's own model and optimizer state, which Lightning alone would replace on every rank by rank 0's.

On load it refuses, with a :class:`~lightning_sync.errors.CheckpointError` that names both sides, a file it cannot
read, a checkpoint without lightning_sync state, and one from another strategy or another number of ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch.distributed as dist
from typing_extensions import override

from lightning_sync.comm.meter import CommStats
from lightning_sync.errors import CheckpointError

if TYPE_CHECKING:  # the host class is a Lightning DDPStrategy: its attributes and the hooks this mixin overrides
    from lightning.pytorch.strategies import DDPStrategy as _Host

    from lightning_sync.comm.compression import Compressor
else:
    _Host = object

_CHECKPOINT_KEY = "lightning_sync"
_WEIGHTS_ONLY_HINT = (
    "to start a new run from its weights only, load them into the module (e.g. Module.load_from_checkpoint) and fit "
    "without ckpt_path"
)


class SyncStateCheckpointing(_Host):
    """Mixin of :class:`~lightning_sync.strategies._base.SyncStrategyBase`: saves and restores every rank's sync
    state with Lightning's checkpoints."""

    strategy_name: ClassVar[str]
    if TYPE_CHECKING:

        def _active_compressor(self) -> Compressor | None: ...

    _pending_sync_state: dict[str, Any] | None = None
    _pending_optimizer_states: list[dict[str, Any]] | None = None
    _comm_resumed: CommStats = CommStats()
    _comm_before_training: CommStats | None = None

    @property
    def keeps_replicas_identical(self) -> bool:
        """Whether every rank's model and optimizer state are the same after each step (then Lightning's copy of
        rank 0's is all a resume needs)."""
        return True

    @property
    def comm_totals(self) -> CommStats:
        """This training's communication so far, summed over the runs it was resumed through (each run's setup
        traffic, the broadcast of rank 0's model, is not counted)."""
        meter = getattr(self, "meter", None)
        if meter is None or self._comm_before_training is None:
            return self._comm_resumed
        return self._comm_resumed + (meter.total - self._comm_before_training)

    def _start_counting_training_comm(self) -> None:
        meter = getattr(self, "meter", None)
        self._comm_before_training = meter.total if meter is not None else None

    def sync_state_dict(self) -> dict[str, Any]:
        """This rank's sync state: counters, compressor memory, communication totals and (when replicas may differ)
        its own model and optimizer state; modes add their own."""
        state: dict[str, Any] = {
            "sync_steps": self._sync_steps,
            "skipped_steps": self.skipped_steps,
            "comm": vars(self.comm_totals).copy(),
        }
        compressor = self._active_compressor()
        if compressor is not None:
            state["compressor"] = compressor.state_dict()
        if not self.keeps_replicas_identical:
            assert self.lightning_module is not None
            state["module_state"] = self.lightning_module.state_dict()
            state["optimizer_states"] = [opt.state_dict() for opt in self.optimizers]
        return state

    def load_sync_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`sync_state_dict` returned on this rank, once the strategy is set up (the optimizer
        states come later, in :meth:`load_optimizer_state_dict`, after Lightning's own)."""
        self._sync_steps = int(state["sync_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if "module_state" in state:
            assert self.lightning_module is not None
            self.lightning_module.load_state_dict(state["module_state"])
        self._comm_resumed = CommStats(**state.get("comm", {}))
        compressor = self._active_compressor()
        if compressor is not None and "compressor" in state:
            compressor.load_state_dict(state["compressor"])

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Adds every rank's sync state to the checkpoint (gathered to rank 0, which writes the file)."""
        checkpoint[_CHECKPOINT_KEY] = {"strategy": self.strategy_name, "ranks": self._gather_sync_states()}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _gather_sync_states(self) -> list[Any]:
        """Every rank's :meth:`sync_state_dict`, in rank order (one all-gather)."""
        state = self.sync_state_dict()
        if not (dist.is_available() and dist.is_initialized()):
            return [state]
        states: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(states, state)
        return states

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads the checkpoint and keeps this rank's sync state to restore once the strategy is set up.

        Raises:
            CheckpointError: the file is missing or unreadable, has no lightning_sync state, or was saved by another
                strategy or another number of ranks.
        """
        path = Path(checkpoint_path)
        if not path.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} does not exist (or is not a file)")
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=False)
        except Exception as error:  # torch.load raises many types for a truncated or foreign file
            raise CheckpointError(
                f"checkpoint {str(path)!r} cannot be read ({type(error).__name__}: {error}); the file is truncated, "
                "corrupt or not a PyTorch checkpoint"
            ) from error
        if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
            raise CheckpointError(f"checkpoint {str(path)!r} is not a Lightning checkpoint (no 'state_dict')")
        ranks = self._this_runs_sync_states(checkpoint, path)
        self._pending_sync_state = ranks[self.global_rank]
        self._pending_optimizer_states = self._pending_sync_state.get("optimizer_states")
        return checkpoint

    def _this_runs_sync_states(self, checkpoint: Mapping[str, Any], path: Path) -> list[dict[str, Any]]:
        saved = checkpoint.get(_CHECKPOINT_KEY)
        if saved is None:
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no lightning_sync state (it was saved by another strategy, e.g. "
                f"Lightning's own), so this {self.strategy_name!r} run cannot resume from it; {_WEIGHTS_ONLY_HINT}"
            )
        if saved.get("strategy") != self.strategy_name:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was saved by strategy {saved.get('strategy')!r}, this run uses "
                f"{self.strategy_name!r}; resume with the same strategy, or {_WEIGHTS_ONLY_HINT}"
            )
        ranks = saved["ranks"]
        if len(ranks) != self.world_size:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was saved by {len(ranks)} ranks, this run has {self.world_size}; resume "
                f"with the same number of ranks, or {_WEIGHTS_ONLY_HINT}"
            )
        return ranks

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning's restore (rank 0's optimizer state on every rank), then, where the mode lets ranks' states
        differ, this rank's own state from the checkpoint."""
        super().load_optimizer_state_dict(checkpoint)
        if self._pending_optimizer_states is not None:
            for optimizer, state in zip(self.optimizers, self._pending_optimizer_states):
                optimizer.load_state_dict(state)  # moves the state to each parameter's device
            self._pending_optimizer_states = None
