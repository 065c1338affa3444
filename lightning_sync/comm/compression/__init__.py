"""Gradient compression shared by every sync mode.

A :class:`Compressor` averages one :class:`FlatBucket` over a process group. It owns the encoding, the collectives
(issued through a :class:`~lightning_sync.comm.meter.CommMeter`, so the meter sees the compressed payload) and the
decoding, and writes the mean back into the bucket's buffer in place. The same objects serve the DDP comm hook,
the bucketed all-reduce and periodic averaging.

Compressors with memory (error-feedback residuals, PowerSGD's warm-start factors) keep it per bucket index; it is
part of :meth:`Compressor.state_dict`, so it goes into checkpoints.

Nothing here knows of Lightning.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.distributed import ProcessGroup
from typing_extensions import override

from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.nonfinite import zero_nonfinite_
from lightning_sync.comm.tuning import MIB, MIN_CHUNK_MB, PARALLEL_CHUNKS, ROUNDING_SLACK
from lightning_sync.errors import check_choice, check_range


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


class CastCompression(Compressor):
    """Ring all-reduce of the bucket, cast to ``wire_dtype`` for the wire (``None``: sent as it is), then the mean.

    The payload is divided by the world size before the sum (unless the owner already did), which also keeps a
    16-bit sum in range. A payload of at least ``2 * min_chunk_mb`` is sent as ``parallel_chunks`` all-reduces of
    contiguous slices, launched together: gloo runs concurrent collectives on separate worker threads (two by
    default), so a large transfer uses more than one core while the rank waits for it. The bytes are the same.

    Args:
        parallel_chunks: the most slices one payload is split into (1: never split).
        min_chunk_mb: the smallest slice, in MiB.
    """

    wire_dtype: ClassVar[torch.dtype | None] = None

    def __init__(self, parallel_chunks: int = PARALLEL_CHUNKS, min_chunk_mb: float = MIN_CHUNK_MB) -> None:
        super().__init__()
        check_range("parallel_chunks", parallel_chunks, low=1, integer=True)
        check_range("min_chunk_mb", min_chunk_mb, low=0, low_open=True)
        self.parallel_chunks = int(parallel_chunks)
        self.min_chunk_bytes = min_chunk_mb * MIB

    def _slices(self, wire: torch.Tensor) -> list[torch.Tensor]:
        nbytes = wire.numel() * wire.element_size()
        chunks = max(1, min(self.parallel_chunks, int(nbytes // self.min_chunk_bytes)))
        return list(wire.chunk(chunks)) if chunks > 1 else [wire]

    def average(self, bucket: FlatBucket, meter: CommMeter, group: ProcessGroup | None = None) -> torch.futures.Future:
        n = meter.world_size(group)
        buffer = bucket.buffer
        if n == 1:
            return _completed(buffer)
        wire = buffer if self.wire_dtype is None else buffer.to(self.wire_dtype)
        if not bucket.divided:
            wire.div_(n)
        futures = [meter.all_reduce(part, group=group, async_op=True).get_future() for part in self._slices(wire)]
        done = futures[0] if len(futures) == 1 else torch.futures.collect_all(futures)

        def _decode(done: torch.futures.Future) -> torch.Tensor:
            done.value()  # the first failed slice's error (collect_all ends at a failure, before the other slices)
            if wire is not buffer:
                buffer.copy_(wire)
            return buffer

        return done.then(_decode)


class NoCompression(CastCompression):
    """Plain all-reduce in the buffer's own dtype (fp32 for fp32 gradients): the exact mean."""

    name = "none"


class FP16Compression(CastCompression):
    """IEEE half precision on the wire (pre-divided by the world size to keep the sum in range)."""

    name = "fp16"
    wire_dtype = torch.float16


class BF16Compression(CastCompression):
    """bfloat16 on the wire: fp32's range, 8 bits of mantissa."""

    name = "bf16"
    wire_dtype = torch.bfloat16


