"""How one shard's tensors are laid out in a flat byte buffer on the wire (private helper)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor as a flat uint8 tensor (a view when the tensor is contiguous)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


class ShardLayout:
    """The tensors of one shard in one byte buffer, largest element size first (then in shard order), so each slice
    can be viewed in its own dtype without padding; the shard's flat fp32 form (gradients) has the same order.

    Args:
        shapes: shape of each tensor, in shard order.
        dtypes: dtype of each tensor, in shard order.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> None:
        if len(shapes) != len(dtypes):
            raise ValueError(f"got {len(shapes)} shapes but {len(dtypes)} dtypes")
        self.shapes = [torch.Size(s) for s in shapes]
        self.dtypes = list(dtypes)
        self.numels = [s.numel() for s in self.shapes]
        self.itemsize = [torch.empty(0, dtype=d).element_size() for d in self.dtypes]
        self.order = sorted(range(len(self.shapes)), key=lambda j: (-self.itemsize[j], j))
        self.byte_offsets = [0] * len(self.shapes)
        self.offsets = [0] * len(self.shapes)  # element offsets in the flat fp32 form
        nbytes = numel = 0
        for j in self.order:
            self.byte_offsets[j], self.offsets[j] = nbytes, numel
            nbytes += self.numels[j] * self.itemsize[j]
            numel += self.numels[j]
        self.nbytes = nbytes
        self.numel = numel

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> ShardLayout:
        """The layout of these tensors."""
        return cls([t.shape for t in tensors], [t.dtype for t in tensors])

    def signature(self) -> str:
        """A text form of the layout, for checksums and the server's check of the INIT."""
        return ";".join(f"{list(s)}:{d}" for s, d in zip(self.shapes, self.dtypes))

    def pack(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """A new uint8 buffer with the bytes of ``tensors`` (shard order; ``None`` counts as zeros)."""
        parts = []
        for j in self.order:
            t = tensors[j]
            if t is None:
                t = torch.zeros(self.shapes[j], dtype=self.dtypes[j])
            parts.append(as_bytes(t.detach().to("cpu", self.dtypes[j])))
        if not parts:
            return torch.empty(0, dtype=torch.uint8)
        return torch.cat(parts)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Views of a buffer made by :meth:`pack` as the shard's tensors (shard order, own dtype and shape)."""
        if buffer.dtype != torch.uint8 or buffer.numel() != self.nbytes:
            raise ValueError(f"expected {self.nbytes} bytes (uint8), got {buffer.numel()} of {buffer.dtype}")
        spans = zip(self.byte_offsets, self.numels, self.itemsize, self.dtypes, self.shapes)
        return [buffer[start : start + n * size].view(dtype).view(shape) for start, n, size, dtype, shape in spans]

    def unpack_into(self, buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Copies a packed buffer into ``tensors`` in place (their device and dtype are kept)."""
        with torch.no_grad():
            for view, t in zip(self.views(buffer), tensors):
                t.copy_(view)

    def flat_fp32(self, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """A new fp32 vector of all ``tensors`` (``None`` counts as zeros), in layout order."""
        flat = torch.zeros(self.numel, dtype=torch.float32)
        for j, t in enumerate(tensors):
            if t is not None:
                flat[self.offsets[j] : self.offsets[j] + self.numels[j]].copy_(t.detach().reshape(-1))
        return flat

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat vector (layout order) as the shard's shapes, in shard order."""
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]
