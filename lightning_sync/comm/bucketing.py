"""Gradient all-reduce by hand: bucketed and overlapped with backward, or flat, or the textbook per-parameter loop.

:class:`GradientSynchronizer` averages the gradients of a fixed list of parameters over a process group, through a
:class:`~lightning_sync.comm.compression.Compressor` and a :class:`~lightning_sync.comm.meter.CommMeter`. It knows
nothing of Lightning. One *round* is one backward pass (or several, with accumulation disabled in between) followed
by :meth:`GradientSynchronizer.finish`:

``overlap``
    Parameters are packed, in reverse registration order (the order backward usually produces gradients), into
    buckets of ``bucket_cap_mb`` (the first bucket ``first_bucket_mb``, so communication starts early). A
    post-accumulate-grad hook copies each gradient into its bucket slot; when a bucket is full it is launched
    asynchronously. Buckets launch strictly in index order, so every rank issues the same sequence of collectives
    even when gradients arrive in a different order. :meth:`finish` launches what is left, waits for all, and
    writes the averages back to ``.grad``.
``flat``
    One buffer per dtype, packed and averaged after backward.
``naive``
    One blocking average per parameter after backward (the textbook loop; kept to compare against).

Parameters without a gradient on this rank (unused or conditionally used) take part with zeros, so no rank waits for
a bucket that never fills. With ``find_unused_parameters=True`` the ranks also all-reduce a used-mask, and a
parameter that no rank used keeps ``grad=None`` (as torch DDP does); otherwise it gets a zero gradient.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
from torch.distributed import ProcessGroup

from lightning_sync.comm.compression import Compressor, FlatBucket
from lightning_sync.comm.meter import CommMeter

_MB = 1024 * 1024


@dataclass
class _Bucket:
    index: int
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    offsets: list[int]
    future: Optional[torch.futures.Future] = None
    filled: set[int] = field(default_factory=set)  # ids of params whose gradient is in the buffer this round
    slots: list[torch.Tensor] = field(default_factory=list)  # one view of ``buffer`` per parameter, made once

    def __post_init__(self) -> None:
        self.slots = [
            self.buffer[offset : offset + p.numel()].view(p.shape) for p, offset in zip(self.params, self.offsets)
        ]

    @property
    def shapes(self) -> list[torch.Size]:
        return [p.shape for p in self.params]

    @property
    def full(self) -> bool:
        """Every parameter's gradient of this round is in the buffer."""
        return len(self.filled) == len(self.params)


def _scaled_copy(dst: torch.Tensor, src: torch.Tensor, scale: float) -> None:
    """``dst = src * scale`` in one pass; in place when ``src`` already is ``dst`` (a grad that is a bucket view)."""
    if src.data_ptr() == dst.data_ptr():
        dst.mul_(scale)
    else:
        torch.mul(src, scale, out=dst)


def plan_buckets(
    params: Sequence[torch.nn.Parameter], bucket_cap_bytes: float, first_bucket_bytes: float
) -> list[list[int]]:
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


