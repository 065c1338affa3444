"""AllReduceStrategy end to end: 2 forked ranks of a real Trainer, compared with Lightning's own DDP.

Replica checks run inside the ranks; rank 0 saves its final parameters (and per-step comm) for the parent to compare.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning_utils import make_trainer
from torch import nn

from lightning_sync import AllReduceStrategy, ConfigError, PowerSGDCompression, TopKCompression
from lightning_sync.examples.data import DigitsDataModule
from lightning_sync.examples.models import DigitsClassifier


def _flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


class _Collect(pl.Callback):
    """In every rank: asserts replicas are identical at the end; rank 0 saves params and per-step comm."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.sent: list[float] = []
        self.calls: list[float] = []
        self._step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        gathered = trainer.strategy.all_gather(_flat(pl_module))
        assert torch.equal(gathered[0], gathered[1]), "replicas differ at the start of training"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        stepped, self._step = trainer.global_step != self._step, trainer.global_step
        if stepped and "comm/bytes_sent" in metrics:
            self.sent.append(float(metrics["comm/bytes_sent"]))
            self.calls.append(float(metrics["comm/calls"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        flat = _flat(pl_module)
        gathered = trainer.strategy.all_gather(flat)
        assert all(torch.equal(gathered[0], g) for g in gathered[1:]), "replicas differ after training"
        if trainer.is_global_zero:
            torch.save({"params": flat, "sent": self.sent, "calls": self.calls}, self.out)


def _fit(strategy: Any, out: Path, model: type[pl.LightningModule] = DigitsClassifier, **trainer_kwargs: Any) -> dict:
    """Seeds, builds ``model`` (a class, so every run starts from the same weights), fits 2 ranks.

    Returns:
        What rank 0 recorded.
    """
    pl.seed_everything(7, verbose=False)
    model = model()
    trainer = make_trainer(strategy, callbacks=[_Collect(out)], **{"max_steps": 20, **trainer_kwargs})
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=16))
    return torch.load(out)


def _ours(**kwargs: Any) -> AllReduceStrategy:
    return AllReduceStrategy(start_method="fork", **kwargs)


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory) -> dict:
    """Lightning DDP, 20 optimizer steps with accumulate_grad_batches=2 and gradient clipping."""
    out = tmp_path_factory.mktemp("ddp") / "ddp.pt"
    return _fit("ddp_fork", out, accumulate_grad_batches=2, gradient_clip_val=0.05)


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucketing", ["overlap", "flat", "naive"])
def test_equals_lightning_ddp_with_accumulation_and_clipping(bucketing, ddp_reference, tmp_path):
    # small buckets so that overlap really launches several buckets during backward
    strategy = _ours(bucketing=bucketing, bucket_cap_mb=0.02, first_bucket_mb=0.005)
    ours = _fit(strategy, tmp_path / "ours.pt", accumulate_grad_batches=2, gradient_clip_val=0.05)
    diff = (ours["params"] - ddp_reference["params"]).abs().max().item()
    assert diff <= 1e-6, f"{bucketing}: differs from Lightning ddp by {diff:.3e}"
    # accumulation: one sync per optimizer step, i.e. nothing sent on the non-final micro-batch
    grad_bytes = 4 * sum(p.numel() for p in DigitsClassifier().parameters())
    assert len(ours["sent"]) == 20
    assert all(s == pytest.approx(grad_bytes, rel=1e-6) for s in ours["sent"]), ours["sent"][:3]
    if bucketing == "naive":
        assert all(c == 6 for c in ours["calls"]), ours["calls"][:3]  # one per parameter
    else:  # overlap and flat send the same buckets, during or after backward
        assert all(c > 2 for c in ours["calls"]), ours["calls"][:3]


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_every_launch_point_ends_with_the_same_bits_on_3_ranks(tmp_path):
    """3 ranks (where a sum depends on its order), 30 steps: overlap, flat and auto (which tries both launch points
    over its first 19 rounds, then keeps one) end with bitwise-equal parameters."""
    final = {}
    for bucketing in ("overlap", "flat", "auto"):
        strategy = _ours(bucketing=bucketing, bucket_cap_mb=0.02, first_bucket_mb=0.005)
        final[bucketing] = _fit(strategy, tmp_path / f"{bucketing}.pt", devices=3, max_steps=30)["params"]
    for bucketing in ("flat", "auto"):
        diff = (final[bucketing] - final["overlap"]).abs().max().item()
        assert torch.equal(final[bucketing], final["overlap"]), f"{bucketing} ends {diff:.3g} away from overlap"


