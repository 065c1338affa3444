"""Compressors on a real 2-rank gloo group: the mean they produce, the bytes the meter counts, their memory."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from lightning_sync.comm.compression import (
    CODECS,
    BF16Compression,
    Compressor,
    FlatBucket,
    FP16Compression,
    NoCompression,
    PowerSGDCompression,
    TopKCompression,
    resolve_codec,
)
from lightning_sync.comm.meter import CommMeter, ring_all_reduce_bytes
from lightning_sync.errors import ConfigError


# ---------------------------------------------------------------------------------------------------------- helpers
def _tensors(rank: int, shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.Tensor]:
    """Per-rank deterministic random tensors (any rank can recompute any other rank's)."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return [torch.randn(*shape, generator=gen) for shape in shapes]


def _bucket(tensors: list[torch.Tensor], index: int = 0) -> FlatBucket:
    return FlatBucket(
        index=index,
        buffer=torch.cat([t.reshape(-1) for t in tensors]).clone(),
        shapes=[t.shape for t in tensors],
    )


def _exact_mean(world_size: int, shapes: list[tuple[int, ...]], seed: int = 0) -> torch.Tensor:
    per_rank = [_bucket(_tensors(r, shapes, seed)).buffer for r in range(world_size)]
    return torch.stack(per_rank).mean(dim=0)


def _same_on_all_ranks(tensor: torch.Tensor, world_size: int) -> None:
    """Asserts that ``tensor`` is bit-identical on every rank (uses dist directly, not the meter)."""
    gathered = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(gathered, tensor.contiguous())
    for other in gathered:
        assert torch.equal(other, tensor), "ranks disagree"


def _average(comp: Compressor, bucket: FlatBucket, meter: CommMeter) -> torch.Tensor:
    out = comp.average(bucket, meter).wait()
    assert out is bucket.buffer, "the future must resolve to bucket.buffer"
    return out


# -------------------------------------------------------------------------------------- none / fp16 / bf16
def _check_dense(rank: int, world_size: int, name: str, elem: int, tol: float) -> None:
    shapes = [(40, 25), (25,), (3, 7, 2)]
    numel = sum(math.prod(s) for s in shapes)
    comp = resolve_codec(name)()
    meter = CommMeter()
    out = _average(comp, _bucket(_tensors(rank, shapes)), meter)
    torch.testing.assert_close(out, _exact_mean(world_size, shapes), rtol=tol, atol=tol)
    stats = meter.step()
    assert stats.bytes_sent == pytest.approx(2 * (world_size - 1) / world_size * numel * elem)
    assert stats.calls == 1
    _same_on_all_ranks(out, world_size)


@pytest.mark.dist
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "cls", "elem", "tol"),
    [("none", NoCompression, 4, 1e-6), ("fp16", FP16Compression, 2, 2e-3), ("bf16", BF16Compression, 2, 2e-2)],
)
def test_dense_exact_mean_and_bytes(name: str, cls: type, elem: int, tol: float) -> None:
    assert isinstance(resolve_codec(name)(), cls)
    run_ranks(_check_dense, name, elem, tol)


# ------------------------------------------------------------------------------------------------------------ top-k
def _check_topk_full_density(rank: int, world_size: int) -> None:
    shapes = [(30, 10), (10,)]
    comp = TopKCompression(1.0)
    out = _average(comp, _bucket(_tensors(rank, shapes)), CommMeter())
    torch.testing.assert_close(out, _exact_mean(world_size, shapes), rtol=1e-6, atol=1e-6)
    # Everything was sent, so nothing is left behind.
    assert torch.count_nonzero(comp.residuals[0]) == 0


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_topk_density_one_is_exact_mean() -> None:
    run_ranks(_check_topk_full_density)


