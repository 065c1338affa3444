"""How a strategy launches its ranks, and the failures of a rank that Lightning's launchers leave running.

- Under Hydra, Lightning's ``popen`` launcher re-runs ``sys.argv`` in every child, so a ``hydra -m`` child re-runs the
  whole sweep (Lightning issue #15689): each child runs :func:`hydra_job_command`, the parent's job only
  (``test_multirun_gives_one_sweep_folder``).
- A lost child rank of a ``ps`` job that tolerates it (``async``, ``ssp``, elastic ``sync``) would make Lightning's
  observer SIGKILL every rank: :class:`ChildObserver` names it and lets the job go on (``tests/test_ps_elastic_kill.py``).
  A lost worker comes back the way a new one joins: its supervisor runs the ``strategy.join=true`` command again.
- A rank stopped by a signal (SIGSTOP, SIGTSTP) never times out itself, and torch and Lightning end the other ranks
  with signals it does not act on. Its peers' collectives fail after ``timeout_s``, naming it; each failing rank then
  SIGKILLs the stopped ranks it can see (:func:`kill_frozen_ranks`): a ``popen`` main process its stopped children
  (Lightning kills them only on ``KeyboardInterrupt``; ``test_lost_rank_fails_the_job_in_time_and_leaves_no_process``);
  a ``popen`` child its parent, the job's main process (:data:`LAUNCHER_PID_ENV`;
  ``test_frozen_main_process_is_killed_by_its_child_rank``); a ``fork``/``spawn`` rank its stopped siblings (torch's
  join SIGKILLs them only 30 s after its SIGTERM; ``test_fork_rank_frozen_mid_run_is_named_and_killed``). Only state
  ``T`` in ``/proc/<pid>/stat`` is killed, never a running process nor one stopped by a debugger (``t``); without
  ``/proc`` nothing is found.

The Lightning internals used are reached through :mod:`lightning_sync.strategies._lightning`.
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lightning_sync.strategies._lightning import (
    PopenLauncher,
    launcher_children,
    replace_launch,
    set_launcher,
    start_method,
)

# Command-line flags of a Hydra app that select the config (each takes a value).
_HYDRA_CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")


def _hydra_in_use() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return False
    return HydraConfig.initialized()


def _config_flags(argv: Sequence[str]) -> list[str]:
    """The config-selecting flags of ``argv`` (``-cn x``, ``--config-dir=y``), kept for the child."""
    return [
        arg
        for i, arg in enumerate(argv)
        if arg.split("=", 1)[0] in _HYDRA_CONFIG_FLAGS or (i > 0 and argv[i - 1] in _HYDRA_CONFIG_FLAGS)
    ]


def hydra_job_command(local_rank: int) -> tuple[list[str], str]:
    """The command and working directory that re-run the current Hydra job (not the sweep) as ``local_rank``."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hydra_cfg = HydraConfig.get()
    spec = getattr(__main__, "__spec__", None)
    command = [sys.executable, *([to_absolute_path(sys.argv[0])] if spec is None else ["-m", spec.name])]
    command += [*_config_flags(sys.argv[1:]), *hydra_cfg.overrides.task]
    command += [
        f"hydra.run.dir={hydra_cfg.runtime.output_dir}",
        f"hydra.job.name={hydra_cfg.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",
        "hydra/hydra_logging=disabled",
        "hydra/job_logging=disabled",
    ]
    return command, get_original_cwd()


