"""Dense compressors: the bucket all-reduced as it is, or cast to fp16 / bf16 for the wire."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch.distributed import ProcessGroup

from lightning_sync.comm.compression.base import Compressor, FlatBucket, _completed
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.tuning import MIB, MIN_CHUNK_MB, PARALLEL_CHUNKS
from lightning_sync.errors import check_range


class CastCompression(Compressor):
    """Ring all-reduce of the bucket, cast to ``wire_dtype`` for the wire (``None``: sent as it is), then the mean.

    The payload is divided by the world size before the sum (unless the owner already did), which also keeps a
    16-bit sum in range. A payload of at least ``2 * min_chunk_mb`` goes as ``parallel_chunks`` concurrent
    all-reduces of slices, which gloo runs on separate threads.

    Args:
        parallel_chunks: the most slices one payload is split into (1: never split).
        min_chunk_mb: the smallest slice, in MiB.
    """

    wire_dtype: ClassVar[torch.dtype | None] = None
    capabilities = frozenset({"point_to_point"})

    def __init__(self, parallel_chunks: int = PARALLEL_CHUNKS, min_chunk_mb: float = MIN_CHUNK_MB) -> None:
        super().__init__()
        check_range("parallel_chunks", parallel_chunks, low=1, integer=True)
        check_range("min_chunk_mb", min_chunk_mb, low=0, low_open=True)
        self.parallel_chunks = int(parallel_chunks)
        self.min_chunk_bytes = min_chunk_mb * MIB

    def average(self, bucket: FlatBucket, meter: CommMeter, group: ProcessGroup | None = None) -> torch.futures.Future:
        n = meter.world_size(group)
        buffer = bucket.buffer
        if n == 1:
            return _completed(buffer)
        wire = buffer if self.wire_dtype is None else buffer.to(self.wire_dtype)
        if not bucket.divided:
            wire.div_(n)
        chunks = max(1, min(self.parallel_chunks, int(wire.numel() * wire.element_size() // self.min_chunk_bytes)))
        futures = [meter.all_reduce(part, group=group, async_op=True).get_future() for part in wire.chunk(chunks)]
        done = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)

        def _decode(done: torch.futures.Future) -> torch.Tensor:
            done.value()  # the first failed slice's error (collect_all ends at a failure, before the other slices)
            if wire is not buffer:
                buffer.copy_(wire)
            return buffer

        return done.then(_decode)

    def packed_nbytes(self, numel: int) -> int:
        return numel * (self.wire_dtype or torch.float32).itemsize

    def pack(self, flat: torch.Tensor, key: int) -> torch.Tensor:
        return flat.to(self.wire_dtype or torch.float32).view(torch.uint8)

    def unpack(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        self._check_packed(payload, numel)
        return payload.view(self.wire_dtype or torch.float32).to(torch.float32)


class NoCompression(CastCompression):
    """Plain all-reduce in the buffer's own dtype (fp32 for fp32 gradients): the exact mean.

    Example::

        >>> from lightning_sync import AllReduceStrategy
        >>> strategy = AllReduceStrategy(compression=NoCompression())  # as compression="none"
        >>> NoCompression().packed_nbytes(3)  # a parameter-server push: 3 fp32 values
        12
    """

    name = "none"


class FP16Compression(CastCompression):
    """IEEE half precision on the wire (pre-divided by the world size to keep the sum in range).

    Example::

        >>> codec = FP16Compression()
        >>> codec.unpack(codec.pack(torch.tensor([1.0, 1e-8, 3.14159]), key=0), 3)  # 1e-8 is below fp16's range
        tensor([1.0000, 0.0000, 3.1406])
    """

    name = "fp16"
    wire_dtype = torch.float16


class BF16Compression(CastCompression):
    """bfloat16 on the wire: fp32's range, 8 bits of mantissa.

    Example::

        >>> codec = BF16Compression()
        >>> codec.unpack(codec.pack(torch.tensor([1.0, 1e-8, 3.14159]), key=0), 3)  # fp32's range, 8 bits of mantissa
        tensor([1.0000e+00, 1.0012e-08, 3.1406e+00])
    """

    name = "bf16"
    wire_dtype = torch.bfloat16
