"""Replica consistency checks, as a mixin of :class:`~lightning_sync.strategies._base.SyncStrategyBase`.

The check itself (:func:`lightning_sync.comm.consistency.check_replicas`) is plain torch.distributed code; this
mixin says what each mode must keep identical and who is the authority when ``on_mismatch="resync"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_sync.comm.consistency import TensorMismatch, check_replicas, named_replicated_state


class ReplicaChecking:
    """What every rank must hold alike, and the check (the host strategy has ``config``, ``world_size``,
    ``_sync_steps``, ``lightning_module`` and ``optimizers``)."""

    config: Any
    _sync_steps: int
    lightning_module: Any
    optimizers: Any
    if TYPE_CHECKING:  # the host strategy's (a read-only property of Lightning's)

        @property
        def world_size(self) -> int: ...

    def tensors_to_check(self) -> dict[str, torch.Tensor]:
        """What must be identical on every rank after the current step, by name: the floating parameters, buffers
        and optimizer state (every rank steps on the same gradients; ``ps``'s local optimizer never steps)."""
        return named_replicated_state(self.lightning_module, self.optimizers)

    def check_replicas(self, atol: float = 0.0) -> list[TensorMismatch]:
        """Checks that every rank holds the same :meth:`tensors_to_check`, and acts as ``on_mismatch`` says (see
        :func:`~lightning_sync.comm.consistency.check_replicas`).

        Returns:
            The tensors that differ (empty: none, or one rank).
        """
        if self.world_size == 1:
            return []
        return check_replicas(
            self.tensors_to_check(), self._sync_steps, self.config.on_mismatch, atol=atol, pull=self._authority_pull()
        )

    def _authority_pull(self) -> Callable[[], Any] | None:
        """How ``on_mismatch="resync"`` fetches the authoritative parameters before rank 0's (``None``: rank 0 is
        the authority)."""
        return None