# ---------------------------------------------------------------------------------------------------------- top-k
class TopKCompression(Compressor):
    """Sparsification: each rank sends only its ``k`` largest-magnitude entries, with error feedback.

    Per bucket and call, with ``numel`` entries and ``k = max(1, ceil(density * numel))``:

    1. with error feedback, the residual kept from this bucket's previous call is added to the gradient;
    2. the ``k`` entries of largest magnitude are picked; their fp32 values and int32 indices are packed (values
       bit-cast to int32) into one ``2k``-element tensor and exchanged with a single ``all_gather_into_tensor``,
       so the meter counts exactly ``(n-1) * k * 8`` bytes sent per rank;
    3. every rank scatter-adds all ranks' contributions into a zeroed fp32 buffer, divides by the world size and
       writes that estimate of the mean into ``bucket.buffer``. All ranks get bit-identical results.
    4. with error feedback, the residual becomes ``(gradient + old residual) - what this rank sent``, so nothing is
       lost, only delayed.

    With one rank the buffer already is the mean and is returned untouched (no residual is kept).

    Args:
        density: fraction of the entries sent, in ``(0, 1]``.
        error_feedback: keep what was not sent and add it to the next call's gradient.
    """

    name = "topk"

    def __init__(self, density: float, error_feedback: bool = True) -> None:
        super().__init__()
        check_range("topk_density", density, low=0, high=1, low_open=True)
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
        assert numel < 2**31, "TopKCompression: int32 indices need buckets of fewer than 2**31 entries"

        acc = buffer.detach().reshape(-1).to(torch.float32, copy=True)
        if self.error_feedback:
            residual = self.residuals.get(bucket.index)
            if residual is not None:
                if residual.numel() != numel:
                    raise ValueError(
                        f"TopKCompression: bucket {bucket.index} has {numel} entries but its residual has "
                        f"{residual.numel()}; bucket indices must keep their layout"
                    )
                acc.add_(residual.to(acc.device))

        k = self.num_selected(numel)
        _, indices = torch.topk(acc.abs(), k, sorted=False)
        values = acc[indices]
        if self.error_feedback:
            acc[indices] = 0.0  # what stays behind is exactly (grad + old residual) - sent
            self.residuals[bucket.index] = acc

        payload = torch.cat([values.view(torch.int32), indices.to(torch.int32)])
        gathered = torch.empty(n * 2 * k, dtype=torch.int32, device=payload.device)
        work = meter.all_gather_into_tensor(gathered, payload, group=group, async_op=True)

        def _decode(done: torch.futures.Future) -> torch.Tensor:
            done.value()  # re-raises the error of a failed all-gather (``gathered`` is garbage then)
            per_rank = gathered.view(n, 2, k)
            all_values = per_rank[:, 0, :].reshape(-1).view(torch.float32)
            all_indices = per_rank[:, 1, :].reshape(-1).to(torch.int64)
            dense = torch.zeros(numel, dtype=torch.float32, device=payload.device)
            dense.index_add_(0, all_indices, all_values)
            if not bucket.divided:
                dense.div_(n)
            buffer.copy_(dense.view_as(buffer))
            return buffer

        return work.get_future().then(_decode)

    def state_dict(self) -> dict[str, Any]:
        """Step count and the per-bucket residuals (cloned)."""
        return {"steps": self.steps, "residuals": {i: r.clone() for i, r in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.residuals = {int(i): r.clone() for i, r in state.get("residuals", {}).items()}

    @override
    def forget_nonfinite(self) -> None:
        """Zeroes the NaN and Inf entries of the residuals (each rank's own)."""
        zero_nonfinite_(self.residuals.values())


# ------------------------------------------------------------------------------------------------------- PowerSGD
@dataclass
class _PowerSGDMemory:
    """What PowerSGD keeps for one bucket between calls."""

    shapes: list[torch.Size]
    generator: torch.Generator
    q: list[torch.Tensor]  # one (m, rank) factor per compressed matrix, identical on all ranks
    residuals: list[torch.Tensor | None]  # one (n, m) error-feedback residual per compressed matrix


def _orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning the columns of ``p`` (``n x r``, ``r <= n``), via Householder QR.

    Householder QR always returns orthonormal columns, also for rank-deficient or all-zero ``p`` (no division by a
    vanishing norm, hence no NaN). It is deterministic, so ranks holding identical ``p`` get identical results.
    """
    q, _ = torch.linalg.qr(p, mode="reduced")
    return q


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

    So a compressed ``n x m`` matrix puts exactly ``rank * (n + m)`` fp32 values on the wire. ``Q`` starts from a
    :class:`torch.Generator` seeded with ``seed + bucket.index`` (identical on all ranks); with ``warm_start`` the
    previous step's (all-reduced, hence identical) ``Q`` is reused, otherwise a fresh one is drawn from that
    generator every call. A warm-started column that became exactly zero (e.g. after an all-zero gradient) is
    redrawn, so the factor cannot collapse. Results are bit-identical on all ranks.

    Every collective is issued from the calling thread, in program order: the ``P`` all-reduce (and the remainder's)
    is launched asynchronously and waited for in :meth:`average`, then the ``Q`` all-reduce is launched
    asynchronously and the returned future completes after it. Issuing the second collective from a completion
    callback instead is unsafe on gloo with several buckets in flight: a blocking call there starves gloo's worker
    threads (deadlock), an asynchronous one can reach the process group in a different order on different ranks.

    With one rank the buffer already is the mean and is returned untouched.

    Args:
        rank: the rank of the approximation (``>= 1``).
        start_iter: number of initial steps averaged without compression (``>= 0``).
        error_feedback: keep ``M - approximation`` and add it to the next call's matrix.
        warm_start: reuse the previous ``Q`` instead of drawing a fresh one each call.
        seed: seed of the per-bucket generator (``seed + bucket.index``).
    """

    name = "powersgd"

    def __init__(
        self,
        rank: int,
        start_iter: int = 0,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_range("powersgd_rank", rank, low=1, integer=True)
        check_range("powersgd_start_iter", start_iter, low=0, integer=True)
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.seed = int(seed)
        self._memory: dict[int, _PowerSGDMemory] = {}
        self._uncompressed = NoCompression()

    # ------------------------------------------------------------------ layout
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
            generator = torch.Generator(device="cpu")
            generator.manual_seed(self.seed + bucket.index)
            mem = _PowerSGDMemory(shapes=shapes, generator=generator, q=[], residuals=[])
            self._memory[bucket.index] = mem
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

    # ------------------------------------------------------------------ averaging
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
        rest: torch.Tensor | None = None
        rest_fut: torch.futures.Future | None = None
        if plain and sum(views[i].numel() for i in plain) > 0:
            rest = torch.cat([views[i].reshape(-1) for i in plain]).mul_(bucket.scale(world))
            rest_fut = meter.all_reduce(rest, group=group, async_op=True).get_future()

        # Matrices (plus residuals), and P = M @ Q for all of them packed into one buffer.
        mats: list[torch.Tensor] = []
        ps: list[torch.Tensor] = []
        q_flat: torch.Tensor | None = None
        q_fut: torch.futures.Future | None = None
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

            # Orthonormalise each P (identical on all ranks); Q = M^T @ P, packed into one buffer.
            offset = 0
            for mat in mats:
                numel = mat.shape[0] * self.rank
                ps.append(_orthonormalize(p_flat[offset : offset + numel].view(mat.shape[0], self.rank)))
                offset += numel
            q_flat = torch.cat([(mat.t() @ p).reshape(-1) for mat, p in zip(mats, ps)])
            q_fut = meter.all_reduce(q_flat, group=group, async_op=True).get_future()

        pending = [f for f in (rest_fut, q_fut) if f is not None]

        def _decode(done: Any) -> torch.Tensor:
            if done is not None:
                done.value()  # the first failed collective's error (collect_all ends at a failure)
            if rest is not None:
                offset = 0
                for i in plain:
                    numel = views[i].numel()
                    views[i].copy_(rest[offset : offset + numel].view_as(views[i]))
                    offset += numel
            if q_flat is not None:
                q_flat.mul_(bucket.scale(world))
                residual_share = 1.0 / world if bucket.divided else 1.0
                new_q, new_res, offset = [], [], 0
                for i, mat, p in zip(compressed, mats, ps):
                    numel = mat.shape[1] * self.rank
                    q = q_flat[offset : offset + numel].view(mat.shape[1], self.rank)
                    offset += numel
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

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Step count and, per bucket index, the layout, generator state, ``Q`` factors and residuals (cloned)."""
        return {
            "steps": self.steps,
            "rank": self.rank,
            "buckets": {
                i: {
                    "shapes": [tuple(s) for s in mem.shapes],
                    "generator": mem.generator.get_state().clone(),
                    "q": [q.clone() for q in mem.q],
                    "residuals": [None if r is None else r.clone() for r in mem.residuals],
                }
                for i, mem in self._memory.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "rank" in state and int(state["rank"]) != self.rank:
            raise ValueError(f"PowerSGDCompression: state was saved with rank {state['rank']}, not {self.rank}")
        memory: dict[int, _PowerSGDMemory] = {}
        for i, saved in state.get("buckets", {}).items():
            generator = torch.Generator(device="cpu")
            generator.set_state(saved["generator"].clone())
            memory[int(i)] = _PowerSGDMemory(
                shapes=[torch.Size(s) for s in saved["shapes"]],
                generator=generator,
                q=[q.clone() for q in saved["q"]],
                residuals=[None if r is None else r.clone() for r in saved["residuals"]],
            )
        self._memory = memory

    @override
    def forget_nonfinite(self) -> None:
        """Redraws a bucket's ``Q`` factors when any holds a NaN or Inf (they are all-reduced, so every rank does
        the same), and zeroes the non-finite entries of the residuals (each rank's own)."""
        for mem in self._memory.values():
            if not all(bool(q.isfinite().all()) for q in mem.q):
                mem.q = []
            zero_nonfinite_(r for r in mem.residuals if r is not None)


# -------------------------------------------------------------------------------------------------------- factory
COMPRESSORS = ("none", "fp16", "bf16", "topk", "powersgd")


def build_compressor(
    name: str,
    *,
    topk_density: float = 0.01,
    error_feedback: bool = True,
    powersgd_rank: int = 4,
    powersgd_start_iter: int = 0,
    powersgd_warm_start: bool = True,
    field: str = "compression",
) -> Compressor:
    """A fresh compressor by name (one of :data:`COMPRESSORS`); options not used by that compressor are ignored.

    Args:
        field: the knob that chose ``name``, for the error message.

    Raises:
        ConfigError: ``name`` is not one of :data:`COMPRESSORS`, or an option of the chosen compressor is out of
            range.
    """
    check_choice(field, name, COMPRESSORS)
    if name == "topk":
        return TopKCompression(topk_density, error_feedback=error_feedback)
    if name == "powersgd":
        return PowerSGDCompression(
            powersgd_rank,
            start_iter=powersgd_start_iter,
            error_feedback=error_feedback,
            warm_start=powersgd_warm_start,
        )
    return {"none": NoCompression, "fp16": FP16Compression, "bf16": BF16Compression}[name]()


def compressor_factory(name: str, **options: Any) -> Callable[[], Compressor]:
    """A function that builds fresh, identically configured compressors; checks ``name`` and ``options`` now.

    Use it where a component needs one compressor per bucket group but the knobs should fail early (for example in
    a strategy's constructor, before any process starts).
    """
    build_compressor(name, **options)
    return functools.partial(build_compressor, name, **options)
