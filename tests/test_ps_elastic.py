"""The elastic parameter server: in ``async`` and ``ssp`` a lost worker (killed, or frozen for ``timeout_s``) is dropped
by the servers and the others go on; the job ends with exit code 0 on the survivors, naming the lost one.

Two tiers: plain torch.distributed (a dedicated server process and forked workers, no Lightning), and the Hydra app
with the ``popen`` launcher as a user runs it (rank 0 is the command, ranks 1 and 2 its children, the server a
process of rank 0; see :mod:`fault_utils`).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import json  # noqa: E402
import signal  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from fault_utils import HAS_PROC, run_and_hit  # noqa: E402
from test_ps_core import (  # noqa: E402
    _backward,
    _free_port,
    _server_process,
    _started_sgd_worker,
    procs,  # noqa: E402, F401 - the fixture
)

import lightning_sync.ps as ps  # noqa: E402

HOST = "127.0.0.1"
FREEZE_AT = 5  # worker 2 is hit before its push number FREEZE_AT


# ---------------------------------------------------------------------------------------------------------- units
class _Child:
    """A child rank as the observer sees it: its exit code, ``None`` while it runs."""

    def __init__(self, code: int | None) -> None:
        self.code, self.pid = code, 0

    def poll(self) -> int | None:
        return self.code


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_the_observer_names_a_lost_rank_once_and_the_job_goes_on(capsys):
    from lightning_sync.strategies._launcher import ChildObserver

    children = [_Child(None), _Child(-signal.SIGKILL)]  # local rank 2 killed, rank 1 running
    observer = ChildObserver(children)  # type: ignore[arg-type]
    assert not observer.look() and observer.lost == {2: -signal.SIGKILL}, observer.lost
    err = capsys.readouterr().err
    assert "rank 2 (local) was lost (killed by SIGKILL); the job goes on" in err, err
    observer.look()  # said once
    assert capsys.readouterr().err == ""
    children[0].code = 0
    assert observer.look()  # every child exited: the watch is over


# ---------------------------------------------------------------------------------------------------------- plain torch
def _worker(rank: int, port: int, mode: str, how: int, timeout_s: float, pushes: int, hit_at: Any) -> dict:
    """Worker ``rank`` of 3 pushes ``pushes`` times (worker 2 hits itself with ``how`` at push ``FREEZE_AT``), then
    ends as the strategy does: stop, the lost workers as the servers saw them, goodbye. Worker 0 books when each of
    its pushes returned."""
    store = ps.connect_store(HOST, port, is_host=rank == 0, timeout_s=30)
    group = ps.PSGroup(store, rank, 3, 1, timeout_s, connect_timeout_s=30)
    model, opt, client = _started_sgd_worker(group, rank, mode=mode, max_staleness=2)
    times = []
    for step in range(pushes):
        if rank == 2 and step == FREEZE_AT:
            hit_at.value = time.monotonic()
            os.kill(os.getpid(), how)
        _backward(model, rank, step)
        reply = client.push(ps.current_lrs(opt))
        times.append(time.monotonic())
        time.sleep(0.01)
    client.request_stop()
    lost = ps.servers_at_end(client, timeout_s + 5.0)[0]
    stats = client.server_stats()[0]
    client.close()
    return {"times": times, "lost": lost, "stats": stats, "version": reply.version}


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["async", "ssp"])
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_the_server_drops_a_lost_worker_and_serves_the_others(procs, mode, how):  # noqa: F811
    """Worker 2 of 3 is killed or frozen at its 5th push: the server drops it (at once when its connection closes,
    after ``timeout_s`` when it is silent), workers 0 and 1 see no error, ssp stops counting it as the slowest, and
    every survivor ends knowing it was lost; the server ends cleanly."""
    timeout_s, pushes = 2.0, 200
    port = _free_port()
    hit_at = procs.ctx.Value("d", 0.0)
    procs.start("server", _server_process, port, 0, 3, 1, timeout_s)
    for rank in range(3):
        procs.start(f"worker{rank}", _worker, rank, port, mode, how, timeout_s, pushes, hit_at)
    out = procs.ok(["worker0", "worker1"], timeout=70)
    server = procs.ok(["server"], timeout=15)["server"]
    assert "stats" in server, server  # a clean end: not an error naming worker 2
    assert server["stats"]["lost"] == [2] and server["stats"]["live"] == [False, False, False], server
    for rank in (0, 1):
        lost = out[f"worker{rank}"]["lost"]
        assert list(lost) == [2], lost
        expected = "closed its connection" if how == signal.SIGKILL else "sent nothing"
        assert expected in lost[2], lost
    clocks = out["worker0"]["stats"]["clocks"]
    # the first survivor to finish had every push applied, the other every push before that one's stop: in ssp at
    # most max_staleness behind, in async as far behind as the scheduler left it (8 pushes seen under load);
    # worker 2's until it was hit, no more
    assert max(clocks[:2]) == pushes and clocks[2] <= FREEZE_AT, clocks
    assert min(clocks[:2]) >= (pushes - 5 if mode == "ssp" else pushes // 2), clocks
    # worker 0 went on: its pushes after the drop are as frequent as before the hit (ssp, frozen: after timeout_s)
    times = torch.tensor(out["worker0"]["times"], dtype=torch.float64)
    held = mode == "ssp" and how == signal.SIGSTOP  # ssp waits for a frozen worker until the server drops it
    resumed = hit_at.value + (timeout_s if held else 0.0) + 0.5  # the drop is a timer: on time
    after = times[times > resumed]
    assert len(after) >= 10, (len(after), float(times[-1] - hit_at.value))
    before = times[times < hit_at.value]
    if len(before) >= 3:
        pace_before = float(before[-1] - before[0]) / (len(before) - 1)
        pace_after = float(after[-1] - after[0]) / (len(after) - 1)
        assert pace_after < 3 * pace_before + 0.05, (pace_before, pace_after)


def _worker_to_the_end(rank: int, port: int, withdraw: bool) -> dict:
    """Worker ``rank`` of 3 pushes until the servers stop (``max_updates=60``); worker 2 is killed at its 5th push."""
    store = ps.connect_store(HOST, port, is_host=rank == 0, timeout_s=30)
    group = ps.PSGroup(store, rank, 3, 1, 30.0, connect_timeout_s=30)
    config = {"mode": "async", "max_updates": 60, "withdraw_lost_share": withdraw}
    model, opt, client = _started_sgd_worker(group, rank, **config)
    for step in range(1000):
        if rank == 2 and step == FREEZE_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        _backward(model, rank, step)
        if client.push(ps.current_lrs(opt)).stop:
            break
        time.sleep(0.02 if rank == 0 else 0.005)  # worker 1 makes more of the updates than worker 0
    lost = ps.servers_at_end(client, 10.0)[0]
    stats = client.server_stats()[0]
    client.close()
    return {"lost": lost, "stats": stats}


@pytest.mark.dist
@pytest.mark.timeout(60)
@pytest.mark.parametrize("withdraw", [True, False], ids=["epochs", "steps"])
def test_the_end_counts_the_live_workers(procs, withdraw):  # noqa: F811
    """``max_updates=60`` over 3 workers, worker 2 killed after 5 pushes. An end in epochs (``withdraw_lost_share``)
    withdraws its unused share, 20 - 5: the run ends at version 45, the live workers' shares plus its 5. An end in
    steps keeps 60: the live workers make its updates too."""
    port = _free_port()
    procs.start("server", _server_process, port, 0, 3, 1, 30.0)
    for rank in range(3):
        procs.start(f"worker{rank}", _worker_to_the_end, rank, port, withdraw)
    out = procs.ok(["worker0", "worker1"], timeout=50)
    stats = out["worker0"]["stats"]
    expected = 45 if withdraw else 60
    assert stats["max_updates"] == expected and stats["version"] == expected, stats
    assert stats["clocks"][2] == FREEZE_AT and list(out["worker1"]["lost"]) == [2], (stats, out["worker1"])
    assert stats["stop_reason"] == f"max_updates={expected} reached", stats
    assert "stats" in procs.ok(["server"], timeout=10)["server"]


def _survivor(rank: int, port: int, hit_at: Any, joined: Any, pushed: Any) -> dict:
    """Worker ``rank`` of 3 pushes until ``joined`` and 2 s more (worker 2 kills itself at push ``FREEZE_AT``);
    ``pushed[rank]``: its pushes so far."""
    store = ps.connect_store(HOST, port, is_host=rank == 0, timeout_s=30)
    group = ps.PSGroup(store, rank, 3, 1, 10.0, connect_timeout_s=30)
    model, opt, client = _started_sgd_worker(group, rank, mode="ssp", max_staleness=2)

    def hit(step: int) -> None:
        pushed[rank] = step
        if rank == 2 and step == FREEZE_AT:
            hit_at.value = time.monotonic()
            os.kill(os.getpid(), signal.SIGKILL)

    return _push_until_after_the_join(rank, model, opt, client, joined, before_push=hit)


def _push_until_after_the_join(
    rank: int, model: Any, opt: Any, client: ps.PSClient, joined: Any, before_push: Any = None, pushes: Any = None
) -> dict:
    """Pushes until 2 s after ``joined`` (``before_push(step)`` first; counts into ``pushes``), then asks the stop;
    the workers lost at the end and server 0's stats."""
    for step in range(5000):
        if before_push is not None:
            before_push(step)
        _backward(model, rank, step)
        client.push(ps.current_lrs(opt))
        if pushes is not None:
            with pushes.get_lock():
                pushes.value += 1
        if joined.value and time.monotonic() > joined.value + 2.0:
            break
        time.sleep(0.01)
    client.request_stop()
    lost = ps.servers_at_end(client, 15.0)[0]
    stats = client.server_stats()[0]
    client.close()
    return {"lost": lost, "stats": stats}


