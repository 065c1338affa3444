"""Leaving a process without the garbage collector's last passes over the whole heap.

When an interpreter that has imported torch and Lightning exits, its finalization runs full collections over every
tracked object (several hundred thousand: the modules, torch's operator registry, Lightning's classes) while it
tears the modules down. That costs about a second of CPU per process for nothing: the memory goes back to the
system with the process anyway. It is paid by every rank of every job, each parameter server, and each process of
a launcher, and on a machine with few cores the ranks' exits compete with what is still running.

:func:`skip_final_collection`, called early in a process's ``main``, registers an exit handler that moves every
object into the permanent generation (``gc.freeze``), so those passes find nothing to walk. The handlers registered
after it (the logging module's, any the run adds) run before it, and objects still die by reference count as the
modules are cleared; only reference cycles still alive at exit are left unfinalized, to the operating system, as
after a crash. Nothing here knows of torch or Lightning.
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
