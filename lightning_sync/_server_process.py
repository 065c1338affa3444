"""The mark of a dedicated parameter server process, read when the package is imported.

A dedicated server (``python -m lightning_sync.ps``) runs on torch alone. The ps strategy starts it with
:data:`SERVER_PROCESS_ENV` set to ``1``, and ``import lightning_sync`` then leaves out the strategies and so Lightning,
which would cost every server seconds of CPU at start (see :mod:`lightning_sync`).
"""

from __future__ import annotations

import os

SERVER_PROCESS_ENV = "LIGHTNING_SYNC_SERVER_PROCESS"


def is_server_process() -> bool:
    """Whether this process was started as a dedicated parameter server."""
    return os.environ.get(SERVER_PROCESS_ENV) == "1"
