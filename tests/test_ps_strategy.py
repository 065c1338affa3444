"""ParameterServerStrategy end to end: 2 forked worker ranks of a real Trainer, servers started by the strategy.

Assertions about the replicas run inside the ranks (a failing assert on rank 1 fails the fit); final weights come
back from rank 0 for comparison with Lightning's DDP.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning_utils import WORLD, make_trainer
from torch import nn

from lightning_sync import ConfigError, ParameterServerStrategy
from lightning_sync.examples.data import DigitsDataModule
from lightning_sync.examples.models import DigitsClassifier
from lightning_sync.ps._protocol import HEADER_BYTES
from lightning_sync.strategies._base import sync_state_path

TIMEOUT = pytest.mark.timeout(180)


def _ps(**kwargs: Any) -> ParameterServerStrategy:
    return ParameterServerStrategy(start_method="fork", timeout_s=30, **kwargs)


class TwoGroups(DigitsClassifier):
    """The digits classifier with two param groups of different learning rates (first layer slower)."""

    def configure_optimizers(self):
        first = list(self.net[0].parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in first)]
        return torch.optim.SGD([{"params": first, "lr": 0.02}, {"params": rest}], lr=0.1, momentum=0.9)


class _Record(pl.Callback):
    """Each rank writes, at the end of fit, its parameters, its step count and what the strategy saw to a JSON file
    of its own (in async/ssp the workers are worlds apart: no collective ties them after fit)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.staleness: list[float] = []
        self.ingress: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        if "ps/staleness" in metrics:
            self.staleness.append(float(metrics["ps/staleness"]))
        self.ingress.append({k: float(v) for k, v in metrics.items() if k.endswith("_ingress_per_update")})

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        record = {
            "params": torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()]).tolist(),
            "step": trainer.global_step,
        }
        if trainer.is_global_zero and isinstance(strategy, ParameterServerStrategy):
            record |= {
                "version": strategy.last_reply.version,
                "staleness": self.staleness,
                "ingress": self.ingress,
                "shard_bytes": strategy.client.shard_nbytes,
                "push_bytes": [strategy.client.push_nbytes(i) for i in range(strategy.config.num_servers)],
            }
        self.path.with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(record))


def _fit(strategy: Any, tmp_path: Path, model: type[pl.LightningModule] = DigitsClassifier, **kwargs: Any):
    """Fits on 2 ranks; returns the module and rank 0's record, with both ranks' steps, after checking that the
    workers end holding the same parameters."""
    pl.seed_everything(0, verbose=False)
    module = model()
    out = tmp_path / f"{id(strategy)}.json"
    trainer = make_trainer(strategy, callbacks=[_Record(out)], **kwargs)
    trainer.fit(module, datamodule=DigitsDataModule(batch_size=32))
    ranks = [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0]["params"] == ranks[1]["params"], "workers hold different parameters after fit"
    return module, dict(ranks[0], steps=[rank["step"] for rank in ranks])


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.e2e
@TIMEOUT
@pytest.mark.parametrize("model", [DigitsClassifier, TwoGroups], ids=["one_group", "two_groups"])
def test_sync_equals_ddp(tmp_path, model):
    """Sync mode: the server averages both workers' gradients and steps once = DDP (momentum SGD, 1 or 2 groups)."""
    ddp, _ = _fit("ddp_fork", tmp_path, model, max_steps=25)
    ours, rec = _fit(_ps(), tmp_path, model, max_steps=25)
    assert _max_diff(ours, ddp) <= 1e-6
    assert rec["version"] == 25 and rec["steps"] == [25, 25]


@pytest.mark.e2e
@TIMEOUT
def test_sync_ingress_is_workers_times_model_bytes_and_splits_over_two_servers(tmp_path):
    _, one = _fit(_ps(), tmp_path, max_steps=6)
    model_bytes = sum(p.numel() * 4 for p in DigitsClassifier().parameters())
    (per_update,) = one["ingress"][-1].values()
    overhead = 3 * (HEADER_BYTES + 8)  # per worker and server: a push's header and learning rate, and a few requests'
    assert 0 <= per_update - WORLD * model_bytes < WORLD * overhead  # W gradients, plus headers and learning rates
    _, two = _fit(_ps(num_servers=2), tmp_path, max_steps=6)
    ingress = list(two["ingress"][-1].values())
    assert len(ingress) == 2 and 0 <= sum(ingress) - WORLD * model_bytes < WORLD * 2 * overhead
    assert 0.35 < ingress[0] / sum(ingress) < 0.65, ingress  # balanced by bytes


