"""Where servers run (:func:`start_servers`): dedicated processes started by worker 0, which hosts the store, or
daemon threads of the first worker processes, each its own member of the group. Both run
:func:`~lightning_sync.ps.server.run_server` and end after the last worker's goodbye.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any

from lightning_sync._exit import DaemonWorker
from lightning_sync._server_process import SERVER_PROCESS_ENV
from lightning_sync.ps.errors import PSError, PSTimeoutError
from lightning_sync.ps.group import DEFAULT_PREFIX, check_counts
from lightning_sync.ps.server import run_server


class ServerProcesses:
    """Handle on dedicated server processes (from :func:`start_servers`), ``processes`` in server order.

    A server exits when its parent's connection closes, when no worker talks to it for ``timeout_s``, and, frozen,
    when the thread that started it ends (:func:`lightning_sync.ps.__main__.die_with_parent`;
    ``test_dedicated_server_processes_die_with_their_parent``). It has nothing to clean up (SIGTERM ends it at once),
    so a server still running when the job ends is SIGKILLed, which also ends a frozen one
    (``test_stop_ends_a_frozen_server_at_once``).
    """

    def __init__(self, processes: list[subprocess.Popen]) -> None:
        self.processes = processes

    def raise_if_failed(self) -> None:
        """Raises :class:`PSError` naming every server that exited with an error."""
        failed = [f"server {i} (pid {p.pid}) exit code {p.poll()}" for i, p in enumerate(self.processes) if p.poll()]
        if failed:
            raise PSError(f"parameter server process(es) failed: {', '.join(failed)}")

    def wait(self, timeout_s: float) -> list[int]:
        """Waits up to ``timeout_s`` in all for every server to exit, SIGKILLs those still running; the exit codes."""
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(deadline - time.monotonic(), 0.0))
            p.kill()  # nothing once it has exited
        return [p.wait() for p in self.processes]

    def stop(self) -> list[int]:
        """Ends every server still running, at once; the exit codes."""
        return self.wait(0.0)

    def finish(self, timeout_s: float) -> None:
        """After the workers' goodbyes: waits up to ``timeout_s`` for a clean exit, and raises for a server that
        failed (or had to be killed)."""
        self.wait(timeout_s)
        self.raise_if_failed()


class ColocatedServer:
    """Handle on server ``server``'s loop (``target``) running in a daemon thread of a worker process, with the
    interface of :class:`ServerProcesses`; ``future``: the loop's final stats, or the exception it ended with. A gloo
    wait cannot be interrupted: the thread ends with its process, which does not wait for it
    (``test_an_outer_sync_stuck_on_a_frozen_peer_does_not_hold_the_exit`` for the same :class:`DaemonWorker`).
    """

    def __init__(self, server: int, target: Callable[[], dict[str, Any]]) -> None:
        self.server = server
        worker = DaemonWorker(f"ps-server-{server}")
        self.future = worker.submit(target)
        worker.shutdown()

    def raise_if_failed(self) -> None:
        """Re-raises, in the calling thread, the error the loop ended with (if any)."""
        error = self.future.exception() if self.future.done() else None
        if error is not None:
            raise PSError(f"colocated server {self.server} failed: {error}") from error

    def finish(self, timeout_s: float) -> dict[str, Any]:
        """Waits up to ``timeout_s`` for the loop to end (after every worker's goodbye); returns its stats.

        Raises:
            PSError: the loop failed.
            PSTimeoutError: the loop is still running.
        """
        try:
            self.future.exception(timeout_s)
        except FutureTimeout:
            raise PSTimeoutError(f"colocated server {self.server} still running after {timeout_s:.1f} s") from None
        self.raise_if_failed()
        return self.future.result()

    def stop(self) -> list[int]:
        """Nothing to do (see the class)."""
        return []


def start_servers(
    placement: str,
    worker: int,
    host: str,
    port: int,
    num_workers: int,
    num_servers: int,
    *,
    timeout_s: float,
    prefix: str = DEFAULT_PREFIX,
    spare_workers: int = 0,
) -> ServerProcesses | ColocatedServer | None:
    """Starts the servers that worker ``worker`` is responsible for under ``placement`` (call on every worker), with
    :func:`~lightning_sync.ps.server.run_server`'s arguments. ``dedicated``: worker 0 starts one process per server
    (``python -m lightning_sync.ps``, on torch alone, ``OMP_NUM_THREADS=1`` unless set), which exits with code 0
    after every worker's goodbye, 1 after an error; call it from a thread that lives as long as training, which the
    parent-death signal follows. ``colocated``: worker ``r < num_servers`` runs server ``r`` in a daemon thread, which
    joins the group while this process's worker member does.

    Returns:
        A handle with ``raise_if_failed()``, ``stop()`` and ``finish(timeout_s)``, or ``None`` if it starts none.

    Raises:
        ValueError: bad counts.
    """
    check_counts(num_workers, num_servers)
    arguments: dict[str, Any] = dict(host=host, port=port, num_workers=num_workers, num_servers=num_servers)
    arguments.update(timeout_s=timeout_s, prefix=prefix, spare_workers=spare_workers)
    if placement == "colocated" and worker < num_servers:
        return ColocatedServer(worker, partial(run_server, server=worker, **arguments))
    if placement != "dedicated" or worker != 0:
        return None
    env = {"OMP_NUM_THREADS": "1", **os.environ, SERVER_PROCESS_ENV: "1"}
    command = [sys.executable, "-m", "lightning_sync.ps", "--parent-pid", str(os.getpid())]
    command += [part for k, v in arguments.items() for part in (f"--{k.replace('_', '-')}", str(v))]
    return ServerProcesses([subprocess.Popen([*command, "--server", str(s)], env=env) for s in range(num_servers)])
