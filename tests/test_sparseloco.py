"""SparseLoCo's outer codec: its error feedback, bit packing and quantizer, and its mean on real gloo ranks."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from lightning_sync.comm.compression import FlatBucket
from lightning_sync.comm.compression.sparseloco import SparseLoCo, clip_to_median_, pack_bits, unpack_bits
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.periodic import PeriodicAverager, StreamingOptions
from lightning_sync.errors import ConfigError

SHAPES = [torch.Size([30, 20]), torch.Size([5]), torch.Size([1000])]  # full chunks, tails and a tensor < chunk
MLP_SHAPES = [torch.Size(s) for s in ((256, 64), (256,), (64, 256), (64,), (10, 64), (10,))]  # 33,738 parameters


class _Solo(CommMeter):
    """A meter of one rank, without a process group (the codec then needs no collective)."""

    def world_size(self, group: object = None) -> int:
        return 1


def _delta(rank: int, call: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 * call + rank))


def _bucket(values: torch.Tensor, shapes: list[torch.Size] = SHAPES) -> FlatBucket:
    return FlatBucket(index=0, buffer=values.clone(), shapes=list(shapes))


def _numel(shapes: list[torch.Size]) -> int:
    return sum(math.prod(s) for s in shapes)


# ---------------------------------------------------------------------------------------------------------- unit
@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bits", [None, 1, 2, 8])
def test_error_feedback_identity(bits: int | None) -> None:
    """What is sent plus what is kept is ``decay * old + delta``, call after call; one rank's mean is its own s."""
    codec = SparseLoCo(topk=4, chunk=128, bits=bits, error_decay=0.9)
    numel = _numel(SHAPES)
    kept_per_call = sum(rows * k for _, rows, _, k, _ in codec.segments(SHAPES))
    assert kept_per_call == 4 * (4 + 7) + 3 + 1 + 4  # 600 = 4*128+88, 5 < 128, 1000 = 7*128+104
    old = torch.zeros(numel)
    for call in range(2):
        delta = _delta(0, call, numel)
        sent = codec.average(_bucket(delta), _Solo()).wait()
        kept = codec.errors[0]
        torch.testing.assert_close(sent + kept, 0.9 * old + delta, rtol=1e-6, atol=1e-6)
        assert int(sent.count_nonzero()) == kept_per_call
        old = kept.clone()


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("width", [1, 2, 4, 8, 12])
def test_pack_unpack_round_trip(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    for count in (1, 7, 100):
        values = torch.randint(0, 2**width, (3, count), generator=gen)
        packed = pack_bits(values, width)
        assert packed.dtype == torch.uint8 and packed.shape == (3, -(-count * width // 8))
        assert torch.equal(unpack_bits(packed, width, count), values)
        assert torch.equal(unpack_bits(pack_bits(values[0], width), width, count), values[0])


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_quantizer_error_is_bounded(bits: int) -> None:
    """Per tensor, each decoded value keeps its sign and is within ``(hi - lo) / 2**(bits-1)`` of the value."""
    codec = SparseLoCo(topk=1, chunk=2, bits=bits)
    gen = torch.Generator().manual_seed(bits)
    parts = [torch.randn(50, generator=gen) ** 3 * scale for scale in (1e-3, 1.0, 40.0)]
    values, tensor = torch.cat(parts), torch.arange(3).repeat_interleave(50)
    payload = codec.encode(values, torch.zeros(150, dtype=torch.long), tensor, 3)
    assert payload.numel() == codec.payload_nbytes([torch.Size([100])] * 3)
    positions, decoded = codec.decode(payload.unsqueeze(0), torch.arange(150), tensor, 3)
    assert torch.equal(positions[0], torch.arange(150))
    for part, out in zip(parts, decoded[0].split(50)):
        mag = part.abs()
        bound = (mag.max() - mag.min()) / 2 ** (bits - 1)
        assert float((out - part).abs().max()) <= float(bound) * (1 + 1e-5)
        assert torch.equal(out.sign(), part.sign())


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_bits_per_parameter() -> None:
    """The defaults cost about 0.22 bit per parameter of a 34k-parameter MLP (at most 0.35)."""
    numel = _numel(MLP_SHAPES)
    assert 33_000 < numel < 35_000
    assert SparseLoCo().payload_nbytes(MLP_SHAPES) * 8 / numel <= 0.35
    assert SparseLoCo(bits=None).payload_nbytes(MLP_SHAPES) * 8 / numel <= 0.75


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_clip_to_median() -> None:
    rows = torch.tensor([[3.0, 4.0], [0.0, 1.0], [600.0, 800.0]])  # norms 5, 1, 1000: median 5
    clip_to_median_(rows)
    torch.testing.assert_close(rows, torch.tensor([[3.0, 4.0], [0.0, 1.0], [3.0, 4.0]]))
    pair = torch.tensor([[1.0, 0.0], [0.0, 100.0]])  # two ranks: the lower middle norm
    torch.testing.assert_close(clip_to_median_(pair), torch.eye(2))


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_state_dict_resumes_exactly() -> None:
    numel = _numel(SHAPES)
    codec = SparseLoCo(topk=4, chunk=128, clip_to_median=True)
    codec.average(_bucket(_delta(0, 0, numel)), _Solo()).wait()
    codec.advance()
    state = codec.state_dict()
    resumed = SparseLoCo(topk=4, chunk=128, clip_to_median=True)
    resumed.load_state_dict(state)
    assert resumed.steps == 1 and state["errors"][0] is not codec.errors[0]
    for call in (1, 2):
        a = codec.average(_bucket(_delta(0, call, numel)), _Solo()).wait()
        b = resumed.average(_bucket(_delta(0, call, numel)), _Solo()).wait()
        assert torch.equal(a, b) and torch.equal(codec.errors[0], resumed.errors[0])


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bits", [None, 2])
def test_nonfinite_propagates_and_is_forgotten(bits: int | None) -> None:
    codec = SparseLoCo(topk=4, chunk=128, bits=bits)
    for bad in (float("nan"), float("inf")):
        delta = _delta(0, 0, _numel(SHAPES))
        delta[700] = bad
        assert not codec.average(_bucket(delta), _Solo()).wait().isfinite().all()
        codec.forget_nonfinite()
        assert codec.errors[0].isfinite().all()


@pytest.mark.unit
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"chunk": 1000}, "chunk=1000"),
        ({"chunk": 1}, "chunk=1"),
        ({"topk": 0}, "topk=0"),
        ({"topk": 8, "chunk": 4}, "topk=8"),
        ({"topk": 2.5}, "topk=2.5"),
        ({"bits": 3}, "bits=3"),
        ({"bits": True}, "bits=True"),
        ({"error_decay": 1.5}, "error_decay=1.5"),
    ],
)
def test_bad_arguments(kwargs: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        SparseLoCo(**kwargs)


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_repr_and_contract() -> None:
    codec = SparseLoCo(topk=8, chunk=256, bits=None, error_decay=0.5, clip_to_median=True)
    assert repr(codec) == "SparseLoCo(topk=8, chunk=256, bits=None, error_decay=0.5, clip_to_median=True)"
    assert codec.name == "sparseloco" and codec.capabilities == frozenset({"across_groups"})


# ---------------------------------------------------------------------------------------------------------- ranks
def _reference(rank: int, world_size: int, calls: int) -> None:
    """``bits=None`` equals a plain loop of the algorithm: torch.topk per chunk, dense all_gather."""
    topk, chunk, decay, numel = 4, 128, 0.9, _numel(SHAPES)
    codec, meter = SparseLoCo(topk=topk, chunk=chunk, bits=None, error_decay=decay), CommMeter()
    error = torch.zeros(numel)
    for call in range(calls):
        delta = _delta(rank, call, numel)
        error = decay * error + delta
        sparse, offset = torch.zeros(numel), 0
        for shape in SHAPES:
            end = offset + math.prod(shape)
            for start in range(offset, end, chunk):
                part = error[start : min(start + chunk, end)]
                picked = torch.topk(part.abs(), math.ceil(topk * part.numel() / chunk)).indices
                sparse[start + picked] = part[picked]
            offset = end
        error = error - sparse
        gathered = [torch.empty(numel) for _ in range(world_size)]
        dist.all_gather(gathered, sparse)
        out = codec.average(_bucket(delta), meter).wait()
        torch.testing.assert_close(out, sum(gathered) / world_size, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(codec.errors[0], error, rtol=1e-6, atol=1e-6)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_fp32_values_equal_plain_loop() -> None:
    run_ranks(_reference, 3)


def _wire(rank: int, world_size: int) -> None:
    """The meter counts ``(n-1) * payload_nbytes``; ranks agree bit for bit; a NaN on one rank reaches all."""
    for bits in (2, None):
        codec, meter = SparseLoCo(topk=4, chunk=128, bits=bits), CommMeter()
        delta = _delta(rank, 0, _numel(SHAPES))
        out = codec.average(_bucket(delta), meter).wait()
        stats = meter.step()
        assert stats.calls == 1 and stats.bytes_sent == (world_size - 1) * codec.payload_nbytes(SHAPES)
        everyone = [torch.empty_like(out) for _ in range(world_size)]
        dist.all_gather(everyone, out)
        assert all(torch.equal(other, out) for other in everyone)
        if rank == 0:
            delta[3] = float("nan")
        assert not codec.average(_bucket(delta), meter).wait().isfinite().all()


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_wire_bytes_agreement_and_nonfinite() -> None:
    run_ranks(_wire)


def _clipped(rank: int, world_size: int) -> None:
    """Rank 2 sends 100x its delta: with clipping the mean moves far less than without."""
    numel, meter = _numel(SHAPES), CommMeter()
    delta = _delta(rank, 0, numel)

    def mean(scale: float, clip: bool) -> torch.Tensor:
        codec = SparseLoCo(topk=4, chunk=128, clip_to_median=clip)
        return codec.average(_bucket(delta * (scale if rank == 2 else 1.0)), meter).wait()

    honest = mean(1.0, False)
    moved_clipped = float((mean(100.0, True) - honest).norm())
    moved_plain = float((mean(100.0, False) - honest).norm())
    assert moved_clipped < moved_plain / 20, (moved_clipped, moved_plain)


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_clip_to_median_on_three_ranks() -> None:
    run_ranks(_clipped, world_size=3)


# ---------------------------------------------------------------------------------------------------------- periodic
# DiLoCo (one fragment, no delay) and streaming DiLoCo (2 fragments, delay 1) with SparseLoCo as ``outer_compression``,
# driven through PeriodicAverager from a plain loop of inner SGD steps on 2 gloo ranks.
WIDTH = 64
PERIODIC = {
    "diloco": dict(fragments=1, sync_delay=0),
    "streaming": dict(fragments=2, sync_delay=1),
}


def _mlp() -> torch.nn.Module:
    """4 x Linear(64, 64) (16,640 parameters), identical on every rank."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)])


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _all_ranks(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


class _Loop:
    """Inner SGD on rank-specific random batches, each step reported to the averager; bytes sent per step."""

    def __init__(self, rank: int, averager: PeriodicAverager, seed: int = 100) -> None:
        self.model, self.averager, self.meter = _mlp(), averager, CommMeter()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.gen = torch.Generator().manual_seed(seed + rank)
        averager.setup(self.model.named_parameters(), self.model.named_buffers(), self.meter)

    def run(self, steps: int) -> list[tuple[list[str], int]]:
        """Per step: the labels applied and the bytes sent."""
        out = []
        for _ in range(steps):
            before = self.meter.total.bytes_sent
            self.averager.start_step()
            x = torch.randn(16, WIDTH, generator=self.gen)
            loss = (self.model(x) - x).pow(2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            labels = [group.label for group in self.averager.step([self.opt])]
            out.append((labels, self.meter.total.bytes_sent - before))
        return out

    def finish(self) -> None:
        self.averager.finish([self.opt])
        self.averager.close()


def _averager(kind: str, codec: SparseLoCo | str, sync_every: int = 8) -> PeriodicAverager:
    streaming = StreamingOptions(**PERIODIC[kind], outer_compression=codec)
    return PeriodicAverager(sync_every=sync_every, outer=True, streaming=streaming)


def _periodic_ranks(rank: int, world: int, kind: str) -> None:
    """Replicas end identical; each outer sync sends ``(n-1) * payload_nbytes`` of its fragment, far below fp32."""
    sparse = _Loop(rank, _averager(kind, SparseLoCo(topk=4, chunk=256)))
    steps = sparse.run(24)
    sparse.finish()
    rows = _all_ranks(_flat(sparse.model))
    assert all(torch.equal(row, rows[0]) for row in rows), "SparseLoCo leaves the replicas different"
    assert _flat(sparse.model).isfinite().all()
    groups = {group.label: group for group in sparse.averager.groups}
    assert len(groups) == PERIODIC[kind]["fragments"]
    codec = SparseLoCo(topk=4, chunk=256)
    payload = {
        label: (world - 1)
        * sum(codec.payload_nbytes([p.shape for p in params]) for params in group.averager._bucket_params)
        for label, group in groups.items()
    }
    launched = [b for _, b in steps if b]
    assert len(launched) == 3 * len(groups), steps  # 24 steps, period 8: three syncs of each fragment
    assert sorted(set(launched)) == sorted(set(payload.values())), (launched, payload)

    dense = _Loop(rank, _averager(kind, "none"))
    fp32 = [b for _, b in dense.run(24) if b]
    dense.finish()
    assert len(fp32) == len(launched)
    ratio = sum(launched) / sum(fp32)
    assert ratio < 1 / 10, ratio
    if rank == 0:
        print(f"{kind}: SparseLoCo(topk=4, chunk=256) sends {ratio:.4f} of fp32's bytes per outer sync")


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(PERIODIC))
def test_periodic_replicas_agree_and_bytes_are_the_payload(kind: str) -> None:
    run_ranks(_periodic_ranks, kind, timeout=110)


def _lossless_ranks(rank: int, world: int, kind: str) -> None:
    """``bits=None, topk=chunk, error_decay=0`` sends everything exactly: the uncompressed averager's result."""
    exact = _Loop(rank, _averager(kind, SparseLoCo(topk=256, chunk=256, bits=None, error_decay=0.0)))
    exact.run(20)
    exact.finish()
    plain = _Loop(rank, _averager(kind, "none"))
    plain.run(20)
    plain.finish()
    torch.testing.assert_close(_flat(exact.model), _flat(plain.model), rtol=0, atol=1e-6)
    for group in exact.averager.groups:
        for error in group.averager.compressor.errors.values():
            assert not error.any(), "keeping every entry leaves no error"


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(PERIODIC))
def test_periodic_lossless_sparseloco_equals_uncompressed(kind: str) -> None:
    run_ranks(_lossless_ranks, kind, timeout=110)


def _resume_periodic_ranks(rank: int, world: int, kind: str) -> None:
    """A state_dict taken mid-run (error buffers, global copies, a fragment in flight) resumes bit for bit."""

    def codec() -> SparseLoCo:
        return SparseLoCo(topk=4, chunk=256, error_decay=0.9)

    straight = _Loop(rank, _averager(kind, codec(), sync_every=4))
    straight.run(14)
    straight.finish()

    first = _Loop(rank, _averager(kind, codec(), sync_every=4))
    first.run(7)  # streaming: fragment 1 launched at step 7, in flight; both kinds: error buffers non-zero
    state = first.averager.state_dict()
    errors = [group["averager"]["compressor"]["errors"] for group in state["groups"]]
    assert errors and all(errors), "the averager's state holds no codec memory"
    saved = copy.deepcopy((state, first.model.state_dict(), first.opt.state_dict(), first.gen.get_state()))
    first.averager.close()

    resumed = _Loop(rank, _averager(kind, codec(), sync_every=4))
    resumed.model.load_state_dict(saved[1])
    resumed.opt.load_state_dict(saved[2])
    resumed.gen.set_state(saved[3])
    resumed.averager.load_state_dict(saved[0])
    for group in resumed.averager.groups:
        assert group.averager.compressor.errors, "the error buffers were not restored"
    resumed.run(7)
    resumed.finish()
    assert torch.equal(_flat(resumed.model), _flat(straight.model)), "resume with SparseLoCo is not bit-identical"
    for a, b in zip(straight.averager.groups, resumed.averager.groups):
        for index, error in a.averager.compressor.errors.items():
            assert torch.equal(error, b.averager.compressor.errors[index])


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", list(PERIODIC))
def test_periodic_state_dict_resumes_bit_identically(kind: str) -> None:
    run_ranks(_resume_periodic_ranks, kind, timeout=110)
