"""DDPSyncStrategy end to end: 2 forked ranks of a real Lightning Trainer on the digits MLP (gloo, CPU).

Assertions about replicas run inside the ranks (a callback all-gathers the flat parameters); what the parent compares
between runs, rank 0 saved to a file.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning_utils import WORLD, make_trainer

import lightning_sync
from lightning_sync import DDPSyncStrategy, PowerSGDCompression
from lightning_sync.examples.data import DigitsDataModule
from lightning_sync.examples.models import DigitsClassifier

pytestmark = pytest.mark.e2e

SEED = 1234
BATCHES = 10


def _flat_params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def _grad_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


class Recorder(pl.Callback):
    """Inside every rank: checks replicas are identical after fit; rank 0 saves params and per-step comm to ``out``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.bytes_sent: list[float] = []
        self.initial: torch.Tensor | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.initial = _flat_params(pl_module).clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("comm/bytes_sent")
        if value is not None:
            self.bytes_sent.append(float(value))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert trainer.world_size == WORLD
        assert trainer.global_step == BATCHES, trainer.global_step
        flat = _flat_params(pl_module)
        assert not torch.equal(flat, self.initial), "parameters did not change: nothing was trained"
        gathered = trainer.strategy.all_gather(flat)
        assert gathered.shape == (WORLD, flat.numel()), gathered.shape
        for rank in range(1, WORLD):
            diff = (gathered[rank] - gathered[0]).abs().max().item()
            assert torch.equal(gathered[rank], gathered[0]), f"rank {rank} differs from rank 0 by {diff:.3e}"
        hook_state = getattr(trainer.strategy, "hook_state", None)
        calls = None if hook_state is None else hook_state.calls
        if isinstance(trainer.strategy, DDPSyncStrategy):
            # the hook really ran on CPU/gloo (Lightning alone silently drops comm hooks off CUDA)
            assert calls is not None and calls >= BATCHES, calls
            assert len(self.bytes_sent) == BATCHES, self.bytes_sent
        if trainer.is_global_zero:
            torch.save(
                {
                    "params": flat.clone(),
                    "bytes_sent": self.bytes_sent,
                    "hook_calls": calls,
                    "grad_bytes": _grad_bytes(pl_module),
                },
                self.out,
            )


def _fit(strategy: Any, out: Path, **trainer_kwargs: Any) -> tuple[dict, DigitsClassifier]:
    pl.seed_everything(SEED, workers=True, verbose=False)
    model = DigitsClassifier()
    trainer = make_trainer(
        strategy,
        max_epochs=1,
        limit_train_batches=BATCHES,
        callbacks=[Recorder(out)],
        **trainer_kwargs,
    )
    trainer.fit(model, datamodule=DigitsDataModule(seed=0))
    assert out.is_file(), "rank 0 wrote no result"
    return torch.load(out), model


def _sync(**kwargs: Any) -> DDPSyncStrategy:
    return DDPSyncStrategy(start_method="fork", **kwargs)


@pytest.fixture(scope="module")
def none_run(tmp_path_factory) -> tuple[dict, DigitsClassifier]:
    return _fit(_sync(comm_hook="none"), tmp_path_factory.mktemp("none") / "rank0.pt")


@pytest.mark.timeout(120)
def test_matches_lightning_ddp_and_replicas_agree(none_run, tmp_path):
    ours, our_model = none_run
    ref, ref_model = _fit("ddp_fork", tmp_path / "ddp.pt")
    diff = (ours["params"] - ref["params"]).abs().max().item()
    assert diff <= 1e-6, f"sync_ddp differs from Lightning's ddp by {diff:.3e}"
    # With fork, Lightning sends rank 0's weights back to the parent's model object.
    assert torch.equal(_flat_params(our_model), ours["params"])
    assert torch.equal(_flat_params(ref_model), ref["params"])


@pytest.mark.timeout(60)
def test_logged_bytes_per_step_match_ring_formula(none_run):
    result, _ = none_run
    expected = result["grad_bytes"] * 2 * (WORLD - 1) / WORLD  # ring all-reduce of every fp32 gradient
    assert result["grad_bytes"] == 4 * sum(p.numel() for p in DigitsClassifier().parameters())
    assert len(result["bytes_sent"]) == BATCHES
    for step, sent in enumerate(result["bytes_sent"]):
        assert sent == pytest.approx(expected, rel=0.05), (step, sent, expected)


