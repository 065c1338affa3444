"""A NaN or Inf gradient on one rank: every rank skips that step together, and the replicas stay identical.

The Trainer tests fork 2 ranks; rank 1's loss is multiplied by NaN (or Inf) at one batch, which makes all of its
gradients non-finite. Each rank asserts, at the end of fit, that its parameters are finite, equal to the other
rank's (max |diff| 0), and that it counted the expected skipped steps.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning_utils import make_trainer

from lightning_sync import AllReduceStrategy, DDPSyncStrategy, ParameterServerStrategy, PeriodicSyncStrategy
from lightning_sync.comm.compression import PowerSGDCompression, TopKCompression
from lightning_sync.comm.nonfinite import NonFiniteStepWarning, drop_grads, grads_are_finite
from lightning_sync.examples.data import DigitsDataModule
from lightning_sync.examples.models import DigitsClassifier

TIMEOUT = pytest.mark.timeout(120)
BAD_BATCH, STEPS = 3, 8


# ------------------------------------------------------------------------------------------------ comm functions
@pytest.mark.unit
def test_grads_are_finite_sees_nan_and_inf_and_huge_values_are_finite():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 3e38)  # the max-abs reduction cannot overflow: huge but finite is finite
    assert grads_are_finite([p])
    for bad in (float("nan"), float("inf"), -float("inf")):
        p.grad[2] = bad
        assert not grads_are_finite([p]), bad
    drop_grads([p])
    assert p.grad is None and grads_are_finite([p])


@pytest.mark.unit
def test_compressor_memory_forgets_nonfinite_entries():
    topk = TopKCompression(density=0.5)
    topk.residuals = {0: torch.tensor([1.0, float("nan"), float("inf"), 2.0])}
    topk.forget_nonfinite()
    assert torch.equal(topk.residuals[0], torch.tensor([1.0, 0.0, 0.0, 2.0]))

    powersgd = PowerSGDCompression(rank=1, start_iter=0)
    from lightning_sync.comm.compression.powersgd import _PowerSGDMemory

    good_q = torch.ones(3, 1)
    powersgd._memory = {
        0: _PowerSGDMemory(
            [torch.Size([2, 3])],
            torch.Generator(),
            [torch.tensor([[float("nan")], [1.0], [1.0]])],
            [torch.tensor([[float("inf"), 1.0, 1.0], [1.0, 1.0, 1.0]])],
        ),
        1: _PowerSGDMemory([torch.Size([2, 3])], torch.Generator(), [good_q], [None]),
    }
    powersgd.forget_nonfinite()
    assert powersgd._memory[0].q == [] and powersgd._memory[0].residuals[0][0, 0] == 0.0  # redrawn, zeroed
    assert powersgd._memory[1].q == [good_q]


# ------------------------------------------------------------------------------------------------ Trainer
class _PoisonedOnRank1(DigitsClassifier):
    """Rank 1's loss becomes ``poison`` times the loss at batch ``BAD_BATCH`` of epoch 0."""

    def __init__(self, poison: float) -> None:
        super().__init__(hidden=16, num_hidden_layers=1)
        self.poison = poison

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.trainer.global_rank == 1 and batch_idx == BAD_BATCH and self.current_epoch == 0:
            loss = loss * self.poison
        return loss


class _Outcome(pl.Callback):
    """At the end of fit (after any final sync), on every rank: finite, identical parameters and the skip count."""

    def __init__(self, skipped: tuple[int, int], identical: bool = True) -> None:
        self.skipped, self.identical = skipped, identical
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("sync/skipped_steps")
        if value is not None:
            self.logged.append(float(value))

    def on_fit_end(self, trainer, pl_module) -> None:
        rank = trainer.global_rank
        flat = torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])
        assert trainer.strategy.skipped_steps == self.skipped[rank], (rank, trainer.strategy.skipped_steps)
        assert self.logged and self.logged[-1] == self.skipped[rank], self.logged
        assert bool(flat.isfinite().all()), f"rank {rank}: non-finite parameters"
        if not self.identical:
            return
        gathered = trainer.strategy.all_gather(flat)
        diff = (gathered[0] - gathered[1]).abs().max().item()
        print(f"rank {rank}: skipped {trainer.strategy.skipped_steps}, max |param diff| across replicas {diff}")
        assert diff == 0.0, diff


class _Warned(pl.Callback):
    """Records, on every rank, the NonFiniteStepWarnings of the fit; at its end asserts that ``ranks`` (each rank that
    should warn) warned exactly once, naming ``mode`` and ``global_step={step}``, and that the other ranks did not."""

    def __init__(self, mode: str, step: int, ranks: tuple[int, ...] = (0,), alone: bool = False) -> None:
        self.mode, self.step, self.ranks, self.alone = mode, step, ranks, alone
        self._catching: Any = None

    def on_fit_start(self, trainer, pl_module) -> None:
        self._catching = warnings.catch_warnings(record=True)
        self.caught = self._catching.__enter__()
        warnings.simplefilter("always", NonFiniteStepWarning)  # the test run ignores UserWarning otherwise

    def on_fit_end(self, trainer, pl_module) -> None:
        self._catching.__exit__(None, None, None)
        rank = trainer.global_rank
        messages = [str(w.message) for w in self.caught if issubclass(w.category, NonFiniteStepWarning)]
        if rank not in self.ranks:
            assert not messages, (rank, messages)
            return
        assert len(messages) == 1, (rank, messages)
        who = f"rank {rank} alone" if self.alone else "every rank"
        expected = f"lightning_sync {self.mode}: skipped the optimizer step at global_step={self.step} on {who}"
        assert messages[0].startswith(expected), (messages[0], expected)


