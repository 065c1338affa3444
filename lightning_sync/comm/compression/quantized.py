"""Block-wise int8 / int4 averaging of a bucket, summed in fp32: the outer gradients of streaming DiLoCo.

The payload, zero-padded to a multiple of ``n * BLOCK`` entries, travels per block of :data:`BLOCK` entries as
integer codes in ``[-q, q]`` (``q = 2**(bits-1) - 1``; int4 packs two codes per byte) and one fp32 scale
``absmax / q``, rounded to nearest (no random state). A NaN or Inf makes its block's decoded mean non-finite on
every rank. An ``all_to_all_single`` sends chunk ``j`` of each rank's codes to rank ``j``, which sums the ``n``
copies in fp32; each rank requantizes its reduced chunk and an ``all_gather`` brings every chunk to every rank, so
every rank decodes the same mean, bit for bit, having sent ``2(n-1)/n`` of the quantized payload. The first phase
is waited for inside :meth:`~BlockQuantizedCompression.average`: an owner that must not block calls it from a worker
thread (:mod:`lightning_sync.comm.streaming`).
"""

from __future__ import annotations

from typing import ClassVar, cast

import torch
from torch.distributed import ProcessGroup

from lightning_sync.comm.compression.base import Compressor, FlatBucket, _completed
from lightning_sync.comm.meter import CommMeter

BLOCK = 256
"""Entries per fp32 scale (1/64 byte per entry: int4 takes 1/7.76 of fp32's bytes, int8 1/3.94)."""


class BlockQuantizedCompression(Compressor):
    """Averages a bucket as block-scaled integer codes of :attr:`bits` bits, reduced in fp32 (see the module
    docstring)."""

    bits: ClassVar[int]
    levels: ClassVar[int]  # 2 ** (bits - 1) - 1
    capabilities = frozenset({"across_groups"})

    def chunk_bytes(self, entries: int) -> int:
        """Bytes of ``entries`` (a multiple of :data:`BLOCK`) once encoded: codes, then fp32 scales."""
        return entries * self.bits // 8 + entries // BLOCK * 4

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (fp32, length a multiple of :data:`BLOCK`) as a uint8 tensor: codes, then scales."""
        blocks = values.view(-1, BLOCK)
        # amax propagates NaN and keeps Inf: a block holding either gets a non-finite scale, so it decodes
        # to non-finite values (0 * Inf and 0 * NaN are NaN) without a pass of its own to look for them
        scales = blocks.abs().amax(dim=1, keepdim=True) / self.levels
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / safe).nan_to_num_(0.0).clamp_(-self.levels, self.levels).to(torch.int8).reshape(-1)
        if self.bits == 4:
            nibbles = (codes + 8).to(torch.uint8).view(-1, 2)
            packed = nibbles[:, 0] | (nibbles[:, 1] << 4)
        else:
            packed = codes.view(torch.uint8)
        return torch.cat([packed, scales.reshape(-1).view(torch.uint8)])

    def decode(self, encoded: torch.Tensor, entries: int) -> torch.Tensor:
        """The fp32 values of :meth:`encode`'s output for ``entries`` values."""
        code_bytes = entries * self.bits // 8
        packed, scales = encoded[:code_bytes], encoded[code_bytes:].view(torch.float32)
        if self.bits == 4:
            codes = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1).to(torch.float32) - 8.0
        else:
            codes = packed.view(torch.int8).to(torch.float32)
        return (codes.view(-1, BLOCK) * scales.view(-1, 1)).reshape(-1)

    def average(self, bucket: FlatBucket, meter: CommMeter, group: ProcessGroup | None = None) -> torch.futures.Future:
        n = meter.world_size(group)
        buffer = bucket.buffer
        numel = buffer.numel()
        if n == 1 or numel == 0:
            return _completed(buffer)
        chunk = -(-numel // (n * BLOCK)) * BLOCK  # n chunks of whole blocks, zero-padded
        padded = torch.zeros(n * chunk, dtype=torch.float32, device=buffer.device)
        padded[:numel].copy_(buffer.reshape(-1))

        # 1. reduce-scatter from all_to_all: chunk j of every rank goes to rank j, summed there in fp32 in rank order
        sent = torch.cat([self.encode(part) for part in padded.view(n, -1)])
        received = torch.empty_like(sent)
        meter.all_to_all_single(received, sent, group=group, async_op=True).wait()
        # n > 1 here, so the sum is a tensor, never sum()'s start value 0
        reduced = cast(torch.Tensor, sum(self.decode(part, chunk) for part in received.view(n, -1)))
        reduced.mul_(bucket.scale(n))

        # 2. all-gather of the requantized reduced chunks
        gathered = torch.empty(n * self.chunk_bytes(chunk), dtype=torch.uint8, device=buffer.device)
        work = meter.all_gather_into_tensor(gathered, self.encode(reduced), group=group, async_op=True)

        def _decode(done: torch.futures.Future) -> torch.Tensor:
            done.value()  # the all-gather's error, if it failed
            mean = torch.cat([self.decode(part, chunk) for part in gathered.view(n, -1)])
            buffer.copy_(mean[:numel].view_as(buffer))
            return buffer

        return work.get_future().then(_decode)


class Int8Compression(BlockQuantizedCompression):
    """int8 codes with an fp32 scale per :data:`BLOCK` entries.

    Example::

        >>> from lightning_sync import PeriodicSyncStrategy
        >>> strategy = PeriodicSyncStrategy(mode="diloco", sync_every=16, outer_compression=Int8Compression())
    """

    name = "int8"
    bits = 8
    levels = 127


class Int4Compression(BlockQuantizedCompression):
    """int4 codes (two per byte) with an fp32 scale per :data:`BLOCK` entries.

    Example::

        >>> from lightning_sync import PeriodicSyncStrategy
        >>> strategy = PeriodicSyncStrategy(mode="diloco", sync_every=16, fragments=4, outer_compression=Int4Compression())
    """

    name = "int4"
    bits = 4
    levels = 7
