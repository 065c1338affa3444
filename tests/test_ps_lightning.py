"""An ordinary LightningModule under ``strategy=ps`` in every mode, as a new user writes one: validation with a
torchmetrics accuracy and ``self.log(..., sync_dist=True)``, a StepLR schedule, ``EarlyStopping(monitor="val_loss")``
and ``ModelCheckpoint(save_last=True)``; fit, resume from ``last.ckpt``, test, predict.

In async and ssp each worker validates its own shard of the validation set with the parameters it has just pulled,
and the metrics stay local to it (no worker waits for another); rank 0's are the ones logged and checkpointed on.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning_utils import make_trainer
from torchmetrics.classification import MulticlassAccuracy

from lightning_sync import ParameterServerStrategy
from lightning_sync.examples.data import DigitsDataModule

MODES = ["sync", "async", "ssp"]


class Ordinary(pl.LightningModule):
    """What a user writes: an MLP on the digits, nothing ps-specific."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        self.val_acc = MulticlassAccuracy(num_classes=10)
        self.test_acc = MulticlassAccuracy(num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test_acc", self.test_acc)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)}


class Digits(DigitsDataModule):
    def predict_dataloader(self) -> Any:
        return self.test_dataloader()


class _Seen(pl.Callback):
    """Rank 0 writes the epochs it validated at, its val_loss values and its learning rates to a JSON file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.record: dict[str, list[float]] = {"val_epochs": [], "val_loss": [], "lr": []}

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or "val_loss" not in trainer.callback_metrics:
            return
        self.record["val_epochs"].append(trainer.current_epoch)
        self.record["val_loss"].append(float(trainer.callback_metrics["val_loss"]))
        self.record["lr"].append(trainer.optimizers[0].param_groups[0]["lr"])
        if trainer.is_global_zero:
            self.path.write_text(json.dumps(self.record))


class _Predicted(pl.Callback):
    """Rank 0 writes how many predictions it made, all class indices in [0, 10), to a JSON file (the fork launcher
    returns none to the caller)."""

    def __init__(self, path: Path) -> None:
        self.path, self.count, self.valid = path, 0, True

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self.count += outputs.numel()
        self.valid = self.valid and outputs.dtype == torch.int64 and bool(((outputs >= 0) & (outputs < 10)).all())

    def on_predict_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            self.path.write_text(json.dumps({"count": self.count, "valid": self.valid}))


class _LoggerFolderFirst(pl.Callback):
    """An injected order: rank 1 sets up only once rank 0's logger has made its folder (``version_0``), so that rank
    1's own logger, asked for its version, would say ``version_1``. At the end each rank writes the folder its
    ModelCheckpoint used."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        deadline = time.monotonic() + 60
        while trainer.global_rank == 1 and not (self.logs / "version_0").is_dir() and time.monotonic() < deadline:
            time.sleep(0.05)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        (self.logs.parent / f"dirpath{trainer.global_rank}").write_text(str(trainer.checkpoint_callback.dirpath))


def _trainer(mode: str, ckpt_dir: Path | None, record: Path, early: EarlyStopping, **kwargs: Any) -> pl.Trainer:
    extra = {"max_staleness": 1} if mode == "ssp" else {}
    strategy = ParameterServerStrategy(start_method="fork", timeout_s=30, mode=mode, **extra)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, monitor="val_loss", save_last=True), early, _Seen(record)]
    callbacks += kwargs.pop("callbacks", [])
    common = dict(limit_train_batches=6, limit_val_batches=4, num_sanity_val_steps=0)
    return make_trainer(strategy, callbacks=callbacks, enable_checkpointing=True, **common, **kwargs)


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
def test_an_ordinary_module_fits_resumes_tests_and_predicts(tmp_path, mode):
    pl.seed_everything(0, verbose=False)
    data, ckpts = Digits(batch_size=32), tmp_path / "ckpt"
    first = _trainer(mode, ckpts, tmp_path / "first.json", EarlyStopping(monitor="val_loss", patience=5), max_epochs=2)
    first.fit(Ordinary(), datamodule=data)
    seen = json.loads((tmp_path / "first.json").read_text())
    assert seen["val_loss"][-1] < seen["val_loss"][0] < 2.4, seen  # it validated trained parameters
    assert (ckpts / "last.ckpt").is_file() and Path(first.checkpoint_callback.best_model_path).is_file()

    second = _trainer(
        mode, ckpts, tmp_path / "second.json", EarlyStopping(monitor="val_loss", patience=5), max_epochs=4
    )
    module = Ordinary()
    second.fit(module, datamodule=data, ckpt_path=str(ckpts / "last.ckpt"))
    resumed = json.loads((tmp_path / "second.json").read_text())
    assert resumed["val_loss"][-1] < seen["val_loss"][0], (seen, resumed)
    if mode == "sync":  # the workers walk the epochs together
        assert seen["val_epochs"] == [0, 1] and resumed["val_epochs"] == [2, 3], (seen, resumed)
        assert seen["lr"] == pytest.approx([0.07, 0.049]), seen  # StepLR steps on the workers, each epoch
        assert resumed["lr"] == pytest.approx([0.0343, 0.02401]), resumed  # the schedule came back too
    else:  # each worker walks its own epochs until the servers' version ends the run; it validates at each
        assert seen["val_epochs"][:2] == [0, 1] and resumed["val_epochs"][0] >= 2, (seen, resumed)
        assert seen["lr"][0] == pytest.approx(0.07) and seen["lr"] == sorted(seen["lr"], reverse=True), seen
        assert resumed["lr"][0] < 0.07 - 1e-9, resumed  # the schedule came back (a new one would say 0.07)

    (tested,) = second.test(module, datamodule=data)
    assert tested["test_acc"] > 0.5, tested  # 10 classes: 0.1 by chance
    second.callbacks.append(_Predicted(tmp_path / "predicted.json"))
    second.predict(module, datamodule=data)
    predicted = json.loads((tmp_path / "predicted.json").read_text())
    assert predicted["count"] >= 150 and predicted["valid"], predicted  # rank 0's half of the 360 test digits


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_early_stopping_on_a_validation_metric_stops_every_worker(tmp_path, mode):
    """No improvement of 10 in val_loss can happen: EarlyStopping (patience 1) stops at the second validation on
    whichever worker decides first; the servers carry the stop to the other, and the fit ends long before 50 epochs.
    Each worker is a world of its own, yet both checkpoint into rank 0's logger folder (the default dirpath), though
    rank 1's own logger would name the next version."""
    pl.seed_everything(0, verbose=False)
    early = EarlyStopping(monitor="val_loss", min_delta=10.0, patience=1)
    logger = CSVLogger(tmp_path / "logs")
    folder_first = _LoggerFolderFirst(tmp_path / "logs" / "lightning_logs")
    trainer = _trainer(
        mode, None, tmp_path / "seen.json", early, max_epochs=50, logger=logger, callbacks=[folder_first]
    )
    trainer.fit(Ordinary(), datamodule=Digits(batch_size=32))
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert 2 <= len(seen["val_epochs"]) <= 3, seen
    assert trainer.current_epoch <= 4, trainer.current_epoch
    dirpaths = [(tmp_path / "logs" / f"dirpath{rank}").read_text() for rank in (0, 1)]
    assert dirpaths[0] == dirpaths[1] == str(tmp_path / "logs" / "lightning_logs" / "version_0" / "checkpoints")
