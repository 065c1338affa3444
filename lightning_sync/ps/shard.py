"""One server's shard and the arithmetic of a step, without communication (the loop is
:mod:`lightning_sync.ps.server`)."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lightning_sync.ps._layout import ShardLayout
from lightning_sync.ps._protocol import CLIP_NORM, CLIP_VALUE, Clip
from lightning_sync.ps.optim_spec import OptimizerSpec, build_shard_optimizer, scales_learning_rate

#: Staleness values from this one up are counted together under it (a histogram of bounded size, whatever the run).
STALENESS_CAP = 1024


class ServerShard:
    """The authoritative parameters of one shard, their optimizer, the version clock, the worker clocks and the
    staleness record.

    Args:
        params: initial values of the shard's parameters (copied to CPU; shard order).
        indices: for each, its index in the workers' ordered parameter list.
        spec: the workers' optimizer (:func:`~lightning_sync.ps.optim_spec.optimizer_spec`).
        num_workers: number of workers (size of the clocks).
        outer: (``local_steps > 1``) builds the outer optimizer over the whole shard, which steps instead of ``spec``'s.

    Raises:
        ValueError: ``params`` and ``indices`` differ in length, or ``num_workers < 1``.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        indices: Sequence[int],
        spec: OptimizerSpec,
        num_workers: int,
        outer: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer] | None = None,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers={num_workers!r} must be >= 1")
        self.indices = [int(i) for i in indices]
        self.params = [torch.nn.Parameter(p.detach().to("cpu").clone()) for p in params]
        self.layout = ShardLayout.of(self.params)
        if outer is not None:  # async local SGD: one outer optimizer over the whole shard, its own learning rate
            self.optimizers: list[torch.optim.Optimizer | None] = [outer(self.params)]
            self.group_maps: list[list[int]] = [[]]
            self.owner = [0] * len(self.params)
            self.scale_lr = [False]
        else:  # one shard optimizer per worker optimizer (None where it holds none of this shard's parameters)
            built = [build_shard_optimizer(spec, self.params, self.indices, k) for k in range(spec.num_optimizers)]
            self.optimizers = [opt for opt, _ in built]
            self.group_maps = [mirrored for _, mirrored in built]
            self.owner = [spec.owner[spec.group_of[i]] for i in self.indices]  # each shard parameter's optimizer
            self.scale_lr = [scales_learning_rate(spec, k) for k in range(spec.num_optimizers)]
        self.num_workers = num_workers
        self.version = 0
        self.clocks = [0] * num_workers
        self.staleness_counts: list[Counter[int]] = [Counter() for _ in range(num_workers)]
        self.last_staleness = [-1] * num_workers
        self._packed: torch.Tensor | None = None
        self._packed_version = -1

    def apply(
        self,
        grad: torch.Tensor,
        lrs: Sequence[float],
        optimizer: int = 0,
        clip: Clip | None = None,
        scale: float = 1.0,
    ) -> None:
        """One step of the worker's optimizer number ``optimizer`` with ``grad`` (fp32, layout order), each group at
        the learning rate in ``lrs`` of the worker group it mirrors. ``scale`` multiplies the learning rate of a
        scale-invariant optimizer (:func:`~lightning_sync.ps.optim_spec.scales_learning_rate`), else the gradient,
        after ``clip`` (``torch.nn.utils``' functions, as Lightning's). ``version`` increases by one, also when the
        shard holds none of that optimizer's parameters."""
        if grad.numel() != self.layout.numel:
            raise ValueError(f"gradient has {grad.numel()} entries, the shard {self.layout.numel}")
        if not 0 <= optimizer < len(self.optimizers):
            raise ValueError(f"optimizer {optimizer} does not exist; the worker has {len(self.optimizers)}")
        stepping = self.optimizers[optimizer]
        if stepping is not None:
            lr_scale, grad_scale = (scale, 1.0) if self.scale_lr[optimizer] else (1.0, scale)
            for group, spec_group in zip(stepping.param_groups, self.group_maps[optimizer]):
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(float(lrs[spec_group]) * lr_scale)
                else:
                    group["lr"] = float(lrs[spec_group]) * lr_scale
            for p, g in zip(self.params, self.layout.split(grad)):
                p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
            stepped = [p for p, k in zip(self.params, self.owner) if k == optimizer]
            if clip is not None and clip.algorithm == CLIP_NORM:
                torch.nn.utils.clip_grad_norm_(stepped, clip.value)
            elif clip is not None and clip.algorithm == CLIP_VALUE:
                torch.nn.utils.clip_grad_value_(stepped, clip.value)
            if grad_scale != 1.0:
                for p in stepped:
                    assert p.grad is not None  # set for every parameter above
                    p.grad.mul_(grad_scale)
            stepping.step()
            for p in self.params:
                p.grad = None
        self.version += 1

    def packed(self) -> torch.Tensor:
        """The current parameters as one byte buffer (made once per version; do not modify it)."""
        if self._packed is None or self._packed_version != self.version:
            self._packed = self.layout.pack(self.params)
            self._packed_version = self.version
        return self._packed

    def record(self, worker: int, staleness: int) -> None:
        """Books one applied push of ``worker`` with its staleness."""
        self.clocks[worker] += 1
        self.last_staleness[worker] = int(staleness)
        self.staleness_counts[worker][min(int(staleness), STALENESS_CAP)] += 1

    def state_dict(self) -> dict[str, Any]:
        """Parameters, optimizer state, version, worker clocks and the staleness record (copies, of bounded size)."""
        return {
            "indices": list(self.indices),
            "params": [p.detach().clone() for p in self.params],
            "optimizers": [None if opt is None else copy.deepcopy(opt.state_dict()) for opt in self.optimizers],
            "version": self.version,
            "clocks": list(self.clocks),
            "staleness_counts": [dict(sorted(c.items())) for c in self.staleness_counts],
            "last_staleness": list(self.last_staleness),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` in place, bit for bit (older forms too); ``ValueError`` if it is another
        shard's (other parameter indices, shapes or worker count)."""
        if list(state["indices"]) != self.indices:
            raise ValueError(f"state holds parameters {list(state['indices'])}, this shard {self.indices}")
        if len(state["clocks"]) != self.num_workers:
            raise ValueError(f"state has {len(state['clocks'])} worker clocks, this run {self.num_workers} workers")
        with torch.no_grad():
            for p, saved in zip(self.params, state["params"]):
                if saved.shape != p.shape or saved.dtype != p.dtype:
                    raise ValueError(
                        f"saved parameter {tuple(saved.shape)} {saved.dtype} vs {tuple(p.shape)} {p.dtype}"
                    )
                p.copy_(saved)
        saved = state["optimizers"] if "optimizers" in state else [state["optimizer"]]  # one optimizer, older form
        if len(saved) != len(self.optimizers):
            raise ValueError(f"state holds {len(saved)} optimizers, this run {len(self.optimizers)}")
        for opt, opt_state in zip(self.optimizers, saved):
            if opt is not None:
                opt.load_state_dict(copy.deepcopy(opt_state))
        self.version = int(state["version"])
        self.clocks = [int(c) for c in state["clocks"]]
        if "staleness_history" in state:  # older form: every value
            history = state["staleness_history"]
            self.staleness_counts = [Counter(min(int(s), STALENESS_CAP) for s in h) for h in history]
            self.last_staleness = [int(h[-1]) if h else -1 for h in history]
        else:
            self.staleness_counts = [Counter({int(s): int(n) for s, n in c.items()}) for c in state["staleness_counts"]]
            self.last_staleness = [int(s) for s in state["last_staleness"]]
        self._packed = None

    def stats(self) -> dict[str, Any]:
        """Version, clocks, and per worker the last staleness (``-1`` before its first push) and a histogram
        ``{staleness: pushes}`` in increasing staleness (:data:`STALENESS_CAP` counts that value and all above)."""
        return {
            "version": self.version,
            "clocks": list(self.clocks),
            "last_staleness": list(self.last_staleness),
            "staleness_histogram": [dict(sorted(c.items())) for c in self.staleness_counts],
        }
