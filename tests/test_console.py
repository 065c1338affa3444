"""What the jobs print and how a diverging run is caught.

- ``python -m lightning_sync.compare --help`` works, and ``--smoke`` prints only progress, result lines and the table
  (Lightning's banners silenced in the parent and the forked ranks; real warnings still shown).
- :class:`~lightning_sync.apps._console.ProgressReport`: a plain line per epoch off a terminal, a bar on one; the Hydra
  app's ``trainer.enable_progress_bar`` (null follows the terminal, true/false force it).
- :class:`~lightning_sync.callbacks.DivergenceGuard`: its rule (not finite, exploded, collapsed), all ranks stopping
  together when only one sees the bad loss (2 forked ranks), and a model whose learning rate really diverges
  shown as ``diverged at step N`` by the compare job.
- The DiLoCo case of the compare job (``experiment=diloco``) trains.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from app_utils import run_forked
from lightning_utils import make_trainer

from lightning_sync.apps._console import _QUIET_LOGGERS, ProgressReport, quiet_lightning
from lightning_sync.callbacks import DivergenceGuard, SyncReport
from lightning_sync.examples.data import DigitsDataModule
from lightning_sync.examples.models import DigitsClassifier

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    """A clean child environment: no launch variables, and no PYTHONWARNINGS (the job must quiet itself)."""
    drop = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "PYTHONWARNINGS")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PL_")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def _compare(tmp_path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Runs the compare job in a subprocess, stdout and stderr to pipes (not terminals)."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_sync.compare", "--out", str(tmp_path / "out"), *args],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        check=False,
    )


# ---------------------------------------------------------------------------------------------------- compare CLI
@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_compare_help_works(tmp_path):
    from lightning_sync.apps.compare import main

    argv = ["lightning_sync.compare", "--out", str(tmp_path / "out"), "--help"]
    proc = run_forked(main, argv, tmp_path, _env(), timeout=100)  # no rank: a fork of this process will do
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--cases" in proc.stdout and "allreduce+topk1%" in proc.stdout, proc.stdout
    assert "Traceback" not in proc.stderr


_PROGRESS = re.compile(r"\[\d+/2\] digits \S+ s0 \| epoch 1/1 step 4 \| .*\| eta \d+:\d\d")
_RESULT = re.compile(
    r"\[\d+/2\] digits \S+ s0 +test acc % +\d+\.\d\d +\d+\.\d\d ms/step +[\d,]+ bytes/step +\(\d+ s\)$"
)


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_compare_smoke_prints_only_progress_results_and_table(tmp_path):
    proc = _compare(tmp_path, "--smoke", "--workloads", "digits", "--cases", "ddp,allreduce")
    assert proc.returncode == 0, proc.stderr[-4000:]
    err = [line for line in proc.stderr.splitlines() if line.strip()]
    out = [line for line in proc.stdout.splitlines() if line.strip()]
    # stderr: one progress line per case (rank 0 of each forked run); nothing from Lightning
    assert len(err) == 2 and all(_PROGRESS.match(line) for line in err), proc.stderr
    assert err[0].startswith("[1/2] digits ddp s0 |") and "all runs" in err[0], err  # time left for the whole job
    assert err[1].startswith("[2/2] digits allreduce s0 |"), err
    # stdout: one result line per run, then the heading, the table, its legend and the job's time
    assert all(_RESULT.match(line) for line in out[:2]), out
    assert out[2].startswith("### Digits classifier") and "2 CPU ranks" in out[2] and len(out) == 2 + 1 + 4 + 2, out
    assert all(line.startswith("|") for line in out[3:7]), out
    runs = json.loads((tmp_path / "out" / "results.json").read_text())["workloads"]["digits"]["runs"]
    assert list(runs) == ["ddp", "allreduce"] and all(r["diverged"] is False for v in runs.values() for r in v), runs


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_compare_shows_a_real_divergence(tmp_path):
    """SGD at lr 5 (momentum 0.9) blows the digits MLP's loss up within the first epoch.

    The job's ``main`` runs in a fork of this process (its ranks are forked from it, as from the job's own process):
    no interpreter start-up. The test above runs the job as ``python -m lightning_sync.compare``."""
    from lightning_sync.apps.compare import main

    args = ["--out", str(tmp_path / "out"), "--epochs", "3", "--workloads", "digits", "--seeds", "0", "--cases", "ddp"]
    proc = run_forked(main, ["lightning_sync.compare", *args, "model.lr=5"], tmp_path, _env(), timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "out" / "digits" / "ddp" / "seed0" / "summary.json").read_text())
    assert summary["diverged"] is True and summary["diverged_reason"] in ("exploded", "not finite"), summary
    step = summary["diverged_at_step"]
    assert 0 < step < 18, summary  # within the first epoch (18 steps)
    assert step <= summary["optimizer_steps"] < step + 10, summary  # stopped at the next exchange
    assert "test" not in summary, summary  # a diverged model is not tested
    assert f"DIVERGED ({summary['diverged_reason']}): run " in proc.stderr and f"step {step} " in proc.stderr
    assert re.search(rf"^\[1/1\] digits ddp s0 +DIVERGED at step {step} ", proc.stdout, re.MULTILINE), proc.stdout
    assert re.search(r"\| ddp +\| +diverged \|", proc.stdout), proc.stdout


# ---------------------------------------------------------------------------------------------------- quieting
@pytest.fixture
def quiet():
    """quiet_lightning() for one test, Lightning's logger levels restored afterwards."""
    levels = {name: logging.getLogger(name).level for name in _QUIET_LOGGERS}
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        quiet_lightning()
        yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.unit
