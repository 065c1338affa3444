"""Compressed gradients keep accuracy: digits, 2 ranks, 30 epochs, same seed; each compressor within 1 point.

This is the issue's acceptance run, through the same code path as ``python -m lightning_sync.compare``.
"""

from __future__ import annotations

import pytest

from lightning_sync.apps.compare import CASES
from lightning_sync.apps.runner import run_case

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # five 540-step runs; a training outcome

COMPRESSED = ["allreduce+fp16", "allreduce+bf16", "allreduce+topk1%", "allreduce+powersgd4"]
COMMON = ["strategy.start_method=fork", "trainer.max_epochs=30", "trainer.limit_val_batches=0", "seed=0"]


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory) -> float:
    summary = run_case(CASES["allreduce"] + COMMON, tmp_path_factory.mktemp("none"))
    return summary["test"]["test/acc"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", COMPRESSED)
def test_compressed_accuracy_within_one_point(case, uncompressed, tmp_path):
    summary = run_case(CASES[case] + COMMON, tmp_path)
    acc = summary["test"]["test/acc"]
    assert uncompressed > 0.9, f"uncompressed baseline did not train: {uncompressed:.4f}"
    assert acc >= uncompressed - 0.01, f"{case}: {acc:.4f} vs uncompressed {uncompressed:.4f}"
    assert summary["bytes_sent_per_step"] > 0
