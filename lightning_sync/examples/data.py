"""Data that needs no download: the UCI handwritten digits (shipped in this package), generated regression data, and
text (CPython's reference text by default, or the user's own)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset
from typing_extensions import override


class DigitsDataModule(pl.LightningDataModule):
    """The 8x8 handwritten digits (1,797 images, 10 classes; UCI "Optical Recognition of Handwritten Digits", E.
    Alpaydin and C. Kaynak, CC BY 4.0, the copy scikit-learn ships), read from ``digits.csv.gz`` in this package.

    The split into train / validation / test is fixed by ``seed`` and stratified by class; it is scikit-learn's
    ``train_test_split(..., stratify=labels, random_state=seed)``, index for index (:func:`stratified_split`), without
    importing scikit-learn, whose scipy would cost every process that imports torchmetrics over a second. Pixels are
    scaled to [0, 1]. Under a distributed strategy Lightning shards the train loader across ranks.

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
        table = np.loadtxt(Path(__file__).with_name("digits.csv.gz"), delimiter=",")  # 64 pixels (0..16), the label
        labels = table[:, -1].astype(int)
        x = torch.tensor(table[:, :-1], dtype=torch.float32) / 16.0
        y = torch.tensor(labels, dtype=torch.long)
        rest, test = stratified_split(np.arange(len(y)), labels, self.test_fraction, self.seed)
        val_share = self.val_fraction / (1 - self.test_fraction)
        train, val = stratified_split(rest, labels[rest], val_share, self.seed)
        self.splits = {
            name: TensorDataset(x[ids], y[ids]) for name, ids in (("train", train), ("val", val), ("test", test))
        }

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=256)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=256)


