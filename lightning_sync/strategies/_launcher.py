"""A ``popen`` launcher that re-runs a Hydra job, not the whole command line.

The Lightning internals it builds on (the ``popen`` launcher class, the hook that sets a strategy's launcher) are
reached through :mod:`lightning_sync.strategies._lightning`.

Lightning's subprocess launcher starts ranks 1..n-1 by re-running ``sys.argv``. Under ``hydra -m`` that re-runs the
whole sweep inside every child, and each child also writes a new output folder. This launcher starts each child on
exactly the job the parent is running: the job's own overrides, no ``-m``, and the job's output folder as the run
folder, with nothing written to Hydra's output subdir.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from typing_extensions import override

import lightning_sync.strategies._frozen as _frozen
from lightning_sync.strategies._lightning import PopenLauncher, set_launcher, start_method
from lightning_sync.strategies._observer import ChildObserver, describe_exit

__all__ = ["HydraJobSubprocessLauncher", "configure_launcher", "describe_exit", "hydra_job_command"]

# Command-line flags of a Hydra app that select the config, with whether they take a value.
_HYDRA_CONFIG_FLAGS = {
    "--config-path": True,
    "-cp": True,
    "--config-name": True,
    "-cn": True,
    "--config-dir": True,
    "-cd": True,
}


def _hydra_in_use() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return False
    return HydraConfig.initialized()


def _config_flags(argv: Sequence[str]) -> list[str]:
    """The config-selecting flags of ``argv`` (``-cn x``, ``--config-dir=y``), kept for the child."""
    kept: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if name in _HYDRA_CONFIG_FLAGS:
            takes_next = "=" not in arg and i + 1 < len(argv)
            kept.extend(argv[i : i + 2] if takes_next else [arg])
            i += 2 if takes_next else 1
        else:
            i += 1
    return kept


def hydra_job_command(local_rank: int) -> tuple[list[str], str]:
    """The command and working directory that re-run the current Hydra job (not the sweep) as ``local_rank``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hydra_cfg = HydraConfig.get()
    spec = getattr(__main__, "__spec__", None)
    if spec is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", spec.name]
    command += _config_flags(sys.argv[1:])
    command += list(hydra_cfg.overrides.task)
    output_dir = hydra_cfg.runtime.output_dir
    command += [
        f"hydra.run.dir={output_dir}",
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
        "hydra/hydra_logging=disabled",
        "hydra/job_logging=disabled",
    ]
    return command, get_original_cwd()


class HydraJobSubprocessLauncher(PopenLauncher):
    """Lightning's ``popen`` launcher, except that under Hydra a child runs the parent's job, never its sweep.

    Under Hydra, Lightning's ``_call_children_scripts`` starts each child with the parent's whole command line,
    ``-m`` and the sweep's overrides included, so every child of a ``-m`` job runs the whole sweep (Lightning issue
    #15689, https://github.com/Lightning-AI/pytorch-lightning/issues/15689). This launcher overrides only that
    method, and only under Hydra, where :meth:`start_children` starts each child on :func:`hydra_job_command`;
    otherwise Lightning's own runs. The child observer is Lightning's, unless the strategy tolerates lost ranks
    (:attr:`tolerates_lost_ranks`, see :mod:`~lightning_sync.strategies._observer`). Lightning's ``kill`` is used as
    it is. :meth:`exited_children` and :meth:`wait_children` serve the app's end of job: a child that outlives a
    job (frozen, or still running when the job failed) is killed, so none holds the next job's ports and cores.
    """

    def __init__(self, *args: Any, tolerates_lost_ranks: Callable[[], bool] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tolerates_lost_ranks = tolerates_lost_ranks  # whether a lost child leaves the job running (asked then)

    @override
    def watches_children(self) -> bool:
        return self.tolerates_lost_ranks is not None

    @override
    def observe_children(self) -> None:
        assert self.tolerates_lost_ranks is not None  # (watches_children)
        ChildObserver(self.children, self.tolerates_lost_ranks).start()

    @override
    def start_children(self) -> None:
        if not _hydra_in_use():
            super().start_children()
            return
        self.check_can_start_children()
        self.children = []
        env = self.cluster_environment
        os.environ.update(
            MASTER_ADDR=env.main_address,
            MASTER_PORT=str(env.main_port),
            NODE_RANK=str(env.node_rank()),
            LOCAL_RANK=str(env.local_rank()),
            WORLD_SIZE=str(self.num_processes * self.num_nodes),
        )
        for local_rank in range(1, self.num_processes):
            child_env = dict(os.environ, LOCAL_RANK=str(local_rank))
            if os.environ.get("PL_GLOBAL_SEED") is None:
                child_env.pop("PL_GLOBAL_SEED", None)
            command, cwd = hydra_job_command(local_rank)
            self.children.append(subprocess.Popen(command, env=child_env, cwd=cwd))

    def exited_children(self) -> dict[int, int]:
        """``{local_rank: exit_code}`` of the children that have already exited with an error (now, no waiting)."""
        codes = {local_rank: proc.poll() for local_rank, proc in enumerate(self.children, start=1)}
        return {rank: code for rank, code in codes.items() if code not in (None, 0)}

    def wait_children(self, timeout: float | None = None) -> dict[int, int]:
        """Waits for the children to exit (between the jobs of a sweep, so ports and cores are free again).

        Args:
            timeout: seconds the children together may take; one still running then is killed (SIGKILL, which
                also ends a stopped process) and reported with exit code ``-9``.

        Returns:
            ``{local_rank: exit_code}`` of the children that failed (empty when all exited with 0).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        codes = {}
        for local_rank, proc in enumerate(self.children, start=1):
            try:
                codes[local_rank] = proc.wait(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[local_rank] = proc.wait()
        return {rank: code for rank, code in codes.items() if code != 0}


def configure_launcher(strategy: Any, lightning_default: Callable[[], None]) -> None:
    """Sets ``strategy``'s launcher: :class:`HydraJobSubprocessLauncher` for ``popen``, else Lightning's own.

    Args:
        strategy: a Lightning ``DDPStrategy``, before launch.
        lightning_default: Lightning's way to set the launcher (used for the other start methods).
    """
    if start_method(strategy) != "popen":
        lightning_default()
        return _frozen.end_frozen_ranks_on_failure(strategy.launcher, strategy, popen=False)
    assert strategy.cluster_environment is not None
    tolerates = None  # Lightning's observer, unless the strategy lets a lost rank leave the job running
    if getattr(strategy, "tolerates_lost_ranks", False):
        tolerates = lambda: bool(strategy.tolerates_lost_ranks)  # noqa: E731
    env = strategy.cluster_environment
    launcher = HydraJobSubprocessLauncher(
        env, strategy.num_processes, strategy.num_nodes, tolerates_lost_ranks=tolerates
    )
    set_launcher(strategy, launcher)
    _frozen.end_frozen_ranks_on_failure(launcher, strategy, popen=True)  # a failing rank kills the frozen ones