@pytest.mark.timeout(60)
def test_fp16_hook_runs_on_cpu_and_halves_bytes(none_run, tmp_path):
    fp16, _ = _fit(_sync(comm_hook="fp16"), tmp_path / "fp16.pt")
    none, _ = none_run
    assert fp16["hook_calls"] >= BATCHES
    ratio = sum(fp16["bytes_sent"]) / sum(none["bytes_sent"])
    assert ratio == pytest.approx(0.5, rel=0.05), ratio
    # lossy, but still close to the fp32 run after a few steps
    assert (fp16["params"] - none["params"]).abs().max().item() < 1e-2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "kwargs",
    [
        {"comm_hook": "bf16"},
        {"comm_hook": PowerSGDCompression(start_iter=3), "check_consistency_every": 1},
    ],
    ids=["bf16", "powersgd"],
)
def test_other_hooks_train(kwargs, none_run, tmp_path):
    result, _ = _fit(_sync(**kwargs), tmp_path / "run.pt")
    assert result["hook_calls"] >= BATCHES
    assert all(torch.isfinite(result["params"]))
    none, _ = none_run
    # every step after PowerSGD switches on (and every bf16 step) sends fewer bytes than fp32
    start = getattr(kwargs["comm_hook"], "start_iter", 0)
    compressed = result["bytes_sent"][start + 1 :]
    assert compressed and all(b < 0.6 * none["bytes_sent"][0] for b in compressed), result["bytes_sent"]


def test_registry_builds_sync_ddp():
    from lightning.pytorch.strategies import StrategyRegistry

    assert "sync_ddp" in StrategyRegistry
    assert set(lightning_sync.STRATEGIES) <= set(StrategyRegistry.available_strategies())
    first, second = StrategyRegistry.get("sync_ddp"), StrategyRegistry.get("sync_ddp")
    assert isinstance(first, DDPSyncStrategy) and first is not second
    trainer = pl.Trainer(strategy="sync_ddp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, DDPSyncStrategy)
    assert trainer.strategy.config.comm_hook == "none"


@pytest.mark.timeout(60)
def test_registry_name_trains_two_ranks(tmp_path):
    """``Trainer(strategy="sync_ddp")`` resolves through Lightning's registry and trains on 2 ranks.

    The registered strategy uses the default ``popen`` launcher, which would re-run pytest's command line; the
    Trainer-built instance is switched to ``fork`` here (the CLI tests cover ``popen``).
    """
    pl.seed_everything(SEED, workers=True, verbose=False)
    out = tmp_path / "registry.pt"
    trainer = make_trainer(
        "sync_ddp",
        max_epochs=1,
        limit_train_batches=BATCHES,
        callbacks=[Recorder(out)],
    )
    strategy = trainer.strategy
    assert isinstance(strategy, DDPSyncStrategy)
    assert strategy.num_processes == WORLD and strategy.launcher is not None
    strategy._start_method = "fork"
    strategy._configure_launcher()
    trainer.fit(DigitsClassifier(), datamodule=DigitsDataModule(seed=0))
    result = torch.load(out)
    assert result["hook_calls"] >= BATCHES and len(result["bytes_sent"]) == BATCHES


@pytest.mark.timeout(60)
def test_fork_after_multithreaded_op_does_not_deadlock(tmp_path):
    """libgomp deadlocks a forked child if the parent ran an OpenMP-parallel op; the strategy must guard against it."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        a = torch.randn(1500, 1500)
        assert torch.isfinite((a @ a).sum())
        assert torch.get_num_threads() == 2
        result, _ = _fit(_sync(), tmp_path / "threads.pt")
        assert result["hook_calls"] >= BATCHES
        assert torch.get_num_threads() == 2  # the parent's own setting is left alone
    finally:
        torch.set_num_threads(threads)
        for child in multiprocessing.active_children():  # a hung rank must not outlive the test
            child.kill()
