"""Streaming DiLoCo in ``periodic``: fragments, outer syncs in flight (``sync_delay``), ``fragment_alpha``, and the
int8/int4 outer compression.

Most tests drive :class:`~lightning_sync.comm.periodic.PeriodicAverager` from a plain training loop on 2 forked
gloo ranks (asserting inside the ranks); one runs it inside a Lightning Trainer.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks
from torch import nn

from lightning_sync import ConfigError
from lightning_sync.algorithms import build_parts
from lightning_sync.comm.averaging import ModelAverager
from lightning_sync.comm.compression import FlatBucket, NoCompression
from lightning_sync.comm.compression.quantized import BLOCK, Int4Compression, Int8Compression
from lightning_sync.comm.fragments import block_fragments, layer_fragments, split_fragments
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.peer_errors import PeerError
from lightning_sync.comm.periodic import AdaptiveOptions, PeriodicAverager, StreamingOptions
from lightning_sync.comm.streaming import stagger_offsets
from lightning_sync.config import PeriodicConfig
from lightning_sync.strategies._base import sync_state_path

WIDTH = 64
PAPER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)  # DiLoCo's outer optimizer


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
        if self.averager.in_warmup:  # as the owner does: warmup steps all-reduce the gradients
            for p in self.model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
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
        (dict(fragment_alpha=1.5), "fragment_alpha=1.5 is not allowed; it must be in [0, 1]"),
        (dict(outer_compression="int2"), "outer_compression='int2' is not allowed; choose one of: none, fp16, bf16"),
        (dict(fragments=9, sync_every=8), "fragments=9 is not allowed with sync_every=8; it must be <= sync_every"),
        (
            dict(fragments=4, sync_every=8, sync_delay=2),
            "sync_delay=2 is not allowed with sync_every=8 and fragments=4; it must be >= 0 and < sync_every // "
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
    streaming = {
        k: kwargs.pop(k) for k in ("fragments", "sync_delay", "fragment_alpha", "outer_compression") if k in kwargs
    }
    adaptive = {k: kwargs.pop(k) for k in ("min_sync_every",) if k in kwargs}
    with pytest.raises(ConfigError) as info:
        PeriodicAverager(
            outer=True, streaming=StreamingOptions(**streaming), adaptive=AdaptiveOptions(**adaptive), **kwargs
        )
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
    split = layer_fragments(names, 3)
    assert [[names[i] for i in part] for part in split][0] == [
        "net.0.weight",
        "net.0.bias",
        "net.3.weight",
        "net.3.bias",
    ]
    assert [len(part) for part in split] == [4, 4, 4]
    assert len(layer_fragments(names[:4], 4)) == 2  # two layers: one fragment per layer
    assert layer_fragments([], 4) == [[]] == block_fragments([], 4)
    # fragment f first syncs after (f + 1) * period // k steps: one fragment every period / k steps
    assert stagger_offsets(8, 4) == [6, 4, 2, 0]
    assert stagger_offsets(8, 1) == [0]


def _char_gpt(n_layer: int = 4) -> nn.Module:
    from lightning_sync.examples.models import CharGPT

    torch.manual_seed(0)
    return CharGPT(vocab_size=32, block_size=16, d_model=32, n_layer=n_layer, n_head=2)


def _group_modules(averager: PeriodicAverager, model: nn.Module) -> list[list[str]]:
    """Each group's parameters, as the names of the blocks (``blocks.i``) or modules that hold them."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for group in averager.groups:
        modules: list[str] = []
        for p in group.params:
            parts = names[id(p)].split(".")
            module = ".".join(parts[:2]) if parts[0] == "blocks" else ".".join(parts[:-1])
            if module not in modules:
                modules.append(module)
        out.append(modules)
    return out