@pytest.mark.e2e
@TIMEOUT
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_end_at_the_server_version(tmp_path, mode):
    """max_steps counts server updates; a slowed worker does fewer of them, and staleness is logged. In ssp the fast
    worker 0 may see none: held at the bound, its reply comes right after the straggler's push, so it computes on the
    newest version (seen once in CI under load, all zeros); in async the straggler's pushes land between its own."""
    extra = {"max_staleness": 2} if mode == "ssp" else {}
    _, rec = _fit(_ps(mode=mode, slow_worker=1, slowdown=3.0, **extra), tmp_path, max_steps=40)
    assert rec["version"] == 40
    fast, slow = rec["steps"]
    assert fast + slow >= 40, rec["steps"]
    assert rec["staleness"], rec  # logged (rank 0's, the fast worker's)
    if mode == "async":
        assert max(rec["staleness"]) >= 1, rec["staleness"]  # the straggler's pushes land between its pull and push
        assert fast > slow, rec["steps"]  # the straggler does not set the pace (speed itself: the benchmark)
    else:
        assert abs(fast - slow) <= 2 + 1, rec["steps"]  # the bound, plus a push refused after the stop


@pytest.mark.e2e
@TIMEOUT
def test_colocated_placement_trains_like_dedicated(tmp_path):
    dedicated, _ = _fit(_ps(num_servers=2), tmp_path, max_steps=10)
    colocated, rec = _fit(_ps(num_servers=2, placement="colocated"), tmp_path, max_steps=10)
    assert rec["version"] == 10
    assert _max_diff(dedicated, colocated) == 0.0


@pytest.mark.e2e
@TIMEOUT
def test_sync_resume_from_checkpoint_is_exact(tmp_path):
    """1 epoch + checkpoint, resumed for a 2nd: the servers' parameters, optimizer state and version come back."""
    ckpt = tmp_path / "epoch0.ckpt"

    class Save(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module) -> None:
            trainer.save_checkpoint(ckpt)

    common = dict(limit_train_batches=8)
    straight, _ = _fit(_ps(), tmp_path, max_epochs=2, **common)
    pl.seed_everything(0, verbose=False)
    first = make_trainer(_ps(), max_epochs=1, callbacks=[Save()], **common)
    first.fit(DigitsClassifier(), datamodule=DigitsDataModule(32))
    pl.seed_everything(0, verbose=False)
    resumed = DigitsClassifier()
    trainer = make_trainer(_ps(), max_epochs=2, **common)
    trainer.fit(resumed, datamodule=DigitsDataModule(32), ckpt_path=str(ckpt))
    assert _max_diff(straight, resumed) == 0.0
    saved = torch.load(sync_state_path(ckpt, 0), weights_only=True)["servers"]
    assert saved[0]["version"] == 8


@pytest.mark.unit
@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"num_servers": 0}, r"strategy\.num_servers=0 is not allowed; it must be >= 1"),
        ({"mode": "ssp", "max_staleness": -1}, r"strategy\.max_staleness=-1 is not allowed; it must be >= 0"),
        ({"mode": "hogwild"}, r"strategy\.mode='hogwild' is not allowed; choose one of: sync, async, ssp"),
        ({"placement": "cloud"}, r"strategy\.placement='cloud' is not allowed; choose one of: dedicated, colocated"),
        (
            {"compression": "powersgd"},
            r"strategy\.compression=PowerSGDCompression\(rank=4.* can ride point_to_point, which PowerSGDCompression cannot",
        ),
        ({"max_staleness": 3}, r"strategy\.max_staleness=3 is not allowed with mode='sync'"),
        ({"slowdown": 0.5}, r"strategy\.slowdown=0\.5 is not allowed"),
    ],
)
def test_bad_input_is_a_config_error_at_construction(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ParameterServerStrategy(**kwargs)


@pytest.mark.e2e
def test_more_colocated_servers_than_ranks_fails_before_launch():
    with pytest.raises(ConfigError, match=r"strategy\.num_servers=3 is not allowed with placement='colocated' and 2"):
        make_trainer(_ps(num_servers=3, placement="colocated"))
