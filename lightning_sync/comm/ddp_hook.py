"""A torch DDP communication hook that averages each bucket with a lightning_sync :class:`Compressor`.

torch's built-in hooks call torch.distributed directly, where no meter sees their traffic; this one hands DDP's
bucket to the compressors the other sync modes use, through the :class:`CommMeter`.
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

    Compressor memory is kept per bucket index, so a bucket's index comes from its parameter objects, in the order
    buckets are first seen: not from its shapes (repeated blocks would share one memory), nor from
    ``GradBucket.index()`` (DDP's first step reduces the whole model as bucket 0, then rebuilds the buckets).

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
    _bucket_ids: dict[tuple[int, ...], int] = field(default_factory=dict)

    def bucket_id(self, parameters: list[torch.Tensor]) -> int:
        """A stable index for the bucket holding ``parameters`` (the module's own objects), keyed by their ``id``."""
        key = tuple(id(p) for p in parameters)
        return self._bucket_ids.setdefault(key, len(self._bucket_ids))


def compressed_allreduce_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages one DDP gradient bucket over the group through ``state.compressor``.

    Returns:
        A future resolving to the bucket's buffer, which then holds the mean gradient (DDP copies it to ``.grad``).
    """
    state.calls += 1
    parameters = bucket.parameters()
    flat = FlatBucket(state.bucket_id(parameters), bucket.buffer(), [p.shape for p in parameters])
    return state.compressor.average(flat, state.meter, state.group)
