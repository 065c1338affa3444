"""Runs a function on several ranks of a real gloo process group, forked from the test process.

Assertions run inside the ranks; a failure (or a hang past ``timeout``) on any rank fails the test.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, fn: Callable, args: tuple, errors: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    # Every rank's connections are up before any rank runs fn: a rank whose fn makes no collective could otherwise
    # finish and close its end while a peer is still connecting ("Gloo connectFullMesh failed ... Connection closed
    # by peer", seen once in CI on a test without collectives).
    dist.barrier()
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., None], *args: Any, world_size: int = 2, timeout: float = 60.0, start_method: str = "fork"
) -> None:
    """Calls ``fn(rank, world_size, *args)`` in ``world_size`` processes joined by a gloo process group: forked from
    the test process (about a second), or ``start_method="spawn"`` where the test process holds threads that a fork
    would copy in an unknown state (torchft's lighthouse and managers start a runtime of their own)."""
    ctx = mp.get_context(start_method)
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg")
        procs = [
            ctx.Process(target=_entry, args=(rank, world_size, init_file, fn, args, errors), daemon=True)
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
            p.join(5)
        failures = []
        while not errors.empty():
            rank, trace = errors.get()
            failures.append(f"rank {rank}:\n{trace}")
        if failures:
            raise AssertionError("\n".join(failures))
        if alive:
            raise AssertionError(f"ranks hung for more than {timeout}s: {[procs.index(p) for p in alive]}")
        bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
        assert not bad, f"ranks exited non-zero: {bad}"
