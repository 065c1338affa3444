"""The Hydra app: ``python -m lightning_sync.train strategy=<mode> model=<model> ...`` (or ``lightning-sync-train``).

It composes ``conf/``, instantiates the data, the model and the strategy (its own config group, passed to
``lightning.Trainer``), fits, tests, and writes to the run folder: ``metrics.csv`` (every metric logged in
training, including ``comm/*`` per optimizer step), ``test/metrics.csv``, ``config.yaml`` (the resolved config) and
``summary.json`` (test metrics, median step time, bytes per step). A user's config mistake ends with one line
naming the field and a non-zero exit, before any rank starts.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, cast

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lightning_sync._exit import skip_final_collection
from lightning_sync.apps._app_help import group_options, register_help_resolvers
from lightning_sync.apps.conf_store import check_strategy_knobs, register_strategy_schemas
from lightning_sync.apps.ft_conf import fault_tolerance_arguments
from lightning_sync.errors import ConfigError, check_range


def _config_dir() -> str:
    """``conf/`` beside the package in a checkout, or ``lightning_sync/conf`` in an installed wheel."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package.parent / "conf", package / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise FileNotFoundError(f"no Hydra config found beside {package}")


def _run_stamp() -> str:
    """The run folder's stamp: the time (``%H-%M-%S``), or under torchrun its run id, so that every rank, node and
    restart of one torchrun job writes to (and resumes from) the same folder."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    return time.strftime("%H-%M-%S")


CONFIG_DIR = _config_dir()
OmegaConf.register_new_resolver("run_stamp", _run_stamp, use_cache=True, replace=True)
register_strategy_schemas()  # conf/strategy/*.yaml start from these
register_help_resolvers(CONFIG_DIR)  # --help
LOST_CHILD_GRACE_S = 2.0
"""After this rank failed: how long a ``popen`` child rank that is still running has to show an exit (a killed one:
its sockets, whose reset this rank may have just seen, close before its exit status shows), so the error names it."""
# Environment variables Lightning's popen launcher sets in the parent; cleared between the jobs of a sweep.
_LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


def _config_error(exc: BaseException) -> ConfigError | None:
    """The ConfigError behind ``exc`` (Hydra wraps errors raised while instantiating), if any."""
    seen: BaseException | None = exc
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


def build(cfg: DictConfig, callbacks: Sequence[Any] = ()) -> tuple[Any, Any, Any]:
    """Instantiates (datamodule, model, trainer) from a composed config; raises ConfigError for a bad value.

    Args:
        cfg: the composed config.
        callbacks: more callbacks for the Trainer, after the run's own; a
            :class:`~lightning_sync.apps._console.ProgressReport` among them replaces the default one.
    """
    import lightning.pytorch as pl

    import lightning_sync.strategies  # noqa: F401  (registers the strategies with Lightning)

    _validate_trainer(cfg)
    check_strategy_knobs(OmegaConf.to_container(cfg.strategy, resolve=True))
    try:
        strategy = hydra.utils.instantiate(cfg.strategy, **fault_tolerance_arguments(cfg))
        datamodule = hydra.utils.instantiate(cfg.data)
        # model config fields left null that the data decides (e.g. the text's vocab_size): the data's values
        filled = {k: v for k, v in getattr(datamodule, "model_kwargs", {}).items() if cfg.model.get(k, 0) is None}
        model = hydra.utils.instantiate(cfg.model, **filled)
        validate_model = getattr(strategy, "validate_model", None)
        if validate_model is not None:  # e.g. per-module sync patterns against the real parameter names
            validate_model(model)
    except Exception as exc:  # noqa: BLE001 - re-raised unless it is a config mistake
        error = _config_error(exc)
        if error is None:
            raise
        raise error from None
    run_dir = _run_dir(cfg)
    # cfg.trainer is a DictConfig: its container is a dict
    trainer_kwargs = cast(dict[str, Any], OmegaConf.to_container(cfg.trainer, resolve=True))
    loggers = _make_loggers(cfg, run_dir)
    trainer_callbacks = _make_callbacks(cfg, run_dir, trainer_kwargs, list(callbacks))
    trainer = pl.Trainer(**trainer_kwargs, strategy=strategy, logger=loggers or False, callbacks=trainer_callbacks)
    return datamodule, model, trainer


def _run_dir(cfg: DictConfig) -> Path:
    """The run folder: ``cfg.run_dir`` if set (the compare job), else Hydra's output folder of this job."""
    return Path(cfg.get("run_dir") or HydraConfig.get().runtime.output_dir)


