"""Gradient all-reduce by hand: bucketed and overlapped with backward, or flat, or the textbook per-parameter loop.

:class:`GradientSynchronizer` averages the gradients of a fixed list of parameters over a process group through a
:class:`~lightning_sync.comm.compression.Compressor` and a :class:`~lightning_sync.comm.meter.CommMeter`. One
*round* is one backward pass (or several, with syncing disabled in between) followed by
:meth:`GradientSynchronizer.finish`. Parameters go, in reverse registration order, into buckets of ``bucket_cap_mb``
(the first one ``first_bucket_mb``, so communication starts early):

``overlap``
    A bucket launches, asynchronously and strictly in index order, once a post-accumulate-grad hook has seen its
    last gradient; :meth:`~GradientSynchronizer.finish` launches the rest, waits and writes the averages to ``.grad``.
``flat``
    The same buckets, launched one after the other right after backward.
``naive``
    One blocking average per parameter after backward (the textbook loop; kept to compare against).
``auto``
    The same buckets, launched during or after backward, whichever :class:`LaunchTuner` measures faster on the first
    rounds (on CPU gloo's transfers compete with backward for the cores); a close call goes to after backward when
    the ranks share one machine's CPU cores (``same_host_cpu``). The decision is in the checkpoint.

The launch point decides only *when* a bucket is sent, so ``overlap``, ``flat`` and ``auto`` agree bit for bit on
any number of ranks; ``naive`` matches them on 2 ranks only (on 3 or more, gloo's ring sums an element in an order
that depends on where it sits in its collective). A parameter without a gradient on this rank takes part with
zeros; with ``find_unused_parameters=True`` one that no rank used keeps ``grad=None``, as in torch DDP.
"""

from __future__ import annotations

import copy
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch.distributed import ProcessGroup

from lightning_sync.comm.compression import Compressor, FlatBucket
from lightning_sync.comm.meter import CommMeter
from lightning_sync.comm.nonfinite import all_finite, probe
from lightning_sync.comm.peer_errors import wait_future
from lightning_sync.comm.tuning import LAUNCH_MARGIN, LAUNCH_TRIAL_ROUNDS, LAUNCH_WARMUP_ROUNDS, MIB
from lightning_sync.errors import check_choice, check_range

BUCKETINGS = ("auto", "overlap", "flat", "naive")


@dataclass
class GradBucket:
    """One bucket of gradients: its parameters, and their gradients back to back in one flat buffer.

    Attributes:
        index: the bucket's place in launch order.
        params: the parameters, in the order their gradients sit in ``buffer``.
        buffer: the parameters' gradients back to back.
        future: this round's average in flight (``None`` before launch).
        ready: ids of the parameters whose gradient of this round is final.
        slots: one view of ``buffer`` per parameter, shaped as it.
    """

    index: int
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    future: torch.futures.Future | None = None
    ready: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        views = self.buffer.split([p.numel() for p in self.params])
        self.slots = [view.view(p.shape) for p, view in zip(self.params, views)]


def plan_buckets(params: Sequence[torch.Tensor], bucket_cap_bytes: float, first_bucket_bytes: float) -> list[list[int]]:
    """Splits parameter indices, in order, into buckets that close once they hold their cap (``first_bucket_bytes``
    for the first) and never mix dtypes or devices. The layout depends on the order and the caps alone, never on
    when a bucket is launched: so every launch point sums the same payloads to the same bits."""
    plans: list[list[int]] = []
    current: list[int] = []
    size = 0.0
    for i, p in enumerate(params):
        if current and (params[current[0]].dtype != p.dtype or params[current[0]].device != p.device):
            plans.append(current)
            current, size = [], 0.0
        current.append(i)
        size += p.numel() * p.element_size()
        if size >= (bucket_cap_bytes if plans else first_bucket_bytes):
            plans.append(current)
            current, size = [], 0.0
    if current:
        plans.append(current)
    return plans


def make_buckets(plans: list[list[torch.nn.Parameter]]) -> tuple[list[GradBucket], list[torch.Tensor]]:
    """The buckets, and the buffers they are consecutive slices of: one per run of buckets of one dtype and device
    (zeroed in one fill)."""
    buckets: list[GradBucket] = []
    buffers: list[torch.Tensor] = []
    for (dtype, device), group in itertools.groupby(plans, key=lambda plan: (plan[0].dtype, plan[0].device)):
        run = list(group)
        sizes = [sum(p.numel() for p in plan) for plan in run]
        buffers.append(torch.zeros(sum(sizes), dtype=dtype, device=device))
        for plan, part in zip(run, buffers[-1].split(sizes)):
            buckets.append(GradBucket(len(buckets), plan, part))
    return buckets, buffers


