"""Where servers run: dedicated processes (:func:`start_server_processes`, on worker 0, which hosts the store), or
daemon threads of the first worker processes (:func:`start_colocated_server`), each its own member of the group. Both
run :func:`~lightning_sync.ps.server.run_server` and return after the last worker's goodbye.

A dedicated server, ``python -m lightning_sync.ps``, exits when its parent's connection closes, when the thread that
started it ends (the parent-death signal, :func:`lightning_sync.ps.__main__.die_with_parent`: a frozen server too), on
Ctrl-C and SIGTERM, and when no worker talks to it for ``timeout_s``; an ``atexit`` hook stops the ones still running.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from typing import Any

from lightning_sync._server_process import SERVER_PROCESS_ENV
from lightning_sync.errors import check_range
from lightning_sync.ps.errors import PSError, PSTimeoutError
from lightning_sync.ps.group import DEFAULT_PREFIX, check_counts
from lightning_sync.ps.server import run_server


class ServerProcesses:
    """Handle on dedicated server processes (from :func:`start_server_processes`).

    Attributes:
        processes: one ``subprocess.Popen`` per server, in server order.
    """

    def __init__(self, processes: list[subprocess.Popen]) -> None:
        self.processes = processes

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def raise_if_failed(self) -> None:
        """Raises :class:`PSError` naming every server that exited with an error."""
        failed = [f"server {i} (pid {p.pid}) exit code {p.poll()}" for i, p in enumerate(self.processes) if p.poll()]
        if failed:
            raise PSError(f"parameter server process(es) failed: {', '.join(failed)}")

    def wait(self, timeout_s: float) -> list[int]:
        """Waits up to ``timeout_s`` for every server to exit; returns the exit codes.

        Raises:
            PSTimeoutError: some are still running (they are left running; see :meth:`stop`).
        """
        deadline = time.monotonic() + timeout_s
        try:
            return [p.wait(timeout=max(deadline - time.monotonic(), 0.0)) for p in self.processes]
        except subprocess.TimeoutExpired:
            alive = [i for i, p in enumerate(self.processes) if p.poll() is None]
            raise PSTimeoutError(f"server process(es) {alive} still running after {timeout_s:.1f} s") from None

    def stop(self, grace_s: float = 5.0) -> list[int]:
        """Ends every server still running: SIGTERM, then SIGKILL after ``grace_s``; returns the exit codes. SIGCONT
        follows SIGTERM (as systemd's): a frozen server would hold the SIGTERM pending for the whole grace."""
        for p in self.processes:
            p.send_signal(signal.SIGTERM)  # nothing once it has exited
            p.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return [int(p.returncode) for p in self.processes]

    def finish(self, timeout_s: float) -> None:
        """After the workers' goodbyes: waits up to ``timeout_s`` for a clean exit, stops what still runs, and
        raises for a server that failed (or had to be stopped)."""
        try:
            self.wait(timeout_s)
        finally:
            self.stop()
        self.raise_if_failed()


def start_server_processes(
    host: str,
    port: int,
    num_workers: int,
    num_servers: int,
    *,
    timeout_s: float,
    connect_timeout_s: float | None = None,
    prefix: str = DEFAULT_PREFIX,
    env: Mapping[str, str] | None = None,
    python: str | None = None,
    spare_workers: int = 0,
) -> ServerProcesses:
    """Starts ``num_servers`` server processes that join the PS group through the store at ``host:port``; they exit
    with code 0 after every worker's goodbye, 1 after an error. Call from a thread that lives as long as training:
    the parent-death signal follows it. The arguments are :func:`~lightning_sync.ps.server.run_server`'s, and:

    Args:
        env: environment of the servers (default: this process's, with ``OMP_NUM_THREADS=1`` unless set).
        python: interpreter to run (default: this one).

    Raises:
        ValueError: bad counts.
    """
    check_counts(num_workers, num_servers)
    environ = dict(os.environ if env is None else env)
    environ.setdefault("OMP_NUM_THREADS", "1")
    environ[SERVER_PROCESS_ENV] = "1"  # the server runs on torch alone: no Lightning import (see lightning_sync)
    arguments = dict(
        host=host,
        port=port,
        num_workers=num_workers,
        num_servers=num_servers,
        timeout_s=timeout_s,
        connect_timeout_s=connect_timeout_s,
        prefix=prefix,
        spare_workers=spare_workers,
        parent_pid=os.getpid(),
    )
    options = [part for k, v in arguments.items() if v is not None for part in (f"--{k.replace('_', '-')}", str(v))]
    command = [python or sys.executable, "-m", "lightning_sync.ps", *options]
    handle = ServerProcesses(
        [subprocess.Popen([*command, "--server", str(server)], env=environ) for server in range(num_servers)]
    )
    reference = weakref.ref(handle)

    def _stop_at_exit() -> None:
        live = reference()
        if live is not None:  # servers already gone: nothing to do
            live.stop(grace_s=2.0)

    atexit.register(_stop_at_exit)
    return handle


class ColocatedServer:
    """Handle on a server loop running in a daemon thread of a worker process (from :func:`start_colocated_server`),
    with the interface of :class:`ServerProcesses`.

    Attributes:
        future: the loop's final stats, or the exception it ended with.
    """

    def __init__(self, server: int, target: Callable[[], dict[str, Any]]) -> None:
        self.server = server
        self.future: Future[dict[str, Any]] = Future()
        threading.Thread(target=self._run, args=(target,), name=f"ps-server-{server}", daemon=True).start()

    def _run(self, target: Callable[[], dict[str, Any]]) -> None:
        try:
            self.future.set_result(target())
        except BaseException as exc:  # noqa: BLE001 - kept for the owner to raise in its own thread
            self.future.set_exception(exc)

    def raise_if_failed(self) -> None:
        """Re-raises, in the calling thread, the error the loop ended with (if any)."""
        error = self.future.exception() if self.future.done() else None
        if error is not None:
            raise PSError(f"colocated server {self.server} failed: {error}") from error

    def join(self, timeout_s: float) -> dict[str, Any]:
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

    finish = join

    def stop(self, grace_s: float = 0.0) -> list[int]:
        """Nothing to do: a gloo wait cannot be interrupted, so the daemon thread ends with its process (or after
        ``timeout_s`` without requests)."""
        return []


def start_colocated_server(
    host: str,
    port: int,
    server: int,
    num_workers: int,
    num_servers: int,
    *,
    timeout_s: float,
    connect_timeout_s: float | None = None,
    prefix: str = DEFAULT_PREFIX,
    spare_workers: int = 0,
) -> ColocatedServer:
    """Starts server ``server`` in a daemon thread of this process (meant for worker ``server``'s), which joins the
    group while this process's worker member does; the arguments are :func:`~lightning_sync.ps.server.run_server`'s.

    Raises:
        ValueError: ``server`` is not in ``[0, num_servers)`` or bad counts.
    """
    check_counts(num_workers, num_servers)
    check_range("server", server, low=0, high=num_servers - 1, integer=True)

    target = partial(
        run_server, host, port, server, num_workers, num_servers, timeout_s=timeout_s,
        connect_timeout_s=connect_timeout_s, prefix=prefix, spare_workers=spare_workers,
    )  # fmt: skip
    return ColocatedServer(server, target)


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
) -> Any | None:
    """Starts the servers that worker ``worker`` is responsible for under ``placement`` (call on every worker):
    ``dedicated``, worker 0 all the processes; ``colocated``, worker ``r < num_servers`` server ``r`` in a thread.

    Returns:
        A handle with ``raise_if_failed()``, ``stop()`` and ``finish(timeout_s)``, or ``None`` if it starts none.

    Raises:
        ValueError: bad counts.
    """
    if placement == "dedicated" and worker == 0:
        return start_server_processes(
            host, port, num_workers, num_servers, timeout_s=timeout_s, prefix=prefix, spare_workers=spare_workers
        )
    if placement == "colocated" and worker < num_servers:
        return start_colocated_server(
            host, port, worker, num_workers, num_servers, timeout_s=timeout_s, prefix=prefix,
            spare_workers=spare_workers,
        )  # fmt: skip
    return None
