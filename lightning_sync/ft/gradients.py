"""Per-step gradient sync across replica groups (the ``allreduce`` strategy's fault tolerance), on torchft.

Nothing here knows of Lightning: :func:`average_gradients_across` runs after a step's gradients were averaged inside
the replica group and before the optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from lightning_sync.comm.nonfinite import drop_grads
from lightning_sync.ft.replica import ReplicaGroupLink


def average_gradients_across(link: ReplicaGroupLink, params: Sequence[nn.Parameter]) -> bool:
    """One torchft step of the ``allreduce`` strategy: a quorum (a group behind heals here), the gradients (already
    averaged inside the group; a missing one counts as zeros) averaged over the quorum's groups in one flat buffer,
    and torchft's vote. Not committed: the gradients are dropped, so the optimizer step leaves the parameters and
    its state alone.

    Returns:
        Whether the step is committed.
    """
    link.start()
    trainable = [p for p in params if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in trainable]
    flat = torch.cat([g.detach().reshape(-1) for g in grads]) if grads else torch.zeros(0)
    link.average_([flat])
    committed = link.commit()
    if not committed:
        drop_grads(trainable)
        return False
    offset = 0
    with torch.no_grad():
        for p, g in zip(trainable, grads):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).to(g.dtype)
            offset += n
    return True
