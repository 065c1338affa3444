"""Streaming DiLoCo in ``periodic``: fragments, outer syncs in flight (``sync_delay``), ``fragment_alpha``, and the
int8/int4 outer compression.

Most tests drive :class:`~lightning_sync.comm.periodic.PeriodicAverager` from a plain training loop on 2 forked
gloo ranks (asserting inside the ranks); one runs it inside a Lightning Trainer.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn

from lightning_sync import ConfigError
from lightning_sync.algorithms import build_parts
from lightning_sync.comm.averaging import ModelAverager, make_outer_optimizer
from lightning_sync.comm.compression import FlatBucket, NoCompression
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.periodic import PeriodicAverager
from lightning_sync.comm.quantized import BLOCK, Int4Compression, Int8Compression
from lightning_sync.comm.streaming import stagger_offsets, strided_fragments
from lightning_sync.config import PeriodicConfig

WIDTH = 64


# ---------------------------------------------------------------------------------------------------------- helpers
def make_model(layers: int = 4) -> nn.Module:
    """``layers`` Linear(64, 64) layers (4160 parameters each), identical on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def both_ranks(tensor: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor.contiguous())
    return out


class Loop:
    """Inner SGD on rank-specific random batches, with the averager told about every step."""

    def __init__(self, rank: int, averager: PeriodicAverager, model: nn.Module | None = None, seed: int = 100):
        self.model = model or make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.averager = averager
        self.meter = CommMeter()
        self.gen = torch.Generator().manual_seed(seed + rank)
        averager.setup(self.model.named_parameters(), self.model.named_buffers(), self.meter)

    def inner_step(self) -> None:
        x = torch.randn(16, WIDTH, generator=self.gen)
        loss = (self.model(x) - x).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()

    def run(self, steps: int) -> list[list[str]]:
        """Runs ``steps`` steps; returns the labels synced at each."""
        synced = []
        for _ in range(steps):
            self.averager.start_step()
            self.inner_step()
            synced.append([group.label for group in self.averager.step([self.opt])])
        return synced


# ---------------------------------------------------------------------------------------------------------- knobs
@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(fragments=0), "fragments=0 is not allowed; it must be >= 1"),
        (dict(fragments=1.5), "fragments=1.5 is not allowed; it must be an integer"),
        (dict(sync_delay=-1), "sync_delay=-1 is not allowed; it must be >= 0"),
        (dict(fragment_alpha=1.0), "fragment_alpha=1.0 is not allowed; it must be in [0, 1)"),
        (dict(outer_compression="int2"), "outer_compression='int2' is not allowed; choose one of: none, bf16"),
        (dict(fragments=9, sync_every=8), "fragments=9 is not allowed with sync_every=8; it must be <= sync_every"),
        (
            dict(fragments=4, sync_every=8, sync_delay=2),
            "sync_delay=2 is not allowed with sync_every=8 and fragments=4; it must be >= 0 and < sync_every / "
            "fragments = 2",
        ),
        (
            dict(sync_every="auto", min_sync_every=2, fragments=2, sync_delay=1),
            "sync_delay=1 is not allowed with min_sync_every=2 and fragments=2",
        ),
        (
            dict(module_sync_every={"0.*": 2}, fragments=4),
            "fragments=4 is not allowed with module_sync_every['0.*']=2",
        ),
    ],
)
def test_knob_errors_name_field_value_and_what_is_allowed(kwargs, message):
    with pytest.raises(ConfigError) as info:
        PeriodicAverager(outer=True, **kwargs)
    assert message in str(info.value)


@pytest.mark.unit
def test_knob_errors_through_the_strategy_config():
    with pytest.raises(ConfigError, match="outer_compression='int4' is not allowed with compression='topk'"):
        build_parts(PeriodicConfig(mode="diloco", compression="topk", outer_compression="int4"))
    with pytest.raises(ConfigError, match="sync_delay=4 is not allowed with sync_every=8 and fragments=2"):
        build_parts(PeriodicConfig(mode="diloco", sync_every=8, fragments=2, sync_delay=4))
    with pytest.raises(ConfigError, match="fragments=2 is not allowed with mode='gradient'"):
        PeriodicConfig(mode="gradient", fragments=2)
    averager = build_parts(
        PeriodicConfig(
            mode="diloco", sync_every=8, fragments=4, sync_delay=1, fragment_alpha=0.5, outer_compression="int4"
        )
    ).averager
    assert averager is not None and (averager.fragments, averager.sync_delay) == (4, 1)
    assert averager.fragment_alpha == 0.5 and isinstance(averager.new_compressor(), Int4Compression)


@pytest.mark.unit
def test_fragments_are_strided_by_layer_and_staggered():
    names = [f"net.{i}.{kind}" for i in range(6) for kind in ("weight", "bias")]
    split = strided_fragments(names, 3)
    assert [[names[i] for i in part] for part in split][0] == [
        "net.0.weight",
        "net.0.bias",
        "net.3.weight",
        "net.3.bias",
    ]
    assert [len(part) for part in split] == [4, 4, 4]
    assert len(strided_fragments(names[:4], 4)) == 2  # two layers: one fragment per layer
    assert strided_fragments([], 4) == [[]]
    # fragment f first syncs after (f + 1) * period // k steps: one fragment every period / k steps
    assert stagger_offsets(8, 4) == [6, 4, 2, 0]
    assert stagger_offsets(8, 1) == [0]


