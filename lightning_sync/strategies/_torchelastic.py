"""Restarts under torchrun (``--max-restarts``): each attempt joins its process group through its own store keys."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def join_restarted_torchelastic_group(strategy: Any) -> None:
    """After a torchrun restart, joins the default process group through a store prefixed by the restart count.

    The failure it handles: torchrun's workers share the agent's TCPStore (``TORCHELASTIC_USE_AGENT_STORE``), and
    with the c10d rendezvous (``--standalone``) that store outlives a restart, under the same keys: a restarted rank
    reads a peer's address from the failed attempt and gloo fails connecting to it ("Gloo connectFullMesh failed ...
    timed out connecting: Connection refused"), so ``--max-restarts`` never recovers. This is torch's issue #135712
    (https://github.com/pytorch/pytorch/issues/135712, sharing the rendezvous store breaks torchelastic restarts;
    its workaround, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, must be set for torchrun, out of a library's reach).
    ``tests/test_restart.py`` fails that way without this function. A prefix per attempt keeps each attempt's keys
    apart; Lightning's own ``init_process_group`` then sees the group initialised and leaves it.

    Args:
        strategy: a lightning_sync strategy whose world ranks are set (``set_world_ranks``).
    """
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restarts == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return
    env = strategy.cluster_environment
    timeout = timedelta(seconds=strategy.config.timeout_s)
    store = dist.TCPStore(env.main_address, env.main_port, is_master=False, timeout=timeout)
    dist.init_process_group(
        dist.get_default_backend_for_device(strategy.root_device),
        store=dist.PrefixStore(f"lightning_sync/restart_{restarts}", store),
        rank=strategy.global_rank,
        world_size=strategy.world_size,
        timeout=timeout,
    )
