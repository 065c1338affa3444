"""Encoding of pushed gradients for a point-to-point transport: ``none``, ``fp16``, ``bf16``, ``topk``.

A worker encodes each server's share of the gradients into one uint8 buffer; the server decodes it into an fp32
vector of the shard (layout order). Bytes on the wire are the encoded size, so the meter counts compressed pushes at
their real size:

==============  =====================================================================================
``none``        the gradients in the parameters' own dtype (fp32 model: 4 bytes per entry)
``fp16``        cast to float16 (2 bytes per entry)
``bf16``        cast to bfloat16 (2 bytes per entry)
``topk``        the ``ceil(density * n)`` entries of largest magnitude of the shard: int32 indices, then fp32
                values (8 bytes per kept entry; int64 indices past 2**31 entries); with error feedback the
                entries not sent stay on the worker and are added to the next push to that server
==============  =====================================================================================

PowerSGD is not offered: it averages low-rank factors with all-reduces across the workers, which a push to a
server does not have.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from lightning_sync.ps._layout import ShardLayout, as_bytes
from lightning_sync.ps.settings import PSConfig

_CAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


class GradientCodec:
    """Encodes one worker's pushes, per server, and decodes them on the server.

    Args:
        compression: one of :data:`~lightning_sync.ps.settings.COMPRESSIONS`.
        topk_density: fraction of entries ``topk`` keeps, in ``(0, 1]``.
        error_feedback: with ``topk``, carry what was left out into the next push (per server).

    Raises:
        ValueError: bad ``compression`` (``powersgd`` included) or ``topk_density``.
    """

    def __init__(self, compression: str = "none", topk_density: float = 0.01, error_feedback: bool = True) -> None:
        PSConfig(compression=compression, topk_density=topk_density, error_feedback=error_feedback)  # validates
        self.compression = compression
        self.topk_density = float(topk_density)
        self.error_feedback = bool(error_feedback)
        self.residuals: dict[int, torch.Tensor] = {}

    @classmethod
    def from_config(cls, config: PSConfig) -> GradientCodec:
        return cls(config.compression, config.topk_density, config.error_feedback)

    # ---------------------------------------------------------------- sizes
    def topk_count(self, numel: int) -> int:
        """How many entries ``topk`` sends for a shard of ``numel`` entries (at least one, at most all)."""
        return min(numel, max(1, math.ceil(self.topk_density * numel))) if numel else 0

    @staticmethod
    def _index_dtype(numel: int) -> torch.dtype:
        return torch.int32 if numel < 2**31 else torch.int64

    def payload_nbytes(self, layout: ShardLayout) -> int:
        """Exact size in bytes of an encoded push of one shard."""
        if self.compression == "none":
            return layout.nbytes
        if self.compression in _CAST:
            return 2 * layout.numel
        k = self.topk_count(layout.numel)
        return k * (torch.empty(0, dtype=self._index_dtype(layout.numel)).element_size() + 4)

    # ---------------------------------------------------------------- worker side
    def encode(self, server: int, layout: ShardLayout, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """One shard's gradients (shard order; ``None`` = zeros) as a new uint8 buffer for ``server``.

        Guarantees: the buffer has :meth:`payload_nbytes` bytes; with ``topk`` and error feedback, the residual of
        ``server`` becomes what this push left out.
        """
        if self.compression == "none":
            return layout.pack(grads)
        if self.compression in _CAST:
            return as_bytes(layout.flat_fp32(grads).to(_CAST[self.compression]))
        flat = layout.flat_fp32(grads)
        if self.error_feedback and server in self.residuals:
            flat.add_(self.residuals[server])
        k = self.topk_count(layout.numel)
        _, indices = torch.topk(flat.abs(), k, sorted=False)
        values = flat[indices]
        if self.error_feedback:
            flat[indices] = 0.0
            self.residuals[server] = flat
        return torch.cat([as_bytes(indices.to(self._index_dtype(layout.numel))), as_bytes(values)])

    # ---------------------------------------------------------------- server side
    def decode(self, payload: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
        """The fp32 gradient vector (layout order) of an encoded push; may be a view of ``payload``.

        Raises:
            ValueError: ``payload`` does not have :meth:`payload_nbytes` bytes.
        """
        expected = self.payload_nbytes(layout)
        if payload.numel() != expected:
            raise ValueError(f"a {self.compression} push of this shard has {expected} bytes, got {payload.numel()}")
        if self.compression == "none":
            if all(d == torch.float32 for d in layout.dtypes):
                return payload.view(torch.float32)
            return layout.flat_fp32(layout.views(payload))
        if self.compression in _CAST:
            return payload.view(_CAST[self.compression]).to(torch.float32)
        k = self.topk_count(layout.numel)
        index_dtype = self._index_dtype(layout.numel)
        index_bytes = k * torch.empty(0, dtype=index_dtype).element_size()
        indices = payload[:index_bytes].view(index_dtype).to(torch.int64)
        values = payload[index_bytes:].view(torch.float32)
        dense = torch.zeros(layout.numel, dtype=torch.float32)
        dense.index_put_((indices,), values)
        return dense

    # ---------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Settings and the per-server residuals (cloned)."""
        return {
            "compression": self.compression,
            "topk_density": self.topk_density,
            "residuals": {k: r.clone() for k, r in self.residuals.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`.

        Raises:
            ValueError: the state was saved with another compression or density.
        """
        if state.get("compression") != self.compression or float(state.get("topk_density", -1)) != self.topk_density:
            raise ValueError(
                f"codec state was saved with compression={state.get('compression')!r}, "
                f"topk_density={state.get('topk_density')!r}; this codec has {self.compression!r}, {self.topk_density}"
            )
        self.residuals = {int(k): r.clone() for k, r in state.get("residuals", {}).items()}
