"""How a strategy's ranks meet (``strategies/_base.py``'s ``join_default_group``): a short ``timeout_s`` bounds every
wait once they have met, not the meeting itself, where a rank may still be importing torch and Lightning."""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"

import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from lightning.fabric.plugins.environments import LightningEnvironment  # noqa: E402

from lightning_sync.apps.bench.launch import free_port  # noqa: E402
from lightning_sync.comm.peer_errors import rendezvous_timeout_s  # noqa: E402
from lightning_sync.strategies._base import join_default_group  # noqa: E402

TIMEOUT_S = 1.0
LATE_S = 4.0  # how late rank 1 comes: past timeout_s, well within the rendezvous' bound


def _rank(rank: int, port: int, errors: mp.SimpleQueue) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank))
        env = LightningEnvironment()
        env.set_world_size(2)
        env.set_global_rank(rank)
        strategy = SimpleNamespace(
            cluster_environment=env,
            config=SimpleNamespace(timeout_s=TIMEOUT_S),
            world_size=2,
            global_rank=rank,
            root_device=torch.device("cpu"),
            process_group_backend="gloo",
        )
        if rank == 1:
            time.sleep(LATE_S)  # the injected lateness: a rank still importing
        join_default_group(strategy)
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        assert t.item() == 3.0
        store = dist.distributed_c10d._get_default_store()
        start = time.monotonic()
        with pytest.raises(dist.DistStoreError):  # a key nobody sets: the wait is timeout_s, not the rendezvous'
            store.get(f"never_set_{rank}")
        assert time.monotonic() - start < rendezvous_timeout_s(TIMEOUT_S) / 2
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as error:  # reported to the test process
        errors.put(f"rank {rank}: {error!r}")
        raise


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_a_rank_later_than_timeout_s_still_joins_and_later_waits_are_timeout_s():
    """Rank 1 reaches the rendezvous 4 s after rank 0 with ``timeout_s=1``: both join and all-reduce (with the
    rendezvous bounded by ``timeout_s``, rank 0 fails after 1 s, "1/2 clients joined"); a store wait after it still
    ends after about ``timeout_s``."""
    assert rendezvous_timeout_s(TIMEOUT_S) > LATE_S * 5
    port = free_port()  # below the ephemeral range: another test's connection cannot take it meanwhile
    ctx = mp.get_context("fork")
    errors = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(rank, port, errors)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    for p in procs:
        if p.is_alive():
            p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, failures
    assert [p.exitcode for p in procs] == [0, 0]
