"""``python -m lightning_sync.ps ...``: one dedicated parameter server (:func:`~lightning_sync.ps.server.run_server`)
as a process of its own, with its command line."""

from __future__ import annotations

import argparse
import ctypes
import inspect
import os
import signal
import sys
from collections.abc import Sequence

from lightning_sync.ps.errors import PSError
from lightning_sync.ps.server import run_server


def die_with_parent(parent: int) -> bool:
    """Has the kernel SIGKILL this process when the thread of ``parent`` that started it ends (Linux:
    ``prctl(PR_SET_PDEATHSIG)``, set after ``exec``, not in an unsafe ``preexec_fn``); whether ``parent`` is still its
    parent. A frozen server cannot see its killed parent's connections close and would hold the job's stderr open for
    ever (``test_dedicated_server_processes_die_with_their_parent``)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    return os.getppid() == parent


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_sync.ps``, one option per argument of ``run_server`` and ``--parent-pid``: exit code 0
    after a clean end, 1 after an error."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_sync.ps",
        description=run_server.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, parameter in inspect.signature(run_server).parameters.items():
        kind = str if name in ("host", "prefix") else float if name.endswith("_s") else int
        required = parameter.default is parameter.empty
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, required=required, default=parameter.default)
    parser.add_argument("--parent-pid", type=int, default=None, help="die with this process (the one starting it)")
    args = vars(parser.parse_args(argv))
    name, parent = f"lightning_sync.ps server {args['server']}", args.pop("parent_pid")
    if parent is not None and not die_with_parent(parent):
        print(f"{name}: the process that started it is gone", file=sys.stderr)
        return 1
    # the loop waits inside gloo, where Python cannot run a KeyboardInterrupt: Ctrl-C and SIGTERM end it at once
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        stats = run_server(**args)
    except (PSError, ValueError) as exc:
        print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    bytes_in_out = f"{stats['bytes_recv']} bytes in, {stats['bytes_sent']} bytes out"
    print(f"{name}: done at version {stats.get('version', 0)} ({bytes_in_out})", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()  # os._exit: a server has nothing to clean up, and the interpreter's teardown with torch
    os._exit(code)  # loaded takes about 0.7 s of CPU, which every job's end would wait for
