"""Starting a benchmark script's two worker ranks, on loopback or one per emulated host, and reading rank 0's result.

Used by ``netns_launch_point.py`` and ``streaming_overlap.py``: each re-runs itself with ``--worker`` in two
processes (torch.distributed's env:// rendezvous) and rank 0 prints its result as the last line of JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def launch_two_ranks(script: str, argv: list[str], hosts: list | None, master_port: int, timeout: float) -> Any:
    """Runs ``script --worker argv...`` as ranks 0 and 1 and returns the JSON rank 0 printed last.

    Args:
        script: the benchmark script's path (its ``--worker`` mode is one rank).
        argv: the arguments both ranks get after ``--worker``.
        hosts: the emulated hosts (``lightning_sync.apps.netns.emulated_hosts``), one per rank; ``None``: loopback.
        master_port: the rendezvous port on rank 0's address.
        timeout: seconds to wait for both ranks; a rank still running then is killed (so that it keeps no network
            namespace alive) and the run fails.
    """
    env = dict(
        os.environ,
        WORLD_SIZE="2",
        MASTER_PORT=str(master_port),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(Path(__file__).resolve().parents[1]),
    )
    cmd = [sys.executable, script, "--worker", *argv]
    procs = []
    for rank in range(2):
        rank_env = dict(env, RANK=str(rank))
        if hosts is None:
            rank_env["MASTER_ADDR"] = "127.0.0.1"
            rank_cmd = cmd
        else:
            rank_env.update(MASTER_ADDR=hosts[0].address, GLOO_SOCKET_IFNAME=hosts[rank].interface)
            rank_cmd = hosts[rank].command(cmd)
        procs.append(subprocess.Popen(rank_cmd, env=rank_env, stdout=subprocess.PIPE, text=True))
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    bad = [p.returncode for p in procs if p.returncode != 0]
    if bad:
        raise SystemExit(f"error: ranks exited with {bad}")
    return json.loads(outs[0].strip().splitlines()[-1])
