"""A real parameter server on torch.distributed point-to-point (c10d, gloo), with no Lightning in it.

One module per concern: :mod:`~lightning_sync.ps.group` (the PS process group of ``W`` worker and ``k`` server ranks,
every wait bounded), :mod:`~lightning_sync.ps.client` (the worker's side, and which server holds which parameter),
:mod:`~lightning_sync.ps.server` and :mod:`~lightning_sync.ps.shard` (the server loop, which declares a silent worker
lost, and the arithmetic of a step), :mod:`~lightning_sync.ps.optim_spec` (the worker's optimizer as a picklable
recipe), :mod:`~lightning_sync.ps.elastic` (lost workers), :mod:`~lightning_sync.ps.placement` (dedicated processes,
``python -m lightning_sync.ps``, or colocated threads).
"""

from lightning_sync.ps._protocol import CLIP_ALGORITHMS, Clip
from lightning_sync.ps.client import PSClient, PSReply, ServerStepOptimizer, shard_by_bytes
from lightning_sync.ps.elastic import servers_at_end
from lightning_sync.ps.errors import PSError, PSPeerLostError, PSServerError, PSTimeoutError
from lightning_sync.ps.group import PSGroup, claim_spare_slot, connect_store
from lightning_sync.ps.optim_spec import (
    OptimizerSpec,
    build_shard_optimizer,
    current_lrs,
    optimizer_spec,
    scales_learning_rate,
)
from lightning_sync.ps.placement import ColocatedServer, ServerProcesses, start_servers
from lightning_sync.ps.server import ParameterServer, run_server
from lightning_sync.ps.settings import PSConfig
from lightning_sync.ps.shard import ServerShard

__all__ = [
    "CLIP_ALGORITHMS",
    "Clip",
    "ColocatedServer",
    "OptimizerSpec",
    "PSClient",
    "PSConfig",
    "PSError",
    "PSGroup",
    "PSPeerLostError",
    "PSReply",
    "PSServerError",
    "PSTimeoutError",
    "ParameterServer",
    "ServerProcesses",
    "ServerShard",
    "ServerStepOptimizer",
    "build_shard_optimizer",
    "claim_spare_slot",
    "connect_store",
    "current_lrs",
    "optimizer_spec",
    "run_server",
    "scales_learning_rate",
    "servers_at_end",
    "shard_by_bytes",
    "start_servers",
]