def _make_loggers(cfg: DictConfig, run_dir: Path) -> list[Any]:
    """The ``logger/`` group's loggers (each entry with a ``_target_``); a ``save_dir`` of null is the run folder.

    Args:
        cfg: the composed config (``cfg.logger`` missing or null: no logger).
        run_dir: the run folder.

    Raises:
        ConfigError: ``logger=tensorboard`` without ``tensorboard`` or ``tensorboardX`` installed (said before any
            rank starts, with what to install).
    """
    from importlib.util import find_spec

    from lightning.pytorch.loggers import TensorBoardLogger

    loggers = []
    for name, conf in (cfg.get("logger") or {}).items():
        if not isinstance(conf, DictConfig) or "_target_" not in conf:
            continue
        target = hydra.utils.get_class(conf._target_)
        if issubclass(target, TensorBoardLogger) and not (find_spec("tensorboard") or find_spec("tensorboardX")):
            raise ConfigError(
                f"logger.{name} ({conf._target_}) needs TensorBoard, which is not installed: "
                "pip install tensorboard (or use logger=csv)"
            )
        extra = {"save_dir": str(run_dir)} if conf.get("save_dir") is None else {}
        loggers.append(hydra.utils.instantiate(conf, **extra))
    return loggers


def _make_callbacks(cfg: DictConfig, run_dir: Path, trainer_kwargs: dict[str, Any], extra: list[Any]) -> list[Any]:
    """The run's own callbacks, then ``extra``, then the ``callbacks/`` group's; settles progress and checkpointing.

    Sets ``trainer_kwargs["enable_progress_bar"]`` (null: a bar when stderr is a terminal; without a bar, one plain
    line per epoch) and ``enable_checkpointing`` (null: on when a ``ModelCheckpoint`` is configured; false drops the
    configured ones). A ``ModelCheckpoint`` whose ``dirpath`` is null writes to ``<run folder>/checkpoints``, a
    ``StepClock`` whose ``path`` is null to ``<run folder>/step_clock.txt``.

    Args:
        cfg: the composed config (``cfg.callbacks``: name -> callback config).
        run_dir: the run folder.
        trainer_kwargs: the Trainer's arguments, updated in place.
        extra: callbacks from the caller (see :func:`build`).
    """
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_sync.apps._console import ProgressReport
    from lightning_sync.callbacks import DivergenceGuard, StepClock, SyncReport

    summary = str(run_dir / "summary.json")
    # SyncReport first: the guard's per-batch exchange comes after the batch has been timed.
    made: list[Any] = [SyncReport(path=summary), DivergenceGuard(path=summary, run_name=str(run_dir))]
    if trainer_kwargs.get("enable_progress_bar") is None:
        trainer_kwargs["enable_progress_bar"] = sys.stderr.isatty()
    if not trainer_kwargs["enable_progress_bar"] and not any(isinstance(cb, ProgressReport) for cb in extra):
        made.append(ProgressReport(bar=False))
    made += extra
    for conf in (cfg.get("callbacks") or {}).values():
        if not isinstance(conf, DictConfig) or "_target_" not in conf:
            continue
        target = hydra.utils.get_class(conf._target_)
        if issubclass(target, ModelCheckpoint):
            if trainer_kwargs.get("enable_checkpointing") is False:
                continue
            if conf.get("dirpath") is None:
                made.append(hydra.utils.instantiate(conf, dirpath=str(run_dir / "checkpoints")))
                continue
        if issubclass(target, StepClock) and conf.get("path") is None:
            made.append(hydra.utils.instantiate(conf, path=str(run_dir / "step_clock.txt")))
            continue
        made.append(hydra.utils.instantiate(conf))
    if trainer_kwargs.get("enable_checkpointing") is None:
        trainer_kwargs["enable_checkpointing"] = any(isinstance(cb, ModelCheckpoint) for cb in made)
    return made


