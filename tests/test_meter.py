"""CommMeter: the bytes it books per collective, its async handles, and step deltas (2 real gloo ranks)."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_ranks

from lightning_sync.comm.meter import CommMeter, CommStats, ring_all_reduce_bytes

pytestmark = pytest.mark.timeout(60)


def _all_reduce_bytes(rank: int, world: int) -> None:
    meter = CommMeter()
    for numel, dtype in ((1000, torch.float32), (7, torch.float64), (333, torch.float16)):
        before = meter.total
        t = torch.full((numel,), float(rank + 1), dtype=dtype)
        assert meter.all_reduce(t).wait()  # a blocking call returns a handle whose work is done
        assert torch.all(t == sum(r + 1 for r in range(world))), t  # really reduced
        size = numel * t.element_size()
        delta = meter.total - before
        assert delta.bytes_sent == 2 * (world - 1) / world * size, (delta, size)
        assert delta.bytes_recv == 2 * (world - 1) / world * size, (delta, size)
        assert delta.calls == 1
        assert delta.seconds > 0
    assert ring_all_reduce_bytes(4000, 2) == 4000.0
    assert ring_all_reduce_bytes(4000, 4) == 6000.0
    assert ring_all_reduce_bytes(4000, 1) == 0.0


@pytest.mark.dist
def test_all_reduce_bytes_are_ring_formula():
    run_ranks(_all_reduce_bytes)


def _async_all_reduce(rank: int, world: int) -> None:
    meter = CommMeter()
    t = torch.full((4096,), float(rank + 1))
    work = meter.all_reduce(t, async_op=True)
    assert work is not None
    assert meter.total.calls == 1  # booked at launch
    assert work.wait() is True
    assert torch.all(t == 3.0), t
    total = meter.total
    assert total.seconds > 0, total
    assert total.bytes_sent == 2 * (world - 1) / world * 4096 * 4
    # the time is booked exactly once, however often one waits
    work.wait()
    assert meter.total.seconds == total.seconds

    # get_future() completes after the collective and after booking its time
    meter2 = CommMeter()
    t2 = torch.ones(16) * (rank + 1)
    fut = meter2.all_reduce(t2, async_op=True).get_future()
    fut.wait()
    assert torch.all(t2 == 3.0)
    assert meter2.total.seconds > 0


@pytest.mark.dist
def test_async_all_reduce_wait_and_seconds():
    run_ranks(_async_all_reduce)


def _all_gather(rank: int, world: int) -> None:
    meter = CommMeter()
    for async_op in (False, True):
        before = meter.total
        t = torch.arange(10, dtype=torch.float32) + 100 * rank
        out = torch.empty(world * 10)
        work = meter.all_gather_into_tensor(out, t, async_op=async_op)
        if async_op:
            work.wait()
        expect = torch.cat([torch.arange(10, dtype=torch.float32) + 100 * r for r in range(world)])
        assert torch.equal(out, expect), out
        delta = meter.total - before
        assert delta.bytes_sent == (world - 1) * 10 * 4, delta
        assert delta.bytes_recv == (world - 1) * 10 * 4, delta
        assert delta.calls == 1
        assert delta.seconds > 0


@pytest.mark.dist
def test_all_gather_into_tensor_bytes():
    run_ranks(_all_gather)


def _broadcast(rank: int, world: int) -> None:
    meter = CommMeter()
    t = torch.full((250,), float(rank + 7))
    meter.broadcast(t, src=0)
    assert torch.all(t == 7.0), t
    total = meter.total
    assert total.calls == 1
    assert total.bytes_sent == (world - 1) / world * 250 * 4
    assert total.bytes_recv == (world - 1) / world * 250 * 4
    t = torch.full((10,), float(rank))
    meter.broadcast(t, src=1, async_op=True).wait()
    assert torch.all(t == 1.0)
    assert meter.total.calls == 2


@pytest.mark.dist
def test_broadcast_counted():
    run_ranks(_broadcast)


def _step(rank: int, world: int) -> None:
    meter = CommMeter()
    first = meter.step()
    assert first == CommStats()  # nothing yet
    meter.all_reduce(torch.ones(100))
    meter.all_reduce(torch.ones(100))
    d1 = meter.step()
    assert d1.calls == 2 and d1.bytes_sent == 2 * 400.0 and d1.seconds > 0, d1
    # step() resets: an empty interval is all zeros
    d2 = meter.step()
    assert d2 == CommStats(), d2
    meter.all_reduce(torch.ones(50, dtype=torch.float64))
    d3 = meter.step()
    assert d3.calls == 1 and d3.bytes_sent == 400.0, d3
    # the total keeps everything
    total = meter.total
    assert total.calls == 3 and total.bytes_sent == 1200.0
    meter.record(10.0, 20.0, seconds=0.5, calls=2)
    d4 = meter.step()
    assert (d4.bytes_sent, d4.bytes_recv, d4.calls, d4.seconds) == (10.0, 20.0, 2, 0.5)
    # a meter on an explicit group counts that group's size
    group = dist.new_group([0, 1])
    gm = CommMeter(group)
    gm.all_reduce(torch.ones(8))
    assert gm.total.bytes_sent == 2 * (world - 1) / world * 32


@pytest.mark.dist
def test_step_returns_deltas_and_resets():
    run_ranks(_step)


@pytest.mark.unit
def test_as_metrics_keys():
    stats = CommStats(bytes_sent=1.0, bytes_recv=2.0, calls=3, seconds=0.25)
    metrics = stats.as_metrics()
    assert metrics == {"comm/bytes_sent": 1.0, "comm/bytes_recv": 2.0, "comm/calls": 3.0, "comm/seconds": 0.25}
    assert all(isinstance(v, float) for v in metrics.values())
    assert set(stats.as_metrics("x/")) == {"x/bytes_sent", "x/bytes_recv", "x/calls", "x/seconds"}
    assert (stats + stats) - stats == stats


def _let_go_of_the_group_under_an_async_collective(rank: int, world: int) -> None:
    group = dist.new_group(ranks=[0, 1])
    meter = CommMeter()
    if rank == 1:
        time.sleep(1.0)  # rank 0 lets go of everything while its collective still waits for this rank
    work = meter.all_reduce(torch.ones(1000), group=group, async_op=True)
    if rank == 0:
        dist.destroy_process_group(group)
        del work, group
        gc.collect()
        time.sleep(2.0)  # meanwhile rank 1 joins: the collective completes, and its callback ends, on gloo's thread
    else:
        work.wait()
        dist.destroy_process_group(group)


@pytest.mark.dist
def test_an_async_collective_does_not_keep_its_group_alive_on_the_backend_thread():
    """Were the group's last reference the work callback's, it would be freed on gloo's own thread, which then joins
    itself: ``std::system_error: Resource deadlock avoided`` aborts the rank (exit -6)."""
    run_ranks(_let_go_of_the_group_under_an_async_collective)
