"""The ``periodic`` sync mode: communicate every N steps instead of every step.

Three algorithms (``strategy.mode``), all built on :class:`~lightning_sync.strategies.allreduce.AllReduceStrategy`
(no DDP wrapper; rank 0's state broadcast at setup) and on the Lightning-free :mod:`lightning_sync.comm.averaging`
and :mod:`lightning_sync.comm.adaptive`.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from typing_extensions import override

from lightning_sync.comm.adaptive import AdaptivePeriod, agree_max
from lightning_sync.comm.averaging import (
    ModelAverager,
    average_buffers,
    average_optimizer_state,
    make_outer_optimizer,
    match_module_policy,
    validate_module_policy,
)
from lightning_sync.comm.consistency import ReplicaMismatchError, replica_fingerprint_spread
from lightning_sync.config import ConfigError, PeriodicConfig
from lightning_sync.strategies.allreduce import AllReduceStrategy

DEFAULT_GROUP = "*"


@dataclass
class SyncGroup:
    """Parameters (and buffers) that are synced together, with their own period and global copy.

    Attributes:
        label: the ``module_sync_every`` pattern, or ``"*"`` for the parameters no pattern matches.
        period: a fixed period, or ``None`` for the default group (which follows ``sync_every``, maybe adaptive).
        names: the parameter names, in order.
        params: the parameters (those with ``requires_grad``).
        buffers: the module buffers synced with this group.
        averager: the global copy and the averaging.
        outer: DiLoCo's outer optimizer over ``averager.anchors`` (``None`` in other modes).
        since_sync: local optimizer steps since this group was last synced.
        syncs: how many times this group was synced.
    """

    label: str
    period: Optional[int]
    names: list[str]
    params: list[nn.Parameter]
    buffers: list[Tensor]
    averager: ModelAverager
    outer: Optional[torch.optim.Optimizer] = None
    since_sync: int = 0
    syncs: int = field(default=0)


class PeriodicSyncStrategy(AllReduceStrategy):
    """Data parallel that communicates every ``sync_every`` steps.

    ``mode="gradient"``: periodic gradient accumulation
        Each rank accumulates local gradients for ``sync_every`` micro-batches without communicating, then one
        bucketed all-reduce (the :class:`~lightning_sync.comm.bucketing.GradientSynchronizer` of
        :class:`AllReduceStrategy`) and one optimizer step. Combined with the Trainer's own
        ``accumulate_grad_batches=A``, the effective period is ``A * sync_every`` micro-batches: the strategy sets
        ``trainer.accumulate_grad_batches = A * sync_every`` for the duration of ``fit`` (and restores it at
        teardown), so the run is exactly Lightning DDP with ``accumulate_grad_batches=A * sync_every`` (loss divided
        by ``A * sync_every``; the last batch of an epoch steps with what it has; ``global_step``, ``max_steps``,
        step-interval LR schedulers and ``estimated_stepping_batches`` count real optimizer steps) while sending
        ``1/(A * sync_every)`` of per-micro-batch DDP's bytes. Lightning's ``handles_gradient_accumulation`` is
        deliberately not used: with it the loop would call ``optimizer_zero_grad`` on every micro-batch (wiping the
        accumulation), count every micro-batch as a global step and step LR schedulers per micro-batch. Requires
        automatic optimization, and cannot be combined with a ``GradientAccumulationScheduler`` callback (both are
        a :class:`~lightning_sync.config.ConfigError` at setup). Buffers (BatchNorm statistics) are averaged at
        every sync instead of broadcast from rank 0 at every forward, so nothing is sent between syncs.

    ``mode="local_sgd"``: local SGD / post-local SGD
        Every rank steps its own optimizer on every step; every ``sync_every`` steps the parameters and buffers are
        averaged (optionally also the floating optimizer state, ``average_optimizer_state``). The first
        ``warmup_steps`` steps all-reduce gradients every step, as DDP. With ``sync_every=1`` and plain SGD this
        equals DDP (up to rounding).

    ``mode="diloco"``: DiLoCo
        The LightningModule's optimizer is the inner optimizer. Every ``sync_every`` steps the averaged
        pseudo-gradient ``global - local`` is applied to the global copy by an outer SGD (``outer_lr``,
        ``outer_momentum``, ``outer_nesterov``; default Nesterov, lr 0.7, momentum 0.9) and every replica loads the
        result. The global copy and the outer optimizer state are part of :meth:`sync_state_dict` (checkpoints).

    A *step* in ``local_sgd``/``diloco`` is one optimizer step (one call of ``optimizer.step`` through the strategy;
    with ``accumulate_grad_batches=A`` that is every ``A`` micro-batches, which accumulate locally). Parameters and
    pseudo-gradients travel as deltas from the global copy through the configured ``compression``; buffers and
    optimizer state are averaged exactly. At the end of ``fit`` every group with unsynced steps is synced once more,
    so the model returned (and tested) is the common one. Between syncs each rank validates its own replica.

    ``sync_every="auto"`` (``local_sgd``/``diloco``): after each sync of the default group the ranks all-reduce (MAX)
    the measured compute seconds per step and the communication seconds of that sync (meter seconds), and every
    rank picks the same period with :class:`~lightning_sync.comm.adaptive.AdaptivePeriod` (target
    ``target_comm_fraction``, clamped to ``[min_sync_every, max_sync_every]``, starting at ``min_sync_every``).

    ``module_sync_every`` (``local_sgd``/``diloco``): ``{glob pattern: period}``; patterns are :mod:`fnmatch` globs
    (case-sensitive, ``*`` also crosses dots) on the LightningModule's full parameter names (``net.4.weight``).
    Each pattern's parameters (and the buffers whose names it matches) form a group with its own period, global
    copy, compressor and outer optimizer; everything else follows ``sync_every``. Types and periods are checked at
    construction; a pattern matching no parameter or a parameter matched twice is a ConfigError at setup (before
    training). :func:`~lightning_sync.comm.averaging.validate_module_policy` runs the same check on a model before
    any process starts.

    Logged through the LightningModule, per optimizer step: ``sync/period`` at the first step, whenever it changes
    and at every sync; ``sync/divergence`` = ``||this rank's params - averaged params||`` at every sync (over the
    groups synced, measured before the replicas are overwritten). In ``gradient`` mode every step is a sync.

    Args:
        **kwargs: the fields of :class:`~lightning_sync.config.PeriodicConfig` and Lightning's own strategy
            arguments.
    """

    config_class = PeriodicConfig
    strategy_name = "sync_periodic"
    config: PeriodicConfig

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        cfg = self.config
        self.groups: list[SyncGroup] = []
        self.adaptive: Optional[AdaptivePeriod] = None
        if cfg.sync_every == "auto":
            self.adaptive = AdaptivePeriod(cfg.target_comm_fraction, cfg.min_sync_every, cfg.max_sync_every)
        self.local_steps = 0
        self.last_synced: list[SyncGroup] = []
        self.last_divergence: Optional[float] = None
        self._logged_period: Optional[int] = None
        self._all_buffers: list[Tensor] = []
        self._accumulating_trainer: Optional[pl.Trainer] = None
        self._user_accumulate: Optional[int] = None
        self._window_start: Optional[float] = None
        self._window_comm_start = 0.0
        self._compute_seconds = 0.0
        self._compute_steps = 0

    # ------------------------------------------------------------------ periods
    @property
    def period(self) -> int:
        """The current period of the default group (micro-batches per sync in ``gradient`` mode)."""
        if self.adaptive is not None:
            return self.adaptive.period
        return int(self.config.sync_every)

    def group_period(self, group: SyncGroup) -> int:
        return self.period if group.period is None else group.period

    @property
    def in_warmup(self) -> bool:
        """Whether the next optimizer step all-reduces gradients (``local_sgd``/``diloco`` warmup)."""
        return self.config.mode != "gradient" and self.local_steps < self.config.warmup_steps

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """In ``gradient`` mode, multiplies the Trainer's ``accumulate_grad_batches`` by ``sync_every`` (for fit)."""
        if self.config.mode == "gradient" and trainer.state.fn == TrainerFn.FITTING:
            self._apply_accumulation(trainer)
        super().setup(trainer)

    def _apply_accumulation(self, trainer: pl.Trainer) -> None:
        module = trainer.lightning_module
        if module is not None and not module.automatic_optimization:
            raise ConfigError(
                "strategy.mode='gradient' is not allowed with manual optimization (Lightning does not accumulate "
                "there); accumulate in training_step yourself, or use mode local_sgd or diloco"
            )
        if any(isinstance(cb, GradientAccumulationScheduler) for cb in trainer.callbacks):
            raise ConfigError(
                "strategy.mode='gradient' is not allowed with a GradientAccumulationScheduler callback; set the "
                "period with strategy.sync_every (effective period = accumulate_grad_batches * sync_every)"
            )
        if self._user_accumulate is None:
            self._user_accumulate = int(trainer.accumulate_grad_batches)
            self._accumulating_trainer = trainer
            trainer.accumulate_grad_batches = self._user_accumulate * int(self.config.sync_every)

    @override
    def configure_ddp(self) -> None:
        """Broadcasts rank 0's state, builds the gradient synchronizer (``gradient`` mode, warmup) and the groups.

        Raises:
            ConfigError: ``module_sync_every`` has a pattern that matches no parameter, or a parameter matched by
                two patterns.
        """
        self._broadcast_rank0_state()
        cfg = self.config
        self._all_buffers = list(self.model.buffers())
        if cfg.mode == "gradient" or cfg.warmup_steps > 0:
            self.synchronizer = cfg.build_synchronizer(self.model.parameters(), self.meter)
        if cfg.mode != "gradient":
            self.groups = self._build_groups(self.model)

    def validate_model(self, model: nn.Module) -> dict[str, int]:
        """Checks ``module_sync_every`` against ``model`` (e.g. in the launching process, before ranks start).

        Returns:
            ``{parameter name: period}`` for the parameters a pattern matches.

        Raises:
            ConfigError: a pattern matching no parameter, or a parameter matched by two patterns.
        """
        return validate_module_policy(model, self.config.module_sync_every)

    def _build_groups(self, model: nn.Module) -> list[SyncGroup]:
        cfg = self.config
        assert self.meter is not None
        policy = cfg.module_sync_every or {}
        named = list(model.named_parameters())
        validate_module_policy([name for name, _ in named], cfg.module_sync_every)
        param_pattern = match_module_policy([name for name, _ in named], policy)
        named_buffers = list(model.named_buffers())
        buffer_pattern = match_module_policy([name for name, _ in named_buffers], policy, what="buffer")
        labels: list[tuple[str, Optional[int]]] = [(DEFAULT_GROUP, None)] + [(p, n) for p, n in policy.items()]
        groups = []
        for label, period in labels:
            names = [n for n, p in named if p.requires_grad and param_pattern.get(n, DEFAULT_GROUP) == label]
            params = [p for n, p in named if p.requires_grad and param_pattern.get(n, DEFAULT_GROUP) == label]
            buffers = [b for n, b in named_buffers if buffer_pattern.get(n, DEFAULT_GROUP) == label]
            averager = ModelAverager(
                params, cfg.build_compressor(cfg.compression), self.meter, bucket_cap_mb=cfg.bucket_cap_mb
            )
            outer = None
            if cfg.mode == "diloco" and averager.anchors:
                outer = make_outer_optimizer(averager, cfg.outer_lr, cfg.outer_momentum, cfg.outer_nesterov)
            groups.append(SyncGroup(label, period, names, params, buffers, averager, outer))
        return groups

    # ------------------------------------------------------------------ per-step hooks
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the step without broadcasting buffers (they are averaged at each sync instead)."""
        return super(AllReduceStrategy, self).training_step(*args, **kwargs)

    @override
    def pre_backward(self, closure_loss: Tensor) -> None:
        """Opens a gradient sync round only in ``gradient`` mode and during warmup (never for local steps)."""
        if self.synchronizer is not None and (self.config.mode == "gradient" or self.in_warmup):
            self.synchronizer.start_round()

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Starts timing the compute of the current optimizer step (for ``sync_every: auto``)."""
        super().on_train_batch_start(batch, batch_idx)
        if self._window_start is None:
            self._window_start = time.perf_counter()
            self._window_comm_start = self.meter.total.seconds if self.meter is not None else 0.0

    @override
    def on_sync_step_end(self) -> None:
        """After every optimizer step: buffers in ``gradient`` mode/warmup, else the groups that are due."""
        grad_synced = self._synced
        super().on_sync_step_end()
        self.local_steps += 1
        self.last_synced = []
        self.last_divergence = None
        self._measure_compute()
        cfg = self.config
        if cfg.mode == "gradient" or self.local_steps <= cfg.warmup_steps:
            if grad_synced or cfg.mode != "gradient":
                average_buffers(self._all_buffers, self.meter)
            if cfg.mode != "gradient" and self.local_steps == cfg.warmup_steps:
                for group in self.groups:  # replicas are identical after a synced step: start the local phase
                    group.averager.reset_anchor_()
                    group.since_sync = 0
            self._log_sync()
            return
        due = []
        for group in self.groups:
            group.since_sync += 1
            if group.since_sync >= self.group_period(group):
                due.append(group)
        if due:
            self.sync_groups(due)
        self._log_sync()

    def _measure_compute(self) -> None:
        if self._window_start is None:
            return
        comm = (self.meter.total.seconds if self.meter is not None else 0.0) - self._window_comm_start
        self._compute_seconds += max(time.perf_counter() - self._window_start - comm, 0.0)
        self._compute_steps += 1
        self._window_start = None

    def sync_groups(self, groups: list[SyncGroup]) -> float:
        """Syncs ``groups`` now (every rank must call it with the same groups, in the same order).

        Returns:
            This rank's divergence ``||params - average||`` over the groups' parameters, at sync time.
        """
        assert self.meter is not None
        cfg = self.config
        comm_start = self.meter.total.seconds
        squared = []
        for group in groups:
            if cfg.mode == "diloco":
                squared.append(group.averager.outer_step_(group.outer) if group.outer is not None else 0.0)
            else:
                squared.append(group.averager.average_())
            group.since_sync = 0
            group.syncs += 1
        buffers = [b for group in groups for b in group.buffers]
        if buffers:
            average_buffers(buffers, self.meter)
        if cfg.average_optimizer_state:
            average_optimizer_state(self.optimizers, [p for group in groups for p in group.params], self.meter)
        self.last_synced = list(groups)
        self.last_divergence = math.sqrt(sum(squared))
        if self.adaptive is not None and any(group.label == DEFAULT_GROUP for group in groups):
            self._adapt(self.meter.total.seconds - comm_start)
        return self.last_divergence

    def _adapt(self, comm_seconds: float) -> None:
        """Chooses the next period from the slowest rank's measurements (identical on every rank)."""
        assert self.adaptive is not None and self.meter is not None
        compute = self._compute_seconds / self._compute_steps if self._compute_steps else 0.0
        compute, comm = agree_max([compute, comm_seconds], self.meter)
        self.adaptive.update(compute, comm)
        self._compute_seconds = 0.0
        self._compute_steps = 0

    def _log_sync(self) -> None:
        """Logs ``sync/period`` when it changes and at every sync, and ``sync/divergence`` at every sync.

        (Not every step: each logged key costs Lightning a few milliseconds, as much as a small model's step.)
        """
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is None or module._current_fx_name is None:
            return
        metrics = {}
        period = self.period
        if period != self._logged_period or self.last_divergence is not None:
            metrics["sync/period"] = float(period)
            self._logged_period = period
        if self.last_divergence is not None:
            metrics["sync/divergence"] = self.last_divergence
        if metrics:
            module.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=False)

    @override
    def on_train_end(self) -> None:
        """Syncs every group that has unsynced local steps, so all ranks end with the common model."""
        super().on_train_end()
        if self.config.mode == "gradient" or self.local_steps <= self.config.warmup_steps:
            return
        pending = [group for group in self.groups if group.since_sync > 0]
        if pending:
            self.sync_groups(pending)

    # ------------------------------------------------------------------ replica consistency
    @override
    def check_replicas(self, atol: float = 0.0) -> float:
        """Checks what must be identical now: everything after a gradient-synced step, else the groups just synced.

        Returns 0.0 (and checks nothing) after a purely local step, where replicas legitimately differ.
        """
        cfg = self.config
        if cfg.mode == "gradient" or self.local_steps <= cfg.warmup_steps:
            return super().check_replicas(atol)
        tensors = [p for group in self.last_synced for p in group.params]
        tensors += [b for group in self.last_synced for b in group.buffers if b.is_floating_point()]
        if not tensors:
            return 0.0
        spread = replica_fingerprint_spread(tensors)
        if spread > atol:
            raise ReplicaMismatchError(
                f"replicas differ right after syncing {[g.label for g in self.last_synced]} at step "
                f"{self.local_steps}: fingerprint spread {spread:.3e} > {atol}"
            )
        return spread

    # ------------------------------------------------------------------ checkpoint
    @override
    def sync_state_dict(self) -> dict[str, Any]:
        """Adds step counters, each group's global copy, compressor memory and outer optimizer, and the period."""
        state = super().sync_state_dict()
        state["periodic"] = {
            "mode": self.config.mode,
            "local_steps": self.local_steps,
            "groups": [
                {
                    "label": group.label,
                    "since_sync": group.since_sync,
                    "syncs": group.syncs,
                    "averager": group.averager.state_dict(),
                    "outer": copy.deepcopy(group.outer.state_dict()) if group.outer is not None else None,
                }
                for group in self.groups
            ],
            "adaptive": self.adaptive.state_dict() if self.adaptive is not None else None,
        }
        return state

    @override
    def load_sync_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what :meth:`sync_state_dict` saved (the groups must have the same labels and sizes)."""
        super().load_sync_state_dict(state)
        saved = state.get("periodic")
        if saved is None:
            return
        if saved["mode"] != self.config.mode:
            raise ValueError(f"checkpoint was saved with mode {saved['mode']!r}, this run uses {self.config.mode!r}")
        self.local_steps = int(saved["local_steps"])
        if self.adaptive is not None and saved.get("adaptive") is not None:
            self.adaptive.load_state_dict(saved["adaptive"])
        if not self.groups:
            return
        labels = [g["label"] for g in saved["groups"]]
        if labels != [group.label for group in self.groups]:
            raise ValueError(
                f"checkpoint has sync groups {labels}, this run has {[g.label for g in self.groups]}; resume with "
                "the same module_sync_every"
            )
        for group, saved_group in zip(self.groups, saved["groups"]):
            group.since_sync = int(saved_group["since_sync"])
            group.syncs = int(saved_group["syncs"])
            group.averager.load_state_dict(saved_group["averager"])
            if group.outer is not None and saved_group["outer"] is not None:
                group.outer.load_state_dict(saved_group["outer"])

    @override
    def teardown(self) -> None:
        """Restores the Trainer's ``accumulate_grad_batches`` (``gradient`` mode), then tears down as usual."""
        if self._accumulating_trainer is not None and self._user_accumulate is not None:
            self._accumulating_trainer.accumulate_grad_batches = self._user_accumulate
        self._accumulating_trainer = None
        self._user_accumulate = None
        super().teardown()
