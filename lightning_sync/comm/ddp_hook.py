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

    Compressor memory is kept per bucket index, so each bucket needs an index that stays the same from step to step.
    It is derived from the bucket's parameter objects, in order: not from its shapes (repeated blocks give buckets
    of identical shapes, which would share one error-feedback state), nor from ``GradBucket.index()`` (DDP reduces
    the whole model as bucket 0 in the first step, then rebuilds the buckets, so index 0 names two buckets).
    Indices are handed out in the order buckets are first seen, which DDP's launch order makes the same in every run
    of the same model, a resumed one included.

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
        """A stable index for the bucket holding ``parameters``, keyed by their ``id`` (DDP hands the hook the
        module's own parameter objects, so an ``id`` is not reused while the hook is registered)."""
        key = tuple(id(p) for p in parameters)
        return self._bucket_ids.setdefault(key, len(self._bucket_ids))

    @property
    def num_buckets(self) -> int:
        """How many distinct buckets the hook has seen (the first step's layout and the rebuilt one)."""
        return len(self._bucket_ids)


def compressed_allreduce_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Averages one DDP gradient bucket over the group through ``state.compressor``.

    Returns:
        A future resolving to the bucket's buffer, which then holds the mean gradient (DDP copies it to ``.grad``).
    """
    state.calls += 1
    parameters = bucket.parameters()
    shapes = [p.shape for p in parameters]
    buffer = bucket.buffer()
    flat = FlatBucket(index=state.bucket_id(parameters), buffer=buffer, shapes=shapes)
    return state.compressor.average(flat, state.meter, state.group)