@pytest.mark.unit
def test_fragments_take_whole_blocks_strided_and_the_rest_beside_the_nearest_block():
    """Block i joins fragment i % k; the embeddings go with the first block, the final norm with the last block's
    fragment; the tied head is the embedding. Without repeated blocks (an MLP of different widths) layers are the
    units."""
    model = _char_gpt(n_layer=4)
    for k, expected in [
        (1, [["tok_emb", "pos_emb", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "ln_f"]]),
        (2, [["tok_emb", "pos_emb", "blocks.0", "blocks.2"], ["blocks.1", "blocks.3", "ln_f"]]),
        (3, [["tok_emb", "pos_emb", "blocks.0", "blocks.3", "ln_f"], ["blocks.1"], ["blocks.2"]]),
        (8, [["tok_emb", "pos_emb", "blocks.0"], ["blocks.1"], ["blocks.2"], ["blocks.3", "ln_f"]]),
    ]:
        averager = PeriodicAverager(sync_every=8, outer=True, streaming=StreamingOptions(fragments=k))
        if k > 4:
            with pytest.warns(UserWarning, match=f"fragments={k}: sync group '\\*' has 4 blocks .* gets 4 fragments"):
                averager.setup(model.named_parameters(), model.named_buffers(), CommMeter())
        else:
            averager.setup(model.named_parameters(), model.named_buffers(), CommMeter())
        assert _group_modules(averager, model) == expected, k
    mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    split = block_fragments([(n, p.shape) for n, p in mlp.named_parameters()], 2)
    assert split == [[0, 1, 4, 5], [2, 3]]  # by layer: 0 and 4, then 2
    square = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    split = block_fragments([(n, p.shape) for n, p in square.named_parameters()], 2)
    assert split == [[0, 1, 4, 5, 6, 7], [2, 3]]  # 3 blocks 0, 1, 2; the head goes with block 2's fragment, 0
    assert split_fragments([(n, p.shape) for n, p in square.named_parameters()], 2, (("0", "2"), ("[13]",))) == [
        [0, 1, 4, 5],
        [2, 3, 6, 7],
    ]


@pytest.mark.unit
def test_fragment_modules_name_the_fragments_in_sync_order():
    model = _char_gpt(n_layer=2)
    explicit = [["blocks.1", "ln_f"], ["tok_emb", "pos_emb", "blocks.0"]]  # fragment 0 syncs first
    averager = PeriodicAverager(sync_every=8, outer=True, streaming=StreamingOptions(fragment_modules=explicit))
    assert averager.fragments == 2
    averager.setup(model.named_parameters(), model.named_buffers(), CommMeter())
    assert _group_modules(averager, model) == [["blocks.1", "ln_f"], ["tok_emb", "pos_emb", "blocks.0"]]
    assert [g.offset for g in averager.groups] == stagger_offsets(8, 2)
    # through the strategy's keyword constructor and its check against the model, before any rank starts
    from lightning_sync import PeriodicSyncStrategy

    strategy = PeriodicSyncStrategy(mode="diloco", sync_every=8, fragment_modules=explicit)
    assert strategy.averager is not None and strategy.averager.fragments == 2
    strategy.validate_model(model)
    bad = PeriodicSyncStrategy(mode="diloco", sync_every=8, fragment_modules=[["blocks.*"], ["tok_emb", "pos_emb"]])
    with pytest.raises(ConfigError, match=r"strategy.fragment_modules: parameter 'ln_f.weight' is in no fragment"):
        bad.validate_model(model)


@pytest.mark.unit
def test_the_guide_prints_the_char_gpt_partition_the_code_forms():
    """docs/guide/streaming-diloco.md holds tools/gen_fragments.py's tables, as the code forms them now."""
    from repo_utils import load_script

    gen = load_script("tools/gen_fragments.py")
    text = gen.GUIDE.read_text()
    assert gen.updated(text) == text, "the guide's fragment tables are stale: run python tools/gen_fragments.py"
    assert "| 0 | `tok_emb`, `pos_emb`, `blocks.0` |" in text