def _check_topk_bytes(rank: int, world_size: int) -> None:
    numel, k = 1000, 10  # density 0.01
    comp = TopKCompression(0.01)
    assert comp.num_selected(numel) == k
    meter = CommMeter()
    grad = _tensors(rank, [(numel,)])[0]
    out = _average(comp, FlatBucket(0, grad.clone(), [torch.Size([numel])]), meter)
    stats = meter.step()
    assert stats.bytes_sent == (world_size - 1) * k * (4 + 4)
    assert stats.bytes_recv == (world_size - 1) * k * (4 + 4)
    assert stats.calls == 1
    # The output is the mean of the ranks' top-k entries: at most n*k non-zeros, and this rank's top-k are in it.
    assert torch.count_nonzero(out) <= world_size * k
    top = grad.abs().topk(k).indices
    assert torch.count_nonzero(out[top]) == k
    # Error feedback: the residual is the gradient minus what was sent.
    residual = comp.residuals[0]
    assert torch.count_nonzero(residual[top]) == 0
    mask = torch.ones(numel, dtype=torch.bool)
    mask[top] = False
    assert torch.equal(residual[mask], grad[mask])
    _same_on_all_ranks(out, world_size)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_topk_bytes_are_k_values_and_k_indices() -> None:
    run_ranks(_check_topk_bytes)


def _check_topk_error_feedback(rank: int, world_size: int) -> None:
    numel, steps = 200, 300
    grad = _tensors(rank, [(numel,)], seed=3)[0]
    mean = _exact_mean(world_size, [(numel,)], seed=3)
    errors = {}
    for feedback in (True, False):
        comp = TopKCompression(0.05, error_feedback=feedback)
        meter = CommMeter()
        total = torch.zeros(numel)
        for _ in range(steps):
            total += _average(comp, FlatBucket(7, grad.clone(), [torch.Size([numel])]), meter)
            comp.advance()
        errors[feedback] = ((total / steps - mean).norm() / mean.norm()).item()
        if feedback:
            # Nothing is lost: n * sum of outputs + all ranks' residuals == steps * sum of gradients.
            residual_sum = comp.residuals[7].clone()
            dist.all_reduce(residual_sum)
            torch.testing.assert_close(
                world_size * total + residual_sum, steps * world_size * mean, rtol=1e-4, atol=1e-2
            )
    assert errors[True] < 0.1, errors
    assert errors[False] > 0.5, errors


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_topk_error_feedback_converges_to_mean() -> None:
    run_ranks(_check_topk_error_feedback)


# --------------------------------------------------------------------------------------------------------- PowerSGD
# A compressed 32x64 matrix (rank 4: 4*96 < 2048), a bias, and a 2x3 matrix too small to compress (4*5 >= 6).
_PSGD_SHAPES = [(32, 64), (64,), (2, 3)]


def _check_powersgd_bytes(rank: int, world_size: int) -> None:
    comp = PowerSGDCompression(rank=4, start_iter=2)
    meter = CommMeter()
    numel = sum(math.prod(s) for s in _PSGD_SHAPES)
    assert [comp.is_compressed(torch.Size(s)) for s in _PSGD_SHAPES] == [True, False, False]
    for step in range(2):  # before start_iter: exactly NoCompression
        out = _average(comp, _bucket(_tensors(rank, _PSGD_SHAPES, seed=step)), meter)
        torch.testing.assert_close(out, _exact_mean(world_size, _PSGD_SHAPES, seed=step), rtol=1e-6, atol=1e-6)
        stats = meter.step()
        assert stats.bytes_sent == pytest.approx(ring_all_reduce_bytes(numel * 4, world_size))
        assert stats.calls == 1
        comp.advance()
    out = _average(comp, _bucket(_tensors(rank, _PSGD_SHAPES, seed=2)), meter)
    stats = meter.step()
    factors = 4 * (32 + 64) * 4
    uncompressed = (64 + 6) * 4
    expected = ring_all_reduce_bytes(factors, world_size) + ring_all_reduce_bytes(uncompressed, world_size)
    assert stats.bytes_sent == pytest.approx(expected)
    assert stats.calls == 3  # P, Q and the uncompressed remainder
    # The uncompressed part is the exact mean; the compressed one is the same on all ranks.
    exact = _exact_mean(world_size, _PSGD_SHAPES, seed=2)
    torch.testing.assert_close(out[32 * 64 :], exact[32 * 64 :], rtol=1e-6, atol=1e-6)
    _same_on_all_ranks(out, world_size)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_powersgd_bytes_before_and_after_start_iter() -> None:
    run_ranks(_check_powersgd_bytes)