def _push_to_the_stop(rank: int, model: Any, opt: Any, client: ps.PSClient) -> tuple[int, Any]:
    """Pushes until the servers stop; how many pushes were applied, and the last reply."""
    applied = 0
    for step in range(5000):
        _backward(model, rank, step)
        reply = client.push(ps.current_lrs(opt))
        applied += int(reply.applied)
        if reply.stop:
            break
        time.sleep(0.01)
    client.close()
    return applied, reply


def _rejoiner(port: int, joined: Any) -> dict:
    """Worker 2 again, restarted: a new member of rank 2 (``rejoin=True``) pulls the servers' parameters and its
    clock, then pushes until the stop."""
    store = ps.connect_store(HOST, port, is_host=False, timeout_s=30)
    group = ps.PSGroup(store, 2, 3, 1, 10.0, connect_timeout_s=30, rejoin=True)
    model, opt, client = _started_sgd_worker(group, 2, mode="ssp", max_staleness=2)  # rank 2: no init, a pull
    at_join = client.last_reply
    joined.value = time.monotonic()
    applied, reply = _push_to_the_stop(2, model, opt, client)
    return {"generation": group.generation, "clock_at_join": at_join.clocks[0], "applied": applied,
            "joins_in_replies": (at_join.joins, reply.joins)}  # fmt: skip


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_a_killed_worker_restarted_with_rejoin_is_served_again(procs):  # noqa: F811
    """ssp, 3 workers: worker 2 is killed at its 5th push and dropped; a new process of rank 2 joins with
    ``rejoin=True``: it starts from the servers' parameters with its clock raised to the slowest live worker's, its
    pushes are applied again, the others are not held back by it, the server's stats count the join, and at the end
    no worker counts as lost."""
    port = _free_port()
    hit_at, joined, pushed = procs.ctx.Value("d", 0.0), procs.ctx.Value("d", 0.0), procs.ctx.Array("i", 3)
    procs.start("server", _server_process, port, 0, 3, 1, 10.0)
    for rank in range(3):
        procs.start(f"worker{rank}", _survivor, rank, port, hit_at, joined, pushed)
    # the join comes once worker 2 is dead and the survivors are past what ssp allowed them while it lived (their
    # clocks above FREEZE_AT + max_staleness), whichever way the OS shares the CPU
    deadline = time.monotonic() + 60
    while not (hit_at.value and min(pushed[:2]) > FREEZE_AT + 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    procs.start("rejoiner", _rejoiner, port, joined)
    out = procs.ok(["worker0", "worker1", "rejoiner"], timeout=70)
    stats, again = out["worker0"]["stats"], out["rejoiner"]
    assert stats["joins"] == {2: 1} and stats["lost"] == [], stats
    assert again["generation"] == 1 and again["applied"] >= 10, again
    assert again["joins_in_replies"] == ((1,), (1,)), again  # the replies' header counts it (ps/server0_joins)
    assert again["clock_at_join"] > FREEZE_AT, again  # raised to the slowest live worker's: ssp does not wait on it
    assert stats["clocks"][2] >= again["clock_at_join"] + again["applied"] - 1, (stats, again)
    assert out["worker0"]["lost"] == {} and out["worker1"]["lost"] == {}, out
    assert "stats" in procs.ok(["server"], timeout=10)["server"]


# ---------------------------------------------------------------------------------------------------------- the app
TIMEOUT_S = 15.0


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_PROC, reason="needs /proc")
def test_a_frozen_ssp_worker_is_dropped_and_the_job_ends_on_the_others(tmp_path):
    """2 workers, ssp with ``max_staleness=2``: worker 1 is SIGSTOPped. Worker 0 is held back by it for at most
    ``timeout_s`` (the server then drops it), finishes, and the job exits 0 naming it; the frozen process is killed
    at the end, not left behind. (A lost worker of 3: ``test_ps_elastic_kill.py``.)"""
    timeout_s = TIMEOUT_S
    run_dir = tmp_path / "run"
    overrides = [
        "strategy=ps",
        "strategy.mode=ssp",
        "strategy.max_staleness=2",
        f"strategy.timeout_s={timeout_s}",
        "trainer.devices=2",
        "trainer.max_epochs=10",
        "+logger.csv.flush_logs_every_n_steps=5",
        "test=false",
    ]
    outcome = run_and_hit(overrides, run_dir, "rank1", signal.SIGSTOP, wait_s=180.0)
    print(f"ssp worker 1 SIGSTOP: exit code {outcome.returncode} after {outcome.seconds:.1f} s")
    assert outcome.returncode == 0, outcome.stderr[-4000:]
    summary = _summary(run_dir)
    assert list(summary.get("lost_workers", {})) == ["1"], summary
    assert "sent nothing" in summary["lost_workers"]["1"], summary
    assert not outcome.left, f"orphans: {outcome.left}"
