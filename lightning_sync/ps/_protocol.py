"""Messages between worker clients and servers (private helper): a fixed-size int64 header (:class:`Request`,
:class:`ReplyHeader`, their fields in order), then, if its ``payload_nbytes`` > 0, one uint8 payload on its own tag.
Gloo aborts the process when a receive buffer and the data sent differ in size, so payload sizes are only ever taken
from the header that announces them.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any

import torch

HEADER_SLOTS = 14
#: Size in bytes of every header on the wire.
HEADER_BYTES = HEADER_SLOTS * 8

TAG_REQUEST = 101
TAG_REQUEST_DATA = 102
TAG_REPLY = 103
TAG_REPLY_DATA = 104

FLAG_STOP = 1  # reply: training is over
FLAG_NOT_APPLIED = 2  # reply to a push: the gradient was not applied (the run had stopped)
FLAG_SKIPPED = 4  # reply to a push: the step was skipped, a pushed gradient held NaN or Inf
FLAG_NONFINITE = 2  # PUSH request: this worker's gradient held NaN or Inf, so only its learning rates travel


CLIP_NONE, CLIP_VALUE, CLIP_NORM = 0, 1, 2
#: Lightning's names of the clipping algorithms, by code.
CLIP_ALGORITHMS = {"value": CLIP_VALUE, "norm": CLIP_NORM}


@dataclass(frozen=True)
class Clip:
    """Gradient clipping the server applies before a step: ``algorithm`` (:data:`CLIP_VALUE` or :data:`CLIP_NORM`)
    at ``value``."""

    algorithm: int
    value: float


class Kind(IntEnum):
    INIT = 1
    PULL = 2
    PUSH = 3
    STOP = 4
    GET_STATE = 5
    STATS = 7  # 6 was SET_STATE, removed
    BYE = 8


class Status(IntEnum):
    OK = 0
    ERROR = 1


class StopCode(IntEnum):
    NONE = 0
    MAX_UPDATES = 1
    REQUESTED = 2


@dataclass
class Request:
    """Worker to server (:data:`TAG_REQUEST`); ``optimizer``: the one a push steps; ``clip``: how the server clips its
    gradient, on the wire as the algorithm and the value's float64 bits."""

    kind: Kind
    worker: int
    version: int
    payload_nbytes: int
    checksum: int
    flags: int
    optimizer: int = 0
    clip: Clip | None = None

    def header(self) -> torch.Tensor:
        values = [int(self.kind), self.worker, self.version, self.payload_nbytes, self.checksum, self.flags]
        clip = self.clip if self.clip is not None else Clip(CLIP_NONE, 0.0)
        bits = int(torch.tensor([float(clip.value)], dtype=torch.float64).view(torch.int64))
        values += [self.optimizer, clip.algorithm, bits]
        return torch.tensor(values + [0] * (HEADER_SLOTS - len(values)), dtype=torch.int64)

    @classmethod
    def parse(cls, header: torch.Tensor) -> Request:
        v = header.tolist()
        value = float(header[8:9].view(torch.float64))
        clip = Clip(v[7], value) if v[7] != CLIP_NONE else None
        return cls(Kind(v[0]), v[1], v[2], v[3], v[4], v[5], v[6], clip)


@dataclass
class ReplyHeader:
    """Server to worker (:data:`TAG_REPLY`); the fields of :class:`~lightning_sync.ps.client.PSReply`, per server."""

    kind: Kind
    status: Status = Status.OK
    version: int = 0
    flags: int = 0
    payload_nbytes: int = 0
    bytes_recv: int = 0
    staleness: int = -1
    stop_code: StopCode = StopCode.NONE
    stop_worker: int = -1
    clock: int = 0
    min_clock: int = 0
    live_workers: int = 0
    lost_workers: int = 0
    joins: int = 0

    def header(self) -> torch.Tensor:
        return torch.tensor([int(getattr(self, f.name)) for f in fields(self)], dtype=torch.int64)

    @classmethod
    def parse(cls, header: torch.Tensor) -> ReplyHeader:
        reply = cls(*header.tolist())
        reply.kind, reply.status, reply.stop_code = Kind(reply.kind), Status(reply.status), StopCode(reply.stop_code)
        return reply


def to_blob(obj: Any) -> torch.Tensor:
    """``obj`` (plain values and tensors) serialized by ``torch.save`` into a uint8 tensor."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def from_blob(blob: torch.Tensor) -> Any:
    """Inverse of :func:`to_blob`; only plain values and tensors are accepted (``weights_only``)."""
    return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)


def stop_reason(code: StopCode, worker: int, max_updates: Any = None) -> str:
    """Human-readable reason of a stop."""
    if code == StopCode.MAX_UPDATES:
        return "max_updates reached" if max_updates is None else f"max_updates={max_updates} reached"
    if code == StopCode.REQUESTED:
        return f"worker {worker} requested stop"
    return ""