def _check_powersgd_low_rank(rank: int, world_size: int) -> None:
    gen = torch.Generator().manual_seed(5)  # the same on all ranks
    u, v = torch.randn(48, 1, generator=gen), torch.randn(1, 3, 5, 4, generator=gen)
    matrix = (u @ v.reshape(1, -1)).reshape(48, 3, 5, 4)  # rank-1 4-d tensor, viewed as 48x60
    bias = torch.randn(48, generator=gen)
    comp = PowerSGDCompression(rank=2, start_iter=0)
    meter = CommMeter()
    out = _average(comp, _bucket([matrix, bias], index=3), meter)
    torch.testing.assert_close(out[: matrix.numel()].view_as(matrix), matrix, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[matrix.numel() :], bias, rtol=1e-6, atol=1e-6)
    assert meter.step().bytes_sent == pytest.approx(
        ring_all_reduce_bytes(2 * (48 + 60) * 4, world_size) + ring_all_reduce_bytes(48 * 4, world_size)
    )
    _same_on_all_ranks(out, world_size)

    # Different random matrices per rank: lossy, but identical on all ranks and finite; a zero gradient gives a
    # zero output without NaN (no error feedback, which would send the residual), and the all-zero warm-start
    # factor it leaves behind is redrawn, so later steps are not stuck at zero.
    comp = PowerSGDCompression(rank=2, start_iter=0, seed=11, error_feedback=False)
    for step, scale in enumerate((1.0, 0.0, 1.0, 1.0)):
        tensors = [t * scale for t in _tensors(rank, [(20, 30), (30,)], seed=step)]
        out = _average(comp, _bucket(tensors, index=1), meter)
        comp.advance()
        assert torch.isfinite(out).all()
        _same_on_all_ranks(out, world_size)
        if scale == 0.0:
            assert torch.count_nonzero(out) == 0
        else:
            assert out[:600].norm() > 0


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_powersgd_low_rank_exact_and_ranks_agree() -> None:
    run_ranks(_check_powersgd_low_rank)


def _check_powersgd_error_feedback(rank: int, world_size: int) -> None:
    # On a constant gradient, error feedback makes the running average of the outputs approach the true mean.
    shapes = [(16, 24)]
    mean = _exact_mean(world_size, shapes, seed=9)
    errors = {}
    for feedback in (True, False):
        comp = PowerSGDCompression(rank=1, start_iter=0, error_feedback=feedback)
        meter = CommMeter()
        total, steps = torch.zeros(mean.numel()), 200
        for _ in range(steps):
            total += _average(comp, _bucket(_tensors(rank, shapes, seed=9)), meter)
            comp.advance()
        errors[feedback] = ((total / steps - mean).norm() / mean.norm()).item()
    assert errors[True] < 0.1, errors
    assert errors[False] > 0.3, errors


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_powersgd_error_feedback_converges_to_mean() -> None:
    run_ranks(_check_powersgd_error_feedback)


# ------------------------------------------------------------------------------- several buckets, resumed state
def _check_buckets_in_flight(rank: int, world_size: int) -> None:
    # Several buckets launched before any is waited for: no deadlock, each gets its own result.
    layouts = [[(40, 50), (50,)], [(64, 32)], [(7,), (30, 30)]]
    for comp in (PowerSGDCompression(rank=2, start_iter=0), TopKCompression(1.0)):
        meter = CommMeter()
        buckets = [_bucket(_tensors(rank, shapes, seed=i), index=i) for i, shapes in enumerate(layouts)]
        futures = [comp.average(b, meter) for b in buckets]
        for i, (fut, shapes) in enumerate(zip(futures, layouts)):
            out = fut.wait()
            _same_on_all_ranks(out, world_size)
            if isinstance(comp, TopKCompression):  # density 1: lossless
                torch.testing.assert_close(out, _exact_mean(world_size, shapes, seed=i), rtol=1e-6, atol=1e-6)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_buckets_in_flight_do_not_deadlock() -> None:
    run_ranks(_check_buckets_in_flight)