def stratified_split(
    items: np.ndarray, labels: np.ndarray, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(train, test)``: ``items`` split at random, each class in proportion, as scikit-learn's
    ``train_test_split(items, test_size=test_fraction, random_state=seed, stratify=labels)`` splits them (the same
    draws from ``numpy.random.RandomState(seed)``: each class's share rounded by the largest remainders, ties broken
    at random, then each class shuffled, then each side)."""
    n_test = math.ceil(test_fraction * len(items))
    _, class_of, counts = np.unique(labels, return_inverse=True, return_counts=True)
    members = np.split(np.argsort(class_of, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    n_train = _largest_remainders(counts, len(items) - n_test, rng)
    n_test_of = _largest_remainders(counts - n_train, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for group, k, t in zip(members, n_train, n_test_of):
        shuffled = group.take(rng.permutation(len(group)))
        train.extend(shuffled[:k])
        test.extend(shuffled[k : k + t])
    return items[rng.permutation(train)], items[rng.permutation(test)]


def _largest_remainders(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """``draws`` shared out over classes of ``counts`` in proportion: floors, then one more each to the largest
    remainders, a tie broken by ``rng`` (scikit-learn's ``_approximate_mode``)."""
    share = counts / counts.sum() * draws
    taken = np.floor(share)
    missing = int(draws - taken.sum())
    remainder = share - taken
    for value in np.sort(np.unique(remainder))[::-1]:
        if missing <= 0:
            break
        (tied,) = np.where(remainder == value)
        now = min(len(tied), missing)
        taken[rng.choice(tied, size=now, replace=False)] += 1
        missing -= now
    return taken.astype(int)


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


# ------------------------------------------------------------------------------------------------ character text
TEXT_CHUNK = 2048
"""Characters per chunk of the deterministic split: of every 20 chunks, the 19th is validation, the 20th test."""


def default_corpus() -> str:
    """CPython's own reference text (``pydoc_data.topics``, about 465k characters of English), topics in name
    order: on every machine with Python, no download."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def read_text(path: str | Path, min_chars: int = 0, field: str = "data.path") -> str:
    """The text at ``path``: a UTF-8 file, or every ``*.txt`` file under a folder (sorted by path, joined by a
    blank line).

    Args:
        path: a file or a folder.
        min_chars: the fewest characters allowed.
        field: the config field named in errors.

    Raises:
        ConfigError: the path is missing or unreadable, a folder holds no ``.txt`` file, or the text is empty or
            shorter than ``min_chars`` (one line naming ``field``, the value and what is allowed).
    """
    from lightning_sync.errors import ConfigError

    file = Path(path).expanduser()
    if not file.exists():
        raise ConfigError(
            f"{field}={str(path)!r} is not allowed; no such file or folder (a text file or a folder of .txt files)"
        )
    files = sorted(file.rglob("*.txt")) if file.is_dir() else [file]
    if not files:
        raise ConfigError(f"{field}={str(path)!r} is not allowed; the folder holds no .txt file")
    parts = []
    for one in files:
        try:
            parts.append(one.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
            raise ConfigError(
                f"{field}={str(path)!r} is not allowed; {one} is not readable UTF-8 text ({reason})"
            ) from None
    text = "\n\n".join(parts)
    if len(text) < max(1, min_chars):
        what = "empty" if not text else f"{len(text):,} characters"
        raise ConfigError(
            f"{field}={str(path)!r} is not allowed; its text is {what}, it must hold at least {max(1, min_chars):,} characters"
        )
    return text


def split_text(text: str, chunk: int = TEXT_CHUNK) -> dict[str, str]:
    """``{"train", "val", "test"}`` parts of ``text``, the same on every call: the text is cut into ``chunk``
    characters; of every 20 chunks the 19th goes to validation, the 20th to test, the rest to training. A text of
    fewer than 20 chunks is cut into 20 equal chunks instead, so every part gets some."""
    if len(text) < 20 * chunk:
        chunk = max(1, len(text) // 20)
    parts: dict[str, list[str]] = {"train": [], "val": [], "test": []}
    for i, start in enumerate(range(0, len(text), chunk)):
        name = {18: "val", 19: "test"}.get(i % 20, "train")
        parts[name].append(text[start : start + chunk])
    return {name: "".join(pieces) for name, pieces in parts.items()}


class WindowDataset(torch.utils.data.Dataset):
    """Non-overlapping windows of a token sequence: item ``i`` is ``(x, y)``, ``block_size`` tokens from
    ``i * block_size`` and the same shifted by one (the next-character targets)."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        window = self.tokens[start : start + self.block_size + 1]
        return window[:-1], window[1:]


class TextDataModule(pl.LightningDataModule):
    """Character-level text for next-character prediction; no download.

    The text is CPython's reference text (:func:`default_corpus`) or the user's own (``path``: a file, or a folder
    of ``.txt`` files). It is read, checked and split when the module is made, before any rank starts, so a bad
    ``path`` is reported at once. The split is deterministic (:func:`split_text`); the vocabulary is the sorted set
    of characters of the whole text (:attr:`vocab_size`, given to the model through :attr:`model_kwargs`).
    Training batches are non-overlapping windows of ``block_size`` characters in an order that the global seed
    shuffles; under a distributed strategy Lightning shards them across ranks.

    Attributes:
        vocab: the characters, in token order.
        unigram_entropy: the entropy of the text's character frequencies, nats per character: the loss of a model
            that knows only how often each character occurs.
        unigram_bits: the same in bits per character.

    Args:
        path: a UTF-8 text file, or a folder whose ``*.txt`` files are read; ``None``: the default corpus.
        block_size: characters per training window (the model's context).
        batch_size: windows per batch per rank.
        val_windows: at most this many validation windows are evaluated (``None``: all of them).
    """

    def __init__(
        self, path: str | None = None, block_size: int = 64, batch_size: int = 16, val_windows: int | None = 256
    ) -> None:
        super().__init__()
        from lightning_sync.errors import check_range

        check_range("data.block_size", block_size, low=2, integer=True)
        check_range("data.batch_size", batch_size, low=1, integer=True)
        if val_windows is not None:
            check_range("data.val_windows", val_windows, low=1, integer=True)
        # every split must hold at least one window (validation and test are 1/20 of the text each)
        text = default_corpus() if path is None else read_text(path, min_chars=20 * (block_size + 1))
        self.path = path
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_windows = val_windows
        self.vocab = sorted(set(text))
        counts = torch.bincount(self._encode(text), minlength=len(self.vocab)).double()
        probs = counts[counts > 0] / counts.sum()
        self.unigram_entropy = float(-(probs * probs.log()).sum())
        self.unigram_bits = self.unigram_entropy / math.log(2)
        self.num_chars = len(text)
        self.tokens = {name: self._encode(part) for name, part in split_text(text).items()}
        self.splits: dict[str, torch.utils.data.Dataset] = {}

    def _encode(self, text: str) -> torch.Tensor:
        index = {ch: i for i, ch in enumerate(self.vocab)}
        return torch.tensor([index[ch] for ch in text], dtype=torch.long)

    def decode(self, tokens: Iterable[int]) -> str:
        """The characters of token ids."""
        return "".join(self.vocab[int(t)] for t in tokens)

    @property
    def vocab_size(self) -> int:
        """Distinct characters of the text."""
        return len(self.vocab)

    @property
    def model_kwargs(self) -> dict[str, Any]:
        """What the model needs from the data: ``vocab_size`` and ``block_size`` (the app fills the model config's
        null fields with these)."""
        return {"vocab_size": self.vocab_size, "block_size": self.block_size}

    @override
    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        for name, tokens in self.tokens.items():
            windows = WindowDataset(tokens, self.block_size)
            data: torch.utils.data.Dataset = windows
            if name != "train" and self.val_windows is not None and len(windows) > self.val_windows:
                # evenly spaced over the split, so the evaluated windows span the whole text
                step = len(windows) / self.val_windows
                data = torch.utils.data.Subset(windows, [int(i * step) for i in range(self.val_windows)])
            self.splits[name] = data

    @override
    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, drop_last=True)

    @override
    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=64)

    @override
    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["test"], batch_size=64)
