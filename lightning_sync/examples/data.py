"""Data that needs no download: scikit-learn's handwritten digits, and generated regression data."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), shipped inside scikit-learn.

    The split into train / validation / test is fixed by ``seed`` and stratified by class. Pixels are scaled to
    [0, 1]. Under a distributed strategy Lightning shards the train loader across ranks.

    Args:
        batch_size: samples per batch per rank.
        val_fraction: share of the samples held out for validation.
        test_fraction: share held out for the final test.
        seed: the split's seed.
    """

    num_features = 64
    num_classes = 10

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.15, test_fraction: float = 0.2, seed: int = 0):
        super().__init__()
        if not (0 < val_fraction < 1 and 0 < test_fraction < 1 and val_fraction + test_fraction < 1):
            raise ValueError(
                f"data.val_fraction={val_fraction} and data.test_fraction={test_fraction} must be in (0, 1) "
                "and sum to less than 1"
            )
        if batch_size < 1:
            raise ValueError(f"data.batch_size={batch_size} must be >= 1")
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.seed = seed
        self.splits: dict[str, TensorDataset] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        images, labels = load_digits(return_X_y=True)
        x = torch.tensor(images, dtype=torch.float32) / 16.0
        y = torch.tensor(labels, dtype=torch.long)
        idx = torch.arange(len(y)).numpy()
        rest, test = train_test_split(idx, test_size=self.test_fraction, random_state=self.seed, stratify=labels)
        val_share = self.val_fraction / (1 - self.test_fraction)
        train, val = train_test_split(rest, test_size=val_share, random_state=self.seed, stratify=labels[rest])
        self.splits = {
            name: TensorDataset(x[ids], y[ids]) for name, ids in (("train", train), ("val", val), ("test", test))
        }

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=256)


class SyntheticDataModule(pl.LightningDataModule):
    """Random inputs and the outputs of a fixed random linear teacher, generated from ``seed``.

    Args:
        in_features: input width (the synthetic model's ``width``).
        num_samples: training samples (validation and test get a quarter each).
        batch_size: samples per batch per rank.
        seed: the generator's seed (same on every rank).
    """

    def __init__(self, in_features: int = 256, num_samples: int = 4096, batch_size: int = 64, seed: int = 0):
        super().__init__()
        if in_features < 1 or num_samples < 1 or batch_size < 1:
            raise ValueError(
                f"data.in_features={in_features}, data.num_samples={num_samples}, data.batch_size={batch_size} "
                "must all be >= 1"
            )
        self.in_features = in_features
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.seed = seed
        self.splits: dict[str, TensorDataset] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        gen = torch.Generator().manual_seed(self.seed)
        teacher = torch.randn(self.in_features, 1, generator=gen) / self.in_features**0.5
        sizes = {"train": self.num_samples, "val": max(1, self.num_samples // 4), "test": max(1, self.num_samples // 4)}
        for name, n in sizes.items():
            x = torch.randn(n, self.in_features, generator=gen)
            self.splits[name] = TensorDataset(x, x @ teacher)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=self.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=self.batch_size)