def _roundtrip(comp: Compressor) -> dict:
    buf = io.BytesIO()
    torch.save(comp.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _check_state_dict(rank: int, world_size: int) -> None:
    shapes = [(24, 40), (40,), (12, 5, 5)]
    makers = {
        "topk": lambda: TopKCompression(0.1),
        "powersgd": lambda: PowerSGDCompression(rank=2, start_iter=1, seed=4),
        "powersgd_cold": lambda: PowerSGDCompression(rank=2, start_iter=0, warm_start=False, seed=4),
    }
    for name, make in makers.items():
        comp, meter = make(), CommMeter()
        for step in range(3):
            for index in (0, 1):
                _average(comp, _bucket(_tensors(rank, shapes, seed=10 * step + index), index=index), meter)
            comp.advance()
        state = _roundtrip(comp)
        resumed = make()
        resumed.load_state_dict(state)
        assert resumed.steps == 3
        for step in (3, 4):
            for index in (0, 1):
                grads = _tensors(rank, shapes, seed=10 * step + index)
                a = _average(comp, _bucket(grads, index=index), meter)
                b = _average(resumed, _bucket(grads, index=index), meter)
                assert torch.equal(a, b), f"{name}: resumed run differs at step {step}, bucket {index}"
            comp.advance()
            resumed.advance()
        # The state is a copy: running on does not change a state_dict taken earlier.
        before = comp.state_dict()
        _average(comp, _bucket(_tensors(rank, shapes, seed=99)), meter)
        after = comp.state_dict()
        key = "residuals" if name == "topk" else "buckets"
        assert before[key].keys() == after[key].keys()
        if name == "topk":
            assert not torch.equal(before["residuals"][0], after["residuals"][0])


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_state_dict_roundtrip_is_bit_exact() -> None:
    run_ranks(_check_state_dict)


# ---------------------------------------------------------------------------------------------------------- factory
@pytest.mark.unit
@pytest.mark.timeout(60)
def test_the_codec_registry_names_objects_and_errors() -> None:
    assert list(CODECS) == ["none", "fp16", "bf16", "topk", "powersgd", "int8", "int4", "sparseloco"]
    assert [resolve_codec(n)().name for n in CODECS] == list(CODECS)
    topk = TopKCompression(density=0.25, error_feedback=False)
    copies = resolve_codec(topk)
    first, second = copies(), copies()
    assert first is not topk and first is not second and repr(first) == repr(topk)
    assert repr(topk) == "TopKCompression(density=0.25, error_feedback=False)"
    assert Compressor.from_spec(topk.spec()).__dict__.keys() == topk.__dict__.keys()
    assert repr(Compressor.from_spec(topk.spec())) == repr(topk)
    psgd = resolve_codec("powersgd")()
    assert isinstance(psgd, PowerSGDCompression) and (psgd.rank, psgd.start_iter, psgd.warm_start) == (4, 10, True)
    with pytest.raises(ConfigError, match="compression='zstd' is not allowed") as info:
        resolve_codec("zstd")
    assert all(n in str(info.value) for n in CODECS)
    with pytest.raises(ConfigError, match="compression=3 is not allowed; it must be a codec object"):
        resolve_codec(3)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"compression=PowerSGDCompression\(rank=4.* point_to_point.*: none, fp16"):
        resolve_codec("powersgd", needs=("point_to_point",))
    for bad, named in (
        (lambda: TopKCompression(0.0), "density=0.0"),
        (lambda: TopKCompression(1.5), "density"),
        (lambda: PowerSGDCompression(0), "rank=0"),
        (lambda: PowerSGDCompression(start_iter=-1), "start_iter=-1"),
    ):
        with pytest.raises(ConfigError, match=named):
            bad()


def _divided_matches_undivided(rank: int, world_size: int) -> None:
    """A bucket the owner already divided by the world size gives the same means and memory, step after step."""
    from lightning_sync.comm.compression import FlatBucket, PowerSGDCompression, TopKCompression
    from lightning_sync.comm.meter import CommMeter

    meter = CommMeter()
    for make in (lambda: PowerSGDCompression(rank=2, start_iter=0), lambda: TopKCompression(density=0.1)):
        plain, divided = make(), make()
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(4):
            grad = torch.randn(32 * 24, generator=gen)
            a = FlatBucket(index=0, buffer=grad.clone(), shapes=[torch.Size([32, 24])])
            b = FlatBucket(index=0, buffer=grad / world_size, shapes=[torch.Size([32, 24])], divided=True)
            out_a = plain.average(a, meter).wait()
            out_b = divided.average(b, meter).wait()
            torch.testing.assert_close(out_b, out_a, rtol=1e-4, atol=1e-5)
            plain.advance()
            divided.advance()


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_divided_buckets_give_the_same_mean_and_error_feedback():
    run_ranks(_divided_matches_undivided)


