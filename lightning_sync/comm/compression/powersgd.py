"""PowerSGD: low-rank gradient compression by one step of power iteration, with error feedback and warm start."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup
from typing_extensions import override

from lightning_sync.comm.compression.base import Compressor, FlatBucket, _completed
from lightning_sync.comm.compression.cast import NoCompression
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.nonfinite import zero_nonfinite_
from lightning_sync.errors import check_range


@dataclass
class _PowerSGDMemory:
    """What PowerSGD keeps for one bucket between calls."""

    shapes: list[torch.Size]
    generator: torch.Generator
    q: list[torch.Tensor]  # one (m, rank) factor per compressed matrix, identical on all ranks
    residuals: list[torch.Tensor | None]  # one (n, m) error-feedback residual per compressed matrix


class PowerSGDCompression(Compressor):
    """Low-rank gradient compression by one step of power iteration (Vogels et al., 2019, "PowerSGD").

    While ``steps < start_iter`` it is exactly :class:`NoCompression`. After that, per bucket:

    * every tensor with ``ndim >= 2`` is viewed as a matrix ``M`` of shape ``(shape[0], prod(shape[1:]))``; it is
      compressed iff ``rank * (n + m) < n * m``. Every other tensor (biases, small matrices) goes, packed into one
      flat buffer, through one plain all-reduce;
    * for the compressed matrices (with error feedback ``M += residual`` first): ``P = M @ Q``; all ``P`` are
      all-reduced packed in one buffer; each ``P`` is orthonormalised; ``Q = M^T @ P``; all ``Q`` are all-reduced
      packed in one buffer and divided by the world size; the approximation ``P @ Q^T`` (= ``P P^T mean(M)``) is
      written back into the bucket and ``residual = M - approximation``.

    A compressed ``n x m`` matrix so puts ``rank * (n + m)`` fp32 values on the wire. ``Q`` is drawn from a generator
    seeded with ``seed + bucket.index``, or with ``warm_start`` is the previous step's (a column that became exactly
    zero redrawn). Results are bit-identical on all ranks; with one rank the buffer is returned untouched. The ``P``
    all-reduce is waited for in :meth:`average` and the ``Q`` one issued from the calling thread: from a completion
    callback it could reach gloo in a different order on different ranks.

    Args:
        rank: the rank of the approximation (``>= 1``).
        start_iter: number of initial steps averaged without compression (``>= 0``).
        error_feedback: keep ``M - approximation`` and add it to the next call's matrix.
        warm_start: reuse the previous ``Q`` instead of drawing a fresh one each call.
        seed: seed of the per-bucket generator (``seed + bucket.index``).

    Example::

        >>> from lightning_sync import AllReduceStrategy, DDPSyncStrategy
        >>> strategy = AllReduceStrategy(compression=PowerSGDCompression(rank=2, start_iter=0))
        >>> strategy.config.compression
        PowerSGDCompression(rank=2, start_iter=0, error_feedback=True, warm_start=True, seed=0)
        >>> hooked = DDPSyncStrategy(comm_hook="powersgd")  # torch DDP with this codec as its communication hook
    """

    name = "powersgd"

    def __init__(
        self,
        rank: int = 4,
        start_iter: int = 10,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_range("rank", rank, low=1, integer=True)
        check_range("start_iter", start_iter, low=0, integer=True)
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.seed = int(seed)
        self._memory: dict[int, _PowerSGDMemory] = {}
        self._uncompressed = NoCompression()

    def is_compressed(self, shape: torch.Size) -> bool:
        """Whether a tensor of this shape is sent as rank-``rank`` factors (else it is all-reduced as is)."""
        if len(shape) < 2:
            return False
        n, m = shape[0], math.prod(shape[1:])
        return self.rank * (n + m) < n * m

    def _memory_for(self, bucket: FlatBucket, device: torch.device) -> _PowerSGDMemory:
        shapes = [torch.Size(s) for s in bucket.shapes]
        mem = self._memory.get(bucket.index)
        if mem is None:
            generator = torch.Generator(device="cpu").manual_seed(self.seed + bucket.index)
            mem = self._memory[bucket.index] = _PowerSGDMemory(shapes=shapes, generator=generator, q=[], residuals=[])
        elif mem.shapes != shapes:
            raise ValueError(
                f"PowerSGDCompression: bucket {bucket.index} changed layout from {mem.shapes} to {shapes}; "
                "bucket indices must keep their layout"
            )
        return mem

    def _initial_q(self, mem: _PowerSGDMemory, slot: int, m: int, device: torch.device) -> torch.Tensor:
        """The ``Q`` to multiply with for compressed matrix number ``slot`` (identical on all ranks)."""
        if self.warm_start and slot < len(mem.q):
            q = mem.q[slot].to(device)
            dead = q.abs().sum(dim=0) == 0
            if bool(dead.any()):
                fresh = torch.randn(m, self.rank, generator=mem.generator).to(device)
                q = torch.where(dead.unsqueeze(0), fresh, q)
            return q
        return torch.randn(m, self.rank, generator=mem.generator).to(device)

    def average(self, bucket: FlatBucket, meter: CommMeter, group: ProcessGroup | None = None) -> torch.futures.Future:
        if self.steps < self.start_iter:
            return self._uncompressed.average(bucket, meter, group)
        world = meter.world_size(group)
        buffer = bucket.buffer
        if world == 1:
            return _completed(buffer)
        device = buffer.device
        mem = self._memory_for(bucket, device)

        views = bucket.views()
        compressed = [i for i, v in enumerate(views) if self.is_compressed(v.shape)]
        plain = [i for i, v in enumerate(views) if not self.is_compressed(v.shape)]

        # Remainder: one flat uncompressed all-reduce of the pre-divided tensors.
        pending: list[torch.futures.Future] = []
        rest: torch.Tensor | None = None
        if plain and sum(views[i].numel() for i in plain) > 0:
            rest = torch.cat([views[i].reshape(-1) for i in plain]).mul_(bucket.scale(world))
            pending.append(meter.all_reduce(rest, group=group, async_op=True).get_future())

        # Matrices (plus residuals), and P = M @ Q for all of them packed into one buffer.
        mats: list[torch.Tensor] = []
        ps: list[torch.Tensor] = []
        q_flat: torch.Tensor | None = None
        if compressed:
            qs = []
            for slot, i in enumerate(compressed):
                mat = views[i].reshape(views[i].shape[0], -1).to(torch.float32, copy=True)
                residual = mem.residuals[slot] if self.error_feedback and slot < len(mem.residuals) else None
                if residual is not None:
                    mat.add_(residual.to(device))
                mats.append(mat)
                qs.append(self._initial_q(mem, slot, mat.shape[1], device))
            p_flat = torch.cat([(mat @ q).reshape(-1) for mat, q in zip(mats, qs)])
            meter.all_reduce(p_flat, group=group, async_op=True).wait()

            # Orthonormalise each P by Householder QR (no NaN for a rank-deficient P, and deterministic); Q = M^T @ P.
            for mat, part in zip(mats, p_flat.split([mat.shape[0] * self.rank for mat in mats])):
                ps.append(torch.linalg.qr(part.view(mat.shape[0], self.rank))[0])
            q_flat = torch.cat([(mat.t() @ p).reshape(-1) for mat, p in zip(mats, ps)])
            pending.append(meter.all_reduce(q_flat, group=group, async_op=True).get_future())

        def _decode(done: Any) -> torch.Tensor:
            if done is not None:
                done.value()  # the first failed collective's error (collect_all ends at a failure)
            if rest is not None:
                for i, part in zip(plain, rest.split([views[i].numel() for i in plain])):
                    views[i].copy_(part.view_as(views[i]))
            if q_flat is not None:
                q_flat.mul_(bucket.scale(world))
                residual_share = 1.0 / world if bucket.divided else 1.0
                new_q, new_res = [], []
                q_parts = q_flat.split([mat.shape[1] * self.rank for mat in mats])
                for i, mat, p, part in zip(compressed, mats, ps, q_parts):
                    q = part.view(mat.shape[1], self.rank)
                    approx = p @ q.t()
                    views[i].copy_(approx.view_as(views[i]))
                    new_q.append(q.clone())
                    # ``mat`` is this rank's share: the full gradient, or gradient / world when ``divided``;
                    # the residual is what the mean's approximation left out of it, in the same units.
                    new_res.append(mat.sub_(approx, alpha=residual_share) if self.error_feedback else None)
                mem.q = new_q if self.warm_start else []
                mem.residuals = new_res if self.error_feedback else []
            return buffer

        if not pending:
            return _completed(_decode(None))
        return torch.futures.collect_all(pending).then(_decode)

    def state_dict(self) -> dict[str, Any]:
        """Step count and, per bucket index, the layout, generator state, ``Q`` factors and residuals (cloned)."""
        buckets = {
            i: {
                "shapes": [tuple(s) for s in m.shapes],
                "generator": m.generator.get_state(),
                "q": m.q,
                "residuals": m.residuals,
            }
            for i, m in self._memory.items()
        }
        return {"steps": self.steps, "rank": self.rank, "buckets": copy.deepcopy(buckets)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "rank" in state and int(state["rank"]) != self.rank:
            raise ValueError(f"PowerSGDCompression: state was saved with rank {state['rank']}, not {self.rank}")
        self._memory = {}
        for i, saved in copy.deepcopy(state.get("buckets", {})).items():
            generator = torch.Generator(device="cpu")
            generator.set_state(saved["generator"])
            shapes = [torch.Size(s) for s in saved["shapes"]]
            self._memory[int(i)] = _PowerSGDMemory(shapes, generator, saved["q"], saved["residuals"])

    @override
    def forget_nonfinite(self) -> None:
        """Redraws a bucket's ``Q`` factors when any holds a NaN or Inf (they are all-reduced, so every rank does
        the same), and zeroes the non-finite entries of the residuals (each rank's own)."""
        for mem in self._memory.values():
            if not all(bool(q.isfinite().all()) for q in mem.q):
                mem.q = []
            zero_nonfinite_(r for r in mem.residuals if r is not None)