def test_quiet_lightning_drops_banners_and_keeps_the_rest(quiet):
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    records = _Records()
    logger.addHandler(records)
    try:
        rank_zero_info("GPU available: False, used: False")
        rank_zero_info("💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]")
        rank_zero_info("-" * 100 + "\ndistributed_backend=gloo\nAll distributed processes registered.")
        logger.warning("Something a user should see")
    finally:
        logger.removeHandler(records)
    assert records.messages == ["Something a user should see"], records.messages
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(
            "`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`", FutureWarning
        )
        warnings.warn("It is recommended to use `self.log('train/loss', ..., sync_dist=True)` when logging")
        warnings.warn("a real problem", UserWarning)
    assert [str(w.message) for w in caught] == ["a real problem"]


@pytest.mark.unit
def test_quiet_lightning_is_idempotent(quiet):
    count = len(warnings.filters)
    quiet_lightning()
    assert len(warnings.filters) == count  # the same warning filters, not a second copy
    assert all(logging.getLogger(name).level == logging.WARNING for name in _QUIET_LOGGERS)


# ---------------------------------------------------------------------------------------------------- progress
def _fit_one_rank(callbacks: list[Any], epochs: int = 2, **model: Any) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        limit_train_batches=3,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(DigitsClassifier(**model), datamodule=DigitsDataModule(batch_size=16))
    return trainer


@pytest.mark.e2e
def test_progress_report_plain_line_per_epoch():
    stream = io.StringIO()
    _fit_one_rank([ProgressReport(label="[1/3] demo", later_runs=2, stream=stream)])
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2, lines
    for epoch, line in enumerate(lines, start=1):
        assert line.startswith(f"[1/3] demo | epoch {epoch}/2 step {3 * epoch} | train/loss "), line
        assert re.search(r"\| val/acc [\d.]+ \| eta \d+:\d\d, all runs \d+:\d\d$", line), line
    assert "\r" not in stream.getvalue()


@pytest.mark.e2e
def test_progress_report_bar_on_a_terminal():
    class _Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = _Terminal()
    _fit_one_rank([ProgressReport(label="[2/2] demo", stream=stream)])
    text = stream.getvalue()
    assert "[2/2] demo" in text and "\r" in text and "step" in text, text
    assert "| epoch 1/2 step" not in text  # no plain lines under a bar


@pytest.mark.unit
@pytest.mark.parametrize(
    "setting,isatty,bar,plain",
    [(None, True, True, False), (None, False, False, True), (True, False, True, False), (False, True, False, True)],
)
def test_hydra_app_progress_bar_follows_the_terminal(setting, isatty, bar, plain, tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from lightning_sync.apps.train import _make_callbacks

    monkeypatch.setattr(sys.stderr, "isatty", lambda: isatty, raising=False)
    cfg = OmegaConf.create({"callbacks": {}})
    kwargs: dict[str, Any] = {"enable_progress_bar": setting}
    made = _make_callbacks(cfg, tmp_path, kwargs, [])
    assert kwargs["enable_progress_bar"] is bar
    assert any(isinstance(cb, ProgressReport) for cb in made) is plain
    assert isinstance(made[0], SyncReport) and isinstance(made[1], DivergenceGuard)
    assert kwargs["enable_checkpointing"] is False  # no ModelCheckpoint configured


@pytest.mark.unit
def test_hydra_app_checkpoint_callback_goes_to_the_run_folder(tmp_path):
    from hydra import compose, initialize_config_dir
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from lightning_sync.apps.train import CONFIG_DIR, _make_callbacks

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["callbacks=early_stopping"])
    kwargs: dict[str, Any] = {"enable_progress_bar": False, "enable_checkpointing": None}
    made = _make_callbacks(cfg, tmp_path, kwargs, [])
    (checkpoint,) = [cb for cb in made if isinstance(cb, ModelCheckpoint)]
    assert Path(checkpoint.dirpath) == (tmp_path / "checkpoints").resolve() and checkpoint.save_last
    assert [cb.monitor for cb in made if isinstance(cb, EarlyStopping)] == ["val/loss"]
    assert kwargs["enable_checkpointing"] is True
    kwargs = {"enable_progress_bar": False, "enable_checkpointing": False}  # the user said no checkpoints
    assert not any(isinstance(cb, ModelCheckpoint) for cb in _make_callbacks(cfg, tmp_path, kwargs, []))


