"""Fault tests' helpers: run the Hydra app as a user does (``popen`` launcher: rank 0 is the command, rank 1 its
child, a ``ps`` server a process that rank 0 starts), hit one of its processes with a signal mid-run, and see how the
job ends and whether any process is left. Processes are found through ``/proc`` by their command lines.

Rank 0, the command, is the app's ``main`` in a fork of the test process standing for ``python -m
lightning_sync.train`` (:class:`app_utils.ForkedApp`: no fresh interpreter's imports); the ranks it launches and the
servers it starts are fresh interpreters, as in a user's run.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from app_utils import ForkedApp

from lightning_sync.apps.train import main as train_main
from lightning_sync.strategies._launcher import stat_fields

HAS_PROC = Path("/proc/self/cmdline").exists()


# A timeout is a wall-clock timer and fires on time under any load; what follows it (a process noticing, printing,
# killing its peers, interpreters exiting) is CPU work, which a busy machine stretches. The margins after it are fixed
# and generous, so that no test depends on how the OS shares the CPU: they catch a job that hangs or waits out a long
# timeout, not one a few seconds slow. A job hit by a fault ends within its ``timeout_s`` (the detection) plus
# ENDED_WITHIN_S; a test waits ``timeout_s + WAIT_S`` for that end before killing the job (so the assertion on the
# time, not the wait, reports a slow end), and its ``@pytest.mark.timeout`` is above both. A process of plain
# torch.distributed (no interpreter to start or end) notices a lost peer within ``timeout_s + NOTICED_WITHIN_S``.
ENDED_WITHIN_S = 60.0
WAIT_S = 90.0
NOTICED_WITHIN_S = 15.0


def _cmdlines() -> dict[int, str]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                out[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                pass
    return out


def _parent_and_session(pid: int) -> tuple[int, ...]:
    """The parent pid and the session id of ``pid`` (the job runs in a session of its own: see _start_training)."""
    fields = stat_fields(pid)
    return () if fields is None else (int(fields[1]), int(fields[3]))


def job_processes(run_dir: Path, main_pid: int) -> dict[str, int]:
    """``{"rank0": pid, "rank1": pid, "server0": pid}`` of a job (``"rank2"`` ... with more ranks; whichever of them
    exist now)."""
    found = {"rank0": main_pid} if (stat_fields(main_pid) or ["Z"])[0] != "Z" else {}  # the fork, until reaped
    for pid, cmd in _cmdlines().items():
        if f"hydra.run.dir={run_dir}" in cmd and "lightning_sync.train" in cmd:
            child = re.search(r"hydra\.job\.name=\S*_rank(\d+)", cmd)  # a popen child runs its rank's job name
            found[f"rank{child.group(1) if child else 1}"] = pid
        elif "lightning_sync.ps" in cmd and "--server 0" in cmd and main_pid in _parent_and_session(pid):
            found["server0"] = pid  # by its session too: a server whose parent died is an orphan of this job
    return found


@dataclass
class FaultOutcome:
    """How a job hit by a signal ended."""

    returncode: int
    seconds: float  # from the signal to the exit of the job's command
    stderr: str
    left: dict[str, int]  # processes of the job still there after it ended (each is SIGKILLed before returning)


def fork_train(args: list[str], out: Path, env: dict[str, str] | None = None) -> ForkedApp:
    """``python -m lightning_sync.train <args>`` as the app's ``main`` in a fork of the test process (``env``: added to
    its environment; its stdout and stderr go to ``stdout.txt`` and ``stderr.txt`` in ``out``, made here)."""
    out.mkdir(parents=True)
    environment = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    command = [sys.executable, "-m", "lightning_sync.train", *args]
    return ForkedApp(train_main, ["lightning_sync.train", *args], out.parent, environment, out, command)


def _start_training(
    overrides: list[str], run_dir: Path, after_s: float = 1.0, env: dict[str, str] | None = None
) -> ForkedApp:
    """Starts the job (:func:`fork_train`, its output in ``<run_dir>.out``) and returns once it has trained for
    ``after_s`` seconds; an exit before that fails the test. (The ranks' rendezvous waits at least 60 s whatever the
    job's short ``timeout_s``: ``rendezvous_timeout_s``.)"""
    job = fork_train([*overrides, f"hydra.run.dir={run_dir}"], run_dir.with_name(f"{run_dir.name}.out"), env)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not (run_dir / "metrics.csv").is_file():
        if job.poll() is not None:
            raise AssertionError(job_stderr(job)[-3000:])
        time.sleep(0.2)
    if not (run_dir / "metrics.csv").is_file():
        job.kill()
        raise AssertionError("the job did not start training within 90 s")
    time.sleep(after_s)  # training is under way
    return job


def job_stderr(job: ForkedApp) -> str:
    """What the job's command wrote on stderr so far."""
    return (job.out / "stderr.txt").read_text()


def run_and_hit(
    overrides: list[str], run_dir: Path, target: str, how: signal.Signals, wait_s: float, after_s: float = 1.0
) -> FaultOutcome:
    """Runs ``python -m lightning_sync.train <overrides>`` and, once training is under way, sends ``how`` to
    ``target`` (a key of :func:`job_processes`), ``after_s`` seconds after its first metrics; waits at most ``wait_s``
    seconds for the job to end.

    The job's command is killed (with its process group) if it outlives ``wait_s``, and any process of the job
    found afterwards is killed too, so a failing test leaves nothing behind.
    """
    job = _start_training(overrides, run_dir, after_s=after_s)
    try:
        victims = job_processes(run_dir, job.pid)
        assert target in victims, victims
        os.kill(victims[target], how)
        hit = time.monotonic()
        job.wait(wait_s)
        seconds = time.monotonic() - hit
    finally:
        if job.poll() is None:
            job.kill()  # with its process group
    stderr = job_stderr(job)
    deadline = time.monotonic() + 3.0  # a process that has just been killed may take a moment to leave /proc
    while (left := job_processes(run_dir, job.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left.values():  # never leave a frozen process behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    return FaultOutcome(job.returncode, seconds, stderr, left)