def _chunked_ranks(rank: int, world_size: int) -> None:
    """A payload over 2 x min_chunk_mb goes as two concurrent all-reduces with the same bytes and the same mean."""
    from lightning_sync.comm.compression import FlatBucket, NoCompression
    from lightning_sync.comm.meter import CommMeter

    meter = CommMeter()
    numel = 300_000  # 1.2 MB of fp32: two chunks of 0.6 MB at min_chunk_mb=0.5
    grad = torch.arange(numel, dtype=torch.float32) * (rank + 1)
    out = (
        NoCompression(parallel_chunks=2, min_chunk_mb=0.5)
        .average(FlatBucket(index=0, buffer=grad.clone(), shapes=[torch.Size([numel])]), meter)
        .wait()
    )
    torch.testing.assert_close(out, torch.arange(numel, dtype=torch.float32) * 1.5)
    assert meter.total.calls == 2
    assert meter.total.bytes_sent == ring_all_reduce_bytes(numel * 4, world_size)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_large_payload_is_sent_as_concurrent_chunks():
    run_ranks(_chunked_ranks)


# ------------------------------------------------------------------------------- DDP hook: memory per bucket
_BLOCKS, _WIDTH = 4, 16
# One block (a 16x16 weight and a 16-entry bias) fills a bucket exactly, so DDP puts each block in a bucket of its own.
_BLOCK_CAP_MB = (_WIDTH * _WIDTH + _WIDTH) * 4 / 2**20


def _ddp_identical_blocks(rank: int, world_size: int) -> None:
    """A model of identical blocks, each in its own DDP bucket: every bucket gets compressor memory of its own."""
    from torch.nn.parallel import DistributedDataParallel

    from lightning_sync.comm.ddp_hook import DDPHookState, compressed_allreduce_hook

    for comp in (TopKCompression(0.1), PowerSGDCompression(rank=1, start_iter=0)):
        torch.manual_seed(0)  # the same initial model on every rank
        model = torch.nn.Sequential(*(torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(_BLOCKS)))
        ddp = DistributedDataParallel(model, bucket_cap_mb=_BLOCK_CAP_MB)
        state = DDPHookState(compressor=comp, meter=CommMeter())
        seen: list[list[tuple[int, ...]]] = []  # per step: each bucket's parameters (ids), in launch order

        def spy(hook_state, bucket, seen=seen):  # no annotations: DDP checks them
            seen[-1].append(tuple(id(p) for p in bucket.parameters()))
            return compressed_allreduce_hook(hook_state, bucket)

        ddp.register_comm_hook(state, spy)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(3):
            seen.append([])
            ddp(torch.randn(8, _WIDTH, generator=gen)).pow(2).sum().backward()
            comp.advance()
            ddp.zero_grad()

        # After DDP's rebuild (step 1 reduces the whole model as one bucket), one bucket per block, of equal shapes.
        blocks = {tuple(sorted(id(p) for p in block.parameters())) for block in model}
        assert seen[1] == seen[2] and len(seen[1]) == _BLOCKS, seen
        assert {tuple(sorted(b)) for b in seen[1]} == blocks
        buckets = len({b for step in seen for b in step})  # the first step's and the rebuilt ones
        assert buckets == _BLOCKS + 1
        if isinstance(comp, TopKCompression):  # one residual per bucket, of the bucket's size
            memory = [[r] for r in comp.state_dict()["residuals"].values()]
        else:  # one residual per compressed matrix of the bucket
            memory = [saved["residuals"] for saved in comp.state_dict()["buckets"].values()]
        assert len(memory) == buckets, f"{comp.name}: {len(memory)} memory states for {buckets} buckets"
        assert len(state._bucket_ids) == buckets
        # Each block's memory is its own: the residuals of the block buckets (the ones of a single block) differ.
        block_numel = _WIDTH * _WIDTH + (_WIDTH if isinstance(comp, TopKCompression) else 0)
        leftovers = [r[0] for r in memory if len(r) == 1 and r[0].numel() == block_numel]
        assert len(leftovers) == _BLOCKS
        for i in range(_BLOCKS):
            for j in range(i):
                assert not torch.equal(leftovers[i], leftovers[j]), f"{comp.name}: buckets {i} and {j} share memory"


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_ddp_hook_keeps_compressor_memory_per_bucket():
    run_ranks(_ddp_identical_blocks)
