"""Local SGD and DiLoCo: a periodic averager that owns its schedule (period, warmup, groups, adaptive period).

:class:`PeriodicAverager` checks its schedule at construction, as torch's ``PeriodicModelAverager`` does, so a bad
value fails before any process starts. Its owner (a Lightning strategy, or a plain training loop) then calls
:meth:`~PeriodicAverager.setup` once the process group exists (it splits the model into sync groups,
:mod:`lightning_sync.comm.sync_groups`), reads :attr:`~PeriodicAverager.in_warmup` before each optimizer step (an
all-reduce of its gradients instead of a local step), calls :meth:`~PeriodicAverager.step` after it and
:meth:`~PeriodicAverager.finish` at the end.

Streaming DiLoCo (:mod:`lightning_sync.comm.streaming`): with ``fragments=k`` each sync group is split into up to
``k`` fragments, each with its own global copy, compressor and outer optimizer; fragment ``f`` of a group with
period ``p`` first syncs after ``(f + 1) * p // k`` steps, then every ``p``. With ``sync_delay=τ`` a fragment's
outer sync is launched ``τ`` steps before its sync step, on a worker thread, and applied at it, mixed by
``fragment_alpha``. With ``sync_every="auto"`` the ranks agree (MAX) on the measured compute seconds per step and
sync seconds after each sync of the default group, and :class:`~lightning_sync.comm.adaptive.AdaptivePeriod` picks
the next period.
"""

from __future__ import annotations

import concurrent.futures
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from lightning_sync._exit import DaemonWorker
from lightning_sync.comm.adaptive import AdaptiveOptions, AdaptivePeriod, ComputeTimer, agree_max
from lightning_sync.comm.averaging import (
    OUTER_OPTIMIZER,
    WAIT_GRACE_S,
    ModelAverager,
    OptimizerCallable,
    average_buffers,
    average_optimizer_state,
    check_optimizer_callable,
    optimizer_state_tensors,
)
from lightning_sync.comm.compression import Compressor, NoCompression, resolve_codec
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.module_policy import POLICY_FIELD, normalize_module_policy
from lightning_sync.comm.streaming import StreamingOptions, new_stream_group
from lightning_sync.comm.sync_groups import (
    SyncGroup,
    build_sync_groups,
    groups_state,
    load_groups_state,
)
from lightning_sync.errors import ConfigError, check_range


def _check_ranges(sync_every: int | str, warmup_steps: int, bucket_cap_mb: float) -> None:
    """Checks each knob's own range.

    Raises:
        ConfigError: the first knob out of range, named.
    """
    if sync_every != "auto":
        if isinstance(sync_every, bool) or not isinstance(sync_every, int):
            raise ConfigError(f"sync_every={sync_every!r} is not allowed; it must be an integer >= 1 or 'auto'")
        check_range("sync_every", sync_every, low=1, integer=True)
    check_range("warmup_steps", warmup_steps, low=0, integer=True)
    check_range("bucket_cap_mb", bucket_cap_mb, low=0, low_open=True)


def _check_streaming(
    streaming: StreamingOptions,
    new_compressor: Callable[[], Compressor],
    sync_every: int | str,
    min_sync_every: int | None,
    policy: Mapping[str, int],
) -> None:
    """Checks the streaming knobs against each other and against every period a sync group may have
    (``min_sync_every``: the smallest adaptive period, or ``None``; ``policy``: ``{pattern: period}``).

    Raises:
        ConfigError: a streaming knob out of range or one that does not fit a period, named as the knob (a period
            as the knob that sets it); ``fragment_modules`` together with ``module_sync_every``.
    """
    fragments, sync_delay, outer_compression = streaming.fragments, streaming.sync_delay, streaming.outer_compression
    check_range("fragments", fragments, low=1, integer=True)
    check_range("sync_delay", sync_delay, low=0, integer=True)
    check_range("fragment_alpha", streaming.fragment_alpha, low=0, high=1)
    base = new_compressor().name  # outer_compression itself is resolved (and checked) by the averager
    if outer_compression != "none" and base != "none":
        raise ConfigError(
            f"outer_compression={outer_compression!r} is not allowed with compression={base!r}; the "
            "pseudo-gradients take one codec: set compression=none, or outer_compression=none"
        )
    periods = [("sync_every", sync_every)] if isinstance(sync_every, int) else []
    if min_sync_every is not None:
        periods.append(("min_sync_every", min_sync_every))
    periods += [(f"{POLICY_FIELD}[{pattern!r}]", every) for pattern, every in policy.items()]
    for field, period in periods:
        if fragments > period:
            raise ConfigError(
                f"fragments={fragments} is not allowed with {field}={period}; it must be <= {field} (each "
                "fragment syncs at its own step of the period)"
            )
        if sync_delay >= period // fragments:  # fragment 0 first syncs after period // fragments steps
            raise ConfigError(
                f"sync_delay={sync_delay} is not allowed with {field}={period} and fragments={fragments}; it "
                f"must be >= 0 and < {field} // fragments = {period // fragments} (fragment 0 first syncs "
                f"{period // fragments} steps in, and its outer sync launches sync_delay steps before)"
            )
    if streaming.fragment_modules is not None and policy:
        raise ConfigError(
            f"fragment_modules={[list(f) for f in streaming.fragment_modules]!r} is not allowed with "
            f"{POLICY_FIELD}; explicit fragments split one group: leave one of them unset"
        )