def run(cfg: DictConfig, callbacks: Sequence[Any] = ()) -> dict[str, Any]:
    """Fits (and tests) one configuration; returns the run's summary on global rank 0 (``{}`` on other ranks).

    ``cfg.ckpt_path`` (if set) resumes the fit from that checkpoint. A run whose training loss diverged (see
    :class:`~lightning_sync.callbacks.DivergenceGuard`) is not tested; its summary says ``"diverged": true``.

    Args:
        cfg: the composed config.
        callbacks: more callbacks for the Trainer (see :func:`build`).
    """
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lightning_sync.callbacks import DivergenceGuard, SyncReport, read_summary

    launch_env = {k: os.environ.get(k) for k in _LAUNCH_ENV}
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule, model, trainer = build(cfg, callbacks)
    run_dir = _run_dir(cfg)
    if trainer.is_global_zero:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    report = next(cb for cb in trainer.callbacks if isinstance(cb, SyncReport))
    assert report.path is not None  # the app's own SyncReport (the first) writes the run's summary.json
    guard = next(cb for cb in trainer.callbacks if isinstance(cb, DivergenceGuard))
    try:
        trainer.fit(model, datamodule=datamodule, ckpt_path=_ckpt_path(cfg))
        # Every rank's guard agreed. With fork/spawn the guards ran in the ranks, and the file rank 0 wrote is the
        # record (read only where no guard ran: a popen rank 1 could catch rank 0 half-way through writing it).
        diverged = guard.verdict is not None
        if not guard.checked_batches and trainer.is_global_zero:
            diverged = read_summary(report.path).get("diverged", False)
        if cfg.get("test", True) and not diverged:
            # Test metrics go to test/metrics.csv: with fork/spawn the test runs in new processes whose CSV writer
            # would otherwise start metrics.csv afresh and erase the training curve.
            others = [lg for lg in trainer.loggers if not isinstance(lg, CSVLogger)]
            trainer.loggers = [*others, CSVLogger(save_dir=str(run_dir), name="", version="test")]
            trainer.test(model, datamodule=datamodule, verbose=False)
    except BaseException as error:
        _end_job(trainer, launch_env, failed=True, error=error)
        raise
    _end_job(trainer, launch_env)
    if not trainer.is_global_zero:
        return {}
    # With fork/spawn the callbacks ran in the ranks, not here: the file rank 0 wrote is the record.
    summary = read_summary(report.path) or report.summary
    if getattr(datamodule, "unigram_entropy", None) is not None:  # a text's baseline, beside the model's loss
        summary["unigram"] = {"loss": datamodule.unigram_entropy, "bpc": datamodule.unigram_bits}
    return summary


def _ckpt_path(cfg: DictConfig) -> str | None:
    """``cfg.ckpt_path``; when unset in a run that torchrun restarted (``--max-restarts``), ``"last"``: Lightning's
    name for the newest ``last.ckpt`` of the ModelCheckpoint callbacks (none yet: the fit starts afresh)."""
    path = cfg.get("ckpt_path")
    if path is None and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        return "last"
    return path


