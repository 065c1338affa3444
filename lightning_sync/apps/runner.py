"""One case of the Hydra config, trained in this process: what the main job and the studies run.

A case is a list of Hydra overrides on ``conf/config.yaml`` (the configs shipped with the package); its ranks are
forked. Run folders are named by :func:`case_dir_name`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lightning_sync.apps.train import CONFIG_DIR, run

STUDY_OVERRIDES = ("strategy.start_method=fork", "callbacks=none", "trainer.enable_progress_bar=false")
"""What every study case gets first: forked ranks, no checkpoints, no Lightning bar."""


def available_strategies() -> set[str]:
    """The strategy configs (``conf/strategy/*.yaml``) of this installation."""
    return {p.stem for p in Path(CONFIG_DIR, "strategy").glob("*.yaml")}


def case_dir_name(case: str) -> str:
    """A folder name for a case name (``periodic:diloco/8`` -> ``periodic_diloco_8``)."""
    return case.replace("/", "_").replace(":", "_").replace("%", "pct")


def run_case(overrides: list[str], run_dir: Path, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Composes the config with ``overrides`` and trains it in this process (ranks are forked).

    Args:
        overrides: Hydra overrides on top of ``conf/config.yaml``.
        run_dir: the run folder.
        callbacks: more Trainer callbacks (e.g. the job's progress display).

    Returns:
        The run's summary, as :func:`lightning_sync.apps.train.run` returns it.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    with open_dict(cfg):
        cfg.run_dir = str(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run(cfg, callbacks)
