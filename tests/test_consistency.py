"""Replica-consistency checks: the comm functions on a real 2-rank gloo group, then a Trainer with injected drift.

The comm tests assert inside the ranks (``dist_utils.run_ranks``); the Trainer tests fork 2 ranks of a real
``AllReduceStrategy``/``DDPSyncStrategy`` and assert inside them with callbacks, or on the error that reaches the
parent.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from dist_utils import run_ranks
from lightning_utils import make_trainer
from torch import nn

from lightning_sync import AllReduceStrategy, ConfigError, DDPSyncStrategy
from lightning_sync.comm.consistency import (
    ReplicaMismatchError,
    check_replicas,
    find_mismatches,
    named_replicated_state,
)
from lightning_sync.examples.data import DigitsDataModule
from lightning_sync.examples.models import DigitsClassifier

TIMEOUT = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------------------------ comm functions
def _replica() -> dict[str, torch.Tensor]:
    """The same named tensors on every rank (seeded), fp32 and fp64, one with a NaN that every rank holds."""
    gen = torch.Generator().manual_seed(3)
    nan = torch.randn(5, generator=gen)
    nan[2] = float("nan")
    return {
        "net.0.weight": torch.randn(8, 4, generator=gen),
        "net.0.bias": torch.randn(8, generator=gen),
        "net.2.weight": torch.randn(3, 8, generator=gen, dtype=torch.float64),
        "bn.running_mean": nan,
    }


def _identical_replicas_give_no_report(rank: int, world: int) -> None:
    named = _replica()
    assert find_mismatches(named) == []
    assert check_replicas(named, steps=5, on_mismatch="raise") == []


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_identical_replicas_give_no_report():
    run_ranks(_identical_replicas_give_no_report)


def _one_ulp_on_rank_1_is_named(rank: int, world: int) -> None:
    named = _replica()
    bias = named["net.0.bias"]
    before = bias[5].clone()
    if rank == 1:
        bias[5] = torch.nextafter(bias[5], torch.tensor(float("inf")))  # one ulp up
    ulp = float(torch.nextafter(before, torch.tensor(float("inf"))).double() - before.double())
    (mismatch,) = find_mismatches(named)
    assert (mismatch.name, mismatch.ranks, mismatch.max_abs_diff) == ("net.0.bias", (1,), ulp)
    assert ulp > 0 and str(mismatch) == f"net.0.bias (ranks [1], max |diff| {ulp:.1e})"
    with pytest.raises(ReplicaMismatchError) as info:
        check_replicas(named, steps=12)
    assert str(info.value) == f"replicas differ after 12 sync steps: net.0.bias (ranks [1], max |diff| {ulp:.1e})"
    assert find_mismatches(named, atol=ulp) == []  # within the tolerance
    # resync: rank 0's value everywhere, and nothing else touched
    reference = {name: t.clone() for name, t in _replica().items()}
    assert [m.name for m in check_replicas(named, steps=12, on_mismatch="resync")] == ["net.0.bias"]
    assert bias[5] == before
    for name, t in named.items():
        assert torch.equal(t.nan_to_num(), reference[name].nan_to_num()), name
    assert find_mismatches(named) == []


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_one_ulp_in_one_element_on_rank_1_is_named_with_rank_and_diff():
    run_ranks(_one_ulp_on_rank_1_is_named)


def _swap_and_several_tensors(rank: int, world: int) -> None:
    named = _replica()
    if rank == 1:
        w = named["net.0.weight"]
        w[0, 0], w[3, 1] = w[3, 1].clone(), w[0, 0].clone()  # same sum and sum of squares: only position tells
        named["net.2.weight"][2, 7] += 0.25
    found = find_mismatches(named)
    assert [m.name for m in found] == ["net.0.weight", "net.2.weight"]
    w = _replica()["net.0.weight"]
    assert found[0].max_abs_diff == abs(float(w[0, 0]) - float(w[3, 1]))  # exact, in float64
    assert found[1].max_abs_diff == pytest.approx(0.25, rel=1e-12)
    assert all(m.ranks == (1,) for m in found)
    if rank == 0:  # warn: logs on rank 0 and goes on
        logger = logging.getLogger("lightning_sync.comm.consistency")
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logger.addHandler(handler)
    assert len(check_replicas(named, steps=3, on_mismatch="warn")) == 2
    if rank == 0:
        logger.removeHandler(handler)
        (record,) = records
        assert record.getMessage().startswith("replicas differ after 3 sync steps: net.0.weight (ranks [1], ")


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_swapped_entries_and_several_tensors_are_found_and_warn_goes_on():
    run_ranks(_swap_and_several_tensors)


def _optimizer_state_is_named(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    named = named_replicated_state(model, [optimizer])
    assert "optimizer[0].state[2.weight].momentum_buffer" in named and "2.weight" in named
    assert find_mismatches(named) == []
    if rank == 1:
        optimizer.state[model[2].weight]["momentum_buffer"][1, 2] += 1e-3
    (mismatch,) = find_mismatches(named_replicated_state(model, [optimizer]))
    assert mismatch.name == "optimizer[0].state[2.weight].momentum_buffer" and mismatch.ranks == (1,)
    only = named_replicated_state(model, [optimizer], only=[model[0].bias])
    assert list(only) == ["0.bias"]


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_optimizer_state_is_checked_and_named():
    run_ranks(_optimizer_state_is_named)


@pytest.mark.unit
def test_on_mismatch_is_a_checked_knob():
    assert AllReduceStrategy().config.on_mismatch == "raise"
    with pytest.raises(ConfigError, match=r"strategy\.on_mismatch='fix'.*raise, warn, resync"):
        AllReduceStrategy(on_mismatch="fix")


# ------------------------------------------------------------------------------------------------ Trainer
DRIFT_BATCH, EVERY, STEPS = 3, 2, 10


class _Drift(pl.Callback):
    """Adds ``amount`` to one tensor on rank 1 after the optimizer step of batch ``DRIFT_BATCH``."""

    def __init__(self, amount: float = 1e-3, target: str = "net.0.bias") -> None:
        self.amount, self.target = amount, target

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == DRIFT_BATCH and trainer.global_rank == 1:
            with torch.no_grad():
                self._tensor(trainer, pl_module).add_(self.amount)

    def _tensor(self, trainer, pl_module) -> torch.Tensor:
        if self.target.startswith("optimizer"):
            return trainer.optimizers[0].state[pl_module.net[0].bias]["momentum_buffer"]
        return dict(pl_module.named_parameters())[self.target]


class _Outcome(pl.Callback):
    """Captures rank 0's consistency log; at the end asserts the run finished and whether the replicas agree."""

    def __init__(self, identical: bool) -> None:
        self.identical = identical
        self.records: list[logging.LogRecord] = []
        self.handler = logging.Handler()
        self.handler.emit = self.records.append  # type: ignore[method-assign]

    def on_train_start(self, trainer, pl_module) -> None:
        logging.getLogger("lightning_sync.comm.consistency").addHandler(self.handler)

    def on_train_end(self, trainer, pl_module) -> None:
        logging.getLogger("lightning_sync.comm.consistency").removeHandler(self.handler)
        assert trainer.global_step == STEPS
        bias = trainer.strategy.all_gather(pl_module.net[0].bias.detach().clone())
        assert torch.equal(bias[0], bias[1]) == self.identical, bias
        checks_after_drift = (STEPS - (DRIFT_BATCH + 1)) // EVERY
        if trainer.global_rank == 0:
            messages = [r.getMessage() for r in self.records]
            assert len(messages) == (1 if self.identical else checks_after_drift), messages  # once per check
            first = f"replicas differ after {DRIFT_BATCH + 1 + EVERY} sync steps: net.0.bias (ranks [1], max |diff| "
            assert messages[0].startswith(first + "1.0e-03)"), messages
        else:
            assert self.records == []  # only rank 0 logs


