"""Replica-consistency checks: do all ranks hold the same parameters, buffers and optimizer state?

Each rank reduces each named tensor to a float64 fingerprint (size, sum, sum of squares, and a position-weighted
sum that a one-ulp difference moves), and one all-gather carries them all. Only the tensors whose fingerprints
differ from rank 0's are then broadcast from rank 0, and one more all-gather says which ranks differ and by how
much (rank 0's copy is then at hand, so ``resync`` costs nothing more). The check goes around the communication
meter: it is a debugging aid, not a sync mode's traffic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_sync.comm.meter import control_device
from lightning_sync.errors import check_choice

log = logging.getLogger(__name__)


class ReplicaMismatchError(RuntimeError):
    """Raised when replicas that should be identical are not."""


@dataclass(frozen=True)
class TensorMismatch:
    """One tensor that differs between replicas.

    Attributes:
        name: the tensor's name, e.g. ``net.2.weight`` or ``optimizer[0].state[net.2.weight].momentum_buffer``.
        ranks: the ranks (of the group) whose copy differs from rank 0's.
        max_abs_diff: the largest absolute difference of any element from rank 0's copy, over those ranks (``nan``
            when one side has a NaN where the other has a number).
    """

    name: str
    ranks: tuple[int, ...]
    max_abs_diff: float

    def __str__(self) -> str:
        return f"{self.name} (ranks {list(self.ranks)}, max |diff| {self.max_abs_diff:.1e})"


def named_replicated_state(
    module: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (), only: Iterable[torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The floating tensors that a replica holds, by name: the module's parameters and buffers, and the optimizers'
    per-parameter state as ``optimizer[i].state[<parameter name>].<key>``; ``only``: just these tensors (by identity).
    """
    named = {n: t for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_floating_point()}
    for i, optimizer in enumerate(optimizers):
        for param_name, param in module.named_parameters():  # module order: the same on every rank
            state = optimizer.state.get(param, {})
            for key in sorted(state, key=str):
                if torch.is_tensor(state[key]) and state[key].is_floating_point():
                    named[f"optimizer[{i}].state[{param_name}].{key}"] = state[key]
    if only is not None:
        keep = {id(t) for t in only}
        named = {n: t for n, t in named.items() if id(t) in keep}
    return named


