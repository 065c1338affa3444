"""Frozen ranks on this node: found through ``/proc`` and killed when a rank fails, so that a frozen rank neither
holds the job open nor outlives it (private helper of :mod:`lightning_sync.strategies._launcher`).

A process stopped by a signal (SIGSTOP, or SIGTSTP from a terminal) never reaches a timeout of its own: only another
process can end it. Its peers' collectives fail after ``timeout_s`` (naming it, see
:class:`~lightning_sync.comm.meter.PeerError`), and each failing rank kills the stopped ranks it can see:

- ``popen``, main process (rank 0 of the node): its stopped children, named by local rank. It is the command a
  user runs, so when a child is frozen the job ends here. Lightning's child observer acts only on children that
  exited, and Lightning kills the children only on ``KeyboardInterrupt``, so a frozen child would outlive a plain
  ``Trainer`` job (the Hydra app also kills them in ``_end_job``; ``tests/test_faults.py`` SIGSTOP of rank 1
  checks that the frozen rank is named and killed).
- ``popen``, child rank: its parent if that is the job's main process and it is stopped. Nothing else could end a
  frozen main process (Lightning's observer is a thread of it); the job's command then exits killed by SIGKILL,
  after this rank said why on stderr. Without it ``test_frozen_main_process_is_killed_by_its_child_rank`` hangs.
- ``fork``/``spawn`` rank: its stopped siblings that run a rank's command line. torch's join would SIGTERM them
  (which a stopped process does not act on) and SIGKILL them only 30 s later: without it the job of
  ``test_fork_rank_frozen_mid_run_is_named_and_killed`` ends 45 s after the freeze, not ``timeout_s`` (15 s) plus
  a few seconds.

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


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped by a signal (``False`` if it is gone, or there is no ``/proc``)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] == "T"


def kill_if_stopped(pid: int, who: str) -> bool:
    """SIGKILLs ``pid`` if it is stopped (SIGKILL is the one signal a stopped process acts on), saying so on stderr.

    Args:
        pid: the process.
        who: how the job calls it, e.g. ``"rank 1 (local)"``.

    Returns:
        Whether it was killed.
    """
    if not is_stopped(pid):
        return False
    print(
        f"error: {who}, pid {pid}, is frozen (stopped by a signal): killing it so that the job ends",
        file=sys.stderr,
        flush=True,
    )
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _same_rank_command(mine: bytes, theirs: bytes) -> bool:
    """Whether two command lines are those of ranks started alike by ``multiprocessing``: a forked rank keeps its
    parent's; a spawned one runs ``spawn_main(...)`` with its own pipe handle, ending in ``--multiprocessing-fork``."""
    spawned = b"--multiprocessing-fork\0"
    return mine == theirs or (mine.endswith(spawned) and theirs.endswith(spawned))


def _stopped_sibling_ranks() -> list[int]:
    """The stopped children of this process's parent, other than this one, that run a rank's command line."""
    proc = Path("/proc")
    me, parent = os.getpid(), os.getppid()
    try:
        command = (proc / str(me) / "cmdline").read_bytes()
        pids = [int(entry.name) for entry in proc.iterdir() if entry.name.isdigit() and int(entry.name) != me]
    except OSError:
        return []
    found = []
    for pid in pids:
        fields = stat_fields(pid)
        if fields is None or fields[0] != "T" or int(fields[1]) != parent:
            continue
        try:
            if _same_rank_command(command, (proc / str(pid) / "cmdline").read_bytes()):
                found.append(pid)
        except OSError:
            continue
    return found


def kill_frozen_ranks(launcher: Any, rank: int, error: BaseException) -> None:
    """After this rank failed with ``error``: kills the frozen ranks it sees (see the module docstring).

    Args:
        launcher: the rank's launcher (a ``popen`` main process's holds its children).
        rank: this rank (global).
        error: what it failed with; said on stderr before a ``fork``/``spawn`` sibling is killed, since the
            launching process reports whichever rank it sees end first, which may be the killed one.
    """
    children = launcher_children(launcher)
    if any(proc.poll() is None and is_stopped(proc.pid) for proc in children):
        for local_rank, proc in enumerate(children, start=1):
            if proc.poll() is None:
                kill_if_stopped(proc.pid, f"rank {local_rank} (local)")
    parent = os.getppid()
    if os.environ.get(LAUNCHER_PID_ENV) == str(parent):
        kill_if_stopped(parent, "rank 0 (local, the main process)")
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
    """Makes every rank that ``launcher`` runs kill the frozen ranks it sees when it fails.

    ``launcher.launch(function, ...)`` runs ``function`` in every rank (in this very process for a ``popen`` main
    process); it is wrapped once, on this instance.

    Args:
        launcher: the strategy's launcher (``None``: nothing to do).
        strategy: the strategy.
        popen: whether ``launcher`` starts its ranks with ``popen`` (else ``fork``/``spawn``).
    """
    if launcher is not None and not isinstance(launcher.launch, _Launch):
        replace_launch(launcher, _Launch(launcher, strategy, popen))
