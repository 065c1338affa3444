"""Runs one benchmark run as two torchrun nodes of one rank each: both on loopback, or one per emulated host.

An emulated host is a network namespace behind a rate-limited link (:mod:`lightning_sync.apps.netns`, root only), so
traffic between the nodes crosses a link of the chosen rate, shaped (tbf) on both ends. Every node's output goes to
``node<i>.log`` in the run's folder. A run is bounded by ``timeout_s``; when one node fails the other is stopped at
once, and on any exit (error, timeout, Ctrl-C) every process of the run is killed before the namespaces go.
Traffic only ever goes to 127.0.0.1 or to the emulated hosts' own addresses.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning_sync
from lightning_sync.apps.netns import EmulatedHost, emulated_hosts

NODES = 2
_POLL_S = 0.1


class RunFailed(RuntimeError):
    """A run that did not produce a result: a node exited non-zero, or the run timed out."""


def root_problem(rate: str) -> str | None:
    """Why ``rate`` cannot run here (``None``: it can). Emulated links need root and iproute2."""
    if rate == "loopback":
        return None
    if os.name != "posix" or os.geteuid() != 0:
        return f"network.rate={rate} needs root (ip netns, tc) to emulate the links"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return f"network.rate={rate} needs iproute2 (ip, tc) to emulate the links"
    return None


@contextmanager
def network(rate: str, prefix: str) -> Iterator[list[EmulatedHost] | None]:
    """The two hosts for ``rate`` (``None`` for loopback); the namespaces are removed on exit, whatever happens."""
    if rate == "loopback":
        yield None
        return
    with emulated_hosts(NODES, rate, prefix=prefix or f"lb{os.getpid() % 10000:04d}") as hosts:
        yield hosts


def free_port() -> int:
    """A free port below the kernel's ephemeral range: the master binds it seconds after this check (once torch is
    imported), and a port from the ephemeral range can be taken meanwhile as the local end of any outgoing
    connection on the machine ("EADDRINUSE", seen in CI while other tests ran). Drawn from the system's randomness,
    not the ``random`` module's state, which a seeded run (``seed_everything``) makes the same in every process."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = random.SystemRandom().randrange(max(1024, low // 2), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # every try taken: any free port
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _node_command(node: int, nodes: int, master: str, port: int, spec_path: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        "--nproc_per_node=1",
        f"--node_rank={node}",
        f"--master_addr={master}",
        f"--master_port={port}",
        "-m",
        "lightning_sync.apps.bench.worker",
        str(spec_path),
    ]


def _descendants(pids: list[int]) -> list[int]:
    """Every live descendant of ``pids`` (children, their children, ...), from one read of ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError):
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    todo = list(pids)
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _kill(procs: list[subprocess.Popen]) -> None:
    """SIGKILLs each node's whole process group and every descendant, then reaps them.

    torchrun starts its workers in sessions of their own, so killing the node's process group alone leaves a
    worker that is still importing running until its rendezvous gives up; its pids are read before the kill.
    """
    live = [proc.pid for proc in procs if proc.poll() is None]
    for pid in _descendants(live):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _cause(path: Path) -> str:
    """The worker's exception line from a node's log (the first one, torchrun's own excluded), else its last line."""
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    errors = [
        line
        for line in lines
        if re.match(r"(\[rank\d+\]: )?[\w.]*(Error|Exception|Interrupt)\b", line) and "ChildFailedError" not in line
    ]
    return (errors[:1] or lines[-1:] or ["(empty log)"])[0].strip()


def run_nodes(
    spec: dict[str, Any],
    run_dir: Path,
    hosts: list[EmulatedHost] | None,
    timeout_s: float,
) -> dict[str, Any]:
    """Runs ``spec`` on ``spec["nodes"]`` nodes (default 2) and returns rank 0's result.

    Guarantees: when it returns or raises, no process of the run is left.

    Raises:
        RunFailed: a node exited non-zero (the message has its last log lines) or ``timeout_s`` passed.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    result_path = run_dir / "result.json"
    result_path.unlink(missing_ok=True)
    spec_path = run_dir / "spec.json"
    spec_path.write_text(json.dumps({**spec, "result": str(result_path)}, indent=1))
    package_root = str(Path(lightning_sync.__file__).resolve().parent.parent)
    pythonpath = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH", "")) if p)
    master = "127.0.0.1" if hosts is None else hosts[0].address
    port = free_port()
    procs: list[subprocess.Popen] = []
    try:
        nodes = int(spec.get("nodes", NODES))
        for node in range(nodes):
            env = dict(
                os.environ,
                OMP_NUM_THREADS="1",
                PYTHONPATH=pythonpath,
                GLOO_SOCKET_IFNAME="lo" if hosts is None else hosts[node].interface,
            )
            argv = _node_command(node, nodes, master, port, spec_path)
            if hosts is not None:
                argv = hosts[node].command(argv)
            with open(run_dir / f"node{node}.log", "w") as log:
                procs.append(
                    subprocess.Popen(
                        argv,
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break  # one node failed: the other would only wait for it
            if time.monotonic() > deadline:
                raise RunFailed(f"timed out after {timeout_s:.0f} s (timeout_s); logs in {run_dir}")
            time.sleep(_POLL_S)
    finally:
        _kill(procs)
    codes = [p.returncode for p in procs]
    if any(code != 0 for code in codes) or not result_path.is_file():
        failed = next((i for i, c in enumerate(codes) if c != 0), 0)
        log_path = run_dir / f"node{failed}.log"
        raise RunFailed(f"node exit codes {codes}: {_cause(log_path)} (log: {log_path})")
    result = json.loads(result_path.read_text())
    if spec.get("wire"):
        result.update(wire_totals([result_path.with_name(f"{result_path.name}.rank{r}") for r in range(nodes)]))
    return result


def wire_totals(paths: list[Path]) -> dict[str, Any]:
    """The ranks' wire counters and meter totals over training (``<result>.rank<r>`` files), added up.

    Returns:
        ``wire_bytes_per_step``: bytes the hosts' interfaces sent per optimizer step, mean over hosts (beside the
        meter's ``bytes_sent_per_step`` of rank 0); ``wire_over_meter``: all bytes sent on the link over the
        meter's bytes that cross it (ring-formula or compressed payload; ps: the remote worker's pushes and
        replies); and the per-rank numbers under ``wire``.
    """
    parts = [json.loads(p.read_text()) for p in paths if p.is_file()]
    if len(parts) != len(paths) or any(p["tx_bytes"] is None or not p["steps"] for p in parts):
        return {"wire": parts, "wire_bytes_per_step": None, "wire_over_meter": None}
    tx = sum(p["tx_bytes"] for p in parts)
    cross = sum(p["meter_cross_host"] for p in parts)
    return {
        "wire": parts,
        "wire_bytes_per_step": statistics.mean(p["tx_bytes"] / p["steps"] for p in parts),
        "meter_cross_host_bytes": cross,
        "wire_over_meter": tx / cross if cross else None,
    }
