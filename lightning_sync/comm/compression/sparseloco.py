"""SparseLoCo's outer codec: error feedback, top-k per chunk, 2-bit values, one all-gather (arXiv 2508.15706)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from lightning_sync.comm.compression.base import Compressor, FlatBucket, _completed
from lightning_sync.comm.meter import CommMeter
from lightning_sync.errors import ConfigError, check_range

Segment = tuple[int, int, int, int, int]
"""``(start, rows, width, kept per row, tensor)``: ``rows`` chunks of ``width`` entries from ``start`` of the bucket."""


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Integers in ``[0, 2**width)``, shape ``(..., m)``, as uint8 ``(..., ceil(m * width / 8))`` (low bit first)."""
    shifts = torch.arange(width, device=values.device, dtype=torch.int32)
    bits = ((values.to(torch.int32).unsqueeze(-1) >> shifts) & 1).to(torch.uint8).flatten(-2)
    bits = F.pad(bits, (0, -bits.shape[-1] % 8)).unflatten(-1, (-1, 8))
    return (bits << torch.arange(8, device=values.device, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The ``count`` int64 integers of :func:`pack_bits`'s ``packed`` (shape ``(..., bytes)``)."""
    bits = (packed.to(torch.int32).unsqueeze(-1) >> torch.arange(8, device=packed.device, dtype=torch.int32)) & 1
    bits = bits.flatten(-2)[..., : count * width].unflatten(-1, (count, width)).to(torch.int64)
    return (bits << torch.arange(width, device=packed.device)).sum(-1)


def _floats(rows: torch.Tensor) -> torch.Tensor:
    """The fp32 values of uint8 ``rows`` ``(m, 4 * j)``, as ``(m, j)`` (copied: a row may start unaligned)."""
    return rows.reshape(-1).clone().view(torch.float32).view(rows.shape[0], -1)


def clip_to_median_(values: torch.Tensor) -> torch.Tensor:
    """Scales each row of ``values`` (one rank's contribution each) whose L2 norm is above the median of the rows'
    norms down to that norm, in place. With an even count the median is the lower middle one (``torch.median``)."""
    norms = values.norm(dim=1)
    median = norms.median()
    values.mul_(torch.where(norms > median, median / norms, torch.ones_like(norms)).unsqueeze(1))
    return values


class SparseLoCo(Compressor):
    """Averages a bucket as SparseLoCo does: each rank sends the top-k of every chunk of its error-fed buffer.

    Per call and bucket, on every rank: ``e = error_decay * e + buffer`` (fp32, kept per ``bucket.index``); each
    tensor, flattened, is cut into chunks of ``chunk`` entries, of which the ``topk`` of largest ``|e|`` are kept (a
    shorter chunk of ``len`` entries keeps ``ceil(topk * len / chunk)``, so the payload size follows from the shapes).
    The kept values are quantized and ``e`` loses what is sent. One ``all_gather_into_tensor`` of the uint8 payloads
    follows; every rank decodes every rank's contribution (optionally :func:`clip_to_median_`) and ``bucket.buffer``
    becomes their sum times ``bucket.scale(n)``. With one rank the codec still runs.

    Quantizer (``bits`` b): a sign bit and a level of ``b - 1`` bits; per tensor, the ``2**(b-1)`` levels are equal
    bins of the range of the kept ``|values|``, each decoding to its bin's mean ``|value|`` (``bits=None``: fp32
    values). A NaN or Inf kept makes the decoded mean non-finite on every rank. The payload (:meth:`payload_nbytes`)
    holds the bin means, the codes and the in-chunk indices at ``log2(chunk)`` bits: about 0.22 bit per parameter
    at the defaults.

    Args:
        topk: entries kept per full chunk, in ``[1, chunk]``.
        chunk: entries per chunk, a power of two >= 2.
        bits: 1, 2, 4 or 8 bits per kept value, or ``None`` for fp32 values.
        error_decay: ``beta`` of ``e = beta * e + buffer``, in ``[0, 1]``.
        clip_to_median: scale each rank's contribution down to the median of the ranks' L2 norms when above it
            (computed from the gathered payloads on every rank alike: no extra collective).

    Example::

        >>> codec = SparseLoCo(topk=64, chunk=4096, bits=2)
        >>> codec
        SparseLoCo(topk=64, chunk=4096, bits=2, error_decay=0.95, clip_to_median=False)
        >>> codec.payload_nbytes([torch.Size([256, 128]), torch.Size([128])])  # 32896 parameters, 0.22 bit each
        916
    """

    name = "sparseloco"
    capabilities = frozenset({"across_groups"})
    memory = "errors"

    def __init__(
        self,
        topk: int = 64,
        chunk: int = 4096,
        bits: int | None = 2,
        error_decay: float = 0.95,
        clip_to_median: bool = False,
    ) -> None:
        super().__init__()
        check_range("chunk", chunk, low=2, integer=True)
        if chunk & (chunk - 1):
            raise ConfigError(f"chunk={chunk!r} is not allowed; it must be a power of two >= 2")
        check_range("topk", topk, low=1, high=chunk, integer=True)
        if isinstance(bits, bool) or bits not in (1, 2, 4, 8, None):
            raise ConfigError(f"bits={bits!r} is not allowed; choose 1, 2, 4, 8 or None (fp32 values)")
        check_range("error_decay", error_decay, low=0, high=1)
        self.topk, self.chunk, self.bits = topk, chunk, bits
        self.error_decay, self.clip_to_median = float(error_decay), bool(clip_to_median)
        self.index_bits = chunk.bit_length() - 1
        self.levels = 1 if bits is None else 1 << (bits - 1)
        self.errors: dict[int, torch.Tensor] = {}

    def segments(self, shapes: list[torch.Size]) -> list[Segment]:
        """The runs of equal chunks of a bucket with these ``shapes``, in payload order."""
        out, start = [], 0
        for tensor, shape in enumerate(shapes):
            numel = math.prod(shape)
            full, tail = divmod(numel, self.chunk)
            if full:
                out.append((start, full, self.chunk, self.topk, tensor))
            if tail:
                out.append((start + full * self.chunk, 1, tail, -(-self.topk * tail // self.chunk), tensor))
            start += numel
        return out

    def payload_nbytes(self, shapes: list[torch.Size]) -> int:
        """Bytes each rank contributes to the all-gather for a bucket of these ``shapes``."""
        kept = sum(rows * k for _, rows, _, k, _ in self.segments(shapes))
        head = 4 * kept if self.bits is None else 4 * self.levels * len(shapes) + -(-kept * self.bits // 8)
        return head + -(-kept * self.index_bits // 8)

    def _quantize(self, values: torch.Tensor, tensor: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes of ``values`` (sign bit over the level) and the fp32 bin means, ``levels`` per tensor."""
        assert self.bits is not None
        mag = values.abs()
        lo = mag.new_zeros(count).scatter_reduce(0, tensor, mag, "amin", include_self=False)
        hi = mag.new_zeros(count).scatter_reduce(0, tensor, mag, "amax", include_self=False)
        step = (hi - lo) / self.levels
        step = torch.where(step > 0, step, torch.ones_like(step))
        level = ((mag - lo[tensor]) / step[tensor]).floor_().nan_to_num_(0.0).clamp_(0, self.levels - 1).long()
        slot = tensor * self.levels + level
        sums = mag.new_zeros(count * self.levels).index_add_(0, slot, mag)
        counts = mag.new_zeros(count * self.levels).index_add_(0, slot, torch.ones_like(mag))
        return level | ((values < 0).long() << (self.bits - 1)), sums / counts.clamp_min(1.0)

    def encode(self, values: torch.Tensor, indices: torch.Tensor, tensor: torch.Tensor, count: int) -> torch.Tensor:
        """The uint8 payload of the kept ``values`` (fp32) at in-chunk ``indices`` of tensors ``tensor``."""
        if self.bits is None:
            head = [values.view(torch.uint8)]
        else:
            codes, means = self._quantize(values, tensor, count)
            head = [means.view(torch.uint8), pack_bits(codes, self.bits)]
        return torch.cat([*head, pack_bits(indices, self.index_bits)])

    def decode(
        self, payloads: torch.Tensor, base: torch.Tensor, tensor: torch.Tensor, count: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket positions and fp32 values, each ``(m, kept)``, of ``m`` payloads ``(m, bytes)``."""
        kept = base.numel()
        if self.bits is None:
            cut = 4 * kept
            values = _floats(payloads[:, :cut])
        else:
            cut = 4 * self.levels * count
            means = _floats(payloads[:, :cut])
            code_bytes = -(-kept * self.bits // 8)
            codes = unpack_bits(payloads[:, cut : cut + code_bytes], self.bits, kept)
            cut += code_bytes
            sign = 1.0 - 2.0 * (codes >> (self.bits - 1)).to(torch.float32)
            values = means.gather(1, tensor * self.levels + (codes & (self.levels - 1))) * sign
        return base + unpack_bits(payloads[:, cut:], self.index_bits, kept), values

    def average(self, bucket: FlatBucket, meter: CommMeter, group: ProcessGroup | None = None) -> torch.futures.Future:
        n = meter.world_size(group)
        buffer = bucket.buffer
        numel = buffer.numel()
        if numel == 0:
            return _completed(buffer)
        error, flat = self.errors.get(bucket.index), buffer.detach().reshape(-1)
        if sum(math.prod(s) for s in bucket.shapes) != numel or (error is not None and error.numel() != numel):
            raise ValueError(
                f"SparseLoCo: bucket {bucket.index} has {numel} entries, which its shapes or its error buffer (from an "
                "earlier call) do not add up to; bucket indices must keep their layout"
            )
        if error is None:
            error = flat.to(torch.float32, copy=True)
        else:
            error = error.to(flat.device).mul_(self.error_decay).add_(flat)
        self.errors[bucket.index] = error

        segments, count = self.segments(bucket.shapes), len(bucket.shapes)
        values, indices, bases, owners = [], [], [], []  # kept values, in-chunk indices, chunk offsets, tensors
        for start, rows, width, k, owner in segments:
            block = error[start : start + rows * width].view(rows, width)
            picked = block.abs().topk(k, dim=1, sorted=False).indices
            values.append(block.gather(1, picked).reshape(-1))
            indices.append(picked.reshape(-1))
            bases.append((start + torch.arange(rows, device=error.device) * width).repeat_interleave(k))
            owners.append(torch.full((rows * k,), owner, device=error.device))
        base, tensor = torch.cat(bases), torch.cat(owners)
        payload = self.encode(torch.cat(values), torch.cat(indices), tensor, count)
        positions, sent = self.decode(payload.unsqueeze(0), base, tensor, count)
        error[positions[0]] -= sent[0]  # sent + kept == decay * old + buffer

        gathered = payload if n == 1 else torch.empty(n * payload.numel(), dtype=torch.uint8, device=payload.device)

        def _finish(done: torch.futures.Future | None) -> torch.Tensor:
            if done is not None:
                done.value()  # re-raises the error of a failed all-gather (``gathered`` is garbage then)
            positions, contributions = self.decode(gathered.view(n, -1), base, tensor, count)
            if self.clip_to_median:
                clip_to_median_(contributions)
            mean = torch.zeros(numel, dtype=torch.float32, device=buffer.device)
            for r in range(n):  # one rank at a time: no index repeats within a call, so GPUs add deterministically
                mean.index_add_(0, positions[r], contributions[r])
            buffer.copy_(mean.mul_(bucket.scale(n)).view_as(buffer))
            return buffer

        if n == 1:
            return _completed(_finish(None))
        work = meter.all_gather_into_tensor(gathered, payload, group=group, async_op=True)
        return work.get_future().then(_finish)