class _TwoOptimizers(pl.LightningModule):
    """Manual optimization with two optimizers over two halves of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.body = nn.Linear(64, 32)
        self.head = nn.Linear(32, 10)

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_body, opt_head = self.optimizers()
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(torch.relu(self.body(x))), y)
        opt_body.zero_grad()
        opt_head.zero_grad()
        self.manual_backward(loss)
        opt_body.step()
        opt_head.step()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.body.parameters(), lr=0.1), torch.optim.Adam(self.head.parameters(), lr=1e-2)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_manual_optimization_with_two_optimizers_equals_ddp(tmp_path):
    ref = _fit("ddp_fork", tmp_path / "ddp.pt", model=_TwoOptimizers, max_steps=20)
    ours = _fit(_ours(), tmp_path / "ours.pt", model=_TwoOptimizers, max_steps=20)
    diff = (ours["params"] - ref["params"]).abs().max().item()
    assert diff <= 1e-6, diff


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_bf16_mixed_equals_ddp(tmp_path):
    ref = _fit("ddp_fork", tmp_path / "ddp.pt", precision="bf16-mixed", max_steps=10)
    ours = _fit(_ours(), tmp_path / "ours.pt", precision="bf16-mixed", max_steps=10)
    diff = (ours["params"] - ref["params"]).abs().max().item()
    assert diff <= 1e-6, diff


class _Conditional(DigitsClassifier):
    """``extra`` is used on rank 0 only; ``never`` is used by no rank; ``frozen`` has no gradient at all."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(64, 10)
        self.never = nn.Linear(4, 4)
        self.frozen = nn.Linear(64, 10)
        self.frozen.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x) + self.frozen(x)
        if self.global_rank == 0:
            logits = logits + self.extra(x)
        return nn.functional.cross_entropy(logits, y)


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize("bucketing", ["overlap", "flat"])
def test_unused_parameters_match_ddp_find_unused(bucketing, tmp_path):
    ref = _fit("ddp_fork_find_unused_parameters_true", tmp_path / "ddp.pt", model=_Conditional, max_steps=6)
    ours = _fit(
        _ours(bucketing=bucketing, find_unused_parameters=True, bucket_cap_mb=0.01, first_bucket_mb=0.001),
        tmp_path / "ours.pt",
        model=_Conditional,
        max_steps=6,
    )
    diff = (ours["params"] - ref["params"]).abs().max().item()
    assert diff <= 1e-6, diff


class _PerturbOnRank1(DigitsClassifier):
    def setup(self, stage: str) -> None:
        if self.global_rank == 1:  # runs before the strategy sets up: replicas start different
            with torch.no_grad():
                for p in self.parameters():
                    p.add_(1.0)


@pytest.mark.e2e
@pytest.mark.timeout(60)
def test_rank0_state_is_broadcast_at_setup(tmp_path):
    # _Collect asserts inside the ranks that replicas are identical at train start
    _fit(_ours(), tmp_path / "ours.pt", model=_PerturbOnRank1, max_steps=2)


class _OneMatrix(pl.LightningModule):
    """A single n x m weight (no bias): the compressors' byte formulas are exact for it."""

    def __init__(self, n: int = 48, m: int = 64) -> None:
        super().__init__()
        self.layer = nn.Linear(m, n, bias=False)
        self.out = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.layer(x)[:, :10], y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.e2e
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "kwargs,expected_bytes",
    [
        ({"compression": "none"}, 48 * 64 * 4),
        ({"compression": "fp16"}, 48 * 64 * 2),
        ({"compression": "bf16"}, 48 * 64 * 2),
        ({"compression": PowerSGDCompression(rank=2, start_iter=0)}, 2 * (48 + 64) * 4),
        # k = ceil(0.05 * 3072) = 154 values (fp32) + 154 indices (int32)
        ({"compression": TopKCompression(density=0.05)}, 154 * 4 + 154 * 4),
    ],
    ids=["none", "fp16", "bf16", "powersgd", "topk"],
)
def test_meter_counts_compressed_bytes(kwargs, expected_bytes, tmp_path):
    ours = _fit(_ours(**kwargs), tmp_path / "ours.pt", model=_OneMatrix, max_steps=4)
    # 2 ranks: a ring all-reduce sends 2(n-1)/n = 1 payload; an all-gather sends (n-1) = 1 payload
    assert ours["sent"] == [pytest.approx(expected_bytes, rel=1e-9)] * 4, ours["sent"]


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"bucket_cap_mb": 0}, "strategy.bucket_cap_mb=0"),
        ({"bucket_cap_mb": -1.0}, "strategy.bucket_cap_mb=-1.0"),
        ({"bucketing": "ring"}, "strategy.bucketing='ring'"),
        ({"compression": "zip"}, "strategy.compression='zip'"),
        ({"compression": 0.01}, "strategy.compression=0.01 is not allowed; it must be a codec object"),
        ({"start_method": "thread"}, "strategy.start_method='thread'"),
    ],
)
def test_bad_config_is_rejected_before_launch(kwargs, field):
    with pytest.raises(ConfigError) as info:
        AllReduceStrategy(**kwargs)
    assert field in str(info.value), str(info.value)


@pytest.mark.unit
def test_unknown_knob_is_a_type_error():
    with pytest.raises(TypeError, match="bucket_size"):  # as any Python call (and mypy) rejects it
        AllReduceStrategy(bucket_size=3)  # type: ignore[call-arg]


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_fp16_mixed_with_grad_scaler_equals_ddp(tmp_path):
    """fp16 autocast with a CPU GradScaler (Lightning would turn "16-mixed" into bf16 on CPU, so pass the plugin)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugin() -> MixedPrecision:
        return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**8))

    ref = _fit("ddp_fork", tmp_path / "ddp.pt", plugins=[plugin()], max_steps=10, gradient_clip_val=0.05)
    ours = _fit(_ours(), tmp_path / "ours.pt", plugins=[plugin()], max_steps=10, gradient_clip_val=0.05)
    diff = (ours["params"] - ref["params"]).abs().max().item()
    assert diff <= 1e-6, diff
