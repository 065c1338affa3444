"""The contract every gradient compressor follows: :class:`FlatBucket` in, :class:`Compressor` averages it.

A :class:`Compressor` averages one :class:`FlatBucket` over a process group. It owns the encoding, the collectives
(issued through a :class:`~lightning_sync.comm.meter.CommMeter`, so the meter sees the compressed payload) and the
decoding, and writes the mean back into the bucket's buffer in place. Compressors with memory keep it per bucket
index; it is part of :meth:`Compressor.state_dict`, so it goes into checkpoints.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.distributed import ProcessGroup

from lightning_sync.comm.meter import CommMeter


@dataclass
class FlatBucket:
    """A flat 1-D buffer holding several tensors back to back.

    Attributes:
        index: a stable id of the bucket (the same bucket gets the same index every step); compressor memory is
            keyed by it.
        buffer: the contiguous 1-D buffer.
        shapes: the shapes of the tensors laid out in ``buffer``, in order, with no gaps.
        divided: the owner already divided ``buffer`` by the world size (fused into its copy into the bucket), so
            a sum over ranks is the mean and the compressor must not divide again.
    """

    index: int
    buffer: torch.Tensor
    shapes: list[torch.Size]
    divided: bool = False

    def scale(self, n: int) -> float:
        """The factor that turns a sum over ``n`` ranks of this bucket's payload into a mean (1 if ``divided``)."""
        return 1.0 if self.divided else 1.0 / n

    def views(self) -> list[torch.Tensor]:
        """The tensors of the bucket, as views into ``buffer`` with their own shapes."""
        out, offset = [], 0
        for shape in self.shapes:
            numel = math.prod(shape)
            out.append(self.buffer[offset : offset + numel].view(shape))
            offset += numel
        return out


def _completed(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class Compressor(ABC):
    """Averages buckets over a process group, possibly compressing what goes on the wire.

    Subclasses implement :meth:`average`. ``steps`` counts completed optimizer steps (syncs); the owner calls
    :meth:`advance` once after each, which lets a compressor switch on late (PowerSGD's ``start_iter``).
    """

    name: ClassVar[str]

    def __init__(self) -> None:
        self.steps = 0

    @abstractmethod
    def average(self, bucket: FlatBucket, meter: CommMeter, group: ProcessGroup | None = None) -> torch.futures.Future:
        """Starts averaging ``bucket.buffer`` over ``group`` (all ranks must call it with the same bucket layout).

        Returns:
            A future that resolves to ``bucket.buffer`` once it holds the mean over the group's ranks (or the
            decompressed estimate of it).
        """

    def advance(self) -> None:
        """Marks the end of one optimizer step."""
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly (step count, residuals, factors)."""
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])

    def forget_nonfinite(self) -> None:
        """After a step skipped for non-finite gradients: clears what the memory took from them, so that the
        next steps are not poisoned (the same decision on every rank for memory that is identical on all)."""
