"""A fault-tolerant job on one host: torchft's lighthouse, replica groups of the Hydra app, and what they logged.

Used by notebook 07, ``benchmarks/ft_goodput.py`` and the tests: :func:`start_lighthouse` runs torchft's own
``torchft_lighthouse`` binary as a process (as a user runs it) and returns its address; :func:`group_command` is
the Hydra app's command line for one replica group; :func:`read_commits` reads the groups' commit lines back from
their logs, with the time, torchft's step and the groups that took part. Standard library only: Lightning's
:class:`~lightning_sync.apps.file_gate.FileGate` is a module of its own.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

COMMIT_LINE = re.compile(
    r"^\[(?P<when>[\d-]+ [\d:,]+)\]\S* - replica group (?P<group>\d+): sync committed "
    r"\(step (?P<step>\d+), commit \d+, groups \[(?P<groups>[\d, ]*)\]\)"
)
"""A commit as the Hydra app logs it (``lightning_sync.ft.replica``), under Hydra's default log format."""


@dataclass(frozen=True)
class Lighthouse:
    """A running ``torchft_lighthouse``: its process and the ``host:port`` it listens on."""

    process: subprocess.Popen[bytes]
    address: str

    def stop(self) -> None:
        """Kills the lighthouse and waits for it."""
        stop_process(self.process)


@dataclass(frozen=True)
class Commit:
    """A committed sync, as one group logged it: the unix time, torchft's step after it, the logging group, and the
    groups that took part (their pseudo-gradients are in it)."""

    time: float
    step: int
    group: int
    groups: tuple[int, ...]


def start_lighthouse(
    log: str | Path,
    min_replicas: int = 2,
    join_timeout_ms: int = 5000,
    heartbeat_timeout_ms: int = 1000,
    host: str = "127.0.0.1",
    start_timeout_s: float = 30.0,
) -> Lighthouse:
    """Starts torchft's ``torchft_lighthouse`` on a free port of ``host``, in a session of its own, writing to ``log``.

    Args:
        log: the lighthouse's output (the address is read from its ``listening on`` line).
        min_replicas: the fewest groups a quorum may have (the lighthouse's ``--min_replicas``).
        join_timeout_ms: how long a quorum waits for the groups of the last one to join, once ``min_replicas`` are in.
        heartbeat_timeout_ms: how old a group's heartbeat may be before the lighthouse drops it.
        host: the address to bind.
        start_timeout_s: how long to wait for the ``listening on`` line.

    Raises:
        RuntimeError: the lighthouse exited or said nothing within ``start_timeout_s`` (its output is in the message).
    """
    binary = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable)) or "torchft_lighthouse"
    path = Path(log)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        process = subprocess.Popen(
            [binary, "--bind", f"{host}:0", "--min_replicas", str(min_replicas), "--join_timeout_ms",
             str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + start_timeout_s
    while "listening on" not in path.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_process(process)
            raise RuntimeError(f"torchft_lighthouse did not start:\n{path.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)
    line = next(line for line in path.read_text().splitlines() if "listening on" in line)
    return Lighthouse(process, f"{host}:{line.rstrip('/').rsplit(':', 1)[1]}")


def group_command(
    lighthouse: str,
    replica_group: int,
    num_replica_groups: int,
    run_dir: str | Path,
    *overrides: str,
    min_replicas: int = 2,
    timeout_s: float = 5.0,
    heartbeat_timeout_s: float = 1.0,
    join_timeout_s: float = 5.0,
) -> list[str]:
    """The Hydra app's command line for one replica group of one rank (``trainer.devices=1``) that joins
    ``lighthouse``, writes to ``run_dir`` and takes ``overrides`` (``experiment=...``, ``strategy=...``) first."""
    return [
        sys.executable, "-m", "lightning_sync.train", *overrides, "trainer.devices=1", "ft=torchft",
        f"ft.lighthouse={lighthouse}", f"ft.replica_group={replica_group}",
        f"ft.num_replica_groups={num_replica_groups}", f"ft.min_replicas={min_replicas}", f"ft.timeout_s={timeout_s}",
        f"+ft.heartbeat_timeout_s={heartbeat_timeout_s}", f"+ft.join_timeout_s={join_timeout_s}",
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip


def start_process(command: list[str], log: str | Path, cwd: str | Path | None = None) -> subprocess.Popen[bytes]:
    """Starts ``command`` in a session of its own (so :func:`stop_process` ends everything it starts), with
    ``OMP_NUM_THREADS=1`` unless set, stdout and stderr to ``log``.

    The process is a job of its own (a replica group is its own world), so it does not inherit ``MASTER_PORT``:
    replica groups started from one environment that holds it would all bind that port (EADDRINUSE)."""
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    env.setdefault("OMP_NUM_THREADS", "1")
    path = Path(log)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as out:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), read from ``/proc``; empty where ``/proc`` has none."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        for child in children:
            found += [child, *descendants(child)]
    return found


def stop_process(process: subprocess.Popen[bytes], sig: int = signal.SIGKILL, wait_s: float = 30.0) -> None:
    """Sends ``sig`` to ``process``'s process group and to every process below it, and waits for it.

    The processes below are found first and signalled one by one, because a launcher may start its workers in
    sessions of their own (torchrun does): signalling its group alone would leave them running, orphaned.
    """
    if process.poll() is None:
        below = descendants(process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        for pid in below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    process.wait(wait_s)


def read_commits(*logs: str | Path) -> list[Commit]:
    """The commit lines of the given logs (each group's Hydra log, ``<run dir>/train.log``), oldest first."""
    found = []
    for log in logs:
        path = Path(log)
        if not path.exists():
            continue
        for line in path.read_text(errors="replace").splitlines():
            match = COMMIT_LINE.match(line)
            if match is None:
                continue
            when = datetime.datetime.strptime(match["when"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            groups = tuple(int(g) for g in match["groups"].replace(" ", "").split(",") if g)
            found.append(Commit(when, int(match["step"]), int(match["group"]), groups))
    return sorted(found, key=lambda c: c.time)
