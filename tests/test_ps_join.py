"""Workers added to a running parameter server in spare slots (``spare_workers``, ``ps.claim_spare_slot``), in plain
torch (nothing here times a failure); the app's ``strategy.join`` is ``test_ps_elastic_kill.py``'s.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import time  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from test_ps_core import _free_port, _model, _started_sgd_worker, procs  # noqa: E402, F401 - procs: the fixture
from test_ps_elastic import _push_to_the_stop, _push_until_after_the_join  # noqa: E402

import lightning_sync.ps as ps  # noqa: E402

HOST = "127.0.0.1"


def _server_with_spares(port: int, num_workers: int, spare_workers: int) -> dict:
    try:
        return {"stats": ps.run_server(HOST, port, 0, num_workers, 1, timeout_s=10.0, spare_workers=spare_workers)}
    except ps.PSError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _first_worker(rank: int, port: int, pushes: Any, joined: Any) -> dict:
    """Worker ``rank`` of the 2 the run starts with (3 worker ranks, the last a spare slot): async pushes until 2 s
    after the added worker's first pull."""
    store = ps.connect_store(HOST, port, is_host=rank == 0, timeout_s=30)
    group = ps.PSGroup(store, rank, 3, 1, 10.0, connect_timeout_s=30)
    model, opt, client = _started_sgd_worker(group, rank, mode="async")
    return _push_until_after_the_join(rank, model, opt, client, joined, pushes=pushes)


def _added_worker(port: int, joined: Any) -> dict:
    """A worker added to the running job: claims the spare slot, pulls the servers' parameters, pushes until the
    stop; a second claim finds no slot left."""
    store = ps.connect_store(HOST, port, is_host=False, timeout_s=30)
    rank = ps.claim_spare_slot(store, 3, 1)
    try:
        ps.claim_spare_slot(store, 3, 1)
        second = "claimed"
    except ps.PSError as exc:
        second = str(exc)
    group = ps.PSGroup(store, rank, 3, 1, 10.0, connect_timeout_s=30, rejoin=True)
    model, opt, client = _started_sgd_worker(group, rank, mode="async")  # rank 2: no init, a pull
    at_join = client.last_reply
    pulled = [p.detach().clone() for p in model.parameters()]
    joined.value = time.monotonic()
    applied, reply = _push_to_the_stop(rank, model, opt, client)
    start = [p.detach() for p in _model().parameters()]
    return {
        "rank": rank, "second_claim": second, "generation": group.generation, "applied": applied,
        "clock_at_join": at_join.clocks[0], "joins_in_replies": (at_join.joins, reply.joins),
        "pulled_trained": any(not torch.equal(a, b) for a, b in zip(pulled, start)),
    }  # fmt: skip


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_a_worker_added_in_a_spare_slot_is_served(procs):  # noqa: F811
    """async, 3 worker ranks of which the last is a spare slot: the server serves the 2 workers without waiting for
    the slot; a third process claims it mid-run, pulls the trained parameters with its clock raised to the others'
    slowest, and its pushes are applied; the server's stats count the join, and nobody counts as lost."""
    port = _free_port()
    pushes, joined = procs.ctx.Value("i", 0), procs.ctx.Value("d", 0.0)
    procs.start("server", _server_with_spares, port, 3, 1)
    for rank in range(2):
        procs.start(f"worker{rank}", _first_worker, rank, port, pushes, joined)
    deadline = time.monotonic() + 60
    while pushes.value < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pushes.value >= 20, "the two workers did not get going without the spare slot's worker"
    procs.start("added", _added_worker, port, joined)
    out = procs.ok(["worker0", "worker1", "added"], timeout=70)
    stats, added = out["worker0"]["stats"], out["added"]
    assert added["rank"] == 2 and added["generation"] == 1, added
    assert "no spare worker slot left" in added["second_claim"], added
    assert added["pulled_trained"] and added["applied"] >= 10, added
    assert added["clock_at_join"] >= 5, added  # raised to the slowest live worker's, not 0
    assert added["joins_in_replies"] == ((1,), (1,)), added
    assert stats["joins"] == {2: 1} and stats["vacant"] == [] and stats["lost"] == [], stats
    assert out["worker0"]["lost"] == {} and out["worker1"]["lost"] == {}, out
    assert "stats" in procs.ok(["server"], timeout=10)["server"]


def _sync_worker_with_a_spare_slot(port: int) -> dict:
    store = ps.connect_store(HOST, port, is_host=True, timeout_s=30)
    group = ps.PSGroup(store, 0, 2, 1, 10.0, connect_timeout_s=30)
    try:
        _started_sgd_worker(group, 0, mode="sync")
    except ps.PSServerError as exc:
        return {"error": str(exc)}
    return {"error": None}


@pytest.mark.dist
@pytest.mark.timeout(60)
def test_sync_refuses_spare_slots(procs):  # noqa: F811
    """A lockstep sync round needs every worker: the server refuses an INIT of sync (not elastic) with a spare slot,
    naming it."""
    port = _free_port()
    procs.start("server", _server_with_spares, port, 2, 1)
    procs.start("worker0", _sync_worker_with_a_spare_slot, port)
    error = procs.ok(["worker0"], timeout=40)["worker0"]["error"]
    assert error and "1 spare worker slot(s) in mode='sync'" in error, error
