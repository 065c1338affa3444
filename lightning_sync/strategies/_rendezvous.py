"""How a strategy's ranks join the default process group: they meet within :func:`rendezvous_timeout_s`, and every
wait after that is bounded by ``timeout_s``."""

from __future__ import annotations

import atexit
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_sync.comm.peer_errors import rendezvous_timeout_s


def join_default_group(strategy: Any) -> None:
    """Joins the default process group through a ``TCPStore`` that waits :func:`rendezvous_timeout_s` for the ranks
    and then ``timeout_s`` for any key; the group's collectives wait ``timeout_s``. Lightning then leaves the group.

    Under torchrun the agent's store outlives a restart, so each attempt's keys are prefixed by its restart count: a
    restarted rank would otherwise read a peer's address from the failed attempt ("Gloo connectFullMesh failed",
    torch issue #135712; ``tests/test_restart.py``).

    Args:
        strategy: a lightning_sync strategy whose world ranks are set (``set_world_ranks``).
    """
    if dist.is_initialized():
        return
    env, timeout_s = strategy.cluster_environment, strategy.config.timeout_s
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        env.main_address,
        env.main_port,
        strategy.world_size,
        is_master=strategy.global_rank == 0 and not agent_store,
        timeout=timedelta(seconds=rendezvous_timeout_s(timeout_s)),
        wait_for_workers=True,
        multi_tenant=True,  # as torch's env:// rendezvous: other stores of this process may share the port
    )
    store.set_timeout(timedelta(seconds=timeout_s))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = env.main_address, str(env.main_port)  # as Lightning does
    device = strategy.root_device
    backend = strategy.process_group_backend or dist.get_default_backend_for_device(device)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"lightning_sync/attempt_{attempt}", store),
        rank=strategy.global_rank,
        world_size=strategy.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=None if device.type == "cpu" else device,
    )
    if backend == "nccl":  # as Lightning does: torch warns at exit about an NCCL group left alive
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