def _setup_error(patterns, model=None, **knobs) -> str:
    model = model or _char_gpt(n_layer=2)
    with pytest.raises(ConfigError) as info:
        averager = PeriodicAverager(
            sync_every=8, outer=True, streaming=StreamingOptions(fragment_modules=patterns, **knobs)
        )
        averager.setup(model.named_parameters(), model.named_buffers(), CommMeter())
    return str(info.value)


@pytest.mark.unit
def test_fragment_modules_errors_name_field_value_and_what_is_allowed():
    rest = ["tok_emb", "pos_emb", "ln_f"]
    assert "fragment_modules[1] pattern 'blocks.7' matches no module holding a parameter" in _setup_error(
        [["blocks.0", *rest], ["blocks.1", "blocks.7"]]
    )
    assert (
        "fragment_modules: parameter 'blocks.1.ln1.weight' is in fragments 0 ('blocks.*') and 1 ('blocks.1'); "
        "every parameter must be in exactly one"
    ) in _setup_error([["blocks.*", *rest], ["blocks.1"]])
    assert "fragment_modules: parameter 'ln_f.weight' is in no fragment" in _setup_error(
        [["blocks.0", "tok_emb", "pos_emb"], ["blocks.1"]]
    )
    for value, message in [
        ("blocks.0", "fragment_modules='blocks.0' is not allowed; it must be a list with one entry per fragment"),
        ([], "fragment_modules=[] is not allowed; it must be a list"),
        ([["a"], []], "fragment_modules[1]=[] is not allowed; it must be a pattern or a list of patterns"),
        ([["a", 3]], "fragment_modules[0] pattern 3 is not allowed; it must be a non-empty string"),
        ([["a"], ["a"]], "fragment_modules[1] pattern 'a' is not allowed; it appears twice"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            StreamingOptions(fragment_modules=value)
    with pytest.raises(ConfigError, match=r"fragments=3 is not allowed with fragment_modules of 2 fragments"):
        StreamingOptions(fragments=3, fragment_modules=[["a"], ["b"]])
    with pytest.raises(ConfigError, match=r"fragment_modules=\[\['a'\]\] is not allowed with module_sync_every"):
        PeriodicAverager(module_sync_every={"x.*": 4}, streaming=StreamingOptions(fragment_modules=[["a"]]))
    with pytest.raises(ConfigError, match="fragment_modules=.* is not allowed with mode='gradient'"):
        PeriodicConfig(mode="gradient", fragment_modules=[["a"]])
    with pytest.raises(ConfigError, match=r"fragment_modules\[0\] pattern '' is not allowed"):
        build_parts(PeriodicConfig(mode="diloco", fragment_modules=[[""]]))


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
    outer_opt = PAPER(averager.anchors) if outer else None
    for step in range(1, steps + 1):
        loop.inner_step()
        if step % period == 0:
            averager.sync_(outer_opt)
    if steps % period:
        averager.sync_(outer_opt)
    return flat(loop.model)


def _exactness_ranks(rank: int, world: int) -> None:
    for outer in (True, False):
        reference = _reference_diloco(rank, outer, steps=21, period=4)
        streaming = StreamingOptions(fragments=1, sync_delay=0, fragment_alpha=0.0, outer_compression="none")
        loop = Loop(rank, PeriodicAverager(sync_every=4, outer=outer, outer_optimizer=PAPER, streaming=streaming))
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
        loop = Loop(rank, PeriodicAverager(sync_every=8, outer=True, streaming=StreamingOptions(**knobs)))
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


def _fixed_cost_ranks(rank: int, world: int) -> None:
    """The 8 x Linear(64, 64) MLP, sync_every=8, 64 steps: every byte the averager sends is payload."""
    numel = [2 * WIDTH * (WIDTH + 1)] * 4  # 4 fragments of 2 layers; 1 fragment: all 8
    for knobs in [
        dict(),
        dict(outer_compression="int4"),
        dict(fragments=4),
        dict(fragments=4, outer_compression="int4"),
    ]:
        loop = Loop(
            rank, PeriodicAverager(sync_every=8, outer=True, streaming=StreamingOptions(**knobs)), make_model(8)
        )
        per_fragment = [sum(numel)] if "fragments" not in knobs else numel
        if "outer_compression" in knobs:  # codes and a scale per block, each rank's chunk padded to whole blocks
            codec = Int4Compression()
            payload = [world * codec.chunk_bytes(math.ceil(n / (world * BLOCK)) * BLOCK) for n in per_fragment]
        else:
            payload = [4 * n for n in per_fragment]
        wire = [2 * (world - 1) / world * b for b in payload]  # what a ring all-reduce of that payload sends
        synced = loop.run(64)
        in_training = loop.meter.total.bytes_sent
        flushed = loop.averager.finish([loop.opt])
        labels = [g.label for g in loop.averager.groups]
        expected = sum(wire[labels.index(label)] for step in synced for label in step)
        assert in_training == expected, (knobs, in_training, expected)
        # the end of fit syncs the fragments with local steps: 3 of 4 (fragment 3 synced at step 64), none of 1
        assert loop.meter.total.bytes_sent - in_training == sum(wire[labels.index(g.label)] for g in flushed)
        assert len(flushed) == (3 if "fragments" in knobs else 0)
        if rank == 0:
            syncs = sum(len(step) for step in synced)
            print(f"{knobs}: {in_training / syncs:.0f} bytes per fragment sync, {len(flushed)} flushed at the end")


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_bytes_per_outer_sync_are_the_payload_and_nothing_else():
    run_ranks(_fixed_cost_ranks)


def _uneven_ranks(rank: int, world: int) -> None:
    """k = 3 does not divide H = 8: fragment f still applies at (f + 1) * 8 // 3 + 8 j."""
    streaming = StreamingOptions(fragments=3, sync_delay=1)
    loop = Loop(rank, PeriodicAverager(sync_every=8, outer=True, streaming=streaming))
    synced = loop.run(19)
    applied = {label: [i + 1 for i, s in enumerate(synced) if label in s] for label in ("*#0", "*#1", "*#2")}
    assert applied == {"*#0": [2, 10, 18], "*#1": [5, 13], "*#2": [8, 16]}, applied
    loop.averager.close()

    # fragment_alpha=1: the parameters keep the local weights exactly; the global copy still takes the outer step
    streaming = StreamingOptions(fragments=2, sync_delay=1, fragment_alpha=1.0)
    loop = Loop(rank, PeriodicAverager(sync_every=4, outer=True, streaming=streaming))
    first = loop.averager.groups[0]
    start = _anchor_flat(first).clone()
    loop.averager.start_step()
    loop.inner_step()
    assert loop.averager.step([loop.opt]) == []  # fragment 0 launched
    loop.averager.start_step()
    loop.inner_step()
    local = _fragment_flat(first).clone()
    assert [g.label for g in loop.averager.step([loop.opt])] == ["*#0"]
    assert torch.equal(_fragment_flat(first), local) and first.mixed
    assert not torch.equal(_anchor_flat(first), start)
    rows = both_ranks(_anchor_flat(first))
    assert torch.equal(rows[0], rows[1])
    loop.run(3)
    loop.averager.finish([loop.opt])  # the end of fit loads the global copy everywhere
    rows = both_ranks(flat(loop.model))
    assert torch.equal(rows[0], rows[1])
    loop.averager.close()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_fragments_keep_their_schedule_when_k_does_not_divide_h_and_alpha_one_keeps_the_local_weights():
    run_ranks(_uneven_ranks)


@pytest.mark.unit
def test_a_delay_that_would_move_fragment_0s_first_sync_is_refused_before_start():
    """H=8, k=3: fragment 0 first syncs at step 8 // 3 = 2, so its outer sync cannot launch 2 steps before."""
    with pytest.raises(ConfigError) as info:
        PeriodicAverager(sync_every=8, outer=True, streaming=StreamingOptions(fragments=3, sync_delay=2))
    assert "sync_delay=2 is not allowed with sync_every=8 and fragments=3; it must be >= 0 and < sync_every // " in str(
        info.value
    )
    PeriodicAverager(sync_every=8, outer=True, streaming=StreamingOptions(fragments=3, sync_delay=1))


# ---------------------------------------------------------------------------------------------------------- in flight
def _fragment_flat(group) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in group.params])


