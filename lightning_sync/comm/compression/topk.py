"""Top-k sparsification with error feedback."""

from __future__ import annotations

import math

import torch
from torch.distributed import ProcessGroup

from lightning_sync.comm.compression.base import Compressor, FlatBucket, _completed
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.tuning import ROUNDING_SLACK
from lightning_sync.errors import check_range


class TopKCompression(Compressor):
    """Sparsification: each rank sends only its ``k`` largest-magnitude entries, with error feedback.

    Per bucket and call, with ``k = max(1, ceil(density * numel))``: the residual of the bucket's previous call is
    added (error feedback), and the ``k`` entries of largest magnitude (:meth:`pack`: int32 indices, fp32 values)
    go in one ``all_gather_into_tensor`` (``(n-1) * k * 8`` bytes sent per rank); every rank adds all contributions
    in rank order and divides by the world size, bit-identically. The residual becomes what was not sent: nothing
    is lost, only delayed. With one rank the buffer is returned untouched.

    Args:
        density: fraction of the entries sent, in ``(0, 1]``.
        error_feedback: keep what was not sent and add it to the next call's gradient.

    Example::

        >>> codec = TopKCompression(density=0.25)  # 1 of these 4 values
        >>> codec.unpack(codec.pack(torch.tensor([0.1, -3.0, 0.2, 2.0]), key=0), 4)
        tensor([ 0., -3.,  0.,  0.])
        >>> codec.residuals[0]  # added to the next push of key 0
        tensor([0.1000, 0.0000, 0.2000, 2.0000])
    """

    name = "topk"
    capabilities = frozenset({"point_to_point"})
    memory = "residuals"

    def __init__(self, density: float = 0.01, error_feedback: bool = True) -> None:
        super().__init__()
        check_range("density", density, low=0, high=1, low_open=True)
        self.density = float(density)
        self.error_feedback = bool(error_feedback)
        self.residuals: dict[int, torch.Tensor] = {}

    def num_selected(self, numel: int) -> int:
        """``k = max(1, ceil(density * numel))``, capped at ``numel`` (float noise is ignored)."""
        return min(numel, max(1, math.ceil(self.density * numel - ROUNDING_SLACK)))

    def average(self, bucket: FlatBucket, meter: CommMeter, group: ProcessGroup | None = None) -> torch.futures.Future:
        n = meter.world_size(group)
        buffer = bucket.buffer
        numel = buffer.numel()
        if n == 1 or numel == 0:
            return _completed(buffer)
        payload = self.pack(buffer.detach().reshape(-1).to(torch.float32, copy=True), bucket.index)
        gathered = torch.empty(n * payload.numel(), dtype=torch.uint8, device=payload.device)
        work = meter.all_gather_into_tensor(gathered, payload, group=group, async_op=True)

        def _decode(done: torch.futures.Future) -> torch.Tensor:
            done.value()  # re-raises the error of a failed all-gather (``gathered`` is garbage then)
            dense = torch.zeros(numel, dtype=torch.float32, device=payload.device)
            for part in gathered.view(n, -1):  # rank by rank: the same sum on every rank
                dense.add_(self.unpack(part, numel))
            if not bucket.divided:
                dense.div_(n)
            buffer.copy_(dense.view_as(buffer))
            return buffer

        return work.get_future().then(_decode)

    def _select(self, acc: torch.Tensor, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The values and indices of the ``k`` largest entries of ``acc`` (fp32, 1-D, owned) plus ``key``'s residual,
        which becomes what stays behind (with error feedback)."""
        if self.error_feedback:
            residual = self.residuals.get(key)
            if residual is not None:
                if residual.numel() != acc.numel():
                    raise ValueError(
                        f"TopKCompression: payload {key} has {acc.numel()} entries but its residual has "
                        f"{residual.numel()}; keys must keep their layout"
                    )
                acc.add_(residual.to(acc.device))
        _, indices = torch.topk(acc.abs(), self.num_selected(acc.numel()), sorted=False)
        values = acc[indices]
        if self.error_feedback:
            acc[indices] = 0.0  # what stays behind is exactly (grad + old residual) - sent
            self.residuals[key] = acc
        return values, indices

    def _index_dtype(self, numel: int) -> torch.dtype:
        return torch.int32 if numel < 2**31 else torch.int64

    def packed_nbytes(self, numel: int) -> int:
        """``k`` indices (int32; int64 past 2**31 entries), then ``k`` fp32 values."""
        return self.num_selected(numel) * (self._index_dtype(numel).itemsize + 4) if numel else 0

    def pack(self, flat: torch.Tensor, key: int) -> torch.Tensor:
        if not flat.numel():
            return torch.empty(0, dtype=torch.uint8)
        values, indices = self._select(flat, key)
        return torch.cat([indices.to(self._index_dtype(flat.numel())).view(torch.uint8), values.view(torch.uint8)])

    def unpack(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        self._check_packed(payload, numel)
        split = self.num_selected(numel) * self._index_dtype(numel).itemsize if numel else 0
        indices = payload[:split].view(self._index_dtype(numel)).to(torch.int64)
        dense = torch.zeros(numel, dtype=torch.float32, device=payload.device)
        dense.index_put_((indices,), payload[split:].view(torch.float32))
        return dense