def configure_launcher(strategy: Any, lightning_default: Callable[[], None]) -> None:
    """Sets ``strategy``'s launcher (for ``popen``, a :class:`PopenLauncher` with the hooks above, else Lightning's own),
    whose ranks kill the frozen ones when they fail.

    Args:
        strategy: a Lightning ``DDPStrategy``, before launch.
        lightning_default: Lightning's way to set the launcher (used for the other start methods).
    """
    if start_method(strategy) == "popen":
        assert strategy.cluster_environment is not None
        tolerant = getattr(strategy, "tolerates_lost_ranks", False)
        launcher = PopenLauncher(
            strategy.cluster_environment,
            strategy.num_processes,
            strategy.num_nodes,
            child_command=hydra_job_command if _hydra_in_use() else None,
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
    """Watches the child ranks of the main process, in place of Lightning's observer, where a lost rank leaves the job
    running: a child that exits with an error is named on stderr, once, and the job goes on.

    Args:
        children: the child ranks, local ranks ``1..n-1`` in order.
        period_s: seconds between two looks.
    """

    def __init__(self, children: list[subprocess.Popen], period_s: float = 0.5) -> None:
        super().__init__(daemon=True, name="lightning_sync-child-observer")
        self.children, self.period_s = children, period_s
        self.lost: dict[int, int] = {}  # local rank -> exit code of the children lost while the job went on

    def run(self) -> None:
        while not self.look():
            time.sleep(self.period_s)

    def look(self) -> bool:
        """One look at every child; whether the watch is over (every child exited)."""
        codes = [proc.poll() for proc in self.children]
        for local_rank, code in enumerate(codes, start=1):
            if code not in (None, 0) and local_rank not in self.lost:
                self.lost[local_rank] = code
                print(
                    f"warning: rank {local_rank} (local) was lost ({describe_exit(code)}); the job goes on with the "
                    "other ranks",
                    file=sys.stderr,
                    flush=True,
                )
        return None not in codes


LAUNCHER_PID_ENV = "LIGHTNING_SYNC_LAUNCHER_PID"
"""Set for the ``popen`` children of a main process: its pid (so a child knows its parent is the job's main)."""


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, then the parent pid); ``None`` if
    the process is gone or there is no ``/proc``."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def kill_if_stopped(pid: int, who: str) -> None:
    """SIGKILLs ``pid`` if it is stopped by a signal, saying so on stderr (``who``: e.g. ``"rank 1 (local)"``)."""
    fields = stat_fields(pid)
    if fields is None or fields[0] != "T":
        return
    print(f"error: {who}, pid {pid}, is frozen (stopped by a signal): killing it so that the job ends", file=sys.stderr)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _stopped_sibling_ranks() -> list[int]:
    """The stopped children of this process's parent, other than this one, started alike by ``multiprocessing``: a
    forked rank keeps its parent's command line; a spawned one's ends in ``--multiprocessing-fork``."""
    me, parent, spawned = os.getpid(), os.getppid(), b"--multiprocessing-fork\0"
    try:
        mine = Path(f"/proc/{me}/cmdline").read_bytes()
        pids = [int(entry.name) for entry in Path("/proc").glob("[0-9]*") if int(entry.name) != me]
    except OSError:
        return []
    found = []
    for pid in pids:
        fields = stat_fields(pid)
        if fields is None or fields[0] != "T" or int(fields[1]) != parent:
            continue
        with contextlib.suppress(OSError):
            theirs = Path(f"/proc/{pid}/cmdline").read_bytes()
            if theirs == mine or (theirs.endswith(spawned) and mine.endswith(spawned)):
                found.append(pid)
    return found


def kill_frozen_ranks(launcher: Any, rank: int, error: BaseException) -> None:
    """After this rank (global ``rank``) failed with ``error``: kills the frozen ranks it sees (see the module
    docstring). ``error`` is said first where a sibling is killed: the launching process reports whichever rank it
    sees end first, which may be the killed one."""
    for local_rank, proc in enumerate(launcher_children(launcher), start=1):
        if proc.poll() is None:
            kill_if_stopped(proc.pid, f"rank {local_rank} (local)")
    if os.environ.get(LAUNCHER_PID_ENV) == str(os.getppid()):
        kill_if_stopped(os.getppid(), "rank 0 (local, the main process)")
    siblings = _stopped_sibling_ranks() if multiprocessing.parent_process() is not None else []
    if siblings:
        first = (str(error).strip().splitlines() or [""])[0]
        print(f"error: rank {rank} failed: {type(error).__name__}: {first}", file=sys.stderr, flush=True)
    for pid in siblings:
        kill_if_stopped(pid, "a rank of this job")


def _run_rank(function: Callable[..., Any], launcher: Any, strategy: Any, *args: Any, **kwargs: Any) -> Any:
    """A rank's function; when it fails, the rank first kills the frozen ranks it sees."""
    try:
        return function(*args, **kwargs)
    except BaseException as error:
        kill_frozen_ranks(launcher, strategy.global_rank, error)
        raise


def _launch(
    launch: Callable[..., Any], launcher: Any, strategy: Any, function: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """``launcher.launch`` that runs each rank's function through :func:`_run_rank` (in partials, which ``spawn`` can
    pickle)."""
    if isinstance(launcher, PopenLauncher) and not strategy.cluster_environment.creates_processes_externally:
        os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the children this main process starts inherit it
    return launch(functools.partial(_run_rank, function, launcher, strategy), *args, **kwargs)
