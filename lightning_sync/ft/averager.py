"""Local SGD and DiLoCo across replica groups: a :class:`PeriodicAverager` whose syncs also go through a torchft
quorum, applied only when torchft commits them (otherwise every parameter returns to the global copy, as torchft's
``DiLoCo`` does). With one rank per group, ``N`` groups compute what ``N`` ordinary ranks do. Streaming DiLoCo works
(each fragment's sync is a quorum of its own), and an ``outer_compression`` codec carries the pseudo-gradients
across groups (exact inside one).
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import override

from lightning_sync.comm.compression import Compressor, NoCompression, resolve_codec
from lightning_sync.comm.periodic import PeriodicAverager
from lightning_sync.comm.sync_groups import SyncGroup
from lightning_sync.errors import ConfigError
from lightning_sync.ft.replica import ReplicaGroupLink


def check_fault_tolerant_knobs(averager: PeriodicAverager) -> None:
    """Refuses what an averager was built with that cannot be made fault tolerant, naming the knob.

    Raises:
        ConfigError: ``sync_every="auto"``, ``warmup_steps > 0``, ``average_optimizer_state`` or an
            ``outer_compression`` that cannot ride ``across_groups``.
    """
    if averager.outer_compression != "none":
        resolve_codec(averager.outer_compression, "outer_compression", needs=("across_groups",))
    for name, bad, allowed, why in (
        ("sync_every", averager.adaptive is not None, "an integer", "'auto' lets groups pick different periods"),
        ("warmup_steps", averager.warmup_steps != 0, "0", "warmup all-reduces gradients inside a group only"),
        ("average_optimizer_state", averager.average_optimizer_state, "False", "averaged inside a group only"),
    ):
        if bad:
            value = getattr(averager, name)
            raise ConfigError(f"{name}={value!r} is not allowed with fault tolerance; it must be {allowed} ({why})")


class FaultTolerantAverager(PeriodicAverager):
    """A :class:`PeriodicAverager` whose syncs also average across replica groups, through ``link``.

    Args:
        link: this rank's link to the other groups (``None``: given later to :meth:`connect`, once the replica
            group's process group exists, before :meth:`setup`).
        **knobs: :class:`PeriodicAverager`'s arguments (checked by :func:`check_fault_tolerant_knobs`).

    Raises:
        ConfigError: a knob that cannot be made fault tolerant, or one out of range.
    """

    def __init__(self, link: ReplicaGroupLink | None = None, **knobs: Any) -> None:
        super().__init__(**knobs)
        check_fault_tolerant_knobs(self)
        self._link: ReplicaGroupLink | None = None
        if link is not None:
            self.connect(link)
        # an outer codec rides across the groups (one per sync group, for its memory); inside a group: exact
        self._new_across = self.new_compressor if self.outer_compression != "none" else None
        self._across_codecs: dict[int, Compressor] = {}
        if self._new_across is not None:
            self.new_compressor = NoCompression

    def connect(self, link: ReplicaGroupLink) -> None:
        """Makes ``link`` this rank's link to the other groups (before :meth:`setup`); a healing group pulls the
        averager's state (steps, global copies, outer optimizers) through it."""
        self._link = link
        link.register_state("averager", self.state_dict, self.load_state_dict)

    @property
    def link(self) -> ReplicaGroupLink:
        """This rank's link to the other groups (given to the constructor or to :meth:`connect`)."""
        assert self._link is not None, "FaultTolerantAverager has no link: give one to connect() before setup()"
        return self._link

    @override
    def _quorum(self) -> bool:
        return self.link.start()

    @override
    def _across(self, group: SyncGroup) -> None:
        """The mean of ``group``'s deltas over the quorum's groups, in place (as ``outer_compression`` sends it)."""
        if self._new_across is None:
            self.link.average_(group.averager.deltas)
        else:
            codec = self._across_codecs.setdefault(self.groups.index(group), self._new_across())
            self.link.average_coded_(group.averager.delta_buckets(), codec)
            codec.advance()

    @override
    def _across_buffers(self, buffers: list[torch.Tensor]) -> None:
        self.link.average_([b for b in buffers if b.is_floating_point()])

    @override
    def _commit(self) -> bool:
        """torchft's vote on the sync (a group lost inside it, too few groups: not committed)."""
        return self.link.commit()

    def state_dict(self) -> dict[str, Any]:
        """As :meth:`PeriodicAverager.state_dict`, with the memory of the codecs across groups."""
        return {**super().state_dict(), "across": {i: c.state_dict() for i, c in self._across_codecs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        assert self._new_across is not None or not state.get("across")
        for i, codec_state in state.get("across", {}).items():
            codec = self._across_codecs.setdefault(int(i), self._new_across())  # type: ignore[misc]
            codec.load_state_dict(codec_state)

    def close(self) -> None:
        """Stops the outer-sync worker (none here) and the link's Manager."""
        super().close()
        if self._link is not None:
            self._link.close()
