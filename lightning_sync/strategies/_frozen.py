"""Frozen ranks on this node, killed when a rank fails (private helper of :mod:`lightning_sync.strategies._launcher`).

The failure it handles: a rank stopped by a signal (SIGSTOP, or SIGTSTP from a terminal) never reaches a timeout of
its own, and torch and Lightning end a job's other ranks with signals a stopped process does not act on, or not at
all. Its peers' collectives fail after ``timeout_s``, naming it (:class:`~lightning_sync.comm.meter.PeerError`);
each failing rank then SIGKILLs (the one signal a stopped process acts on) the stopped ranks it can see:

- ``popen`` main process: its stopped children. Lightning kills them only on ``KeyboardInterrupt``, so a frozen
  child would outlive a plain ``Trainer`` job (``tests/test_faults.py``, SIGSTOP of rank 1).
- ``popen`` child: its parent, if it is the job's main process (:data:`LAUNCHER_PID_ENV`). Nothing else ends a
  frozen main process, whose observer is a thread of it (``test_frozen_main_process_is_killed_by_its_child_rank``).
- ``fork``/``spawn`` rank: its stopped siblings that run a rank's command line. torch's join SIGTERMs them and
  SIGKILLs them only 30 s later (``test_fork_rank_frozen_mid_run_is_named_and_killed``).

Only stopped processes (state ``T`` in ``/proc/<pid>/stat``) are killed, never a running one nor one stopped by a
debugger (state ``t``). Where there is no ``/proc``, nothing is found.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning_sync._proc import stat_fields
from lightning_sync.strategies._lightning import launcher_children, replace_launch

LAUNCHER_PID_ENV = "LIGHTNING_SYNC_LAUNCHER_PID"
"""Set for the ``popen`` children of a main process: its pid (so a child knows its parent is the job's main)."""


def kill_if_stopped(pid: int, who: str) -> None:
    """SIGKILLs ``pid`` if it is stopped by a signal, saying so on stderr (``who``: e.g. ``"rank 1 (local)"``)."""
    fields = stat_fields(pid)
    if fields is None or fields[0] != "T":
        return
    print(
        f"error: {who}, pid {pid}, is frozen (stopped by a signal): killing it so that the job ends",
        file=sys.stderr,
        flush=True,
    )
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


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
        try:
            theirs = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
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


class _RankFunction:
    """A rank's function; when it fails, the rank first kills the frozen ranks it sees. Picklable (``spawn``)."""

    def __init__(self, function: Callable[..., Any], launcher: Any, strategy: Any) -> None:
        self.function, self.launcher, self.strategy = function, launcher, strategy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.function(*args, **kwargs)
        except BaseException as error:
            kill_frozen_ranks(self.launcher, self.strategy.global_rank, error)
            raise


class _Launch:
    """``launcher.launch`` that runs each rank's function as a :class:`_RankFunction`. Picklable (``spawn``)."""

    def __init__(self, launcher: Any, strategy: Any, popen: bool) -> None:
        self.launch, self.launcher, self.strategy, self.popen = launcher.launch, launcher, strategy, popen

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.popen and not self.strategy.cluster_environment.creates_processes_externally:
            os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the children this main process starts inherit it
        return self.launch(_RankFunction(function, self.launcher, self.strategy), *args, **kwargs)


def end_frozen_ranks_on_failure(launcher: Any, strategy: Any, popen: bool) -> None:
    """Makes every rank that ``launcher`` (``None``: nothing to do; ``popen``: whether it starts its ranks with
    ``popen``) runs kill the frozen ranks it sees when it fails, by wrapping ``launcher.launch`` once."""
    if launcher is not None and not isinstance(launcher.launch, _Launch):
        replace_launch(launcher, _Launch(launcher, strategy, popen))
