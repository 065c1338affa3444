"""The digits shipped in the package, and their split: scikit-learn's stratified split, drawn without scikit-learn."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import lightning_sync.examples.data as data
from lightning_sync.examples.data import DigitsDataModule, stratified_split

pytestmark = pytest.mark.unit

# scikit-learn 1.9.1's train_test_split(np.arange(1797), test_size=0.2, random_state=seed, stratify=labels), then
# the same on the rest with test_size=0.15 / 0.8: each side's first four indices and sum(index * position).
SKLEARN = {
    0: [([983, 1700, 1225, 543], 595956159), ([844, 502, 480, 683], 32927062), ([1496, 188, 705, 820], 61227901)],
    1: [([767, 574, 1404, 1378], 606206939), ([1511, 333, 1574, 1300], 32564150), ([1403, 1354, 1702, 274], 57935261)],
}


def _labels() -> np.ndarray:
    return np.loadtxt(Path(data.__file__).with_name("digits.csv.gz"), delimiter=",")[:, -1].astype(int)


@pytest.mark.parametrize("seed", sorted(SKLEARN))
def test_the_split_is_scikit_learns_index_for_index(seed):
    y = _labels()
    rest, test = stratified_split(np.arange(len(y)), y, 0.2, seed)
    train, val = stratified_split(rest, y[rest], 0.15 / 0.8, seed)
    got = [(s[:4].tolist(), int((s * np.arange(1, len(s) + 1)).sum())) for s in (train, val, test)]
    assert got == SKLEARN[seed]
    module = DigitsDataModule(seed=seed)  # the module's splits are these rows, in this order
    module.setup()
    for name, ids in (("train", train), ("val", val), ("test", test)):
        assert module.splits[name].tensors[1].tolist() == y[ids].tolist(), name


def test_each_class_keeps_its_share_on_each_side():
    y = _labels()
    assert len(y) == 1797 and np.bincount(y).min() >= 170
    train, test = stratified_split(np.arange(len(y)), y, 0.2, seed=3)
    assert len(test) == 360 and len(train) == 1437 and not set(train) & set(test)
    share = np.bincount(y[test], minlength=10) / np.bincount(y, minlength=10)
    assert np.all(np.abs(share - 0.2) < 0.01), share
