"""What a process's exit need not wait for: the collector's last passes over the heap, and a thread stuck on a peer.

Standard library only (``test_packaging`` loads the module alone).
"""

from __future__ import annotations

import atexit
import functools
import gc
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


@functools.cache
def skip_final_collection() -> None:
    """Freezes every object at exit (``gc.freeze``, once per process), so the exit's full collections, about a second
    of CPU per process that imported torch and Lightning, find nothing to walk; handlers registered after it run
    first, and a cycle alive at exit stays unfinalized (``test_an_app_process_exits_without_collecting_the_heap``)."""
    atexit.register(gc.freeze)


class DaemonWorker(Executor):
    """``ThreadPoolExecutor(1)`` on a daemon thread: jobs run in submission order, each delivering a ``Future``, and
    the interpreter's exit does not wait for a job stuck on a frozen peer, as it joins a ``ThreadPoolExecutor``'s
    threads (``test_an_outer_sync_stuck_on_a_frozen_peer_does_not_hold_the_exit``)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((future, functools.partial(fn, *args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Ends the thread after the jobs submitted so far (never waits)."""
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, call = job
            if not future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - delivered to the job's owner through its Future
                future.set_exception(exc)