# ---------------------------------------------------------------------------------------------------------- quantizer
@pytest.mark.unit
@pytest.mark.parametrize("codec", [Int8Compression, Int4Compression])
def test_block_codes_round_to_nearest_within_half_a_step(codec):
    quantizer = codec()
    values = torch.randn(4 * BLOCK) * torch.linspace(0.01, 10, 4 * BLOCK)
    encoded = quantizer.encode(values)
    assert encoded.dtype == torch.uint8 and encoded.numel() == quantizer.chunk_bytes(values.numel())
    step = values.view(-1, BLOCK).abs().amax(dim=1, keepdim=True) / quantizer.levels
    error = (quantizer.decode(encoded, values.numel()) - values).view(-1, BLOCK).abs()
    assert bool((error <= step / 2 * (1 + 1e-5)).all())
    values[BLOCK + 3] = math.nan
    values[3 * BLOCK] = math.inf
    decoded = quantizer.decode(quantizer.encode(values), values.numel()).view(-1, BLOCK)
    finite = decoded.isfinite().all(dim=1).tolist()
    assert finite == [True, False, True, False]  # a NaN or Inf makes its whole block non-finite


def _quantized_average_ranks(rank: int, world: int) -> None:
    meter = CommMeter()
    torch.manual_seed(rank)
    values = torch.randn(10_000) * (1 + rank)
    exact = values.clone()
    dist.all_reduce(exact)
    exact /= world
    for codec in (Int8Compression, Int4Compression):
        quantizer = codec()
        bucket = FlatBucket(0, values.clone(), [values.shape])
        before = meter.total.bytes_sent
        quantizer.average(bucket, meter).wait()
        sent = meter.total.bytes_sent - before
        mean = bucket.buffer
        rows = both_ranks(mean)
        assert torch.equal(rows[0], rows[1]), "every rank decodes the same mean"
        # two roundings (each rank's chunk, then the requantized sum), each at most half a step of its block
        bound = 2 * exact.abs().max() / quantizer.levels
        assert float((mean - exact).abs().max()) <= bound
        chunk = math.ceil(values.numel() / (world * BLOCK)) * BLOCK
        assert sent == 2 * (world - 1) / world * world * quantizer.chunk_bytes(chunk)  # codes + scales, both phases


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_quantized_average_equals_fp32_mean_within_the_quantization_error():
    run_ranks(_quantized_average_ranks)


# ---------------------------------------------------------------------------------------------------------- exactness
def _reference_diloco(rank: int, outer: bool, steps: int, period: int) -> torch.Tensor:
    """Today's DiLoCo / local SGD written out with ModelAverager: one group, a sync every ``period`` steps."""
    loop = Loop(rank, PeriodicAverager(sync_every=10**6, outer=outer))  # only for its inner loop and data
    averager = ModelAverager(list(loop.model.parameters()), NoCompression(), loop.meter)
    outer_opt = make_outer_optimizer(averager, 0.7, 0.9, True) if outer else None
    for step in range(1, steps + 1):
        loop.inner_step()
        if step % period == 0:
            averager.outer_step_(outer_opt) if outer else averager.average_()
    if steps % period:
        averager.outer_step_(outer_opt) if outer else averager.average_()
    return flat(loop.model)


def _exactness_ranks(rank: int, world: int) -> None:
    for outer in (True, False):
        reference = _reference_diloco(rank, outer, steps=21, period=4)
        knobs = dict(fragments=1, sync_delay=0, fragment_alpha=0.0, outer_compression="none")
        loop = Loop(rank, PeriodicAverager(sync_every=4, outer=outer, **knobs))
        synced = loop.run(21)
        loop.averager.finish([loop.opt])
        assert [i + 1 for i, s in enumerate(synced) if s] == [4, 8, 12, 16, 20]
        assert torch.equal(flat(loop.model), reference), f"outer={outer}: differs from today's algorithm"


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_one_fragment_no_delay_no_compression_equals_todays_diloco_bit_for_bit():
    run_ranks(_exactness_ranks)


# ---------------------------------------------------------------------------------------------------------- bytes
def _bytes_ranks(rank: int, world: int) -> None:
    per_step = {}
    for name, knobs in [
        ("fp32", dict()),
        ("int4", dict(outer_compression="int4")),
        ("k4", dict(fragments=4)),
        ("k4_int4_delay1", dict(fragments=4, sync_delay=1, outer_compression="int4")),
    ]:
        loop = Loop(rank, PeriodicAverager(sync_every=8, outer=True, **knobs))
        sent = []
        for _ in range(16):
            before = loop.meter.total.bytes_sent
            loop.run(1)
            sent.append(loop.meter.total.bytes_sent - before)
        loop.averager.close()
        per_step[name] = sent
    fp32, int4 = per_step["fp32"], per_step["int4"]
    assert [i for i, b in enumerate(fp32) if b] == [7, 15] == [i for i, b in enumerate(int4) if b]
    model_bytes = 4 * sum(p.numel() for p in make_model().parameters())
    assert fp32[7] == 2 * (world - 1) / world * model_bytes
    assert int4[7] <= fp32[7] / 7, (int4[7], fp32[7])
    # fragments=4: one fragment (a quarter of the layers) every 2 steps
    k4 = per_step["k4"]
    assert [i for i, b in enumerate(k4) if b] == [1, 3, 5, 7, 9, 11, 13, 15]
    assert max(k4) == pytest.approx(fp32[7] / 4, rel=0.01)
    assert sum(k4) == sum(fp32)
    assert sum(per_step["k4_int4_delay1"]) <= sum(fp32) / 7
    if rank == 0:
        print(
            f"bytes per outer sync: fp32 {fp32[7]:.0f}, int4 {int4[7]:.0f} (1/{fp32[7] / int4[7]:.2f}); "
            f"fragments=4 peak {max(k4):.0f} ({max(k4) / fp32[7]:.3f} of fp32)"
        )


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_int4_sends_at_most_a_seventh_and_four_fragments_a_quarter_per_transfer():
    run_ranks(_bytes_ranks)