def _anchor_flat(group) -> torch.Tensor:
    """The global copy in parameter order (the buckets may hold the parameters in another order)."""
    by_param = {}
    for anchor, params in zip(group.averager.anchors, group.averager._bucket_params):
        offset = 0
        for p in params:
            by_param[id(p)] = anchor[offset : offset + p.numel()]
            offset += p.numel()
    return torch.cat([by_param[id(p)] for p in group.params])


def _delay_ranks(rank: int, world: int, alpha: float, outer: bool, codec: str) -> None:
    streaming = StreamingOptions(fragments=2, sync_delay=1, fragment_alpha=alpha, outer_compression=codec)
    loop = Loop(rank, PeriodicAverager(sync_every=4, outer=outer, streaming=streaming))
    groups = {group.label: group for group in loop.averager.groups}
    schedule = []
    for _ in range(9):
        loop.averager.start_step()
        loop.inner_step()
        local = {label: _fragment_flat(group) for label, group in groups.items()}
        launched = {label for label, group in groups.items() if group.in_flight is None}
        synced = [group.label for group in loop.averager.step([loop.opt])]
        launched -= {label for label, group in groups.items() if group.in_flight is None}
        schedule.append((sorted(launched), synced))
        for label in synced:
            group = groups[label]
            anchor = _anchor_flat(group)
            rows = both_ranks(anchor)
            assert torch.equal(rows[0], rows[1]), "the global copy differs between ranks after an apply"
            mixed = anchor.lerp(local[label], alpha) if alpha else anchor  # rounded as torchft's DiLoCo rounds it
            assert torch.equal(_fragment_flat(group), mixed)
            if alpha == 0:
                rows = both_ranks(_fragment_flat(group))
                assert torch.equal(rows[0], rows[1]), "a fragment's replicas differ right after its apply"
    # fragment 0 syncs at steps 2, 6 (launched at 1, 5), fragment 1 at 4, 8 (launched at 3, 7)
    assert schedule == [
        (["*#0"], []),
        ([], ["*#0"]),
        (["*#1"], []),
        ([], ["*#1"]),
        (["*#0"], []),
        ([], ["*#0"]),
        (["*#1"], []),
        ([], ["*#1"]),
        (["*#0"], []),
    ], schedule
    loop.averager.finish([loop.opt])
    rows = both_ranks(flat(loop.model))
    assert torch.equal(rows[0], rows[1]), "finish leaves the replicas different"
    loop.averager.close()


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "alpha,outer,codec",
    [(0.0, True, "none"), (0.5, True, "none"), (0.5, False, "int8")],
    ids=["diloco", "alpha", "sgd"],
)
def test_delayed_outer_sync_launches_then_applies_with_alpha(alpha, outer, codec):
    """DiLoCo, and local SGD with int8 deltas."""
    run_ranks(_delay_ranks, alpha, outer, codec)


