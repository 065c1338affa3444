"""Skipping an optimizer step whose gradients hold a NaN or an Inf, on every rank together.

After a gradient all-reduce a NaN or Inf on any rank reaches every rank's averaged gradients, so each rank decides
alone and all decide the same, with no extra collective; where a mode steps without syncing (local SGD's local
steps) a rank skips its own step alone. Skipping drops the gradients (``param.grad = None``), which PyTorch's
optimizers leave untouched; with AMP's ``GradScaler`` nothing is dropped (the scaler skips the step itself). Every
skipped step is said out loud, as a :class:`NonFiniteStepWarning`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class NonFiniteStepWarning(UserWarning):
    """An optimizer step was skipped because its gradients held a NaN or an Inf (``skip_nonfinite``)."""


def skipped_step_message(mode: str, step: int, rank: int | None = None) -> str:
    """The warning for one skipped step.

    Args:
        mode: the sync mode that skipped it (``allreduce``, ``periodic (local_sgd)``, ``ps (async)``, ...).
        step: the trainer's ``global_step`` at the skipped step (the number of optimizer steps before it).
        rank: the rank that skipped it alone; ``None`` when every rank skipped it together.
    """
    who = "every rank" if rank is None else f"rank {rank} alone"
    return (
        f"lightning_sync {mode}: skipped the optimizer step at global_step={step} on {who}: its gradients hold a NaN "
        "or an Inf (skip_nonfinite=True), so the parameters and optimizer state stay as they were"
    )


def grads_are_finite(params: Iterable[torch.Tensor]) -> bool:
    """Whether every gradient of ``params`` is free of NaN and Inf (see :func:`all_finite`)."""
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel() > 0]
    return all_finite([probe(g) for g in grads], grads)


def probe(tensor: torch.Tensor) -> torch.Tensor:
    """The float32 sum of a non-empty tensor (one pass, half an ``aminmax``'s time on a CPU): non-finite when an
    entry is, and also, rarely, when finite entries sum past float32's range (:func:`all_finite` tells them apart)."""
    return tensor.detach().sum(dtype=torch.float32)


def all_finite(probes: list[torch.Tensor], tensors: Iterable[torch.Tensor]) -> bool:
    """Whether ``tensors`` hold no NaN and no Inf, given their :func:`probe` (one host sync; ``True`` for none):
    every probe finite, or else every tensor's ``aminmax`` finite (exact, so a large finite gradient passes)."""
    if not probes or bool(torch.stack(probes).isfinite().all()):
        return True
    return bool(torch.stack([torch.stack(torch.aminmax(t.detach())) for t in tensors]).isfinite().all())


def drop_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Drops the gradients of ``params``, so that an optimizer step leaves them (and its state for them) alone."""
    for p in params:
        p.grad = None


def zero_nonfinite_(tensors: Iterable[torch.Tensor]) -> None:
    """Sets the NaN and Inf entries of ``tensors`` to zero, in place (for compressor memory after a skipped step)."""
    for tensor in tensors:
        torch.nan_to_num_(tensor, nan=0.0, posinf=0.0, neginf=0.0)
