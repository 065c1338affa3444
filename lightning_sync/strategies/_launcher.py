"""How a strategy launches its ranks, and the failures of a rank that Lightning's launchers leave running.

Each piece names the failure it handles and the test that shows it. The Lightning internals used are reached through
:mod:`lightning_sync.strategies._lightning`.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_sync.strategies._lightning import (
    PopenLauncher,
    launcher_children,
    replace_launch,
    set_launcher,
    start_method,
)

LAUNCHER_PID_ENV = "LIGHTNING_SYNC_LAUNCHER_PID"
"""Set for the ``popen`` children of a main process: its pid (so a child knows its parent is the job's main)."""


def hydra_job_command(local_rank: int) -> tuple[list[str], str]:
    """The command and working directory that re-run the current Hydra job, not the sweep, as ``local_rank``:
    Lightning's ``popen`` children re-run ``sys.argv``, so a ``hydra -m`` child would re-run the whole sweep (Lightning
    issue #15689; ``test_multirun_gives_one_sweep_folder``)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hydra_cfg, argv, spec = HydraConfig.get(), sys.argv, getattr(__main__, "__spec__", None)
    flags = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")  # each takes a value
    command = [sys.executable, *([to_absolute_path(argv[0])] if spec is None else ["-m", spec.name])]
    command += [a for i, a in enumerate(argv) if i and (a.split("=", 1)[0] in flags or argv[i - 1] in flags)]
    command += [
        *hydra_cfg.overrides.task,
        f"hydra.run.dir={hydra_cfg.runtime.output_dir}",
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
        "hydra/hydra_logging=disabled",
        "hydra/job_logging=disabled",
    ]
    return command, get_original_cwd()


def configure_launcher(strategy: Any, lightning_default: Callable[[], None]) -> None:
    """Sets ``strategy``'s launcher (``lightning_default``: Lightning's way, for other start methods than ``popen``),
    whose ranks kill the frozen ones when they fail (:func:`kill_frozen_ranks`)."""
    if start_method(strategy) == "popen":
        assert strategy.cluster_environment is not None
        hydra = sys.modules.get("hydra.core.hydra_config")  # imported by a running Hydra app
        tolerant = getattr(strategy, "tolerates_lost_ranks", False)
        launcher = PopenLauncher(
            strategy.cluster_environment,
            strategy.num_processes,
            strategy.num_nodes,
            child_command=hydra_job_command if hydra is not None and hydra.HydraConfig.initialized() else None,
            observer=(lambda children: ChildObserver(children).start()) if tolerant else None,
        )
        set_launcher(strategy, launcher)
    else:
        lightning_default()
    launch = strategy.launcher.launch
    replace_launch(strategy.launcher, functools.partial(_launch, launch, strategy.launcher, strategy))


def describe_exit(code: int) -> str:
    """``"killed by SIGKILL"`` or ``"exit code 1"``: a child's exit code, as a user reads it."""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class ChildObserver(threading.Thread):
    """In place of Lightning's observer, which SIGKILLs every rank once one fails, for a ``ps`` job that tolerates a
    lost rank (async, ssp, elastic sync): names a lost child rank on stderr, once, and the job goes on
    (``test_the_observer_names_a_lost_rank_once_and_the_job_goes_on``, ``tests/test_ps_elastic_kill.py``)."""

    def __init__(self, children: list[subprocess.Popen]) -> None:
        super().__init__(daemon=True, name="lightning_sync-child-observer")
        self.children = children  # local ranks 1..n-1
        self.lost: dict[int, int] = {}  # local rank -> exit code

    def run(self) -> None:
        while not self.look():
            time.sleep(0.5)

    def look(self) -> bool:
        """One look at every child; whether every child exited."""
        codes = [proc.poll() for proc in self.children]
        for local_rank, code in enumerate(codes, start=1):
            if code and local_rank not in self.lost:
                self.lost[local_rank] = code
                say = f"warning: rank {local_rank} (local) was lost ({describe_exit(code)}); the job goes on"
                print(say, file=sys.stderr, flush=True)
        return None not in codes


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, parent pid, ...); ``None``: no such pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def kill_frozen_ranks(launcher: Any, rank: int, error: BaseException) -> None:
    """After this rank (global ``rank``) failed with ``error``, SIGKILLs the ranks it sees stopped by a signal (state
    ``T``: not a running process, nor one a debugger stopped): a rank so stopped never times out itself, and torch and
    Lightning end it with signals it does not act on, so the job would never end. A ``popen`` main process kills its
    children (``test_lost_rank_fails_the_job_in_time_and_leaves_no_process``); a ``popen`` child its parent, the job's
    main process (``test_frozen_main_process_is_killed_by_its_child_rank``); a ``fork``/``spawn`` rank its siblings
    (torch's join SIGKILLs them only 30 s after SIGTERM; ``test_fork_rank_frozen_mid_run_is_named_and_killed``).
    ``error`` is said first: the launching process may report the killed rank's end instead."""
    me, parent = os.getpid(), os.getppid()
    ranks = {p.pid: f"rank {i} (local)" for i, p in enumerate(launcher_children(launcher), 1) if p.poll() is None}
    if os.environ.get(LAUNCHER_PID_ENV) == str(parent):
        ranks[parent] = "rank 0 (local, the main process)"
    if multiprocessing.parent_process() is not None:
        pids = [int(entry.name) for entry in Path("/proc").glob("[0-9]*")]
        ranks.update({pid: "a rank of this job" for pid in pids if (stat_fields(pid) or ["", ""])[1] == str(parent)})
    frozen = {pid: who for pid, who in ranks.items() if pid != me and (stat_fields(pid) or [""])[0] == "T"}
    if frozen:
        first = (str(error).strip().splitlines() or [""])[0]
        print(f"error: rank {rank} failed: {type(error).__name__}: {first}", file=sys.stderr, flush=True)
    for pid, who in frozen.items():
        print(f"error: {who}, pid {pid}, is frozen (stopped): killing it so that the job ends", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _run_rank(function: Callable[..., Any], launcher: Any, strategy: Any, *args: Any, **kwargs: Any) -> Any:
    """A rank's function; when it fails, the rank first kills the frozen ranks it sees (:func:`kill_frozen_ranks`)."""
    try:
        return function(*args, **kwargs)
    except BaseException as error:
        kill_frozen_ranks(launcher, strategy.global_rank, error)
        raise


def _launch(
    launch: Callable[..., Any], launcher: Any, strategy: Any, function: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``launcher.launch`` running each rank's function through :func:`_run_rank` (a partial, which ``spawn`` can
    pickle); a ``popen`` main process tells its children its pid (:data:`LAUNCHER_PID_ENV`), so that one of them can
    kill it frozen (``test_frozen_main_process_is_killed_by_its_child_rank``)."""
    if isinstance(launcher, PopenLauncher) and not strategy.cluster_environment.creates_processes_externally:
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    return launch(functools.partial(_run_rank, function, launcher, strategy), *args, **kwargs)