def _resume_ranks(rank: int, world: int, knobs: dict) -> None:
    straight = Loop(rank, PeriodicAverager(**knobs))
    straight.run(12)
    straight.averager.finish([straight.opt])
    straight.averager.close()

    first = Loop(rank, PeriodicAverager(**knobs))
    first.run(5)  # fragment 0 was launched at step 5: in flight
    assert [group.in_flight is not None for group in first.averager.groups] == [True, False]
    saved = copy.deepcopy(
        (first.averager.state_dict(), first.model.state_dict(), first.opt.state_dict(), first.gen.get_state())
    )
    assert saved[0]["groups"][0]["in_flight"]["launched_at"] == 5
    first.averager.close()

    resumed = Loop(rank, PeriodicAverager(**knobs))
    resumed.model.load_state_dict(saved[1])
    resumed.opt.load_state_dict(saved[2])
    resumed.gen.set_state(saved[3])
    resumed.averager.load_state_dict(saved[0])
    resumed.run(7)
    resumed.averager.finish([resumed.opt])
    resumed.averager.close()
    assert torch.equal(flat(resumed.model), flat(straight.model)), "resume with a fragment in flight is not exact"


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("codec", ["none", "int8"])
def test_resume_with_a_fragment_in_flight_equals_the_uninterrupted_run(codec):
    streaming = StreamingOptions(fragments=2, sync_delay=1, fragment_alpha=0.5, outer_compression=codec)
    run_ranks(_resume_ranks, dict(sync_every=4, outer=True, streaming=streaming))


