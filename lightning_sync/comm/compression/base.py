"""The contract every codec follows (see :mod:`lightning_sync.comm.compression`): a :class:`Compressor` averages a
:class:`FlatBucket` over a process group, in place."""

from __future__ import annotations

import importlib
import inspect
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.distributed import ProcessGroup

from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.nonfinite import zero_nonfinite_


@dataclass
class FlatBucket:
    """A flat 1-D buffer holding several tensors back to back.

    Attributes:
        index: a stable id of the bucket, the same every step (compressor memory is keyed by it).
        buffer: the contiguous 1-D buffer.
        shapes: the shapes of the tensors laid out in ``buffer``, in order, with no gaps.
        divided: the owner already divided ``buffer`` by the world size, so a sum over ranks is the mean.
        participants: the mean is over this many ranks, not the whole group (a torchft quorum); ``None``: all.
    """

    index: int
    buffer: torch.Tensor
    shapes: list[torch.Size]
    divided: bool = False
    participants: int | None = None

    def scale(self, n: int) -> float:
        """The factor that turns a sum over ``n`` ranks of this bucket's payload into a mean (1 if ``divided``)."""
        return 1.0 if self.divided else 1.0 / (self.participants or n)

    def views(self) -> list[torch.Tensor]:
        """The tensors of the bucket, as views into ``buffer`` with their own shapes."""
        sizes = [math.prod(shape) for shape in self.shapes]
        return [part.view(shape) for part, shape in zip(self.buffer[: sum(sizes)].split(sizes), self.shapes)]


def _completed(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class Compressor(ABC):
    """Averages buckets over a process group, possibly compressing what goes on the wire.

    Subclasses implement :meth:`average`. ``steps`` counts completed optimizer steps (syncs): the owner calls
    :meth:`advance` once after each, which lets a compressor switch on late (PowerSGD's ``start_iter``).

    Example::

        A codec is a class with its own arguments; a name of the registry gives its defaults:

        >>> from lightning_sync.comm.compression import CODECS, resolve_codec
        >>> sorted(CODECS)
        ['bf16', 'fp16', 'int4', 'int8', 'none', 'powersgd', 'sparseloco', 'topk']
        >>> resolve_codec("topk")()
        TopKCompression(density=0.01, error_feedback=True)
    """

    name: ClassVar[str]
    capabilities: ClassVar[frozenset[str]] = frozenset()
    """Beyond averaging over a process group: ``point_to_point`` (:meth:`pack` and :meth:`unpack`, for a
    parameter-server push) and ``across_groups`` (:meth:`average` over torchft's process group)."""
    memory: ClassVar[str | None] = None
    """The attribute holding the codec's error-feedback memory, ``{key: tensor}`` (``None``: none)."""

    def __init__(self) -> None:
        self.steps = 0

    @abstractmethod
    def average(self, bucket: FlatBucket, meter: CommMeter, group: ProcessGroup | None = None) -> torch.futures.Future:
        """Starts averaging ``bucket.buffer`` over ``group`` (all ranks must call it with the same bucket layout).

        Returns:
            A future that resolves to ``bucket.buffer`` once it holds the mean (or the codec's estimate of it).
        """

    def _args(self) -> dict[str, Any]:
        """The constructor arguments it keeps under the same names."""
        return {n: getattr(self, n) for n in inspect.signature(type(self)).parameters if hasattr(self, n)}

    def __repr__(self) -> str:
        """The class and :meth:`_args`, e.g. ``TopKCompression(density=0.01, error_feedback=True)``."""
        return f"{type(self).__name__}({', '.join(f'{n}={v!r}' for n, v in self._args().items())})"

    def spec(self) -> dict[str, Any]:
        """The codec as plain values (its class's import path and :meth:`_args`), for :meth:`from_spec`."""
        cls = type(self)
        return {"target": f"{cls.__module__}.{cls.__qualname__}", "args": self._args()}

    @staticmethod
    def from_spec(spec: dict[str, Any]) -> Compressor:
        """The codec :meth:`spec` describes (a fresh one, without memory)."""
        module, _, name = spec["target"].rpartition(".")
        codec = getattr(importlib.import_module(module), name)(**spec["args"])
        assert isinstance(codec, Compressor)
        return codec

    # point_to_point: a flat payload encoded for one receiver (a parameter server), memory keyed by ``key``
    def packed_nbytes(self, numel: int) -> int:
        """Exact bytes of :meth:`pack`'s output for ``numel`` values (``point_to_point`` codecs)."""
        raise NotImplementedError(f"{type(self).__name__} cannot ride point_to_point")

    def pack(self, flat: torch.Tensor, key: int) -> torch.Tensor:
        """``flat`` (fp32, 1-D; the codec may change it) as :meth:`packed_nbytes` bytes of uint8 for receiver
        ``key``; memory (error feedback) is kept per ``key``."""
        raise NotImplementedError(f"{type(self).__name__} cannot ride point_to_point")

    def unpack(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 values (1-D, ``numel``) of a :meth:`pack` payload.

        Raises:
            ValueError: ``payload`` does not have :meth:`packed_nbytes` bytes.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot ride point_to_point")

    def _check_packed(self, payload: torch.Tensor, numel: int) -> None:
        expected = self.packed_nbytes(numel)
        if payload.numel() != expected:
            raise ValueError(f"a {self.name} payload of {numel} values has {expected} bytes, got {payload.numel()}")

    def advance(self) -> None:
        """Marks the end of one optimizer step (sync)."""
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly: the step count and the :attr:`memory` (cloned)."""
        state: dict[str, Any] = {"steps": self.steps}
        if self.memory is not None:
            state[self.memory] = {i: t.clone() for i, t in getattr(self, self.memory).items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        if self.memory is not None:
            setattr(self, self.memory, {int(i): t.clone() for i, t in state.get(self.memory, {}).items()})

    def forget_nonfinite(self) -> None:
        """After a step skipped for non-finite gradients: zeroes the NaN and Inf entries of the :attr:`memory`, so
        that they do not poison the next steps."""
        if self.memory is not None:
            zero_nonfinite_(getattr(self, self.memory).values())
