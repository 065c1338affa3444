"""Manual optimization and several optimizers under ``strategy=ps``: each ``opt.step()`` in ``training_step`` pushes
that optimizer's gradients and pulls the parameters; the servers hold one optimizer per user optimizer. Sync equals
Lightning's DDP; async runs.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import ManualOptimBoringModel
from lightning.pytorch.strategies import DDPStrategy
from lightning_utils import make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_sync import ParameterServerStrategy
from lightning_sync.ps import OptimizerSpec, build_shard_optimizer, current_lrs, optimizer_spec


class TinyGAN(pl.LightningModule):
    """A GAN-style module: generator and discriminator, two optimizers stepped by hand in each batch, with
    ``toggle_optimizer``, gradient clipping and an LR scheduler stepped every epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8))
        self.discriminator = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch: Any, batch_idx: int) -> None:
        real, noise = batch
        opt_g, opt_d = self.optimizers()
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        bce = nn.functional.binary_cross_entropy_with_logits

        self.toggle_optimizer(opt_d)
        fake = self.generator(noise).detach()
        loss_d = bce(self.discriminator(real), ones) + bce(self.discriminator(fake), zeros)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        self.clip_gradients(opt_d, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        opt_d.step()
        self.untoggle_optimizer(opt_d)

        self.toggle_optimizer(opt_g)
        loss_g = bce(self.discriminator(self.generator(noise)), ones)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()
        self.untoggle_optimizer(opt_g)

    def on_train_epoch_end(self) -> None:
        for scheduler in self.lr_schedulers():
            scheduler.step()

    def configure_optimizers(self) -> Any:
        opt_g = torch.optim.SGD(self.generator.parameters(), lr=0.05, momentum=0.9)
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=0.1, momentum=0.5, weight_decay=1e-3)
        schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt_g, opt_d)]
        return [opt_g, opt_d], schedulers

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        real = torch.randn(64, 8, generator=gen) * 0.5 + 1.0
        return DataLoader(TensorDataset(real, torch.randn(64, 4, generator=gen)), batch_size=8)


def _fit(strategy: Any, model_class: type[pl.LightningModule], **kwargs: Any) -> pl.LightningModule:
    pl.seed_everything(0, verbose=False)
    module = model_class()
    make_trainer(strategy, **kwargs).fit(module)
    return module


def _ps(mode: str = "sync") -> ParameterServerStrategy:
    return ParameterServerStrategy(start_method="fork", timeout_s=30, mode=mode)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model_class", [ManualOptimBoringModel, TinyGAN], ids=["ManualOptimBoringModel", "gan"])
def test_manual_optimization_under_ps_sync_equals_ddp_and_async_runs(model_class):
    limits = dict(max_epochs=2, limit_train_batches=4)
    ddp = _fit(DDPStrategy(start_method="fork", find_unused_parameters=True), model_class, **limits)
    ours = _fit(_ps(), model_class, **limits)
    start = model_class()
    pl.seed_everything(0, verbose=False)
    start = model_class()
    assert _max_diff(ddp, start) > 1e-3  # it trained
    assert _max_diff(ours, ddp) <= 1e-6, _max_diff(ours, ddp)
    trained = _fit(_ps("async"), model_class, **limits)
    assert _max_diff(trained, start) > 1e-3 and all(bool(p.isfinite().all()) for p in trained.parameters())


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_one_spec_describes_several_optimizers_and_each_shard_optimizer_mirrors_one():
    gan = TinyGAN()
    opt_g, opt_d = gan.configure_optimizers()[0]
    params = list(gan.parameters())
    spec = optimizer_spec([opt_g, opt_d], params)
    assert spec.num_optimizers == 2 and spec.owner == (0, 1) and spec.group_of == (0, 0, 0, 0, 1, 1, 1, 1)
    assert OptimizerSpec.from_dict(spec.as_dict()) == spec
    assert current_lrs([opt_g, opt_d]) == [0.05, 0.1]
    shard = [params[1], params[5]]  # one generator and one discriminator tensor
    d_opt, mirrored = build_shard_optimizer(spec, shard, [1, 5], optimizer=1)
    assert mirrored == [1] and d_opt.param_groups[0]["params"] == [params[5]]
    assert d_opt.param_groups[0]["momentum"] == 0.5 and d_opt.param_groups[0]["weight_decay"] == 1e-3
    assert build_shard_optimizer(spec, [params[5]], [5], optimizer=0) == (None, [])
    with pytest.raises(ValueError, match=r"params\[0\] is in two param groups"):
        optimizer_spec([opt_g, torch.optim.SGD(gan.generator.parameters(), lr=0.1)], params)
