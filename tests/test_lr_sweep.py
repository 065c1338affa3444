"""``benchmarks/lr_sweep.py``'s table: one row per learning rate, one column per length, the best mean marked."""

from __future__ import annotations

import pytest
from repo_utils import load_script

outer_sweep = load_script("benchmarks/outer_sweep.py")  # lr_sweep imports its helpers, as it does run from benchmarks/
lr_sweep = load_script("benchmarks/lr_sweep.py")


def _point(lr, steps, *values):
    point = outer_sweep.seed_point({str(s): v for s, v in enumerate(values)}, lr=lr, steps=steps)
    return f"lr{lr:g} steps{steps}", point


@pytest.mark.unit
def test_the_table_marks_the_lowest_mean_at_each_length_and_shows_what_is_missing():
    points = dict(
        [
            _point(1e-3, 300, 2.0, 2.1, 1.9),
            _point(3e-3, 300, 2.4, None, 2.2),  # one seed diverged: the mean of the others, 2 seeds
            _point(1e-3, 1000, 1.40, 1.38, 1.39),
            _point(2e-3, 1000, None, None),  # every seed diverged
            _point(3e-3, 1000, 1.48, 1.47, 1.49),
        ]
    )
    rows = lr_sweep.format_sweep({"points": points}).splitlines()[2:]
    by_lr = {row.split("|")[1].strip(): [cell.strip() for cell in row.split("|")[2:-1]] for row in rows}
    assert list(by_lr) == ["0.001", "0.002", "0.003"]
    assert by_lr["0.001"] == ["2.000 [1.900, 2.100] (3) best", "1.390 [1.380, 1.400] (3) best"]
    assert by_lr["0.002"] == ["-", "diverged"]
    assert by_lr["0.003"] == ["2.300 [2.200, 2.400] (2)", "1.480 [1.470, 1.490] (3)"]
