"""The Hydra app: ``python -m lightning_sync.train strategy=<mode> model=<model> ...`` (or ``lightning-sync-train``).

It composes ``conf/``, instantiates the data, the model and the strategy (its own config group, passed to
``lightning.Trainer``), fits, tests, and writes to the run folder: ``metrics.csv`` (every metric logged in
training, including ``comm/*`` per optimizer step), ``test/metrics.csv``, ``config.yaml`` (the resolved config) and
``summary.json`` (test metrics, median step time, bytes per step). A user's config mistake ends with one line
naming the field and a non-zero exit, before any rank starts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import hydra
from omegaconf import DictConfig, OmegaConf

import lightning_sync  # noqa: F401  (registers the strategies)
from lightning_sync.conf_store import register_strategy_schemas
from lightning_sync.errors import ConfigError, check_range


def _config_dir() -> str:
    """``conf/`` beside the package in a checkout, or ``lightning_sync/conf`` in an installed wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "conf", here / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"no Hydra config found beside {here}")


CONFIG_DIR = _config_dir()
register_strategy_schemas()  # conf/strategy/*.yaml start from these
# Environment variables Lightning's popen launcher sets in the parent; cleared between the jobs of a sweep.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


def _config_error(exc: BaseException) -> ConfigError | None:
    """The ConfigError behind ``exc`` (Hydra wraps errors raised while instantiating), if any."""
    seen = exc
    while seen is not None:
        if isinstance(seen, (ConfigError, ValueError)) and not type(seen).__module__.startswith("hydra"):
            return seen if isinstance(seen, ConfigError) else ConfigError(str(seen))
        seen = seen.__cause__ or seen.__context__
    return None


def _validate_trainer(cfg: DictConfig) -> None:
    devices = cfg.trainer.get("devices", 1)
    if devices != "auto":
        check_range("trainer.devices", devices, low=1, integer=True)
    check_range("trainer.num_nodes", cfg.trainer.get("num_nodes", 1), low=1, integer=True)


