"""``python -m lightning_sync.ps ...``: one dedicated parameter server (:func:`~lightning_sync.ps.server.run_server`)
as a process of its own, with its command line."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

import torch

from lightning_sync.ps.errors import PSError
from lightning_sync.ps.group import DEFAULT_PREFIX
from lightning_sync.ps.server import run_server


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_sync.ps", description="One parameter server of a lightning_sync PS group."
    )
    parser.add_argument("--host", required=True, help="host of the run's TCPStore (worker 0)")
    parser.add_argument("--port", type=int, required=True, help="port of the run's TCPStore")
    parser.add_argument("--server", type=int, required=True, help="index of this server, 0 .. num_servers-1")
    parser.add_argument("--num-workers", type=int, required=True, help="worker ranks, the spare slots included")
    parser.add_argument(
        "--spare-workers", type=int, default=0, help="of them, the last ones free for workers added to the run"
    )
    parser.add_argument("--num-servers", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, required=True, help="bound of every wait after the rendezvous")
    parser.add_argument("--connect-timeout-s", type=float, default=None, help="bound of the rendezvous")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX, help="store prefix of the PS group")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_sync.ps``: exit code 0 after a clean end, 1 after an error."""
    args = _parse_args(argv)
    # The loop waits inside gloo, where Python cannot run a KeyboardInterrupt: let Ctrl-C and SIGTERM end the
    # process at once instead.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    try:
        stats = run_server(
            args.host,
            args.port,
            args.server,
            args.num_workers,
            args.num_servers,
            timeout_s=args.timeout_s,
            connect_timeout_s=args.connect_timeout_s,
            prefix=args.prefix,
            spare_workers=args.spare_workers,
        )
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


def exit_after(argv: Sequence[str] | None = None) -> None:
    """Runs :func:`main` and ends the process with its exit code at once.

    A dedicated server has nothing to clean up once the loop returned; skipping the interpreter's teardown (seconds
    once torch.optim has loaded torch._dynamo) lets it leave as soon as the last worker said goodbye.
    """
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_after()