class GradientSynchronizer:
    """Averages the gradients of ``params`` over a process group.

    Args:
        params: the parameters to sync (those with ``requires_grad``); every rank must pass the same list.
        compressor: averages each bucket (``NoCompression`` for an exact mean).
        meter: counts the traffic.
        bucketing: ``overlap``, ``flat`` or ``naive`` (see the module docstring).
        bucket_cap_mb: bucket size for ``overlap``.
        first_bucket_mb: size of the first bucket for ``overlap``.
        find_unused_parameters: all-reduce a used-mask so that parameters no rank used keep ``grad=None``.
        gradient_as_bucket_view: after a round, make each ``.grad`` a view into its bucket instead of copying the
            average out (saves one copy of all gradients per step; the next round overwrites those views, so keep a
            clone if you need a gradient beyond the optimizer step).
        group: the process group (``None``: default).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        compressor: Compressor,
        meter: CommMeter,
        bucketing: str = "overlap",
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        group: Optional[ProcessGroup] = None,
    ) -> None:
        if bucketing not in ("overlap", "flat", "naive"):
            raise ValueError(f"bucketing={bucketing!r} is not one of overlap, flat, naive")
        self.params = [p for p in params if p.requires_grad]
        self.compressor = compressor
        self.meter = meter
        self.bucketing = bucketing
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.group = group
        # Gradients are divided by the world size while being copied into their bucket (one pass, not two).
        self._scale = 1.0 / meter.world_size(group)
        self.sync_enabled = True
        self._round_active = False
        self._next_launch = 0
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        ordered = list(reversed(self.params))  # backward visits layers last to first
        if bucketing == "overlap":
            plans = plan_buckets(ordered, bucket_cap_mb * _MB, first_bucket_mb * _MB)
        elif bucketing == "flat":
            plans = plan_buckets(ordered, math.inf, math.inf)
        else:
            plans = [[i] for i in range(len(ordered))]
        self.buckets = [self._make_bucket(k, [ordered[i] for i in plan]) for k, plan in enumerate(plans)]
        self._where = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        if bucketing == "overlap":
            for p in self.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    @staticmethod
    def _make_bucket(index: int, params: list[torch.nn.Parameter]) -> _Bucket:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        return _Bucket(index=index, params=params, buffer=buffer, offsets=offsets)

    # ------------------------------------------------------------------ round control
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this block backward only accumulates local gradients (no communication)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def start_round(self) -> None:
        """Marks that a backward pass whose gradients must be synced is about to run (call on every rank)."""
        if self.sync_enabled:
            self._round_active = True

    # ------------------------------------------------------------------ overlap
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not (self.sync_enabled and self._round_active):
            return
        bucket, i = self._where[id(param)]
        if id(param) in bucket.filled or bucket.future is not None:
            return  # already counted this round (a second backward before finish adds to .grad only)
        _scaled_copy(bucket.slots[i], param.grad, self._scale)
        bucket.filled.add(id(param))
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if not bucket.full:
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket) -> None:
        flat = FlatBucket(index=bucket.index, buffer=bucket.buffer, shapes=bucket.shapes, divided=True)
        bucket.future = self.compressor.average(flat, self.meter, self.group)

    # ------------------------------------------------------------------ finish
    def _fill_missing(self) -> None:
        """Copies this round's gradients into every bucket slot not yet filled (zeros where there is none)."""
        for bucket in self.buckets:
            if bucket.future is not None:
                continue
            for i, p in enumerate(bucket.params):
                if id(p) in bucket.filled:
                    continue
                if p.grad is None:
                    bucket.slots[i].zero_()
                else:
                    _scaled_copy(bucket.slots[i], p.grad, self._scale)
                bucket.filled.add(id(p))

    def _globally_used(self, local_used: list[bool]) -> Optional[list[bool]]:
        """Which parameters any rank used (only with ``find_unused_parameters``); issued after every bucket, so
        all ranks see the same sequence of collectives."""
        if not self.find_unused_parameters:
            return None
        used = torch.tensor(local_used, dtype=torch.float32)
        self.meter.all_reduce(used, group=self.group)
        return (used > 0).tolist()

    def finish(self) -> bool:
        """Completes the round: launches every bucket not yet launched, waits for all, writes averages to ``.grad``.

        Returns:
            Whether a round was active (``False``: nothing to sync, no collective issued).
        """
        if not self._round_active:
            return False
        local_used = [p.grad is not None for p in self.params]
        self._fill_missing()
        if self.bucketing == "naive":
            for bucket in self.buckets:
                self._launch(bucket)
                bucket.future.wait()
        else:
            self._launch_ready()
        used = self._globally_used(local_used)
        for bucket in self.buckets:
            assert bucket.future is not None
            bucket.future.wait()
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                if self.gradient_as_bucket_view:
                    p.grad = bucket.slots[i]
                elif p.grad is None:
                    p.grad = bucket.slots[i].clone()
                else:
                    p.grad.copy_(bucket.slots[i])
        if used is not None:
            for p, u in zip(self.params, used):
                if not u:
                    p.grad = None
        self._reset_round()
        return True

    def _reset_round(self) -> None:
        for bucket in self.buckets:
            bucket.future = None
            bucket.filled.clear()
        self._next_launch = 0
        self._round_active = False

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
