"""Local SGD and DiLoCo across replica groups: :class:`PeriodicAverager` whose syncs go through a torchft quorum.

Inside a replica group the ranks average as :class:`~lightning_sync.comm.periodic.PeriodicAverager` does (over the
group's own process group); the group's average is then averaged over the groups of the quorum by
:class:`~lightning_sync.ft.replica.ReplicaGroupLink`. Each sync is one quorum, and is committed only when torchft
says so: a sync that failed (a group lost inside it, too few groups) leaves the global copy and the outer optimizer
as they were, and every parameter returns to the global copy, as torchft's own ``DiLoCo`` does. A non-finite average
(``skip_nonfinite``) is identical on every group, so every group skips it.

With one rank per group, ``N`` groups compute what ``N`` ordinary ranks do (the same pseudo-gradient mean, the same
outer step). Streaming fragments work (``fragments > 1``, each fragment's sync is a quorum of its own), but not what
needs more than that: ``sync_delay > 0``, ``sync_every="auto"``, ``warmup_steps > 0``, ``average_optimizer_state``
and ``outer_compression`` are refused (:func:`check_fault_tolerant_knobs`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from lightning_sync.comm.averaging import average_buffers
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.periodic import PeriodicAverager
from lightning_sync.comm.sync_groups import SyncGroup
from lightning_sync.errors import ConfigError
from lightning_sync.ft.replica import ReplicaGroupLink


def check_fault_tolerant_knobs(averager: PeriodicAverager) -> None:
    """Refuses what an averager was built with that cannot be made fault tolerant (yet), naming the knob.

    Raises:
        ConfigError: ``sync_delay > 0``, ``sync_every="auto"``, ``warmup_steps > 0``, ``average_optimizer_state``
            or an ``outer_compression``.
    """
    for name, bad, allowed, why in (
        ("sync_delay", averager.sync_delay != 0, "0", "an outer sync in flight across a quorum change"),
        ("sync_every", averager.adaptive is not None, "an integer", "'auto' lets groups pick different periods"),
        ("warmup_steps", averager.warmup_steps != 0, "0", "warmup all-reduces gradients inside a group only"),
        ("average_optimizer_state", averager.average_optimizer_state, "False", "averaged inside a group only"),
        ("outer_compression", averager.outer_compression != "none", "'none'", "not carried across groups yet"),
    ):
        if bad:
            value = getattr(averager, name)
            raise ConfigError(f"{name}={value!r} is not allowed with fault tolerance; it must be {allowed} ({why})")


class FaultTolerantAverager(PeriodicAverager):
    """A :class:`PeriodicAverager` whose syncs also average across replica groups, through ``link``.

    Args:
        link: this rank's link to the other groups.
        **knobs: :class:`PeriodicAverager`'s arguments (checked by :func:`check_fault_tolerant_knobs`).

    Raises:
        ConfigError: a knob that cannot be made fault tolerant, or one out of range.
    """

    def __init__(self, link: ReplicaGroupLink, **knobs: Any) -> None:
        super().__init__(**knobs)
        check_fault_tolerant_knobs(self)
        self.link = link
        self.committed_syncs = 0
        self.failed_syncs = 0

    def setup(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        named_buffers: Iterable[tuple[str, torch.Tensor]],
        meter: CommMeter,
        group: ProcessGroup | None = None,
    ) -> None:
        """As :meth:`PeriodicAverager.setup`, and adds the averager's state (steps, global copies, outer optimizers)
        to what a healing group pulls."""
        super().setup(named_parameters, named_buffers, meter, group)
        self.link.register_state("averager", self.state_dict, self.load_state_dict)

    def sync_groups(self, groups: Sequence[SyncGroup], optimizers: Sequence[torch.optim.Optimizer] = ()) -> float:
        """One quorum, then each group's average inside this replica group and across the quorum's groups, then
        torchft's vote: committed, the outer steps are taken; not, every parameter returns to its global copy.

        Returns:
            This rank's divergence from its replica group's average (0 with one rank per group).
        """
        meter = self._require_meter()
        self.link.start()
        squared, flights = 0.0, []
        for group in groups:
            flight = group.averager.launch_(self._sign, self.steps)
            squared += group.averager.complete_(flight, self.timeout_s)
            self.link.average_(group.averager.deltas)
            flights.append(flight)
        buffers = [b for group in groups for b in group.buffers if b.is_floating_point()]
        averaged = [b.detach().clone() for b in buffers]
        if averaged:
            average_buffers(averaged, meter, self.group)
            self.link.average_(averaged)
        committed = self.link.commit()
        for group, flight in zip(groups, flights):
            group.in_flight = None
            if committed:
                applied = group.averager.apply_(flight, group.outer, 0.0, self.skip_nonfinite, self.timeout_s)
                group.skipped += int(not applied)
            else:
                group.averager.restore_()
            group.since_sync, group.mixed = 0, False
            group.syncs += 1
        if committed:
            with torch.no_grad():
                for buffer, mean in zip(buffers, averaged):
                    buffer.copy_(mean)
        self.committed_syncs += int(committed)
        self.failed_syncs += int(not committed)
        self.last_synced = list(groups) if committed else []
        self.last_divergence = math.sqrt(squared)
        return self.last_divergence

    def close(self) -> None:
        """Stops the outer-sync worker (none here) and the link's Manager."""
        super().close()
        self.link.close()
