"""Checkpoints that resume a lightning_sync run exactly: every rank's sync state, checked on load.

Next to Lightning's ``<checkpoint>`` (written by rank 0, marked by :func:`mark` with the strategy and the number of
ranks), each rank ``r`` writes ``<checkpoint>.rank<r>.pt`` (:func:`sync_state_path`) through the strategy's
``CheckpointIO``: its ``sync_state_dict()`` (step counters, compressor memory, the mode's state, communication
totals, and, where replicas differ between syncs, its own model and optimizer state, which Lightning alone would
replace by rank 0's). These hold tensors and plain values only, so they are read with ``weights_only=True``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from lightning_sync.errors import CheckpointError

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


def mark(checkpoint: dict[str, Any], strategy: str, ranks: int) -> None:
    """Marks Lightning's ``checkpoint`` with the strategy's name and the number of ranks (checked by
    :func:`check_resumable`)."""
    checkpoint[_CHECKPOINT_KEY] = {"strategy": strategy, "world_size": ranks}


def read(path: Path, load: Callable[[], Any]) -> Any:
    """``load()``, the reading of ``path``.

    Raises:
        CheckpointError: the file is missing, truncated, corrupt or not a PyTorch checkpoint.
    """
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist (or is not a file)")
    try:
        return load()
    except Exception as error:  # torch.load raises many types for a truncated or foreign file
        raise CheckpointError(
            f"checkpoint {str(path)!r} cannot be read ({type(error).__name__}: {error}); the file is truncated, "
            "corrupt or not a PyTorch checkpoint"
        ) from error


def check_resumable(checkpoint: Any, path: Path, strategy: str, ranks: int, rank: int) -> Path:
    """Checks that Lightning's ``checkpoint`` (read from ``path``) was saved by a ``strategy`` run of ``ranks``
    ranks, with rank ``rank``'s sync-state file next to it.

    Returns:
        That file (:func:`sync_state_path`).

    Raises:
        CheckpointError: it is not a Lightning checkpoint, has no lightning_sync state, was saved by another
            strategy or another number of ranks, or the rank's file is missing.
    """
    if not isinstance(checkpoint, Mapping) or "state_dict" not in checkpoint:
        raise CheckpointError(f"checkpoint {str(path)!r} is not a Lightning checkpoint (no 'state_dict')")
    saved = checkpoint.get(_CHECKPOINT_KEY)
    if saved is None:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no lightning_sync state (it was saved by another strategy, e.g. "
            f"Lightning's own), so this {strategy!r} run cannot resume from it; {_WEIGHTS_ONLY_HINT}"
        )
    if saved.get("strategy") != strategy:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was saved by strategy {saved.get('strategy')!r}, this run uses "
            f"{strategy!r}; resume with the same strategy, or {_WEIGHTS_ONLY_HINT}"
        )
    if saved.get("world_size") != ranks:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was saved by {saved.get('world_size')} ranks, this run has "
            f"{ranks}; resume with the same number of ranks, or {_WEIGHTS_ONLY_HINT}"
        )
    own = sync_state_path(path, rank)
    if not own.is_file():
        raise CheckpointError(
            f"checkpoint {str(path)!r} has no sync state of rank {rank}: {str(own)!r} does not exist "
            "(each rank writes its own file next to the checkpoint; copy or move them together)"
        )
    return own