def build(cfg: DictConfig) -> tuple[Any, Any, Any]:
    """Instantiates (datamodule, model, trainer) from a composed config; raises ConfigError for a bad value."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lightning_sync.callbacks import SyncReport

    _validate_trainer(cfg)
    try:
        strategy = hydra.utils.instantiate(cfg.strategy)
        datamodule = hydra.utils.instantiate(cfg.data)
        model = hydra.utils.instantiate(cfg.model)
        validate_model = getattr(strategy, "validate_model", None)
        if validate_model is not None:  # e.g. per-module sync patterns against the real parameter names
            validate_model(model)
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is a config mistake
        error = _config_error(exc)
        if error is None:
            raise
        raise error from None
    run_dir = Path(cfg.get("run_dir") or hydra.core.hydra_config.HydraConfig.get().runtime.output_dir)
    trainer_kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    trainer = pl.Trainer(
        **trainer_kwargs,
        strategy=strategy,
        logger=CSVLogger(save_dir=str(run_dir), name="", version=""),
        callbacks=[SyncReport(path=str(run_dir / "summary.json"))],
    )
    return datamodule, model, trainer


def run(cfg: DictConfig) -> dict[str, Any]:
    """Fits (and tests) one configuration; returns the run's summary on global rank 0 (``{}`` on other ranks)."""
    import lightning.pytorch as pl

    from lightning_sync.callbacks import SyncReport

    launch_env = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule, model, trainer = build(cfg)
    if trainer.is_global_zero:
        Path(trainer.logger.save_dir, "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    try:
        trainer.fit(model, datamodule=datamodule)
        if cfg.get("test", True):
            # Test metrics go to test/metrics.csv: with fork/spawn the test runs in new processes whose CSV writer
            # would otherwise start metrics.csv afresh and erase the training curve.
            from lightning.pytorch.loggers import CSVLogger

            trainer.loggers = [CSVLogger(save_dir=trainer.logger.save_dir, name="", version="test")]
            trainer.test(model, datamodule=datamodule, verbose=False)
    finally:
        _end_job(trainer, launch_env)
    if not trainer.is_global_zero:
        return {}
    # With fork/spawn the callbacks ran in the ranks, not here: the file rank 0 wrote is the record.
    report = next(cb for cb in trainer.callbacks if isinstance(cb, SyncReport))
    path = Path(report.path)
    return json.loads(path.read_text()) if path.is_file() else report.summary


def _end_job(trainer: Any, launch_env: dict[str, str | None]) -> None:
    """Leaves the process as it was before the job, so the next job of a sweep launches its own ranks."""
    import torch.distributed as dist

    launcher = getattr(trainer.strategy, "launcher", None)
    wait_children = getattr(launcher, "wait_children", None)
    if wait_children is not None:
        failed = wait_children(timeout=trainer.strategy.config.timeout_s)
        if failed:
            raise RuntimeError(f"rank processes exited with errors (local rank: exit code): {failed}")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in launch_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        summary = run(cfg)
    except ConfigError as exc:
        _exit_config_error(exc)
    if summary.get("optimizer_steps") is not None:
        print(_summary_line(summary))


def _exit_config_error(exc: ConfigError) -> NoReturn:
    """A user's config mistake: one line on stderr, exit code 2, no traceback."""
    print(f"error: {exc}", file=sys.stderr)
    sys.exit(2)


def _summary_line(summary: dict[str, Any]) -> str:
    parts = [f"strategy={summary.get('strategy')}", f"steps={summary.get('optimizer_steps')}"]
    if summary.get("step_time_ms") is not None:
        parts.append(f"step_time_ms={summary['step_time_ms']:.2f}")
    if "bytes_sent_per_step" in summary:
        parts.append(f"bytes_sent_per_step={summary['bytes_sent_per_step']:.0f}")
    parts += [f"{k}={v:.4f}" for k, v in summary.get("test", {}).items()]
    return "summary: " + " ".join(parts)


# Flags that add config directories: with them, group options may come from elsewhere, so Hydra checks them.
_SEARCH_PATH_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp")


def _check_group_choices(argv: list[str]) -> None:
    """Rejects a command-line choice of a config group option that has no file, in one line.

    Hydra's own message for ``strategy=nope`` lists every option and its search path (a dozen lines and growing);
    this one names the field, the value and what is allowed, like a :class:`ConfigError`. Anything it cannot judge
    (globs, interpolations, extra search paths) is left to Hydra.

    Raises:
        ConfigError: for a plain or comma-swept choice that is not a file of the group.
    """
    if any(arg.split("=", 1)[0] in _SEARCH_PATH_FLAGS or "hydra.searchpath" in arg for arg in argv):
        return
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep

    conf = Path(CONFIG_DIR)
    groups = {d.name: sorted(f.stem for f in d.glob("*.yaml")) for d in conf.iterdir() if d.is_dir()}
    parser = OverridesParser.create()
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
            value = override.value()
        except Exception:  # noqa: BLE001 - not ours to judge; Hydra reports it
            continue
        options = groups.get(override.key_or_group)
        if options is None or not options or override.is_delete():
            continue
        if isinstance(value, ChoiceSweep):
            candidates = list(value.list)
        else:
            candidates = [value]
        for candidate in candidates:
            if isinstance(candidate, str) and "${" not in candidate and candidate not in options:
                raise ConfigError(
                    f"{override.key_or_group}={candidate!r} is not allowed; choose one of: {', '.join(options)}"
                )


def main() -> None:
    """Console-script entry point (``lightning-sync-train``)."""
    try:
        _check_group_choices(sys.argv[1:])
    except ConfigError as exc:
        _exit_config_error(exc)
    _hydra_main()


if __name__ == "__main__":
    main()
