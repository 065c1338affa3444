"""Leaving a process without the garbage collector's last passes over the whole heap.

An interpreter that imported torch and Lightning runs full collections over several hundred thousand objects while
it exits: about a second of CPU per rank, server and launcher, for memory the system takes back anyway.
:func:`skip_final_collection` registers an exit handler that freezes every object (``gc.freeze``) so those passes
find nothing to walk; handlers registered after it run first, and only reference cycles alive at exit are left
unfinalized, as after a crash (``test_an_app_process_exits_without_collecting_the_heap``).
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def skip_final_collection() -> None:
    """Makes the interpreter's exit skip the collector's passes over the heap (once per process; idempotent)."""
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True