def _fit(strategy: Any, *callbacks: pl.Callback) -> None:
    pl.seed_everything(0, verbose=False)
    model = DigitsClassifier(hidden=16, num_hidden_layers=1)
    trainer = make_trainer(strategy, callbacks=list(callbacks), max_steps=STEPS, log_every_n_steps=50)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=16))


@pytest.mark.e2e
@TIMEOUT
def test_drift_on_one_rank_is_caught_within_one_check_period_and_named():
    strategy = AllReduceStrategy(start_method="fork", check_consistency_every=EVERY)
    with pytest.raises(Exception) as info:
        _fit(strategy, _Drift())
    text = str(info.value)
    caught = (DRIFT_BATCH + 1) + EVERY  # drift after step 4; the next check is at step 6
    expected = f"ReplicaMismatchError: replicas differ after {caught} sync steps: net.0.bias (ranks [1], max |diff| "
    assert expected in text, text


@pytest.mark.e2e
@TIMEOUT
@pytest.mark.parametrize("on_mismatch,identical", [("resync", True), ("warn", False)])
def test_resync_repairs_and_warn_goes_on(on_mismatch, identical):
    strategy = AllReduceStrategy(start_method="fork", check_consistency_every=EVERY, on_mismatch=on_mismatch)
    _fit(strategy, _Drift(), _Outcome(identical))