class PeriodicAverager:
    """Averages replicas every ``sync_every`` optimizer steps: local SGD, or DiLoCo with ``outer=True``.

    Args:
        sync_every: optimizer steps per sync, an integer ``>= 1``, or ``"auto"`` to adapt it (see ``adaptive``).
        warmup_steps: optimizer steps whose gradients the owner all-reduces (as DDP) before the local phase.
        outer: DiLoCo: the averaged pseudo-gradient ``global - local`` goes through ``outer_optimizer`` on the global
            copy; otherwise local SGD's plain average.
        outer_optimizer: ``outer=True``: a callable from parameters to a ``torch.optim.Optimizer``, called once per
            fragment on its global copy; ``None``: :data:`~lightning_sync.comm.averaging.OUTER_OPTIMIZER`.
        module_sync_every: per-module periods, ``{glob pattern: period}`` (see the module docstring).
        average_optimizer_state: also average the floating optimizer state (momentum, Adam moments) at each sync.
        new_compressor: makes each group's compressor (each keeps its own memory); default: exact averages.
        bucket_cap_mb: size of the flat buckets the deltas travel in.
        streaming: streaming DiLoCo's fragments, delay, mixing and codec (default: one fragment, no delay).
        adaptive: ``sync_every="auto"``: the target share of time spent communicating and the period's bounds.
        skip_nonfinite: an averaged pseudo-gradient holding a NaN or Inf skips that group's outer step (on every
            rank alike).
        timeout_s: the longest wait for an outer sync in flight (and the timeout of the worker's process group).
        clock: returns the current time in seconds; ``sync_every="auto"`` times compute and syncs with it.

    Raises:
        ConfigError: an argument out of range, named as the knob of the same name.
    """

    def __init__(
        self,
        sync_every: int | str = 8,
        warmup_steps: int = 0,
        outer: bool = False,
        outer_optimizer: OptimizerCallable | None = None,
        module_sync_every: Any = None,
        average_optimizer_state: bool = False,
        new_compressor: Callable[[], Compressor] = NoCompression,
        bucket_cap_mb: float = 4.0,
        streaming: StreamingOptions = StreamingOptions(),  # noqa: B008 - frozen, so one shared default is safe
        adaptive: AdaptiveOptions = AdaptiveOptions(),  # noqa: B008 - frozen, so one shared default is safe
        skip_nonfinite: bool = True,
        timeout_s: float = 600.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        _check_ranges(sync_every, warmup_steps, bucket_cap_mb)
        check_optimizer_callable(outer_optimizer)
        self.adaptive = (
            AdaptivePeriod(adaptive.target_comm_fraction, adaptive.min_sync_every, adaptive.max_sync_every)
            if sync_every == "auto"
            else None
        )
        self.policy = normalize_module_policy(module_sync_every) or {}
        min_every = None if self.adaptive is None else self.adaptive.min_every
        _check_streaming(streaming, new_compressor, sync_every, min_every, self.policy)
        self.sync_every = sync_every
        self.warmup_steps = int(warmup_steps)
        self.outer = bool(outer)
        self.outer_optimizer: OptimizerCallable = OUTER_OPTIMIZER if outer_optimizer is None else outer_optimizer
        self.average_optimizer_state = bool(average_optimizer_state)
        self.new_compressor = new_compressor
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.fragments, self.sync_delay = int(streaming.fragments), int(streaming.sync_delay)
        self.fragment_alpha = float(streaming.fragment_alpha)
        self.fragment_modules = streaming.fragment_modules
        self.outer_compression = streaming.outer_compression
        if self.outer_compression != "none":
            self.new_compressor = resolve_codec(self.outer_compression, "outer_compression")
        self.skip_nonfinite = bool(skip_nonfinite)
        self.timeout_s = timeout_s
        self.clock = clock
        self._worker: DaemonWorker | None = None
        self._across_jobs: dict[int, concurrent.futures.Future] = {}
        self.groups: list[SyncGroup] = []
        self.steps = 0
        self.last_synced: list[SyncGroup] = []
        self.last_divergence: float | None = None
        self.meter: CommMeter | None = None
        self.group: ProcessGroup | None = None
        self._all_params: list[torch.Tensor] = []
        self._all_buffers: list[torch.Tensor] = []
        self._warmup_step_done = False
        self._compute = ComputeTimer(clock)

    # ------------------------------------------------------------------ schedule
    @property
    def period(self) -> int:
        """The current period of the default group."""
        return self.adaptive.period if self.adaptive is not None else int(self.sync_every)

    @property
    def in_warmup(self) -> bool:
        """Whether the coming optimizer step is a warmup step (its gradients are all-reduced by the owner)."""
        return self.steps < self.warmup_steps

    # ------------------------------------------------------------------ lifecycle
    def setup(
        self,
        named_parameters: Iterable[tuple[str, nn.Parameter]],
        named_buffers: Iterable[tuple[str, torch.Tensor]],
        meter: CommMeter,
        group: ProcessGroup | None = None,
    ) -> None:
        """Builds the sync groups (and their fragments) and takes the global copy (call on every rank, with identical
        replicas). With ``sync_delay > 0`` it also makes the outer syncs' process group (a collective call).

        Raises:
            ConfigError: a ``module_sync_every`` pattern matches no parameter, or a parameter matches two; a
                ``fragment_modules`` pattern matches no parameter, or a parameter is in two fragments or in none.
        """
        named = list(named_parameters)
        named_buffers = list(named_buffers)
        self.meter, self.group = meter, group
        self._all_params = [p for _, p in named if p.requires_grad]
        self._all_buffers = [b for _, b in named_buffers]
        sync_group = group
        if self.sync_delay > 0:
            sync_group = new_stream_group(group, self.timeout_s)
            self._worker = DaemonWorker("outer-sync")

        def new_averager(params: list[nn.Parameter]) -> tuple[ModelAverager, torch.optim.Optimizer | None]:
            """A fragment's global copy, and DiLoCo's outer optimizer over it (``None`` for local SGD)."""
            averager = ModelAverager(params, self.new_compressor(), meter, self.bucket_cap_mb, sync_group)
            return averager, self.outer_optimizer(averager.anchors) if self.outer and averager.anchors else None

        self.groups = build_sync_groups(
            named,
            named_buffers,
            self.policy,
            self.fragments,
            self.period,
            new_averager,
            self.fragment_modules,
        )

    def start_step(self) -> None:
        """Marks the start of an optimizer step's compute (for ``sync_every="auto"``; a no-op while one runs)."""
        if self.meter is not None:
            self._compute.start(self.meter.total.seconds)

    def step(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> list[SyncGroup]:
        """Call after every optimizer step, on every rank: syncs what is due.

        After a warmup step the buffers are averaged (and after the last one the global copies reset). After a local
        step the outer syncs in flight whose ``sync_delay`` is up are applied; then every group whose period is up
        is synced, or with ``sync_delay`` has its outer sync launched ``sync_delay`` steps before.

        Args:
            optimizers: the optimizers whose state ``average_optimizer_state`` averages.

        Returns:
            The groups synced (applied) now (empty after a warmup step or when none was due).
        """
        if self.meter is not None:  # an outer sync in flight ran its transfer beside this compute: none is taken off
            self._compute.stop(self.meter.total.seconds, any(group.in_flight is not None for group in self.groups))
        self._warmup_step_done = self.in_warmup
        self.steps += 1
        self.last_synced, self.last_divergence = [], None
        if self._warmup_step_done:
            average_buffers(self._all_buffers, self._require_meter(), self.group)
            if self.steps == self.warmup_steps:
                for group in self.groups:
                    group.averager.reset_anchor_()
                    group.since_sync = group.offset
            return []
        for group in self.groups:
            group.since_sync += 1
        ready = [
            group
            for group in self.groups
            if group.in_flight is not None and self.steps - group.in_flight.launched_at >= self.sync_delay
        ]
        if ready:
            self._apply_in_flight(ready, optimizers)
        if self.sync_delay == 0:
            due = [group for group in self.groups if self._sync_due(group)]
            if due:
                self.sync_groups(due, optimizers)
            return [*ready, *due]
        for group in self.groups:
            if self._launch_due(group):
                self._launch(group)
        return ready

    def _sync_due(self, group: SyncGroup) -> bool:
        """Whether ``group``'s period is up (``sync_delay=0``: it syncs now)."""
        return group.since_sync >= (self.period if group.period is None else group.period)

    def _launch_due(self, group: SyncGroup) -> bool:
        """Whether ``group``'s outer sync is launched now (``sync_delay > 0``): none in flight, and its period is up
        within ``sync_delay`` steps."""
        period = self.period if group.period is None else group.period
        return group.in_flight is None and group.since_sync >= period - self.sync_delay

    def _launch(self, group: SyncGroup) -> None:
        """Starts ``group``'s outer sync on the worker thread (``sync_delay > 0``), then its average across replica
        groups. A group that heals at this quorum launches the fragment the live groups launch now, which its own
        step count may not have chosen."""
        if self._quorum():
            due = [g for g in self.groups if self._launch_due(g)]
            group = due[0] if due else group
        group.in_flight = group.averager.launch_(-1.0 if self.outer else 1.0, self.steps, self._worker)
        assert self._worker is not None
        self._across_jobs[id(group)] = self._worker.submit(lambda: self._across(group))

    def finish(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> list[SyncGroup]:
        """Applies the outer syncs in flight, then syncs every group with unsynced local steps (or mixed
        parameters), so all ranks end with the common model (every rank)."""
        if self.steps <= self.warmup_steps:
            return []
        ready = [group for group in self.groups if group.in_flight is not None]
        if ready:
            self._apply_in_flight(ready, optimizers)
        pending = [group for group in self.groups if group.since_sync > 0 or group.mixed]
        if pending:
            self.sync_groups(pending, optimizers)
        return [*ready, *(group for group in pending if all(group is not r for r in ready))]

    def sync_groups(self, groups: Sequence[SyncGroup], optimizers: Sequence[torch.optim.Optimizer] = ()) -> float:
        """Syncs ``groups`` now, launch and apply, each parameter loading the global copy (every rank must call it
        with the same groups, in the same order).

        Returns:
            This rank's divergence ``||params - average||`` over the groups' parameters, at sync time.
        """
        started = self.clock()
        if self._quorum():  # healed: sync what the live groups sync now, not what this group's own count chose
            groups = [g for g in self.groups if self._sync_due(g)] or groups
        squared = 0.0
        for group in groups:
            group.in_flight = group.averager.launch_(-1.0 if self.outer else 1.0, self.steps)
            squared += group.averager.complete_(group.in_flight, self.timeout_s)
            self._across(group)
        return self._complete(groups, optimizers, squared, 0.0, started)

    def _apply_in_flight(self, groups: Sequence[SyncGroup], optimizers: Sequence[torch.optim.Optimizer]) -> float:
        """Applies the outer syncs in flight of ``groups`` (with ``fragment_alpha``) once they and their averages
        across replica groups are done; ``sync_every="auto"`` counts the seconds this waited, not the transfer hidden
        behind the inner steps."""
        started = self.clock()
        squared = 0.0
        for group in groups:
            assert group.in_flight is not None
            squared += group.averager.complete_(group.in_flight, self.timeout_s)
            across = self._across_jobs.pop(id(group), None)  # none for a sync in flight loaded from a checkpoint
            if across is not None:
                across.result(timeout=self.timeout_s + WAIT_GRACE_S)
        return self._complete(groups, optimizers, squared, self.fragment_alpha, started)

    def _complete(
        self,
        groups: Sequence[SyncGroup],
        optimizers: Sequence[torch.optim.Optimizer],
        squared: float,
        alpha: float,
        started: float,
    ) -> float:
        """Averages the groups' buffers; then, if the sync is committed (:meth:`_commit`), applies each group's sync
        in flight (mixing by ``alpha``) and the buffers' averages, and otherwise returns every parameter to its
        global copy; averages the optimizer state, records the sync and adapts the period."""
        meter = self._require_meter()
        buffers = [b for group in groups for b in group.buffers]
        averaged = [b.detach().clone() for b in buffers]
        if averaged:
            average_buffers(averaged, meter, self.group)
            self._across_buffers(averaged)
        committed = self._commit()
        for group in groups:
            flight, group.in_flight = group.in_flight, None
            assert flight is not None
            applied = committed and group.averager.apply_(
                flight, group.outer, alpha, self.skip_nonfinite, self.timeout_s
            )
            if not committed:
                group.averager.restore_()
            group.skipped += int(committed and not applied)
            group.since_sync, group.syncs, group.mixed = 0, group.syncs + 1, applied and alpha > 0
        if committed:
            with torch.no_grad():
                for buffer, mean in zip(buffers, averaged):
                    buffer.copy_(mean)
        if self.average_optimizer_state:
            average_optimizer_state(optimizers, [p for group in groups for p in group.params], meter, self.group)
        self.last_synced = list(groups) if committed else []
        self.last_divergence = math.sqrt(squared)
        default = [group for group in groups if group.period is None]
        if self.adaptive is not None and default:  # the next period, from the slowest rank's measurements
            # one fragment's comm every period/k steps: as much per step as k fragments' every period
            comm = (self.clock() - started) * default[0].fragments
            self.adaptive.update(*agree_max([self._compute.mean, comm], meter, self.group))
            self._compute.reset()
        return self.last_divergence

    # ------------------------------------------------------------------ across replica groups
    # A sync across torchft replica groups (:class:`~lightning_sync.ft.averager.FaultTolerantAverager`) adds these
    # steps to the one above; without fault tolerance each does nothing.
    def _quorum(self) -> bool:
        """Before a sync is launched: joins the quorum; ``True`` when this rank's replica group has just healed."""
        return False

    def _across(self, group: SyncGroup) -> None:
        """Averages ``group``'s deltas (averaged inside this process group) across the replica groups, in place."""

    def _across_buffers(self, buffers: list[torch.Tensor]) -> None:
        """Averages ``buffers`` (averaged inside this process group) across the replica groups, in place."""

    def _commit(self) -> bool:
        """Whether the syncs completing now are applied (``False``: every parameter returns to its global copy)."""
        return True

    @property
    def skipped_outer_steps(self) -> int:
        """Outer steps skipped so far for a non-finite pseudo-gradient (``skip_nonfinite``), over all groups."""
        return sum(group.skipped for group in self.groups)

    def synced_tensors(self, optimizers: Sequence[torch.optim.Optimizer] = ()) -> list[torch.Tensor]:
        """What must be identical on every rank right after the last :meth:`step`: everything after a warmup step,
        the synced groups' parameters (unless mixed by ``fragment_alpha``) and floating buffers after a sync, and
        ``optimizers``' state of those parameters where it is identical (warmup, ``average_optimizer_state``)."""
        if self._warmup_step_done:
            params, buffers = self._all_params, self._all_buffers
        else:
            params = [p for group in self.last_synced if not group.mixed for p in group.params]
            buffers = [b for group in self.last_synced for b in group.buffers]
        same_state = self._warmup_step_done or self.average_optimizer_state
        state = optimizer_state_tensors(optimizers, params) if same_state else []
        return [*params, *(b for b in buffers if b.is_floating_point()), *state]

    def synced_global_copies(self) -> dict[str, torch.Tensor]:
        """The global copies of the groups synced by the last :meth:`step`, by name (``global_copy[*#0][0]``):
        identical on every rank after a sync, also where ``fragment_alpha`` leaves the parameters mixed."""
        return {
            f"global_copy[{group.label}][{i}]": anchor
            for group in self.last_synced
            for i, anchor in enumerate(group.averager.anchors)
        }

    def close(self) -> None:
        """Waits (up to ``timeout_s``) for the outer-sync worker's jobs and drops it, so the process group can then be
        destroyed (a job still in a collective when its group is destroyed aborts the process)."""
        if self._worker is not None:
            concurrent.futures.wait([self._worker.submit(int)], timeout=self.timeout_s)
            self._worker.shutdown(wait=False)
            self._worker = None

    def _require_meter(self) -> CommMeter:
        if self.meter is None:
            raise RuntimeError("PeriodicAverager.setup() must run before the first step")
        return self.meter

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Step counts, each group's global copy, compressor memory, outer optimizer and outer sync in flight (drained,
        and saved unapplied: :func:`~lightning_sync.comm.sync_groups.groups_state`), and the adaptive period."""
        return {
            "steps": self.steps,
            "groups": groups_state(self.groups, self.timeout_s),
            "adaptive": self.adaptive.state_dict() if self.adaptive is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` (after :meth:`setup`; the groups must have the same labels and sizes)."""
        self.steps = int(state["steps"])
        if self.adaptive is not None and state.get("adaptive") is not None:
            self.adaptive.load_state_dict(state["adaptive"])
        load_groups_state(self.groups, state["groups"])
