"""The sync groups of a periodic averager: a ``module_sync_every`` group (:mod:`lightning_sync.comm.module_policy`),
the default group ``"*"``, or one of their fragments (:mod:`lightning_sync.comm.fragments`); their layout and their
checkpoint state.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_sync.comm.averaging import InFlight, ModelAverager
from lightning_sync.comm.fragments import buffer_fragments, split_fragments
from lightning_sync.comm.module_policy import DEFAULT_GROUP, assign_patterns
from lightning_sync.comm.streaming import stagger_offsets


@dataclass
class SyncGroup:
    """Parameters (and buffers) synced together, with their own period and global copy.

    Attributes:
        label: the ``module_sync_every`` pattern, or ``"*"``; a fragment's label adds ``#f`` (``"*#0"``).
        period: a fixed period, or ``None`` for the default group (which follows ``sync_every``, maybe adaptive).
        params: the parameters (those with ``requires_grad``).
        buffers: the module buffers synced with this group.
        averager: the global copy and the averaging.
        outer: DiLoCo's outer optimizer over ``averager.anchors`` (``None`` for local SGD).
        since_sync: optimizer steps since this group was last synced.
        syncs: how many times this group was synced.
        offset: ``since_sync`` at the start of the local phase (staggers the fragments of a group).
        fragments: how many fragments its ``module_sync_every`` group was split into.
        in_flight: its outer sync between launch and apply (``sync_delay > 0``).
        mixed: its parameters differ from the global copy since the last apply (``fragment_alpha > 0``).
        skipped: outer steps skipped for a non-finite pseudo-gradient.
    """

    label: str
    period: int | None
    params: list[nn.Parameter]
    buffers: list[torch.Tensor]
    averager: ModelAverager
    outer: torch.optim.Optimizer | None = None
    since_sync: int = 0
    syncs: int = 0
    offset: int = 0
    fragments: int = 1
    in_flight: InFlight | None = None
    mixed: bool = False
    skipped: int = 0


def build_sync_groups(
    named: Sequence[tuple[str, nn.Parameter]],
    named_buffers: Sequence[tuple[str, torch.Tensor]],
    policy: Mapping[str, int],
    fragments: int,
    default_period: int,
    new_averager: Callable[[list[nn.Parameter]], tuple[ModelAverager, torch.optim.Optimizer | None]],
    fragment_modules: Sequence[Sequence[str]] | None = None,
) -> list[SyncGroup]:
    """The default group, then one group per ``policy`` pattern, each split into up to ``fragments`` fragments.

    Args:
        named: the model's named parameters (only those with ``requires_grad`` join a group).
        named_buffers: the model's named buffers.
        policy: ``{pattern: period}`` (the parameters and buffers no pattern matches join the default group).
        fragments: how many fragments to split each group into (at most one per block, or per layer).
        default_period: the default group's period, which staggers its fragments.
        new_averager: makes a fragment's averager and outer optimizer (``None``: local SGD) from its parameters.
        fragment_modules: explicit fragments (module-name patterns, in sync order) instead of the block rule.

    Raises:
        ConfigError: a ``policy`` pattern matching no parameter, or a name matching two; a ``fragment_modules``
            pattern matching no parameter, or a parameter in two fragments or none.
    """
    param_pattern, buffer_pattern = assign_patterns([n for n, _ in named], [n for n, _ in named_buffers], policy)
    groups: list[SyncGroup] = []
    for label, period in [(DEFAULT_GROUP, None), *policy.items()]:
        members = [(n, p) for n, p in named if p.requires_grad and param_pattern.get(n, DEFAULT_GROUP) == label]
        buffers = [(n, b) for n, b in named_buffers if buffer_pattern.get(n, DEFAULT_GROUP) == label]
        split = split_fragments([(n, p.shape) for n, p in members], fragments, fragment_modules)
        if len(split) < fragments and len(members) > 1:
            warnings.warn(
                f"fragments={fragments}: sync group {label!r} has {len(split)} blocks (or layers, without repeated "
                f"blocks), so it gets {len(split)} fragments (a block is never split); fragment_modules names others",
                stacklevel=2,
            )
        offsets = stagger_offsets(default_period if period is None else period, len(split))
        owner = buffer_fragments([n for n, _ in members], split, [n for n, _ in buffers])
        for f, (indices, offset) in enumerate(zip(split, offsets)):
            params = [members[i][1] for i in indices]
            # a buffer goes with the fragment of the innermost module above it that is in one fragment
            mine = [b for (_, b), at in zip(buffers, owner) if at == f]
            averager, outer = new_averager(params)
            name = label if len(split) == 1 else f"{label}#{f}"
            group = SyncGroup(name, period, params, mine, averager, outer, fragments=len(split))
            group.since_sync = group.offset = offset
            groups.append(group)
    return groups


def groups_state(groups: Sequence[SyncGroup], timeout_s: float | None = None) -> list[dict[str, Any]]:
    """Each group's step counts, global copy, compressor memory, outer optimizer and outer sync in flight (drained,
    at most ``timeout_s``, and saved unapplied: the resumed run applies it at the step the uninterrupted run does)."""
    return [
        {  # the flight first: draining it advances the compressor
            "in_flight": None if group.in_flight is None else group.averager.flight_state(group.in_flight, timeout_s),
            "label": group.label,
            "since_sync": group.since_sync,
            "syncs": group.syncs,
            "averager": group.averager.state_dict(),
            "outer": copy.deepcopy(group.outer.state_dict()) if group.outer is not None else None,
            "mixed": group.mixed,
            "skipped": group.skipped,
        }
        for group in groups
    ]


def load_groups_state(groups: Sequence[SyncGroup], saved_groups: Sequence[dict[str, Any]]) -> None:
    """Restores :func:`groups_state` into ``groups`` (they must have the same labels and sizes).

    Raises:
        ValueError: the saved groups' labels differ from these.
    """
    labels = [saved["label"] for saved in saved_groups]
    if labels != [group.label for group in groups]:
        raise ValueError(
            f"checkpoint has sync groups {labels}, this run has {[g.label for g in groups]}; resume with "
            "the same module_sync_every and fragments"
        )
    for group, saved in zip(groups, saved_groups):
        group.since_sync = int(saved["since_sync"])
        group.syncs = int(saved["syncs"])
        group.averager.load_state_dict(saved["averager"])
        if group.outer is not None and saved["outer"] is not None:
            group.outer.load_state_dict(saved["outer"])
        flight = saved.get("in_flight")
        group.in_flight = None if flight is None else group.averager.load_flight_state(flight)
        group.mixed = bool(saved.get("mixed", False))
        group.skipped = int(saved.get("skipped", 0))