def _fit(strategy: Any, poison: float, *callbacks: pl.Callback, steps: int = STEPS, **trainer_kwargs: Any) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(strategy, callbacks=list(callbacks), max_steps=steps, **trainer_kwargs)
    trainer.fit(_PoisonedOnRank1(poison), datamodule=DigitsDataModule(batch_size=16))


@TIMEOUT
@pytest.mark.parametrize("poison", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize(
    ("make_strategy", "mode", "step"),
    [
        pytest.param(lambda: AllReduceStrategy(start_method="fork"), "allreduce", BAD_BATCH, id="allreduce"),
        pytest.param(
            lambda: AllReduceStrategy(start_method="fork", compression=TopKCompression(density=0.1)),
            "allreduce",
            BAD_BATCH,
            id="allreduce-topk",
        ),
        pytest.param(
            lambda: AllReduceStrategy(start_method="fork", compression=PowerSGDCompression(rank=1, start_iter=1)),
            "allreduce",
            BAD_BATCH,
            id="allreduce-powersgd",
        ),
        pytest.param(lambda: DDPSyncStrategy(start_method="fork"), "ddp", BAD_BATCH, id="ddp"),
        pytest.param(  # two batches per step: batch 3 is in step 1
            lambda: PeriodicSyncStrategy(start_method="fork", mode="gradient", sync_every=2),
            "periodic (gradient)",
            BAD_BATCH // 2,
            id="periodic-gradient",
        ),
        pytest.param(lambda: ParameterServerStrategy(start_method="fork"), "ps (sync)", BAD_BATCH, id="ps-sync"),
        pytest.param(
            lambda: ParameterServerStrategy(start_method="fork", compression=TopKCompression(0.1), num_servers=2),
            "ps (sync)",
            BAD_BATCH,
            id="ps-sync-topk-2servers",
        ),
    ],
)
@pytest.mark.e2e
def test_all_ranks_skip_the_step_together(make_strategy, mode, step, poison):
    """Both ranks skip, and rank 0 alone warns, once, naming the mode and the step."""
    _fit(make_strategy(), poison, _Outcome(skipped=(1, 1)), _Warned(mode, step))


@pytest.mark.e2e
@TIMEOUT
def test_local_steps_skip_on_the_rank_alone_and_the_sync_still_agrees():
    strategy = PeriodicSyncStrategy(start_method="fork", mode="local_sgd", sync_every=4)
    _fit(strategy, float("nan"), _Outcome(skipped=(0, 1)), _Warned("periodic (local_sgd)", BAD_BATCH, (1,), True))


@pytest.mark.e2e
@TIMEOUT
def test_ps_async_skips_the_poisoned_push_alone():
    """In async the servers skip the one push that held the NaN: only rank 1 counts it, and nothing is poisoned.
    (``max_steps`` counts the servers' updates, all workers' pushes: 40 lets rank 1 reach its bad batch however
    far rank 0 runs ahead.)"""
    _fit(
        ParameterServerStrategy(start_method="fork", mode="async"),
        float("nan"),
        _Outcome((0, 1), identical=False),
        _Warned("ps (async)", BAD_BATCH, (1,), alone=True),
        steps=40,
    )


@pytest.mark.e2e
@TIMEOUT
def test_without_the_skip_the_nan_reaches_every_replica():
    """The control: with ``skip_nonfinite=False`` the same run ends with NaN parameters on both ranks."""

    class _Poisoned(pl.Callback):
        def on_fit_end(self, trainer, pl_module) -> None:
            assert not all(bool(p.isfinite().all()) for p in pl_module.parameters()), "expected NaN parameters"

    _fit(AllReduceStrategy(start_method="fork", skip_nonfinite=False), float("nan"), _Poisoned())


@pytest.mark.e2e
@TIMEOUT
def test_grad_scaler_skips_and_the_step_is_counted():
    """AMP with a GradScaler (on CPU, given explicitly): it skips the overflowing step, on both ranks, and lowers
    its scale; nothing is dropped by the strategy, and the step is counted."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    class _Scale(pl.Callback):
        def on_fit_end(self, trainer, pl_module) -> None:
            scaler = trainer.precision_plugin.scaler
            assert scaler is not None and scaler.get_scale() < 2.0**16, scaler.get_scale()

    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    _fit(AllReduceStrategy(start_method="fork"), float("inf"), _Outcome(skipped=(1, 1)), _Scale(), plugins=[plugin])


@pytest.mark.unit
def test_the_finite_probe_skips_no_step_for_a_sum_that_only_overflows():
    from lightning_sync.comm.nonfinite import all_finite, probe

    big = torch.full((4,), 3e38)  # finite entries whose float32 sum is inf
    small = torch.ones(3)
    assert not bool(probe(big).isfinite()) and all_finite([probe(big), probe(small)], [big, small])
    for bad in (float("nan"), float("inf"), float("-inf")):
        holed = small.clone()
        holed[1] = bad
        assert not all_finite([probe(small), probe(holed)], [small, holed]), bad
    assert all_finite([], [])