# ---------------------------------------------------------------------------------------------------- divergence
def _judge_all(guard: DivergenceGuard, losses: list[float]) -> tuple[int, str] | None:
    """Feeds ``losses`` to the guard's rule; the first (index, reason) it flags."""
    for i, loss in enumerate(losses):
        verdict = guard._judge(loss)
        if verdict is not None:
            return i, DivergenceGuard._REASONS[verdict[1]]
    return None


@pytest.mark.unit
def test_divergence_rule():
    learning = [2.3 - 2.0 * i / 100 for i in range(100)]  # 2.3 down to 0.3
    noisy = [loss * (1.6 if i % 7 == 0 else 1.0) for i, loss in enumerate(learning)]
    assert _judge_all(DivergenceGuard(), noisy) is None
    assert _judge_all(DivergenceGuard(), [2.3] * 300) is None  # never learned: not a divergence (its accuracy says)
    assert _judge_all(DivergenceGuard(), [2.3, 1.5, math.nan, 1.0]) == (2, "not finite")
    assert _judge_all(DivergenceGuard(), [2.3, 1.5, 2299.0, 2301.0]) == (3, "exploded")
    assert _judge_all(DivergenceGuard(factor=None), [2.3, 1.5, 1e9]) is None
    # learned to 0.3, then unlearned back to chance: the mean of the last 20 reaches the first loss again
    collapsed = learning + [2.4] * 30
    index, reason = _judge_all(DivergenceGuard(), collapsed)
    assert reason == "collapsed" and 100 + 15 <= index < 100 + 20, index
    assert _judge_all(DivergenceGuard(window=None), collapsed) is None


class _NanOnRankOne(DigitsClassifier):
    """Rank 1's loss reads nan from its ``bad_batch``-th batch on; its gradients (and rank 0) stay finite."""

    def __init__(self, bad_batch: int) -> None:
        super().__init__()
        self.bad_batch = bad_batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step + 1 >= self.bad_batch:
            loss = loss + torch.tensor(math.nan)  # a constant: the value is nan, the gradient is not
        return loss


@pytest.mark.e2e
@pytest.mark.timeout(180)
@pytest.mark.parametrize("check_every,stopped_at", [(1, 5), (3, 6)])
def test_divergence_on_one_rank_stops_both_together(check_every, stopped_at, tmp_path):
    """Only rank 1 sees the nan (at step 5); rank 0 trains on finite losses. Both must stop after the same batch.

    Without the exchange, rank 0 would train all 12 batches (and its summary would say nothing), or wait forever
    for rank 1 in a collective.
    """
    from lightning_sync import AllReduceStrategy

    summary = tmp_path / "summary.json"
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(
        AllReduceStrategy(start_method="fork"),
        max_epochs=1,
        limit_train_batches=12,
        callbacks=[
            SyncReport(path=str(summary)),
            DivergenceGuard(path=str(summary), run_name="two-ranks", check_every=check_every),
        ],
    )
    trainer.fit(_NanOnRankOne(bad_batch=5), datamodule=DigitsDataModule(batch_size=16))
    result = json.loads(summary.read_text())
    assert result["diverged"] is True, result
    assert result["diverged_at_step"] == 5 and result["diverged_rank"] == 1, result
    assert result["diverged_reason"] == "not finite" and math.isnan(result["diverged_loss"]), result
    assert result["optimizer_steps"] == stopped_at == result["batches"], result


@pytest.mark.e2e
@pytest.mark.timeout(180)
def test_no_divergence_is_recorded_as_such(tmp_path):
    summary = tmp_path / "summary.json"
    _fit_one_rank([SyncReport(path=str(summary)), DivergenceGuard(path=str(summary))])
    result = json.loads(summary.read_text())
    assert result["diverged"] is False and result["optimizer_steps"] == 6, result


# ---------------------------------------------------------------------------------------------------- DiLoCo
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_diloco_case_trains(tmp_path):
    """The compare job's DiLoCo case (AdamW inside, the paper's outer Nesterov lr 0.7 momentum 0.9) at the Hydra
    app's default 5 epochs: well above chance and not diverged (the default inner SGD collapses at 30 epochs)."""
    from lightning_sync.apps.compare import CASES
    from lightning_sync.apps.runner import run_case

    summary = run_case(
        CASES["periodic:diloco/8"]
        + ["strategy.start_method=fork", "trainer.enable_progress_bar=false", "callbacks=none"],
        tmp_path,
    )
    assert summary["diverged"] is False, summary
    assert summary["test"]["test/acc"] > 0.85, summary


@pytest.mark.unit
def test_fault_tolerance_counters_join_the_progress_line():
    from lightning_sync.apps._console import _ft_text

    assert _ft_text({"train/loss": 1.0}) == ""
    metrics = {"ft/quorum_size": 3.0, "ft/commits": 12.0, "ft/failed_commits": 1.0, "ft/heals": 0.0, "ft/x": 5.0}
    assert _ft_text(metrics) == "quorum 3 commits 12 failed 1 heals 0"
