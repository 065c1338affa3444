"""Checkpoints that resume a lightning_sync run exactly: every rank's sync state, checked on load.

A checkpoint is one file per rank next to Lightning's:

* ``<checkpoint>``, written by rank 0 through Lightning (model, optimizer state, loops), with, under the key
  ``"lightning_sync"``, the strategy's name and the number of ranks;
* ``<checkpoint>.rank<r>.pt`` (:func:`sync_state_path`), written by rank ``r`` itself through the strategy's
  ``CheckpointIO``: its own :meth:`~SyncStateCheckpointing.sync_state_dict`, that is step counters, compressor
  memory (error-feedback residuals, PowerSGD factors), the mode's own state, the communication totals, and, where
  the mode lets the replicas differ between syncs (local SGD, DiLoCo), its own model and optimizer state, which
  Lightning alone would replace on every rank by rank 0's.

No rank receives another rank's state, on save or on load. The per-rank files hold tensors and plain values only, so
they are read with ``weights_only=True`` (unless the caller asks for ``weights_only=False``).

On load it refuses, with a :class:`~lightning_sync.errors.CheckpointError` that names both sides, a file it cannot
read, a checkpoint without lightning_sync state, one from another strategy or another number of ranks, and a
missing per-rank file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

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


def sync_state_path(checkpoint_path: str | Path, rank: int) -> Path:
    """The file holding rank ``rank``'s sync state, next to the checkpoint ``checkpoint_path`` (a symlink, as
    ``ModelCheckpoint(save_last="link")`` writes for ``last.ckpt``, is followed to the file it names)."""
    path = Path(checkpoint_path)
    if path.is_symlink():
        path = path.resolve()
    return path.with_name(f"{path.name}.rank{rank}.pt")


def _read(path: Path, load: Any) -> Any:
    try:
        return load()
    except Exception as error:  # torch.load raises many types for a truncated or foreign file
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({type(error).__name__}: {error}); the file is truncated, "
            "corrupt or not a PyTorch checkpoint"
        ) from error


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
        """Rank 0 writes Lightning's checkpoint, marked with the strategy and the number of ranks; every rank writes
        its own sync state next to it (:func:`sync_state_path`). Called on every rank (Lightning's
        ``Trainer.save_checkpoint`` waits at a barrier afterwards); no rank sends its state to another."""
        ranks = self.num_nodes * self.num_processes  # not world_size, which a detached fit (ps) reports as 1
        checkpoint[_CHECKPOINT_KEY] = {"strategy": self.strategy_name, "world_size": ranks}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        self.checkpoint_io.save_checkpoint(self.sync_state_dict(), sync_state_path(filepath, self.global_rank))

    @override
    def remove_checkpoint(self, filepath: str | Path) -> None:
        """Rank 0 removes Lightning's file, every rank its own sync-state file (``ModelCheckpoint`` calls this on
        every rank)."""
        super().remove_checkpoint(filepath)
        self.checkpoint_io.remove_checkpoint(sync_state_path(filepath, self.global_rank))

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """Loads the checkpoint (Lightning's file, as ``weights_only`` says) and this rank's sync-state file (with
        ``weights_only=True`` unless ``weights_only`` is ``False``), and keeps that state to restore once the
        strategy is set up.

        Raises:
            CheckpointError: a file is missing or unreadable, or the checkpoint has no lightning_sync state, or was
                saved by another strategy or another number of ranks.
        """
        path = Path(checkpoint_path)
        if not path.is_file():
            raise CheckpointError(f"checkpoint {str(path)!r} does not exist (or is not a file)")
        checkpoint: dict[str, Any] = _read(
            path, lambda: super(SyncStateCheckpointing, self).load_checkpoint(path, weights_only)
        )
        if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
            raise CheckpointError(f"checkpoint {str(path)!r} is not a Lightning checkpoint (no 'state_dict')")
        self._check_this_run(checkpoint, path)
        own = sync_state_path(path, self.global_rank)
        if not own.is_file():
            raise CheckpointError(
                f"checkpoint {str(path)!r} has no sync state of rank {self.global_rank}: {str(own)!r} does not exist "
                "(each rank writes its own file next to the checkpoint; copy or move them together)"
            )
        self._pending_sync_state = _read(
            own, lambda: self.checkpoint_io.load_checkpoint(own, weights_only=weights_only is not False)
        )
        self._pending_optimizer_states = self._pending_sync_state.get("optimizer_states")
        return checkpoint

    def _check_this_run(self, checkpoint: Mapping[str, Any], path: Path) -> None:
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
        if saved.get("world_size") != self.world_size:
            raise CheckpointError(
                f"checkpoint {str(path)!r} was saved by {saved.get('world_size')} ranks, this run has "
                f"{self.world_size}; resume with the same number of ranks, or {_WEIGHTS_ONLY_HINT}"
            )

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning's restore (rank 0's optimizer state on every rank), then, where the mode lets ranks' states
        differ, this rank's own state from the checkpoint."""
        super().load_optimizer_state_dict(checkpoint)
        if self._pending_optimizer_states is not None:
            for optimizer, state in zip(self.optimizers, self._pending_optimizer_states):
                optimizer.load_state_dict(state)  # moves the state to each parameter's device
            self._pending_optimizer_states = None
