"""``python -m lightning_sync.ps ...``: one dedicated parameter server (:func:`~lightning_sync.ps.server.run_server`)
as a process of its own, with its command line."""

from __future__ import annotations

import argparse
import ctypes
import inspect
import os
import signal
import sys
from argparse import RawDescriptionHelpFormatter
from collections.abc import Sequence

import torch

from lightning_sync.ps.errors import PSError
from lightning_sync.ps.server import run_server


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """One option per argument of :func:`~lightning_sync.ps.server.run_server` (``--num-workers`` for
    ``num_workers``), and ``--parent-pid``."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_sync.ps", description=run_server.__doc__, formatter_class=RawDescriptionHelpFormatter
    )
    for name, parameter in inspect.signature(run_server).parameters.items():
        required, default = parameter.default is parameter.empty, parameter.default
        kind = str if name in ("host", "prefix") else float if name.endswith("_s") else int
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, required=required, default=default)
    parser.add_argument("--parent-pid", type=int, default=None, help="die with this process (the one starting it)")
    return parser.parse_args(argv)


def die_with_parent(parent: int) -> bool:
    """Has the kernel SIGKILL this process when the thread of ``parent`` that started it ends (Linux:
    ``prctl(PR_SET_PDEATHSIG)``); whether ``parent`` is still its parent.

    The failure it handles: the worker that started this server is killed while the server is frozen (SIGSTOP), which
    cannot see the connections close and would hold the job's stderr open for ever. Set after ``exec``: a
    ``preexec_fn`` runs between ``fork`` and ``exec`` of a parent with threads, which is unsafe.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    return os.getppid() == parent  # a parent that died before the signal was set


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_sync.ps``: exit code 0 after a clean end, 1 after an error."""
    args = _parse_args(argv)
    if args.parent_pid is not None and not die_with_parent(args.parent_pid):
        print(f"lightning_sync.ps server {args.server}: the process that started it is gone", file=sys.stderr)
        return 1

    # the loop waits inside gloo, where Python cannot run a KeyboardInterrupt: Ctrl-C and SIGTERM end it at once
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    try:
        stats = run_server(**{k: v for k, v in vars(args).items() if k != "parent_pid"})
    except (PSError, ValueError) as exc:
        print(f"lightning_sync.ps server {args.server}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(
        f"lightning_sync.ps server {args.server}: done at version {stats.get('version', 0)} "
        f"({stats['bytes_recv']} bytes in, {stats['bytes_sent']} bytes out)",
        file=sys.stderr,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()  # os._exit: a server has nothing to clean up, and the interpreter's teardown with torch
    os._exit(code)  # loaded takes about 0.7 s of CPU, which every job's end would wait for