def tensor_fingerprints(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A ``(len(tensors), 4)`` float64 matrix on ``device``: each tensor's size, sum, sum of squares and
    position-weighted sum (each computed where its tensor is)."""
    rows = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1).to(torch.float64)
        # A cheap position-dependent weight in [1, 2): catches swapped or shifted entries that a sum would miss.
        weights = 1.0 + torch.frac(
            torch.arange(flat.numel(), dtype=torch.float64, device=flat.device) * 0.6180339887498949
        )
        sums = [flat.new_tensor(flat.numel()), flat.sum(), flat.square().sum(), (flat * weights).sum()]
        rows.append(torch.stack(sums).cpu())
    return torch.stack(rows).to(device)


def _gather(mine: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``mine``, stacked in rank order."""
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return torch.stack(gathered)


def _differs(values: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Elementwise ``values != reference``, with NaN equal to NaN (a NaN held by every replica is consistent)."""
    return (values != reference) & ~(values.isnan() & reference.isnan())


def find_mismatches(
    named: Mapping[str, torch.Tensor],
    group: ProcessGroup | None = None,
    atol: float = 0.0,
    resync: bool = False,
) -> list[TensorMismatch]:
    """Compares every rank's ``named`` tensors with rank 0's (call on every rank); the result is the same on all.

    Args:
        named: ``{name: tensor}``; every rank must pass the same names, in the same order.
        group: the process group (default: the world).
        atol: a tensor differs when some element is more than ``atol`` from rank 0's.
        resync: copy rank 0's values into the tensors that differ, in place (on every rank).

    Returns:
        The tensors that differ, in the order of ``named`` (empty: the replicas agree).
    """
    names, tensors = list(named), list(named.values())
    if not tensors or dist.get_world_size(group) == 1:
        return []
    device = control_device(group)  # the collectives' tensors go there (NCCL takes CUDA tensors only)
    prints = _gather(tensor_fingerprints(tensors, device), group)  # (world, tensors, 4)
    suspects = [i for i in range(len(tensors)) if bool(_differs(prints[:, i], prints[0, i]).any())]
    if not suspects:
        return []
    if bool((prints[:, suspects, 0] != prints[0, suspects, 0]).any()):
        odd = [names[i] for i in suspects if bool((prints[:, i, 0] != prints[0, i, 0]).any())]
        raise ReplicaMismatchError(f"replicas hold tensors of different sizes: {', '.join(odd)}")
    mine = [tensors[i].detach().reshape(-1).to(device, torch.float64) for i in suspects]
    reference = torch.cat(mine)
    dist.broadcast(reference, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
    refs = reference.split([t.numel() for t in mine])
    diffs = []
    for values, ref in zip(mine, refs):
        mask = _differs(values, ref)
        diffs.append((values[mask] - ref[mask]).abs().max() if bool(mask.any()) else ref.new_zeros(()))
    every = _gather(torch.stack(diffs), group)  # (world, suspects)
    mismatches = []
    for column, (i, ref) in enumerate(zip(suspects, refs)):
        per_rank = every[:, column]
        bad = (per_rank > atol) | per_rank.isnan()
        if bool(bad.any()):
            ranks = tuple(bad.nonzero().flatten().tolist())
            mismatches.append(TensorMismatch(names[i], ranks, float(per_rank[bad].max())))  # max is NaN if one is
            if resync:
                with torch.no_grad():
                    tensors[i].copy_(ref.view_as(tensors[i]))  # any device
    return mismatches


def _first_difference(mine: list[tuple[str, tuple[int, ...], str]], reference: list[Any]) -> str:
    """How ``mine`` differs from ``reference``, in words."""
    theirs = {name: (shape, dtype) for name, shape, dtype in reference}
    ours = {name: (shape, dtype) for name, shape, dtype in mine}
    for name, (shape, dtype) in ours.items():
        if name not in theirs:
            return f"has {name!r} {list(shape)} ({dtype}), which rank 0 lacks"
        if theirs[name] != (shape, dtype):
            return f"has {name!r} of shape {list(shape)} ({dtype}), rank 0 {list(theirs[name][0])} ({theirs[name][1]})"
    missing = [name for name in theirs if name not in ours]
    if missing:
        return f"lacks {missing[0]!r}, which rank 0 has"
    return "has the same tensors as rank 0 in another order"


def check_same_structure(named: Iterable[tuple[str, torch.Tensor]], group: ProcessGroup | None = None) -> None:
    """Checks that every rank's model has the same tensors: names, shapes and dtypes, in the same order (call on
    every rank, before any collective on the tensors themselves, which would fail or hang on a mismatch).

    Raises:
        ReplicaMismatchError: naming every rank whose model differs from rank 0's, with the first difference and
            the tensor counts.
    """
    mine = [(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")) for name, tensor in named]
    layouts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(layouts, mine, group=group)
    problems = [
        f"rank {rank} ({len(layout)} tensors) {_first_difference(layout, layouts[0])}"
        for rank, layout in enumerate(layouts)
        if rank > 0 and layout != layouts[0]
    ]
    if problems:
        raise ReplicaMismatchError(
            f"the model differs across ranks (rank 0 has {len(layouts[0])} parameters and buffers): "
            + "; ".join(problems)
            + ". Every rank must build the same model; check code that depends on the rank or on local files"
        )


def check_replicas(
    named: Mapping[str, torch.Tensor],
    steps: int,
    on_mismatch: str = "raise",
    group: ProcessGroup | None = None,
    atol: float = 0.0,
    pull: Callable[[], Any] | None = None,
) -> list[TensorMismatch]:
    """Checks that every rank holds the same ``named`` tensors, and acts on a mismatch (call on every rank).

    Args:
        named: ``{name: tensor}``, the same names in the same order on every rank.
        steps: how many sync steps were taken (for the message).
        on_mismatch: ``raise`` a :class:`ReplicaMismatchError`; ``warn``: log a warning on rank 0 and go on;
            ``resync``: copy the authority's values into the tensors that differ (``pull``'s, then rank 0's).
        group: the process group (default: the world).
        atol: tolerated absolute difference per element.
        pull: for ``resync``, restores the parameters in place from their authority (e.g. a parameter server).

    Returns:
        The tensors that differed (empty: the replicas agree).

    Raises:
        ReplicaMismatchError: with ``on_mismatch="raise"``, naming the tensors, the ranks and the largest
            difference; or, whatever ``on_mismatch``, when the replicas hold tensors of different sizes.
    """
    check_choice("on_mismatch", on_mismatch, ("raise", "warn", "resync"))
    resync = on_mismatch == "resync"
    mismatches = find_mismatches(named, group, atol, resync=resync and pull is None)
    if not mismatches:
        return []
    more = f", and {len(mismatches) - 8} more tensors" if len(mismatches) > 8 else ""
    message = f"replicas differ after {steps} sync steps: {', '.join(str(m) for m in mismatches[:8])}{more}"
    if on_mismatch == "raise":
        raise ReplicaMismatchError(message)
    if resync and pull is not None:
        pull()  # the authority first; whatever it does not hold (buffers, optimizer state) takes rank 0's values
        find_mismatches({m.name: named[m.name] for m in mismatches}, group, atol, resync=True)
    if dist.get_rank(group) == 0:
        source = "rank 0" if pull is None else "the parameters' authority, then rank 0"
        log.warning("%s%s", message, f"; resynced them from {source}" if resync else "")
    return mismatches
