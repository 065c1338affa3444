"""The ``popen`` main process's watch over its child ranks, where a lost rank may leave the job running (private
helper of :mod:`lightning_sync.strategies._launcher`).

The failure it handles: a child rank of a ``ps`` job in ``async``, ``ssp`` or elastic ``sync`` exits with an error
(killed, crashed). Lightning's own observer would SIGKILL every rank then, yet the servers drop a lost worker and
the others go on (``tests/test_ps_elastic_kill.py``, ``tests/test_ps_faults.py``). :class:`ChildObserver` names the
lost rank on stderr and lets the job go on where the strategy's ``tolerates_lost_ranks`` says so, and otherwise ends
the job as Lightning's does. A lost worker comes back the way a new one joins: its supervisor (torchrun, SLURM
``--requeue``, Kubernetes) runs the ``strategy.join=true`` command again.
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
        children: the child ranks, local ranks ``1..n-1`` in order.
        tolerated: whether a lost rank leaves the job running (asked when one is lost).
        period_s: seconds between two looks.
    """

    def __init__(self, children: list[subprocess.Popen], tolerated: Callable[[], bool], period_s: float = 0.5) -> None:
        super().__init__(daemon=True, name="lightning_sync-child-observer")
        self.children, self.tolerated, self.period_s = children, tolerated, period_s
        self.lost: dict[int, int] = {}  # local rank -> exit code of the children lost while the job went on

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
