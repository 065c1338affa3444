"""How gradients are laid out for the all-reduce: flat buckets, the buffers they live in, and packing into them.

Nothing here knows of Lightning. :func:`plan_buckets` cuts an ordered list of parameters into buckets by size;
:func:`make_buckets` gives each bucket a flat buffer, slices of one buffer per run of buckets of one dtype and device;
:func:`pack_grads` writes a round's gradients into a bucket. The layout depends on the order of the parameters and
the two caps alone, never on when a bucket is launched: that is what lets every launch point of
:class:`~lightning_sync.comm.bucketing.GradientSynchronizer` sum the same payloads to the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import torch


@dataclass
class GradBucket:
    """One bucket of gradients: its parameters, and their gradients back to back in one flat buffer.

    Attributes:
        index: the bucket's place in launch order.
        params: the parameters, in the order their gradients sit in ``buffer``.
        buffer: the parameters' gradients back to back, in ``params`` order.
        future: this round's average in flight (``None`` before launch).
        ready: ids of the parameters whose gradient of this round is final.
        slots: one view of ``buffer`` per parameter, shaped as it (made once).
    """

    index: int
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    future: torch.futures.Future | None = None
    ready: set[int] = field(default_factory=set)
    slots: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.slots = [view.view(p.shape) for p, view in zip(self.params, self.buffer.split(_numels(self.params)))]

    @property
    def shapes(self) -> list[torch.Size]:
        return [p.shape for p in self.params]

    @property
    def full(self) -> bool:
        """Every parameter's gradient of this round is final: the bucket can be packed and launched."""
        return len(self.ready) == len(self.params)


def _numels(params: list[torch.nn.Parameter]) -> list[int]:
    return [p.numel() for p in params]


def pack_grads(bucket: GradBucket, grads: list[torch.Tensor | None]) -> None:
    """Writes ``grads`` (``None``: zeros) into ``bucket.buffer`` back to back, undivided.

    All present, contiguous and not already in place: one ``torch.cat`` (one kernel for the whole bucket instead of
    a copy per tensor). Otherwise tensor by tensor, skipping gradients that already are their slot.
    """
    if all(
        g is not None and g.is_contiguous() and g.data_ptr() != slot.data_ptr() for g, slot in zip(grads, bucket.slots)
    ):
        torch.cat([cast(torch.Tensor, g).view(-1) for g in grads], out=bucket.buffer)  # all present, checked above
        return
    for slot, g in zip(bucket.slots, grads):
        if g is None:
            slot.zero_()
        elif g.data_ptr() != slot.data_ptr():
            slot.copy_(g)


def plan_buckets(params: Sequence[torch.Tensor], bucket_cap_bytes: float, first_bucket_bytes: float) -> list[list[int]]:
    """Splits parameter indices (taken in the given order) into buckets.

    A bucket closes once it holds at least its cap (``first_bucket_bytes`` for the first, ``bucket_cap_bytes``
    after), and never mixes dtypes or devices. A parameter larger than the cap gets a bucket of its own.
    """
    plans: list[list[int]] = []
    current: list[int] = []
    size = 0.0
    for i, p in enumerate(params):
        if current and (params[current[0]].dtype != p.dtype or params[current[0]].device != p.device):
            plans.append(current)
            current, size = [], 0.0
        current.append(i)
        size += p.numel() * p.element_size()
        cap = first_bucket_bytes if not plans else bucket_cap_bytes
        if size >= cap:
            plans.append(current)
            current, size = [], 0.0
    if current:
        plans.append(current)
    return plans


def make_buckets(plans: list[list[torch.nn.Parameter]]) -> tuple[list[GradBucket], list[torch.Tensor]]:
    """The buckets, and the buffers they live in: one per maximal sequence of consecutive buckets of one dtype and
    device, whose buckets' buffers are consecutive slices of it (so it can be zeroed in one fill)."""
    runs: list[list[list[torch.nn.Parameter]]] = []
    for plan in plans:
        head = runs[-1][0][0] if runs else None
        if head is not None and head.dtype == plan[0].dtype and head.device == plan[0].device:
            runs[-1].append(plan)
        else:
            runs.append([plan])
    buckets: list[GradBucket] = []
    buffers: list[torch.Tensor] = []
    for run in runs:
        head = run[0][0]
        buffer = torch.zeros(sum(sum(_numels(plan)) for plan in run), dtype=head.dtype, device=head.device)
        slices = buffer.split([sum(_numels(plan)) for plan in run])
        buckets += [
            GradBucket(index=len(buckets) + k, params=plan, buffer=part)
            for k, (plan, part) in enumerate(zip(run, slices))
        ]
        buffers.append(buffer)
    return buckets, buffers