def _composition_ranks(rank: int, world: int) -> None:
    knobs = dict(streaming=StreamingOptions(fragments=2, sync_delay=1), outer=True)
    averager = PeriodicAverager(sync_every=4, warmup_steps=2, module_sync_every={"3.*": 8}, **knobs)
    loop = Loop(rank, averager)
    assert [(g.label, g.period, g.offset) for g in averager.groups] == [
        ("*#0", None, 2),
        ("*#1", None, 0),
        ("3.*", 8, 0),
    ]
    synced = loop.run(10)  # 2 warmup steps, then the staggered fragments; the one-layer group "3.*" every 8
    assert synced == [[], [], [], ["*#0"], [], ["*#1"], [], ["*#0"], [], ["*#1", "3.*"]], synced
    loop.averager.finish([loop.opt])
    rows = both_ranks(flat(loop.model))
    assert torch.equal(rows[0], rows[1])
    averager.close()

    adaptive = AdaptiveOptions(min_sync_every=4, max_sync_every=16)
    averager = PeriodicAverager(sync_every="auto", adaptive=adaptive, **knobs)
    loop = Loop(rank, averager)
    synced = loop.run(16)
    assert averager.adaptive is not None and averager.adaptive.compute_seconds is not None
    assert sum(len(s) for s in synced) >= 2 and 4 <= averager.period <= 16
    loop.averager.finish([loop.opt])
    rows = both_ranks(flat(loop.model))
    assert torch.equal(rows[0], rows[1])
    averager.close()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_fragments_compose_with_module_groups_warmup_and_auto():
    run_ranks(_composition_ranks)


# ---------------------------------------------------------------------------------------------------------- faults
def _nonfinite_ranks(rank: int, world: int, delay: int, codec: str) -> None:
    streaming = StreamingOptions(fragments=2, sync_delay=delay, outer_compression=codec)
    # with momentum, so that the outer optimizer's state shows whether it stepped
    averager = PeriodicAverager(sync_every=4, outer=True, outer_optimizer=PAPER, streaming=streaming)
    loop = Loop(rank, averager)
    first, second = averager.groups
    start = _fragment_flat(first).clone()
    for step in range(1, 9):
        averager.start_step()
        loop.inner_step()
        launching = step == 2 - delay  # fragment 0 is launched at step 2 - delay and applied at step 2
        if launching and rank == 1:
            kept = first.params[0].detach().clone()
            with torch.no_grad():
                first.params[0][0, 0] = math.nan
        synced = [group.label for group in averager.step([loop.opt])]
        if launching and rank == 1 and delay:
            with torch.no_grad():
                first.params[0].copy_(kept)  # only the pseudo-gradient holds the NaN
        if step == 2:
            assert synced == ["*#0"]
            assert (first.skipped, second.skipped, averager.skipped_outer_steps) == (1, 0, 1)
            assert torch.equal(_fragment_flat(first), start), "a skipped fragment returns to its global copy"
            assert not first.outer.state, "the outer optimizer stepped on a non-finite pseudo-gradient"
            rows = both_ranks(_fragment_flat(first))
            assert torch.equal(rows[0], rows[1])
    assert (first.syncs, second.syncs, averager.skipped_outer_steps) == (2, 2, 1)
    assert first.outer.state and bool(flat(loop.model).isfinite().all())
    averager.close()


