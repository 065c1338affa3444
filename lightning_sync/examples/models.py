"""Example LightningModules to compose with any strategy (any user LightningModule works just as well): the digits
classifier, the synthetic MLPs and a character-level language model (:class:`CharGPT`)."""

from __future__ import annotations

import math
from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import AttributeDict
from torch import nn
from torchmetrics.classification import MulticlassAccuracy
from typing_extensions import override


def _hparams(module: pl.LightningModule) -> AttributeDict:
    """``module.hparams``, an :class:`AttributeDict` after ``save_hyperparameters`` (Lightning types the property as
    ``AttributeDict | MutableMapping``, whose second member has no attribute access)."""
    return cast(AttributeDict, module.hparams)


def _make_optimizer(params: Any, name: str, lr: float, momentum: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"model.optimizer={name!r} is not allowed; choose one of: sgd, adamw")


class DigitsClassifier(pl.LightningModule):
    """An MLP on the 8x8 handwritten digits, with accuracy synced across ranks by torchmetrics.

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
        h = _hparams(self)
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
        h = _hparams(self)
        return _make_optimizer(self.parameters(), h.optimizer, h.lr, h.momentum, 0.0)


# ------------------------------------------------------------------------------------------------ language model
class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention`` (``is_causal=True``)."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(out.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then a 4x MLP, each added to the residual stream."""

    def __init__(self, d_model: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class CharGPT(pl.LightningModule):
    """A small decoder-only transformer over characters: learned token and position embeddings, ``n_layer``
    pre-norm blocks of causal self-attention (``F.scaled_dot_product_attention``) and MLP, a final LayerNorm and an
    output head tied to the token embedding.

    It logs ``train/loss``, ``val/loss`` and ``test/loss`` in nats per character (the mean cross-entropy of the
    next character) and ``val/bpc``, ``test/bpc`` in bits per character.

    Args:
        vocab_size: distinct characters (the data module's ``vocab_size``).
        block_size: the longest context, in characters (the data's windows must not be longer).
        d_model: width of the residual stream.
        n_layer: transformer blocks.
        n_head: attention heads (must divide ``d_model``).
        dropout: dropout on attention and the residual branches.
        optimizer: ``adamw`` or ``sgd``.
        lr: learning rate, constant. The default is AdamW's best of ``benchmarks/lr_sweep.py`` (DDP, 2 ranks, 300 and
            1000 steps, 3 seeds) on the default corpus.
        momentum: SGD momentum.
        weight_decay: weight decay of the matrices (embeddings, norms and biases get none).
    """

    def __init__(
        self,
        vocab_size: int = 128,
        block_size: int = 64,
        d_model: int = 128,
        n_layer: int = 2,
        n_head: int = 4,
        dropout: float = 0.0,
        optimizer: str = "adamw",
        lr: float = 1.5e-3,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        from lightning_sync.errors import ConfigError, check_range

        for name, value in (("vocab_size", vocab_size), ("block_size", block_size)):
            if value is None:
                raise ConfigError(
                    f"model.{name}=None is not allowed here: it comes from a text data module (data=text, or "
                    "experiment=char_lm); with other data give an integer"
                )
        for name, value in (("vocab_size", vocab_size), ("block_size", block_size), ("d_model", d_model)):
            check_range(f"model.{name}", value, low=1, integer=True)
        check_range("model.n_layer", n_layer, low=1, integer=True)
        check_range("model.n_head", n_head, low=1, integer=True)
        check_range("model.dropout", dropout, low=0, high=1, high_open=True)
        if d_model % n_head:
            raise ConfigError(f"model.n_head={n_head} is not allowed; it must divide model.d_model={d_model}")
        self.save_hyperparameters()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, time, vocab_size)`` of the next character at every position of ``tokens``."""
        time = tokens.shape[1]
        if time > _hparams(self).block_size:
            raise ValueError(f"a sequence of {time} tokens is longer than model.block_size={_hparams(self).block_size}")
        x = self.tok_emb(tokens) + self.pos_emb(torch.arange(time, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, batch: Any) -> torch.Tensor:
        """The batch's mean next-character cross-entropy, nats per character."""
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        return loss

    def _evaluate(self, batch: Any, split: str) -> None:
        loss = self.loss(batch)
        self.log(f"{split}/loss", loss, sync_dist=True)
        self.log(f"{split}/bpc", loss / math.log(2), sync_dist=True)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        h = _hparams(self)
        matrices = [p for n, p in self.named_parameters() if p.ndim >= 2]
        others = [p for n, p in self.named_parameters() if p.ndim < 2]
        groups = [{"params": matrices, "weight_decay": h.weight_decay}, {"params": others, "weight_decay": 0.0}]
        return _make_optimizer(groups, h.optimizer, h.lr, h.momentum, h.weight_decay)


def build_char_lm(
    seed: int = 0, path: str | None = None, data: dict[str, Any] | None = None, **model: Any
) -> tuple[CharGPT, Any]:
    """``(model, datamodule)`` of the language-model example without Hydra: the defaults of
    ``conf/model/char_gpt.yaml`` and ``conf/data/text.yaml``, the model's initial weights drawn from ``seed``.

    Args:
        seed: seeds the initial weights (``torch.manual_seed``); the data order follows the global seed at fit
            time (``lightning.seed_everything``).
        path: the user's text (see :class:`~lightning_sync.examples.data.TextDataModule`); ``None``: the default.
        data: more arguments of the data module (``block_size``, ``batch_size``, ``val_windows``).
        **model: arguments of :class:`CharGPT` (``d_model``, ``n_layer``, ``lr``, ...).
    """
    from lightning_sync.examples.data import TextDataModule

    datamodule = TextDataModule(path=path, **(data or {}))
    torch.manual_seed(seed)
    return CharGPT(**{**datamodule.model_kwargs, **model}), datamodule
