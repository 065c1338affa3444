"""What every strategy's config has (:class:`StrategyConfig`), the knobs of the bucketed gradient all-reduce
(:class:`GradientSyncKnobs`), and the configs of the per-step gradient strategies (:class:`DDPConfig`,
:class:`AllReduceConfig`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from typing_extensions import Self

from lightning_sync.config.knobs import knob
from lightning_sync.errors import check_choice, check_range


@dataclass
class StrategyConfig:
    """Knobs every lightning_sync strategy has."""

    start_method: str = knob(
        "popen",
        """How Lightning starts the ranks: ``popen`` re-runs the command (Hydra-aware), ``spawn``/``forkserver`` start
        fresh interpreters, ``fork`` copies this process (each child is pinned to one OpenMP thread to avoid the libgomp
        fork deadlock).""",
    )
    timeout_s: float = knob(
        600.0,
        """Seconds any collective may wait before the process group gives up (no wait is unbounded). The ranks' first
        meeting, where a peer may still be importing torch, waits this long and at least 60 s.""",
    )
    check_consistency_every: int = knob(
        0,
        """Every this many optimizer steps, check that all replicas hold identical parameters, buffers and replicated
        optimizer state (``periodic`` local steps: what was just synced; 0: never); a mismatch names the tensors, the
        ranks and the largest difference.""",
    )
    on_mismatch: str = knob(
        "raise",
        """What a failed replica check does: ``raise`` a ``ReplicaMismatchError``; ``warn``: log a warning on rank 0
        and go on; ``resync``: make the tensors that differ identical again (rank 0's values; ``ps``: the parameters
        are pulled from the servers) and log what was fixed.""",
    )
    skip_nonfinite: bool = knob(
        True,
        """Skip an optimizer step whose synced gradients hold a NaN or Inf, on every rank together (no extra collective:
        the synced gradients are the same everywhere); logged as ``sync/skipped_steps``. With AMP the GradScaler skips.
        ``periodic`` local steps skip on the rank alone; ``ps`` servers skip the step in ``sync``, the push in
        ``async``/``ssp``.""",
    )
    freeze_gc: bool = knob(
        True,
        """When training starts, exempt every object alive then from later garbage collections (``gc.freeze``, undone at
        teardown), so a full collection over the start-up heap does not stall a random rank, and all waiting for it.""",
    )

    def __post_init__(self) -> None:
        check_choice("start_method", self.start_method, ("popen", "spawn", "fork", "forkserver"))
        check_range("timeout_s", self.timeout_s, low=0, low_open=True)
        check_range("check_consistency_every", self.check_consistency_every, low=0, integer=True)
        check_choice("on_mismatch", self.on_mismatch, ("raise", "warn", "resync"))

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> Self:
        """The validated config whose every field is the entry of that name in ``arguments`` (a strategy
        constructor's ``locals()``; other entries are ignored).

        Raises:
            ConfigError: a bad value.
            TypeError: ``arguments`` lacks a field (a constructor whose signature misses a knob).
        """
        missing = [f.name for f in fields(cls) if f.name not in arguments]
        if missing:
            raise TypeError(f"{cls.__name__} needs the arguments {', '.join(missing)}")
        return cls(**{f.name: arguments[f.name] for f in fields(cls)})

    def knobs(self) -> dict[str, Any]:
        """Every field and its value (a shallow copy, unlike :func:`dataclasses.asdict`), e.g. as keyword arguments of
        the strategy this config is for."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def arguments_for(self, component: Callable[..., Any]) -> dict[str, Any]:
        """The knobs that ``component`` (e.g. a comm class) takes as keyword arguments of the same name."""
        return {name: getattr(self, name) for name in inspect.signature(component).parameters if hasattr(self, name)}


@dataclass
class GradientSyncKnobs:
    """Settings of the hand-written gradient all-reduce (:class:`lightning_sync.comm.bucketing.GradientSynchronizer`)."""

    compression: Any = knob(
        "none",
        """Gradient codec: a codec object (``lightning_sync.TopKCompression(density=0.01)``,
        ``lightning_sync.PowerSGDCompression(rank=4)``, ...) or a registry name for its defaults: ``none``, ``fp16``,
        ``bf16``, ``topk``, ``powersgd``, ``int8``, ``int4``, ``sparseloco``.""",
    )
    bucketing: str = knob(
        "auto",
        """``overlap``: buckets launched during backward as their last gradient lands; ``flat``: the same buckets, right
        after backward; ``auto``: whichever of the two the first sync rounds measure faster (the same bits either way);
        ``naive``: the textbook per-parameter all-reduce loop (kept for comparison).""",
    )
    bucket_cap_mb: float = knob(
        4.0,
        """Bucket size in MiB; smaller than DDP's 25, so that a model of a few tens of MB fills several buckets and the
        later ones do not all wait for the end of backward.""",
    )
    first_bucket_mb: float = knob(
        1.0,
        """Size of the first bucket in MiB, small so that communication starts early in backward.""",
    )
    find_unused_parameters: bool = knob(
        False,
        """All-reduce a used-mask each step so that a parameter no rank used keeps ``grad=None`` (as DDP); without it
        such a parameter gets a zero gradient. Parameters unused on some ranks never hang either way.""",
    )
    gradient_as_bucket_view: bool = knob(
        True,
        """Each ``.grad`` is a view into its bucket (no copy back): backward accumulates into it and the sync averages in
        place, so read gradients in ``on_before_optimizer_step`` (synced), not ``on_after_backward`` (in flight);
        ``False`` keeps local gradients until the sync and copies the averages back.""",
    )


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
