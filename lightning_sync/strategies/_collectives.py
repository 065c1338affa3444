"""Lightning's own collectives (``barrier``, ``broadcast``, ``reduce``, ``all_gather``), with a lost peer named.

The Trainer issues these between the mode's own collectives: the barrier of ``save_checkpoint``, the metric reduce
behind ``self.log(sync_dist=True)``, EarlyStopping's decision. A rank that is killed while another waits in one of them
surfaces there first, as gloo's bare "Connection closed by peer"; restated here, the error names the rank, and adds
what a peer reported as the root cause where the mode keeps such reports (the parameter server's store).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from typing_extensions import override

from lightning_sync.comm.peer_errors import PeerError, naming_peer
from lightning_sync.strategies._lightning import LightningDDPHooks


class NamedPeerCollectives(LightningDDPHooks):
    """Lightning's collectives, where a failure that a silent or lost peer caused is raised as a
    :class:`~lightning_sync.comm.peer_errors.PeerError` naming it (other failures are left as they are)."""

    def _collective_timeout_s(self) -> float | None:
        """The process group's timeout, for the message."""
        config = getattr(self, "config", None)
        return getattr(config, "timeout_s", None)

    def _reported_cause(self, error: PeerError) -> str | None:
        """What another process reported as its failure, where the mode keeps such reports (none here).

        Args:
            error: this rank's failure, naming the silent or lost peer.
        """
        return None

    @contextmanager
    def _naming_lost_peer(self, op: str) -> Iterator[None]:
        """:func:`~lightning_sync.comm.peer_errors.naming_peer`, plus the cause another process reported, if any."""
        try:
            with naming_peer(op, None, self._collective_timeout_s()):
                yield
        except PeerError as error:
            cause = self._reported_cause(error)
            if cause is None:
                raise
            raise PeerError(f"{error}; {cause}") from error.__cause__

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's barrier; a silent or lost rank is named."""
        with self._naming_lost_peer("barrier"):
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's broadcast; a silent or lost rank is named."""
        with self._naming_lost_peer("broadcast"):
            return super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's reduce (``self.log(sync_dist=True)``, ``reduce_boolean_decision``); a silent or lost rank is
        named."""
        with self._naming_lost_peer("reduce"):
            return super().reduce(tensor, *args, **kwargs)

    @override
    def all_gather(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's all_gather; a silent or lost rank is named."""
        with self._naming_lost_peer("all_gather"):
            return super().all_gather(tensor, *args, **kwargs)