@pytest.mark.e2e
@TIMEOUT
def test_ddp_optimizer_state_drift_is_named():
    strategy = DDPSyncStrategy(start_method="fork", check_consistency_every=EVERY)
    with pytest.raises(Exception) as info:
        _fit(strategy, _Drift(target="optimizer"))
    text = str(info.value)  # the momentum drift also moved the bias at the next step: both are named
    assert "ReplicaMismatchError: replicas differ after 6 sync steps: net.0.bias (ranks [1], " in text, text
    assert ", optimizer[0].state[net.0.bias].momentum_buffer (ranks [1], max |diff| " in text, text


# ------------------------------------------------------------------------------------------------ setup
class _RankDependentModel(DigitsClassifier):
    """Rank 1 builds a wider hidden layer (``widen``) or one more layer (``extra``) than rank 0."""

    def __init__(self, difference: str) -> None:
        super().__init__(hidden=16, num_hidden_layers=1)
        self.difference = difference

    def setup(self, stage: str) -> None:
        if self.trainer.global_rank != 1:
            return
        if self.difference == "widen":
            self.net[0] = nn.Linear(64, 24)
            self.net[2] = nn.Linear(24, 10)
        else:
            self.extra = nn.Linear(10, 10)


@pytest.mark.e2e
@TIMEOUT
@pytest.mark.parametrize(
    "make_strategy",
    [lambda: AllReduceStrategy(start_method="fork"), lambda: DDPSyncStrategy(start_method="fork")],
    ids=["allreduce", "ddp"],
)
@pytest.mark.parametrize(
    "difference,expected",
    [
        ("widen", "rank 1 (6 tensors) has 'net.0.weight' of shape [24, 64] (float32), rank 0 [16, 64] (float32)"),
        ("extra", "rank 1 (6 tensors) has 'extra.weight' [10, 10] (float32), which rank 0 lacks"),
    ],
)
def test_models_that_differ_across_ranks_fail_setup_with_the_difference(make_strategy, difference, expected):
    trainer = make_trainer(make_strategy(), max_steps=2)
    with pytest.raises(Exception) as info:
        trainer.fit(_RankDependentModel(difference), datamodule=DigitsDataModule(batch_size=16))
    text = str(info.value)
    assert "ReplicaMismatchError: the model differs across ranks (rank 0 has 4 parameters and buffers)" in text, text
    assert expected.replace("(6", "(6" if difference == "extra" else "(4") in text, text