def _end_job(
    trainer: Any, launch_env: dict[str, str | None], failed: bool = False, error: BaseException | None = None
) -> None:
    """Leaves the process as it was before the job, so the next job of a sweep launches its own ranks.

    After a failure in this rank, the ``popen`` children are killed at once (SIGKILL: a frozen child would never
    act on SIGTERM), so none outlives the job; otherwise they get ``timeout_s`` to finish. This rank's ``error`` is
    printed first, in one line: Lightning's child observer, seeing a child killed, ends this process too, at once,
    which can come before Hydra has printed the error.
    """
    import signal

    import torch.distributed as dist

    from lightning_sync.strategies._launcher import describe_exit
    from lightning_sync.strategies._lightning import PopenLauncher, launcher_children

    launcher = getattr(trainer.strategy, "launcher", None)
    if isinstance(launcher, PopenLauncher):
        children = launcher_children(launcher)
        if failed:
            if error is not None:
                message = str(error).strip().splitlines()
                print(f"error: {type(error).__name__}: {message[0] if message else ''}", file=sys.stderr, flush=True)
            # the likely cause of the error: a child that was killed. Its sockets close (this rank's "connection
            # reset") before its exit shows, so a child still running gets a moment to show it (LOST_CHILD_GRACE_S).
            deadline = time.monotonic() + LOST_CHILD_GRACE_S
            for proc in children:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            for rank, code in enumerate([proc.poll() for proc in children], start=1):
                if code not in (None, 0):
                    print(f"error: rank {rank} (local) was lost first: {describe_exit(code)}", file=sys.stderr)
            launcher.kill(signal.SIGKILL)
        if not failed:  # the ranks the servers dropped (a strategy that tolerates it) are not waited for
            _kill_dropped_children(trainer.strategy, children)
        lost = _wait_children(children, timeout=trainer.strategy.config.timeout_s)
        if lost and not failed and getattr(trainer.strategy, "tolerates_lost_ranks", False):
            for rank, code in lost.items():
                print(
                    f"warning: rank {rank} (local) was lost: {describe_exit(code)}; the job ended on the others",
                    file=sys.stderr,
                )
        elif lost and not failed:
            raise RuntimeError(f"rank processes exited with errors (local rank: exit code): {lost}")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in launch_env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _kill_dropped_children(strategy: Any, children: list[subprocess.Popen]) -> None:
    """SIGKILLs the child ranks the servers dropped (``strategy.lost_workers``) that still run: a frozen one would
    otherwise hold the job for ``timeout_s`` before :func:`_wait_children` kills it."""
    import signal

    first = strategy.node_rank * strategy.num_processes
    for worker in getattr(strategy, "lost_workers", {}):
        local = worker - first
        if 1 <= local <= len(children) and children[local - 1].poll() is None:
            children[local - 1].send_signal(signal.SIGKILL)


def _wait_children(children: list[subprocess.Popen], timeout: float) -> dict[int, int]:
    """Waits for the child ranks to exit (between the jobs of a sweep, so ports and cores are free again); one still
    running after ``timeout`` seconds in all is SIGKILLed (which also ends a stopped one).

    Returns:
        ``{local_rank: exit_code}`` of the children that failed (``-9``: killed here).
    """
    deadline = time.monotonic() + timeout
    codes = {}
    for local_rank, proc in enumerate(children, start=1):
        try:
            codes[local_rank] = proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[local_rank] = proc.wait()
    return {rank: code for rank, code in codes.items() if code != 0}


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        _validate_trainer(cfg)  # before torch and Lightning are imported: a mistake is reported at once
        check_strategy_knobs(OmegaConf.to_container(cfg.strategy, resolve=True))
        summary = run(cfg)
    except ConfigError as exc:
        _drop_unused_run_folder()
        _exit_config_error(exc)
    if summary.get("optimizer_steps") is not None:
        print(_summary_line(summary))


def _drop_unused_run_folder() -> None:
    """Removes the run folder Hydra made for a job that a config error stopped before it ran, if it holds nothing
    but Hydra's own record (``.hydra/`` and an empty ``train.log``), and the folders above it that this leaves empty
    (``outputs/<date>/``): a typo leaves no folder behind. A folder with anything else in it (a run being resumed)
    is left alone."""
    try:
        folder = Path(HydraConfig.get().runtime.output_dir)
    except ValueError:  # not under Hydra
        return
    log = folder / "train.log"
    if {p.name for p in folder.iterdir()} <= {".hydra", "train.log"} and (not log.exists() or not log.stat().st_size):
        shutil.rmtree(folder, ignore_errors=True)
        for parent in (folder.parent, folder.parent.parent):  # <date>/ and outputs/ of the default layout
            if parent.is_dir() and not any(parent.iterdir()) and (parent == folder.parent or parent.name == "outputs"):
                parent.rmdir()


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
    if "unigram" in summary:
        parts.append(f"(unigram baseline: loss={summary['unigram']['loss']:.4f} bpc={summary['unigram']['bpc']:.4f})")
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

    groups = group_options(CONFIG_DIR)
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
        candidates: list[object]
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
    skip_final_collection()
    try:
        _check_group_choices(sys.argv[1:])
    except ConfigError as exc:
        _exit_config_error(exc)
    _hydra_main()


if __name__ == "__main__":
    main()