@pytest.mark.dist
@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay,codec", [(0, "none"), (1, "int4")])
def test_nonfinite_pseudo_gradient_skips_that_fragments_outer_step_on_every_rank(delay, codec):
    run_ranks(_nonfinite_ranks, delay, codec)


FROZEN_TIMEOUT_S = 4.0


def _frozen_ranks(rank: int, world: int, stamp: str, result: str) -> None:
    streaming = StreamingOptions(fragments=2, sync_delay=1)
    averager = PeriodicAverager(sync_every=4, outer=True, streaming=streaming, timeout_s=FROZEN_TIMEOUT_S)
    loop = Loop(rank, averager)
    dist.barrier()
    if rank == 1:  # frozen before it launches fragment 0 (step 1): rank 0's outer sync stays in flight
        with open(stamp, "w") as out:
            out.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    started = time.monotonic()
    try:
        loop.run(3)  # launch at step 1, apply (wait) at step 2
    except PeerError as error:
        with open(result, "w") as out:
            out.write(f"{time.monotonic() - started} {error}")
    finally:
        with open(stamp) as inp:
            os.kill(int(inp.read()), signal.SIGKILL)
    os._exit(0)  # the stream group still holds the failed collective: leave without tearing it down


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_frozen_peer_during_an_in_flight_outer_sync_fails_within_timeout_s(tmp_path):
    import torch.multiprocessing as mp
    from dist_utils import _entry

    stamp, result = str(tmp_path / "pid"), tmp_path / "result"
    ctx = mp.get_context("fork")
    errors = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_entry, args=(rank, 2, str(tmp_path / "pg"), _frozen_ranks, (stamp, str(result)), errors))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert errors.empty(), errors.get()
    assert result.is_file(), "rank 0 did not fail with a PeerError"
    seconds, message = result.read_text().split(" ", 1)
    print(f"frozen peer: rank 0 failed after {float(seconds):.1f} s (timeout_s={FROZEN_TIMEOUT_S:g}): {message}")
    assert float(seconds) < FROZEN_TIMEOUT_S + 10, seconds
    assert f"rank 1 did not answer within {FROZEN_TIMEOUT_S:g} s" in message, message


