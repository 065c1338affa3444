"""The ``popen`` main process's watch over its child ranks, where a lost rank may leave the job running (private
helper of :mod:`lightning_sync.strategies._launcher`).

Lightning's child observer ends the whole job (SIGKILL to every child and to the main process) as soon as one child
exits with an error. That is right for a job whose ranks depend on each other, and it stays the observer of every
strategy that does not say otherwise. A strategy whose ``tolerates_lost_ranks`` is true (the parameter server in
``async`` and ``ssp``: the servers drop a lost worker and the others go on) gets :class:`ChildObserver` instead: a
child that exits with an error is named on stderr as lost, and the job goes on; where the strategy asks for it
(``max_restarts``), the observer starts the lost rank again, up to that many times per rank. The decision is this one place; the
app's end of job (``lightning_sync.apps.train``) only reports what it finds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable


def describe_exit(code: int) -> str:
    """``"killed by SIGKILL"`` or ``"exit code 1"``: a child's exit code, as a user reads it."""
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class ChildObserver(threading.Thread):
    """Watches the child ranks of the main process; a child that exits with an error is lost, and the job goes on
    when ``tolerated()`` says so, or ends (every child and the main process SIGKILLed, as Lightning's observer does)
    when it does not.

    Args:
        children: the child ranks, local ranks ``1..n-1`` in order (a restarted rank's process replaces its entry).
        tolerated: whether a lost rank leaves the job running (asked when one is lost).
        period_s: seconds between two looks.
        restart: starts local rank ``r`` again and returns its process (where lost ranks are restarted).
        max_restarts: how many times each rank is started again (with ``restart``) before it counts as lost.
    """

    def __init__(
        self,
        children: list[subprocess.Popen],
        tolerated: Callable[[], bool],
        period_s: float = 0.5,
        restart: Callable[[int], subprocess.Popen] | None = None,
        max_restarts: int = 0,
    ) -> None:
        super().__init__(daemon=True, name="lightning_sync-child-observer")
        self.children = children
        self.tolerated = tolerated
        self.period_s = period_s
        self.restart = restart
        self.max_restarts = max_restarts if restart is not None else 0
        self.restarting = True  # cleared at the end of the job: a rank lost then is not started again
        self.lost: dict[int, int] = {}  # local rank -> exit code of the children lost while the job went on
        self.restarts: dict[int, int] = {}  # local rank -> how many times it was started again

    def run(self) -> None:
        while True:
            time.sleep(self.period_s)
            if self.look():
                return

    def look(self) -> bool:
        """One look at every child; whether the watch is over (every child exited, or the job was ended)."""
        codes = [proc.poll() for proc in self.children]
        for local_rank, code in enumerate(codes, start=1):
            if code in (None, 0) or local_rank in self.lost:
                continue
            if not self.tolerated():
                print(
                    f"error: rank {local_rank} (local) was lost ({describe_exit(code)}): ending the job",
                    file=sys.stderr,
                    flush=True,
                )
                self.end_job()
                return True
            done = self.restarts.get(local_rank, 0)
            if self.restarting and self.restart is not None and done < self.max_restarts:
                self.restarts[local_rank] = done + 1
                print(
                    f"warning: rank {local_rank} (local) was lost ({describe_exit(code)}); starting it again "
                    f"(restart {done + 1} of {self.max_restarts}): it rejoins the running job",
                    file=sys.stderr,
                    flush=True,
                )
                self.children[local_rank - 1] = self.restart(local_rank)
                codes[local_rank - 1] = None
                continue
            self.lost[local_rank] = code
            print(
                f"warning: rank {local_rank} (local) was lost ({describe_exit(code)}); the job goes on with the "
                "other ranks",
                file=sys.stderr,
                flush=True,
            )
        return all(code is not None for code in codes)

    def end_job(self) -> None:
        """SIGKILL to every child and to the main process (a rank may hang in a collective; SIGKILL also ends a
        frozen one)."""
        for proc in self.children:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
