"""No worker can stall the parameter server: a worker that freezes (SIGSTOP) between requests, or in the middle of
one (its request header sent, the data not), does not hold up the server's loop. In async the healthy worker goes
on training; the server drops the frozen one after ``timeout_s``, once, naming it (async and ssp are elastic), and
the healthy worker, which ssp held back until then, trains on and ends normally.

Plain torch.distributed (no Lightning): a dedicated server process and two worker processes, forked.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import signal  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from fault_utils import NOTICED_WITHIN_S  # noqa: E402
from test_ps_core import (  # noqa: E402
    _backward,
    _free_port,
    _join_dedicated,
    _server_process,
    _started_sgd_worker,
    procs,  # noqa: E402, F401 - the fixture
)

import lightning_sync.ps as ps  # noqa: E402
from lightning_sync.ps._protocol import TAG_REQUEST, Kind, Request  # noqa: E402

TIMEOUT_S = 4.0
FREEZE_AT = 5  # worker 1 freezes before its push number FREEZE_AT
DROPPED_S = TIMEOUT_S + 0.5  # after the freeze, worker 1 has been dropped: the drop is a timer, on time
PUSHES_AFTER_DROP = 20  # worker 0 ends after this many pushes once worker 1 has been dropped
MAX_PUSHES = 4000


def _worker(rank: int, port: int, mode: str, where: str, signalled: Any, pushed_at: Any, count: Any) -> dict:
    """Pushes until an error; worker 1 freezes itself at push ``FREEZE_AT``: ``between`` requests, or
    ``mid_request`` (a push header announcing data, then nothing). Worker 0 books the time of every push reply, and
    ends (goodbye) once it has pushed PUSHES_AFTER_DROP times after worker 1's drop."""
    group = _join_dedicated(rank, port, 1, TIMEOUT_S)
    model, opt, client = _started_sgd_worker(group, rank, mode=mode, max_staleness=1)
    after_drop = 0
    try:
        for step in range(MAX_PUSHES):
            _backward(model, rank, step)
            if rank == 1 and step == FREEZE_AT:
                if where == "mid_request":
                    header = Request(Kind.PUSH, 1, client.versions[0], 4096, client.checksums[0], 0).header()
                    group.send(header, group.server_rank(0), TAG_REQUEST).wait()
                signalled.value = time.monotonic()
                os.kill(os.getpid(), signal.SIGSTOP)
            client.push(ps.current_lrs(opt))
            if rank == 0:
                pushed_at[count.value] = time.monotonic()
                count.value += 1
                after_drop += bool(signalled.value) and time.monotonic() > signalled.value + DROPPED_S
                if after_drop >= PUSHES_AFTER_DROP:
                    client.close()
                    return {"error": None, "at": time.monotonic()}
            time.sleep(0.01)
    except ps.PSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "at": time.monotonic()}
    return {"error": None}


@pytest.mark.dist
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "ssp"])
@pytest.mark.parametrize("where", ["between", "mid_request"])
def test_a_frozen_worker_neither_stalls_the_server_nor_chains_waits(procs, mode, where):  # noqa: F811
    port = _free_port()
    signalled = procs.ctx.Value("d", 0.0)
    pushed_at, count = procs.ctx.Array("d", MAX_PUSHES, lock=False), procs.ctx.Value("i", 0, lock=False)
    procs.start("server", _server_process, port, 0, 2, 1, TIMEOUT_S)
    for rank in range(2):
        procs.start(f"worker{rank}", _worker, rank, port, mode, where, signalled, pushed_at, count)
    survivor = procs.ok(["worker0"], timeout=40)["worker0"]
    assert survivor["error"] is None, survivor  # the drop is no concern of worker 0
    server = procs.ok(["server"], timeout=10)["server"]
    assert "stats" in server, server  # a clean end
    stats = server["stats"]
    assert stats["lost"] == [1] and "sent nothing" in stats["lost_reasons"][1], stats
    times = torch.tensor(list(pushed_at[: count.value]), dtype=torch.float64)
    frozen = int(((times > signalled.value + 0.5) & (times < signalled.value + TIMEOUT_S - 0.5)).sum())
    after_drop = times[times > signalled.value + DROPPED_S]
    after = len(after_drop)
    print(f"{mode} {where}: worker 0 pushed {frozen} times while worker 1 was frozen, {after} after its drop")
    if mode == "async":
        assert frozen >= 10, frozen  # the healthy worker went on training while the other was frozen
    else:
        assert frozen <= 2, frozen  # ssp (max_staleness=1) holds the healthy worker back: at most s+1 pushes ahead
    assert after >= 10, after  # once dropped (after timeout_s), the frozen worker holds no one back
    assert after_drop[9] < signalled.value + TIMEOUT_S + NOTICED_WITHIN_S, float(after_drop[9] - signalled.value)
