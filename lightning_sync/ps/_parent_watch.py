"""Makes a dedicated server process die with the process that started it (private helper)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
#: Exit code of a server that found its parent gone.
PARENT_GONE_EXIT_CODE = 3


def die_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """Ends this process as soon as ``parent_pid`` is no longer its parent.

    On Linux the kernel sends SIGKILL when the parent dies (``prctl(PR_SET_PDEATHSIG)``; note that this fires when
    the *thread* that started the child exits, so start servers from a thread that lives as long as training, e.g.
    the main thread). On every platform a daemon thread also checks ``os.getppid()`` every ``poll_s`` seconds, which
    covers a parent that died before the ``prctl`` call.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass
    if os.getppid() != parent_pid:
        os._exit(PARENT_GONE_EXIT_CODE)

    def _watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent_pid:
                os._exit(PARENT_GONE_EXIT_CODE)

    threading.Thread(target=_watch, name="ps-parent-watch", daemon=True).start()
