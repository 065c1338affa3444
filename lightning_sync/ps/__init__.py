"""A real parameter server on torch.distributed point-to-point (c10d, gloo), with no Lightning in it.

Parts, one module per concern:

* :mod:`~lightning_sync.ps.group`: the PS process group (``W`` worker ranks, then ``k`` server ranks) built on a
  store, metered, every wait bounded by ``timeout_s``;
* :mod:`~lightning_sync.ps.sharding`: which server holds which parameter (balanced by bytes);
* :mod:`~lightning_sync.ps.optim_spec`: the worker's optimizer as a picklable recipe, rebuilt per shard;
* :mod:`~lightning_sync.ps.shard`: one server's shard state and the arithmetic of a step (no communication);
* :mod:`~lightning_sync.ps.server`: the server loop (``sync``, ``async``, ``ssp``; stop, checkpoint, stats);
* :mod:`~lightning_sync.ps.liveness`: when the server declares a silent worker lost;
* :mod:`~lightning_sync.ps.elastic`: at the end of an elastic run, which workers the servers dropped;
* ``python -m lightning_sync.ps`` (:mod:`lightning_sync.ps.__main__`): a dedicated server process;
* :mod:`~lightning_sync.ps.client`: the worker's client (init, pull, push, stop, states, stats, close), and
  :mod:`~lightning_sync.ps.reply` what the servers answer it;
* :mod:`~lightning_sync.ps.placement`: dedicated server processes or colocated server threads;
* :mod:`~lightning_sync.ps.straggler`: slowing one worker down for experiments.
"""

from lightning_sync.ps._protocol import CLIP_ALGORITHMS, Clip
from lightning_sync.ps.client import PSClient, PSReply, ServerStepOptimizer
from lightning_sync.ps.elastic import lost_workers_at_end, servers_at_end
from lightning_sync.ps.errors import PSError, PSPeerLostError, PSServerError, PSTimeoutError
from lightning_sync.ps.group import DEFAULT_PREFIX, PSGroup, claim_spare_slot, connect_store, describe, server_ps_rank
from lightning_sync.ps.optim_spec import (
    OptimizerSpec,
    build_shard_optimizer,
    current_lrs,
    optimizer_spec,
    scales_learning_rate,
)
from lightning_sync.ps.placement import (
    ColocatedServer,
    ServerProcesses,
    start_colocated_server,
    start_server_processes,
    start_servers,
)
from lightning_sync.ps.server import ParameterServer, run_server
from lightning_sync.ps.settings import MODES, PSConfig
from lightning_sync.ps.shard import ServerShard
from lightning_sync.ps.sharding import shard_by_bytes, shard_indices
from lightning_sync.ps.straggler import Straggler

__all__ = [
    "CLIP_ALGORITHMS",
    "Clip",
    "ColocatedServer",
    "DEFAULT_PREFIX",
    "MODES",
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
    "Straggler",
    "build_shard_optimizer",
    "claim_spare_slot",
    "connect_store",
    "current_lrs",
    "describe",
    "lost_workers_at_end",
    "optimizer_spec",
    "run_server",
    "scales_learning_rate",
    "server_ps_rank",
    "servers_at_end",
    "shard_by_bytes",
    "shard_indices",
    "start_colocated_server",
    "start_server_processes",
    "start_servers",
]