class LaunchTuner:
    """Chooses, by measurement, whether buckets launch during backward or right after it.

    After ``warmup_rounds`` untimed rounds, ``2 * trial_rounds`` rounds alternate the two launch points, each timed
    from the start of its backward to the start of the next (overlap slows backward down and shortens the wait, so
    only the whole step shows which wins). One all-reduce sums the ranks' medians, and every rank picks alike: the
    launch point faster by more than ``margin``, or on a closer call the ``prefer_after_backward`` prior.

    Args:
        warmup_rounds: rounds left out before the trials.
        trial_rounds: timed rounds per launch point.
        margin: the relative lead a launch point needs to overrule the prior.
        prefer_after_backward: the prior (``None``: :class:`GradientSynchronizer` sets it from ``same_host_cpu``).
        clock: returns the current time in seconds, read at the start of every round.
    """

    def __init__(
        self,
        warmup_rounds: int = LAUNCH_WARMUP_ROUNDS,
        trial_rounds: int = LAUNCH_TRIAL_ROUNDS,
        margin: float = LAUNCH_MARGIN,
        prefer_after_backward: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        assert warmup_rounds >= 0 and trial_rounds >= 1 and margin >= 0
        self.clock = clock
        self.warmup_rounds = warmup_rounds
        self.trial_rounds = trial_rounds
        self.margin = margin
        self.prefer_after_backward = prefer_after_backward
        self.rounds = 0
        self.times: dict[bool, list[float]] = {False: [], True: []}
        self.after_backward: bool | None = None  # the decision, once made
        self.medians_ms: dict[str, float] = {}

    def state_dict(self) -> dict[str, Any]:
        """The trials so far and the decision (so a resumed run keeps its launch point instead of re-tuning)."""
        return copy.deepcopy({key: getattr(self, key) for key in ("rounds", "times", "after_backward", "medians_ms")})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(copy.deepcopy(state))
        self.times = {bool(k): v for k, v in self.times.items()}

    @property
    def deciding(self) -> bool:
        return self.after_backward is None

    def next_after_backward(self) -> bool:
        """Where the coming round launches: decided, or the trial's alternation (during backward first)."""
        if self.after_backward is not None:
            return self.after_backward
        return max(self.rounds - self.warmup_rounds, 0) % 2 == 1

    def record(self, after_backward: bool, seconds: float) -> bool:
        """Books one round's time; returns whether the trials are complete (time to :meth:`decide`)."""
        if self.rounds >= self.warmup_rounds:
            self.times[after_backward].append(seconds)
        self.rounds += 1
        return all(len(v) >= self.trial_rounds for v in self.times.values())

    def decide(self, meter: CommMeter, group: ProcessGroup | None) -> bool:
        """Sums the ranks' medians (one small all-reduce) and fixes the launch point; returns it."""
        times = [statistics.median(self.times[after]) for after in (False, True)]
        medians = torch.tensor(times, dtype=torch.float64, device=meter.control_device(group))
        meter.all_reduce(medians, group=group)
        n = meter.world_size(group)
        during, after = (1e3 * medians / n).tolist()
        self.medians_ms = {"during_backward": during, "after_backward": after}
        if after < (1.0 - self.margin) * during:
            self.after_backward = True
        elif during < (1.0 - self.margin) * after:
            self.after_backward = False
        else:
            self.after_backward = bool(self.prefer_after_backward)
        return self.after_backward


class GradientSynchronizer:
    """Averages the gradients of ``params`` over a process group.

    Args:
        params: the parameters to sync (those with ``requires_grad``); every rank must pass the same list.
        compressor: averages each bucket (``NoCompression`` for an exact mean).
        meter: counts the traffic.
        bucketing: ``overlap``, ``flat``, ``naive`` or ``auto`` (see the module docstring).
        bucket_cap_mb: bucket size (every bucketing but ``naive``).
        first_bucket_mb: size of the first bucket (every bucketing but ``naive``).
        find_unused_parameters: all-reduce a used-mask so that parameters no rank used keep ``grad=None``.
        gradient_as_bucket_view: make each ``.grad`` a view into its bucket instead of copying the average out
            (the next round overwrites those views).
        group: the process group (``None``: default).
        tuner: how ``auto`` measures (``None``: a default :class:`LaunchTuner`).
        same_host_cpu: whether every rank of ``group`` runs on one machine's cores (``None``: assume so for CPU
            tensors); sets ``auto``'s prior (after backward if so).
        check_finite: in :meth:`finish`, check each bucket for NaN and Inf as soon as its average has arrived, while
            later buckets are still in flight; the verdict is :attr:`grads_finite`.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        compressor: Compressor,
        meter: CommMeter,
        bucketing: str = "auto",
        bucket_cap_mb: float = 4.0,
        first_bucket_mb: float = 1.0,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = True,
        group: ProcessGroup | None = None,
        tuner: LaunchTuner | None = None,
        check_finite: bool = False,
        same_host_cpu: bool | None = None,
    ) -> None:
        self.check_settings(bucketing, bucket_cap_mb, first_bucket_mb)
        self.check_finite = check_finite
        self.grads_finite: bool | None = None  # the last round's verdict (``check_finite``), until the next round
        self.params = [p for p in params if p.requires_grad]
        self.compressor = compressor
        self.meter = meter
        self.bucketing = bucketing
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.group = group
        self._world = meter.world_size(group)
        self.tuner = (tuner or LaunchTuner()) if bucketing == "auto" and self._world > 1 else None
        if self.tuner is not None and self.tuner.prefer_after_backward is None and self.params:
            self.tuner.prefer_after_backward = self.params[0].device.type == "cpu" and same_host_cpu is not False
        self.after_backward = bucketing in ("flat", "naive")  # this round's launch point (auto: tried or decided)
        self._round_started: float | None = None
        self.sync_enabled = True
        self._round_active = False
        self._next_launch = 0
        ordered = list(reversed(self.params))  # backward visits layers last to first
        # one layout for every launch point: it alone decides how a gradient is summed (naive: a parameter a bucket)
        caps = (0.0, 0.0) if bucketing == "naive" else (bucket_cap_mb * MIB, first_bucket_mb * MIB)
        plans = plan_buckets(ordered, *caps)
        self.buckets, self._buffers = make_buckets([[ordered[i] for i in plan] for plan in plans])
        self._where = {id(p): b for b in self.buckets for p in b.params}
        overlap = bucketing in ("overlap", "auto")
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params if overlap]

    @staticmethod
    def check_settings(bucketing: str, bucket_cap_mb: float, first_bucket_mb: float) -> None:
        """Checks the bucketing knobs (the constructor does; call it alone to fail before any process starts).

        Raises:
            ConfigError: naming ``bucketing``, ``bucket_cap_mb`` or ``first_bucket_mb``.
        """
        check_choice("bucketing", bucketing, BUCKETINGS)
        check_range("bucket_cap_mb", bucket_cap_mb, low=0, low_open=True)
        check_range("first_bucket_mb", first_bucket_mb, low=0, low_open=True)

    # ------------------------------------------------------------------ round control
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this block backward only accumulates local gradients (no communication)."""
        previous, self.sync_enabled = self.sync_enabled, False
        try:
            yield
        finally:
            self.sync_enabled = previous

    def start_round(self) -> None:
        """Marks that a backward pass whose gradients must be synced is about to run (call on every rank)."""
        if self.sync_enabled and not self._round_active:
            if self.tuner is not None:
                self._tune(self.tuner.clock())
            self._attach_bucket_views()
            self.grads_finite = None
            self._round_active = True

    def _attach_bucket_views(self) -> None:
        """With ``gradient_as_bucket_view``, a parameter without a gradient gets its zeroed bucket slot as ``.grad``
        before backward, which so accumulates straight into the bucket (no allocation, no packing copy); not with
        ``find_unused_parameters``, which must see which gradients backward left at ``None``."""
        if not self.gradient_as_bucket_view or self.find_unused_parameters:
            return
        every = all(p.grad is None for p in self.params)
        for buffer in self._buffers if every else ():
            buffer.zero_()  # one fill per buffer instead of one per parameter
        for bucket in self.buckets:
            for p, slot in zip(bucket.params, bucket.slots):
                if p.grad is None:
                    p.grad = slot if every else slot.zero_()

    def _tune(self, now: float) -> None:
        """``auto``, at the start of a round: books the previous round's whole period (up to this backward), decides
        once the trials are complete, and sets this round's launch point."""
        assert self.tuner is not None
        if (
            self.tuner.deciding
            and self._round_started is not None
            and self.tuner.record(self.after_backward, now - self._round_started)
            and self.tuner.decide(self.meter, self.group)
        ):
            self.remove_hooks()  # launching after backward: nothing left for them to do
        self.after_backward = self.tuner.next_after_backward()
        self._round_started = now if self.tuner.deciding else None

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on exactly as this one would: ``auto``'s trials and decision."""
        return {} if self.tuner is None else {"tuner": self.tuner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tuner is not None and "tuner" in state:
            self.tuner.load_state_dict(state["tuner"])
            self._round_started = None  # the interrupted round's period is lost, not booked
            if self.tuner.after_backward is not None:  # decided
                self.after_backward = self.tuner.after_backward
                if self.after_backward:
                    self.remove_hooks()

    @property
    def launch_point(self) -> str:
        """``during_backward`` or ``after_backward``: where buckets launch now (``auto``: tried or decided)."""
        return "after_backward" if self.after_backward else "during_backward"

    # ------------------------------------------------------------------ overlap
    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not (self.sync_enabled and self._round_active) or self.after_backward:
            return
        bucket = self._where[id(param)]
        if id(param) in bucket.ready or bucket.future is not None:
            return  # already counted this round (a second backward before finish adds to .grad only)
        bucket.ready.add(id(param))
        while self._next_launch < len(self.buckets):  # launch, in index order, every bucket that is full
            bucket = self.buckets[self._next_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._pack_and_launch(bucket)
            self._next_launch += 1

    # ------------------------------------------------------------------ finish
    def _pack_and_launch(self, bucket: GradBucket) -> torch.futures.Future:
        """Packs this round's gradients into ``bucket`` (zeros where there is none; one ``torch.cat`` when all are
        present, contiguous and not in place already), divides, and launches it; returns ``bucket.future``."""
        grads = [p.grad for p in bucket.params]
        slots = bucket.slots
        if len(grads) == 1 and grads[0] is not None and grads[0].data_ptr() != slots[0].data_ptr():
            torch.div(grads[0], self._world, out=slots[0])  # copy and divide in one pass (same bits)
        else:
            if all(g is not None and g.is_contiguous() and g.data_ptr() != s.data_ptr() for g, s in zip(grads, slots)):
                torch.cat([cast(torch.Tensor, g).view(-1) for g in grads], out=bucket.buffer)  # all present
            else:
                for slot, g in zip(slots, grads):
                    if g is None:
                        slot.zero_()
                    elif g.data_ptr() != slot.data_ptr():
                        slot.copy_(g)
            bucket.buffer.div_(self._world)
        flat = FlatBucket(bucket.index, bucket.buffer, [p.shape for p in bucket.params], divided=True)
        bucket.future = self.compressor.average(flat, self.meter, self.group)
        return bucket.future

    def finish(self) -> bool:
        """Completes the round: launches every bucket not yet launched, waits for all, writes averages to ``.grad``.

        Returns:
            Whether a round was active (``False``: nothing to sync, no collective issued).
        """
        if not self._round_active:
            return False
        local_used = [p.grad is not None for p in self.params]
        for bucket in self.buckets[self._next_launch :]:  # each launched before the next is packed
            future = self._pack_and_launch(bucket)
            if self.bucketing == "naive":
                wait_future(future, "gradient all_reduce", self.group)
        if self.find_unused_parameters:  # after every bucket, so all ranks issue the same collectives
            used = torch.tensor(local_used, dtype=torch.float32, device=self.meter.control_device(self.group))
            self.meter.all_reduce(used, group=self.group)
        probes, probed = [], []
        for bucket in self.buckets:
            assert bucket.future is not None
            wait_future(bucket.future, "gradient all_reduce", self.group)
            if self.check_finite and bucket.buffer.numel():
                probes.append(probe(bucket.buffer))  # while the later buckets are still in flight
                probed.append(bucket.buffer)
        if self.check_finite:
            self.grads_finite = all_finite(probes, probed)
        for bucket in self.buckets:
            for p, slot in zip(bucket.params, bucket.slots):
                if self.gradient_as_bucket_view:
                    p.grad = slot
                elif p.grad is None:
                    p.grad = slot.clone()
                else:
                    p.grad.copy_(slot)
            bucket.future = None
            bucket.ready.clear()
        if self.find_unused_parameters:
            for p, anywhere in zip(self.params, used.tolist()):
                if not anywhere:
                    p.grad = None
        self._next_launch = 0
        self._round_active = False
        return True

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