_STUCK_OUTER_SYNC = """
import sys, threading
import torch.distributed as dist
from torch import nn
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.periodic import PeriodicAverager, StreamingOptions

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
averager = PeriodicAverager(sync_every=4, outer=True, streaming=StreamingOptions(fragments=2, sync_delay=1))
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
averager.setup(model.named_parameters(), model.named_buffers(), CommMeter())
averager._worker.submit(threading.Event().wait)  # as an outer sync stuck on a frozen peer
print("leaving", flush=True)
"""


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_an_outer_sync_stuck_on_a_frozen_peer_does_not_hold_the_exit(tmp_path):
    """The outer syncs run on a daemon thread: the interpreter's exit does not wait for a stuck one (it joins a
    ``ThreadPoolExecutor``'s thread, for ever here, up to ``timeout_s`` in a job)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    command = [sys.executable, "-c", _STUCK_OUTER_SYNC, str(tmp_path / "pg")]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------------------- Lightning
def _fit_digits(tmp_path, epochs: int, callbacks=(), ckpt_path=None):
    import lightning.pytorch as pl
    from lightning_utils import make_trainer

    from lightning_sync import PeriodicSyncStrategy
    from lightning_sync.examples.data import DigitsDataModule
    from lightning_sync.examples.models import DigitsClassifier

    strategy = PeriodicSyncStrategy(
        start_method="fork",
        mode="diloco",
        sync_every=4,
        fragments=2,
        sync_delay=1,
        fragment_alpha=0.5,
        outer_compression="int8",
        check_consistency_every=1,
    )
    pl.seed_everything(0, verbose=False)
    model = DigitsClassifier(momentum=0.0)  # Lightning restores rank 0's inner optimizer state on every rank
    trainer = make_trainer(
        strategy, max_epochs=epochs, limit_train_batches=7, num_sanity_val_steps=0, callbacks=list(callbacks)
    )
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32), ckpt_path=ckpt_path)
    return model


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lightning_bytes_are_the_setup_broadcast_then_the_outer_syncs_payload(tmp_path):
    """Through the strategy (replica check at every step included): before training, the broadcast of rank 0's model
    ((n-1)/n of it); during training, exactly each fragment sync's int4 payload; at the end, the flush of the
    fragments with local steps."""
    import json

    import lightning.pytorch as pl
    from lightning_utils import WORLD, make_trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_sync import PeriodicSyncStrategy

    out = tmp_path / "bytes.json"

    class Mlp(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(8)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return (self.net(x) - x).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Record(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.start = trainer.strategy.meter.total.bytes_sent
            self.steps: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            self.steps.append(trainer.strategy.meter.total.bytes_sent)

        def teardown(self, trainer, pl_module, stage) -> None:
            if trainer.is_global_zero:
                end = trainer.strategy.meter.total.bytes_sent
                out.write_text(json.dumps({"start": self.start, "steps": self.steps, "end": end}))

    strategy = PeriodicSyncStrategy(
        start_method="fork",
        mode="diloco",
        sync_every=8,
        fragments=4,
        outer_compression="int4",
        check_consistency_every=1,
    )
    data = DataLoader(TensorDataset(torch.randn(16 * 16, WIDTH)), batch_size=16)
    make_trainer(strategy, max_steps=16, callbacks=[Record()]).fit(Mlp(), data)
    record = json.loads(out.read_text())
    model_bytes = 4 * 8 * WIDTH * (WIDTH + 1)
    assert record["start"] == (WORLD - 1) / WORLD * model_bytes  # the setup broadcast, once
    fragment = (
        2 * (WORLD - 1) * Int4Compression().chunk_bytes(math.ceil(2 * WIDTH * (WIDTH + 1) / (WORLD * BLOCK)) * BLOCK)
    )
    sent = [b - a for a, b in zip([record["start"], *record["steps"]], record["steps"])]
    assert sent == [0.0, fragment] * 8, sent  # one fragment every 2 steps, nothing else
    assert record["end"] - record["steps"][-1] == 3 * fragment  # the flush: fragments 0, 1, 2


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_lightning_streaming_diloco_resumes_exactly_with_a_fragment_in_flight(tmp_path):
    """7 steps per epoch: fragment 1 (launched at step 7) is in flight when the epoch-1 checkpoint is saved. The
    replica check runs at every step (global copies after every apply)."""
    import lightning.pytorch as pl

    ckpt = str(tmp_path / "epoch0.ckpt")

    class Save(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            trainer.save_checkpoint(ckpt)

    straight = _fit_digits(tmp_path, epochs=2)
    _fit_digits(tmp_path, epochs=1, callbacks=(Save(),))
    resumed = _fit_digits(tmp_path, epochs=2, ckpt_path=ckpt)
    groups = torch.load(sync_state_path(ckpt, 0), weights_only=True)["averager"]["groups"]
    assert [group["in_flight"] is not None for group in groups] == [False, True]
    a, b = straight.state_dict(), resumed.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a), "resume with a fragment in flight is not exact"
