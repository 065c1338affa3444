"""Example LightningModules to compose with any strategy (any user LightningModule works just as well)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics.classification import MulticlassAccuracy


def _make_optimizer(params: Any, name: str, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"model.optimizer={name!r} is not allowed; choose one of: sgd, adamw")


class DigitsClassifier(pl.LightningModule):
    """An MLP on scikit-learn's 8x8 digits, with accuracy synced across ranks by torchmetrics.

    Args:
        hidden: width of the hidden layers.
        num_hidden_layers: how many hidden layers.
        optimizer: ``sgd`` or ``adamw``.
        lr: learning rate.
        momentum: SGD momentum.
        weight_decay: weight decay.
    """

    def __init__(
        self,
        hidden: int = 128,
        num_hidden_layers: int = 2,
        optimizer: str = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = 64
        for _ in range(num_hidden_layers):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, 10))
        self.net = nn.Sequential(*layers)
        self.val_acc = MulticlassAccuracy(num_classes=10, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes=10, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.log("val/loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val/acc", self.val_acc)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test/acc", self.test_acc)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        return _make_optimizer(self.parameters(), h.optimizer, h.lr, h.momentum, h.weight_decay)


class SyntheticMLP(pl.LightningModule):
    """A stack of ``depth`` square linear layers of ``width``, fitting a random linear teacher.

    The number of parameter tensors is ``depth`` (no bias) or ``2 * depth`` (bias) plus the head's. Deep and narrow
    (many small tensors) is latency-bound; shallow and wide (a few huge tensors) is bandwidth-bound.

    Args:
        width: features per layer (the data's ``in_features``).
        depth: number of hidden layers.
        bias: whether layers have a bias (doubles the tensor count).
        optimizer: ``sgd`` or ``adamw``.
        lr: learning rate.
        momentum: SGD momentum.
    """

    def __init__(
        self,
        width: int = 256,
        depth: int = 40,
        bias: bool = True,
        optimizer: str = "sgd",
        lr: float = 0.01,
        momentum: float = 0.0,
    ) -> None:
        super().__init__()
        if width < 1 or depth < 1:
            raise ValueError(f"model.width={width} and model.depth={depth} must be >= 1")
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width, bias=bias), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 1, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", F.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test/loss", F.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = self.hparams
        return _make_optimizer(self.parameters(), h.optimizer, h.lr, h.momentum, 0.0)
