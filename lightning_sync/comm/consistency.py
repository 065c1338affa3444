"""Replica-consistency checks: do all ranks hold the same parameters?

Each rank reduces its tensors to a short float64 fingerprint (a plain sum, a sum of squares, and a sum weighted by a
fixed pseudo-random pattern that depends on position), the fingerprints are all-gathered, and their spread is the
largest difference from rank 0's. Identical replicas give exactly 0.0; a one-ulp difference in any element moves
the weighted sum. The check sends a few dozen bytes, so it is cheap enough to run every step, and it goes around
the communication meter: it is a debugging aid, not part of a sync mode's traffic.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class ReplicaMismatchError(RuntimeError):
    """Raised when replicas that should be identical are not."""


def replica_fingerprint(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A float64 vector of 3 numbers that summarises ``tensors`` (same on every rank iff they are equal, w.h.p.)."""
    total = torch.zeros(3, dtype=torch.float64)
    offset = 0
    for t in tensors:
        flat = t.detach().reshape(-1).to(torch.float64)
        # A cheap position-dependent weight in [1, 2): catches swapped or shifted entries that a sum would miss.
        idx = torch.arange(offset, offset + flat.numel(), dtype=torch.float64)
        weights = 1.0 + torch.frac(idx * 0.6180339887498949)
        total += torch.stack([flat.sum(), (flat * flat).sum(), (flat * weights).sum()])
        offset += flat.numel()
    return total


def replica_fingerprint_spread(tensors: Iterable[torch.Tensor], group: Optional[ProcessGroup] = None) -> float:
    """Largest absolute difference between any rank's fingerprint and rank 0's (0.0: identical replicas)."""
    mine = replica_fingerprint(tensors)
    world = dist.get_world_size(group)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    stacked = torch.stack(gathered)
    return float((stacked - stacked[0]).abs().max())
