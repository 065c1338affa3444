"""The configs of the per-step gradient strategies: DDP with its communication hooks, and our all-reduce."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_sync.config.common import GradientSyncKnobs, StrategyConfig
from lightning_sync.config.knobs import knob
from lightning_sync.errors import check_range


@dataclass
class DDPConfig(StrategyConfig):
    """The ``ddp`` strategy: torch DistributedDataParallel, with comm hooks that also run on CPU/gloo."""

    comm_hook: Any = knob(
        "none",
        """DDP communication hook: the codec each bucket is averaged with, an object or a registry name (``none``: a
        plain all-reduce, ``fp16``, ``bf16``, ``powersgd``, ``topk``, ...); registered on gloo as well as NCCL, and
        metered.""",
    )
    bucket_cap_mb: float = knob(25.0, """DDP gradient bucket size in MiB.""")
    find_unused_parameters: bool = knob(
        False,
        "Let DDP tolerate parameters that get no gradient in a step (costs a graph traversal per step).",
    )
    gradient_as_bucket_view: bool = knob(
        False,
        "Make ``param.grad`` views into DDP's buckets (saves one copy and the memory of one gradient).",
    )
    static_graph: bool = knob(False, """Promise DDP the graph and the set of used parameters never change.""")
    broadcast_buffers: bool = knob(True, """Broadcast rank 0's buffers (e.g. BatchNorm statistics) at every forward.""")

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("bucket_cap_mb", self.bucket_cap_mb, low=0, low_open=True)


@dataclass
class AllReduceConfig(GradientSyncKnobs, StrategyConfig):
    """The ``allreduce`` strategy: no DDP wrapper; gradients bucketed and all-reduced by hand."""

    broadcast_buffers: bool = knob(
        True,
        "Broadcast rank 0's buffers (e.g. BatchNorm statistics) before every training step, as DDP does.",
    )
    fault_tolerance: Any = knob(
        None,
        """Fault tolerance across replica groups, on torchft (the ``lightning-sync[ft]`` extra): a
        ``lightning_sync.ft.FaultTolerance``, or a mapping of its fields. This run is then one replica group; each
        step's gradients, averaged inside the group, are also averaged over the groups of a torchft quorum, and a
        step whose sync failed is not committed (its gradients are dropped). ``None``: off.""",
    )
