"""A torch DDP communication hook that averages each bucket with a lightning_sync :class:`Compressor`.

torch's built-in hooks call torch.distributed directly, so no meter can see their traffic. This hook hands DDP's
bucket to the same compressors the other sync modes use; every byte goes through the :class:`CommMeter`. It runs on
any backend that supports the compressor's collectives, gloo included.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at run time.

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_sync.comm.compression import Compressor, FlatBucket
from lightning_sync.comm.meter import CommMeter


@dataclass
class DDPHookState:
    """State handed to :func:`compressed_allreduce_hook` by ``DistributedDataParallel.register_comm_hook``.

    Attributes:
        compressor: averages each bucket.
        meter: counts the traffic.
        group: the process group (``None``: default).
        calls: how many buckets the hook has handled (proves that the hook runs).
    """

    compressor: Compressor
    meter: CommMeter
    group: ProcessGroup | None = None
    calls: int = 0
    _layout_ids: dict[tuple, int] = field(default_factory=dict)

    def bucket_id(self, shapes: list[torch.Size]) -> int:
        """A stable id per bucket layout: DDP renumbers buckets when it rebuilds them after the first step."""
        return self._layout_ids.setdefault(tuple(tuple(s) for s in shapes), len(self._layout_ids))


def compressed_allreduce_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages one DDP gradient bucket over the group through ``state.compressor``.

    Returns:
        A future resolving to the bucket's buffer, which then holds the mean gradient (DDP copies it to ``.grad``).
    """
    state.calls += 1
    shapes = [p.shape for p in bucket.parameters()]
    buffer = bucket.buffer()
    flat = FlatBucket(index=state.bucket_id(shapes), buffer=buffer, shapes=shapes)
    return state.compressor.average(flat, state.meter, state.group)
