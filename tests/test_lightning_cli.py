"""The strategies under LightningCLI (jsonargparse reads their constructor signatures and ``Args:``), and the same
knob through the Hydra app: ``--trainer.strategy.sync_every=8`` and ``strategy.sync_every=8`` both reach the
strategy.

Each test runs its app in a process forked from the test process (a fit initializes a process group, which must not
outlive the test; a fork skips a fresh interpreter's imports, see ``tests/app_utils.py``), on one CPU device for a few
steps.
"""

from __future__ import annotations

import csv
import os
import runpy
import subprocess
from pathlib import Path

import pytest
from app_utils import run_forked

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

pytest.importorskip("jsonargparse", reason="LightningCLI needs jsonargparse[signatures] (the test extra)")

# Left behind by a launching parent they would make the child join the wrong group.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")

CLI_SCRIPT = """
import sys

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

cli = LightningCLI(BoringModel, BoringDataModule, save_config_callback=None)
strategy = cli.trainer.strategy
if cli.subcommand == "fit":
    print("RESULT", type(strategy).__name__, strategy.config.sync_every, strategy.period, cli.trainer.global_step)
"""

QUIET = [
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.limit_val_batches=0",
]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith("PL_")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HYDRA_FULL_ERROR="0")
    return env


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python <args>`` (a script, or ``-m lightning_sync.train``) run in a fork; its exit code and output."""
    if args[0] == "-m":
        from lightning_sync.apps.train import main

        return run_forked(main, [args[1], *args[2:]], cwd, _env(), timeout=200)
    return run_forked(lambda: runpy.run_path(args[0], run_name="__main__"), args, cwd, _env(), timeout=200)


def test_lightning_cli_sets_a_knob_as_a_strategy_argument(tmp_path):
    script = tmp_path / "cli.py"
    script.write_text(CLI_SCRIPT)
    proc = _run(
        [
            str(script),
            "fit",
            "--trainer.strategy=lightning_sync.PeriodicSyncStrategy",
            "--trainer.strategy.sync_every=8",
            "--trainer.max_steps=3",
            *QUIET,
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = [line.split() for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result == [["RESULT", "PeriodicSyncStrategy", "8", "8", "3"]], proc.stdout[-2000:]


OUTER_SCRIPT = """
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

cli = LightningCLI(BoringModel, BoringDataModule, save_config_callback=None)
strategy = cli.trainer.strategy
groups = strategy.averager.groups
outer = strategy.averager.outer_optimizer([torch.nn.Parameter(torch.zeros(1))])
print("RESULT", type(outer).__name__, outer.defaults["lr"], [type(g.outer).__name__ for g in groups], cli.trainer.global_step)
"""


@pytest.mark.parametrize(
    "given, expected",
    [
        ([], ["SGD", "0.7"]),  # the default, lightning_sync.OUTER_OPTIMIZER
        (
            ["--trainer.strategy.outer_optimizer=torch.optim.Adam", "--trainer.strategy.outer_optimizer.lr=0.01"],
            ["Adam", "0.01"],
        ),
        (
            [
                '--trainer.strategy.outer_optimizer={"class_path": "lightning_sync.DelayedNesterov", "init_args": {"lr": 0.5}}'
            ],
            ["DelayedNesterov", "0.5"],
        ),
    ],
    ids=["default", "class_and_argument", "class_path_init_args"],
)
def test_lightning_cli_sets_the_outer_optimizer_as_a_class_and_its_arguments(tmp_path, given, expected):
    """``outer_optimizer`` is an ``OptimizerCallable``: LightningCLI fills it with ``class_path``/``init_args``."""
    script = tmp_path / "cli.py"
    script.write_text(OUTER_SCRIPT)
    proc = _run(
        [
            str(script),
            "fit",
            "--trainer.strategy=lightning_sync.PeriodicSyncStrategy",
            "--trainer.strategy.mode=diloco",
            "--trainer.strategy.sync_every=2",
            *given,
            "--trainer.max_steps=3",
            *QUIET,
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = [line.split(maxsplit=3) for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert result == [["RESULT", *expected, f"['{expected[0]}'] 3"]], proc.stdout[-2000:]


def test_lightning_cli_help_documents_each_knob_and_rejects_a_bad_value(tmp_path):
    from lightning_sync.config import PeriodicConfig, knob_docs

    script = tmp_path / "cli.py"
    script.write_text(CLI_SCRIPT)
    helped = _run([str(script), "fit", "--trainer.strategy.help", "lightning_sync.PeriodicSyncStrategy"], tmp_path)
    assert helped.returncode == 0, helped.stderr[-4000:]
    packed = "".join(helped.stdout.split())  # argparse wraps lines, at hyphens too
    for name, doc in knob_docs(PeriodicConfig).items():
        assert f"--trainer.strategy.{name}" in packed, name
        assert "".join(doc.split()[:6]) in packed, (name, doc)  # its help, from the generated Args: section
    bad = _run(
        [
            str(script),
            "fit",
            "--trainer.strategy=lightning_sync.PeriodicSyncStrategy",
            "--trainer.strategy.sync_every=0",
        ],
        tmp_path,
    )
    assert bad.returncode != 0
    assert "strategy.sync_every=0 is not allowed; it must be >= 1" in bad.stderr, bad.stderr[-4000:]


def test_hydra_app_sets_the_same_knob(tmp_path):
    """``python -m lightning_sync.train strategy=periodic strategy.sync_every=8``: the strategy logs period 8."""
    run_dir = tmp_path / "run"
    proc = _run(
        [
            "-m",
            "lightning_sync.train",
            "strategy=periodic",
            "strategy.sync_every=8",
            "experiment=smoke",
            "trainer.devices=1",
            f"hydra.run.dir={run_dir}",
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(run_dir / "metrics.csv") as f:
        periods = {row["sync/period"] for row in csv.DictReader(f) if row.get("sync/period")}
    assert periods == {"8.0"}, periods
