"""Structured configs: one dataclass per strategy, validated the moment it is built.

A strategy's knobs are the fields of its config dataclass, and each field is documented here, where it is defined.
Hydra's YAML files in ``conf/strategy/`` set the same names. Validation runs in ``__post_init__``, so a bad value
fails in the launching process, before any rank starts, with a :class:`ConfigError` that names the field, the value
and what is allowed.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from typing import Any, Iterable, Optional, TypeVar

from lightning_sync.comm.bucketing import BUCKETINGS, GradientSynchronizer
from lightning_sync.comm.compression import COMPRESSORS, build_compressor

START_METHODS = ("popen", "spawn", "fork", "forkserver")


class ConfigError(ValueError):
    """A user's configuration mistake: one line naming the field, the value and what is allowed."""


def check_choice(field: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{field}={value!r} is not allowed; choose one of: {', '.join(allowed)}")


def check_range(
    field: str,
    value: Any,
    low: Optional[float] = None,
    high: Optional[float] = None,
    low_open: bool = False,
    integer: bool = False,
) -> None:
    """Checks ``low <= value <= high`` (``low < value`` when ``low_open``) and, optionally, that it is an integer."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    bad_type = not number or (integer and not isinstance(value, int))
    if bad_type or (isinstance(value, float) and not math.isfinite(value)):
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{field}={value!r} is not allowed; it must be {kind}")
    lower_ok = low is None or (value > low if low_open else value >= low)
    upper_ok = high is None or value <= high
    if not (lower_ok and upper_ok):
        lo = "" if low is None else f"{'(' if low_open else '['}{low}"
        hi = "" if high is None else f"{high}]"
        if low is not None and high is None:
            allowed = f"> {low}" if low_open else f">= {low}"
        elif low is None:
            allowed = f"<= {high}"
        else:
            allowed = f"in {lo}, {hi}"
        raise ConfigError(f"{field}={value!r} is not allowed; it must be {allowed}")


_C = TypeVar("_C", bound="_StrategyConfig")


@dataclass
class _StrategyConfig:
    """Knobs every lightning_sync strategy has."""

    start_method: str = "popen"
    """How Lightning starts the ranks: ``popen`` re-runs the command (Hydra-aware), ``spawn``/``forkserver`` start
    fresh interpreters, ``fork`` copies this process (each child is pinned to one OpenMP thread to avoid the libgomp
    fork deadlock)."""
    timeout_s: float = 600.0
    """Seconds any collective may wait before the process group gives up (no wait is unbounded)."""
    check_consistency_every: int = 0
    """Every this many optimizer steps, check that all replicas hold identical parameters (0: never)."""

    def __post_init__(self) -> None:
        check_choice("strategy.start_method", self.start_method, START_METHODS)
        check_range("strategy.timeout_s", self.timeout_s, low=0, low_open=True)
        check_range("strategy.check_consistency_every", self.check_consistency_every, low=0, integer=True)

    @classmethod
    def split_kwargs(cls: type[_C], kwargs: dict[str, Any], passthrough: Iterable[str] = ()) -> tuple[_C, dict]:
        """Builds the config from the keys of ``kwargs`` that are its fields.

        Returns:
            The validated config, and the remaining keys, which must all be in ``passthrough``.

        Raises:
            ConfigError: for a key that is neither a field nor in ``passthrough``.
        """
        names = {f.name for f in fields(cls)}
        passthrough = set(passthrough)
        unknown = sorted(set(kwargs) - names - passthrough)
        if unknown:
            raise ConfigError(
                f"strategy.{unknown[0]} is not a knob of {cls.__name__}; known knobs: {', '.join(sorted(names))}"
            )
        mine = {k: v for k, v in kwargs.items() if k in names}
        rest = {k: v for k, v in kwargs.items() if k not in names}
        return cls(**mine), rest


@dataclass
class CompressionKnobs:
    """Settings of the gradient compressors (:mod:`lightning_sync.comm.compression`)."""

    topk_density: float = 0.01
    """``topk``: share of entries sent each step, in (0, 1]; the rest waits in the error-feedback residual."""
    error_feedback: bool = True
    """``topk``/``powersgd``: add what compression left out last time to this step's gradient."""
    powersgd_rank: int = 4
    """``powersgd``: rank r of the low-rank factors; an n x m matrix sends r(n + m) values."""
    powersgd_start_iter: int = 10
    """``powersgd``: optimizer steps sent uncompressed before compression starts (let training settle first)."""
    powersgd_warm_start: bool = True
    """``powersgd``: reuse last step's Q factor as the starting point of the power iteration."""

    def _check_compression(self, field: str, name: str) -> None:
        check_choice(field, name, COMPRESSORS)
        check_range("strategy.topk_density", self.topk_density, low=0, high=1, low_open=True)
        check_range("strategy.powersgd_rank", self.powersgd_rank, low=1, integer=True)
        check_range("strategy.powersgd_start_iter", self.powersgd_start_iter, low=0, integer=True)

    def build_compressor(self, name: str) -> Any:
        """A fresh :class:`~lightning_sync.comm.compression.Compressor` for ``name`` with these settings."""
        return build_compressor(
            name,
            topk_density=self.topk_density,
            error_feedback=self.error_feedback,
            powersgd_rank=self.powersgd_rank,
            powersgd_start_iter=self.powersgd_start_iter,
            powersgd_warm_start=self.powersgd_warm_start,
        )


@dataclass
class DDPConfig(CompressionKnobs, _StrategyConfig):
    """The ``ddp`` strategy: torch DistributedDataParallel, with comm hooks that also run on CPU/gloo."""

    comm_hook: str = "none"
    """DDP communication hook: ``none`` (plain all-reduce), ``fp16``, ``bf16``, ``powersgd`` or ``topk``; all are
    registered on gloo as well as NCCL, and all go through the communication meter."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB."""
    find_unused_parameters: bool = False
    """Let DDP tolerate parameters that get no gradient in a step (costs a graph traversal per step)."""
    gradient_as_bucket_view: bool = False
    """Make ``param.grad`` views into DDP's buckets (saves one copy and the memory of one gradient)."""
    static_graph: bool = False
    """Promise DDP the graph and the set of used parameters never change."""
    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers (e.g. BatchNorm statistics) at every forward."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_compression("strategy.comm_hook", self.comm_hook)
        check_range("strategy.bucket_cap_mb", self.bucket_cap_mb, low=0, low_open=True)


@dataclass
class GradientSyncKnobs(CompressionKnobs):
    """Settings of the hand-written gradient all-reduce (:class:`lightning_sync.comm.bucketing.GradientSynchronizer`).
    """

    compression: str = "none"
    """Gradient compressor: ``none``, ``fp16``, ``bf16``, ``topk`` or ``powersgd``."""
    bucketing: str = "auto"
    """``auto``: the ``overlap`` buckets, launched during backward or right after it, whichever the first sync
    rounds measure faster on this machine (all ranks agree); ``overlap``: buckets launched during backward as their
    last gradient lands; ``flat``: one buffer after backward; ``naive``: the textbook per-parameter all-reduce loop
    (kept for comparison)."""
    bucket_cap_mb: float = 25.0
    """Bucket size in MiB."""
    first_bucket_mb: float = 1.0
    """Size of the first bucket in MiB, small so that communication starts early in backward (``overlap``,
    ``auto``)."""
    find_unused_parameters: bool = False
    """All-reduce a used-mask each step so that a parameter no rank used keeps ``grad=None`` (as DDP); without it
    such a parameter gets a zero gradient. Parameters unused on some ranks never hang either way."""
    gradient_as_bucket_view: bool = True
    """After the sync, each ``.grad`` is a view into its bucket (no copy back); the next step's sync overwrites it."""

    def _check_gradient_sync(self) -> None:
        self._check_compression("strategy.compression", self.compression)
        check_choice("strategy.bucketing", self.bucketing, BUCKETINGS)
        check_range("strategy.bucket_cap_mb", self.bucket_cap_mb, low=0, low_open=True)
        check_range("strategy.first_bucket_mb", self.first_bucket_mb, low=0, low_open=True)

    def build_synchronizer(self, params: Any, meter: Any) -> GradientSynchronizer:
        """A :class:`~lightning_sync.comm.bucketing.GradientSynchronizer` over ``params`` with these settings."""
        return GradientSynchronizer(
            list(params),
            compressor=self.build_compressor(self.compression),
            meter=meter,
            bucketing=self.bucketing,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=self.first_bucket_mb,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )


@dataclass
class AllReduceConfig(GradientSyncKnobs, _StrategyConfig):
    """The ``allreduce`` strategy: no DDP wrapper; gradients bucketed and all-reduced by hand."""

    broadcast_buffers: bool = True
    """Broadcast rank 0's buffers (e.g. BatchNorm statistics) before every training step, as DDP does."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_gradient_sync()


def field_defaults(cls: type) -> dict[str, Any]:
    """``{field: default}`` of a config dataclass (used to check that the YAML files match the dataclasses)."""
    return {f.name: f.default for f in fields(cls) if f.default is not MISSING}


PERIODIC_MODES = ("gradient", "local_sgd", "diloco")


def normalize_module_policy(field: str, value: Any) -> Optional[dict[str, int]]:
    """``module_sync_every`` as a plain ``{pattern: period}`` dict (``None`` when unset).

    Accepts a mapping ``{pattern: period}``, or a list whose items are ``{pattern: period}`` one-entry mappings,
    ``{"pattern": p, "every": n}`` mappings or ``[pattern, period]`` pairs (OmegaConf containers work as well).
    Patterns are non-empty strings, periods integers ``>= 1``, and a pattern may appear only once.
    """
    if value is None:
        return None
    from collections.abc import Mapping, Sequence

    pairs: list[tuple[Any, Any]] = []
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        for item in value:
            if isinstance(item, Mapping) and set(item.keys()) == {"pattern", "every"}:
                pairs.append((item["pattern"], item["every"]))
            elif isinstance(item, Mapping) and len(item) == 1:
                pairs.extend(item.items())
            elif isinstance(item, Sequence) and not isinstance(item, (str, bytes)) and len(item) == 2:
                pairs.append((item[0], item[1]))
            else:
                raise ConfigError(
                    f"{field} item {item!r} is not allowed; each item must be {{pattern: period}}, "
                    "{pattern: ..., every: ...} or [pattern, period]"
                )
    else:
        raise ConfigError(
            f"{field}={value!r} is not allowed; it must be null, a mapping {{pattern: period}} or a list of "
            "[pattern, period] pairs"
        )
    if not pairs:
        raise ConfigError(f"{field}={value!r} is not allowed; give at least one pattern (or null for none)")
    policy: dict[str, int] = {}
    for pattern, period in pairs:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{field} pattern {pattern!r} is not allowed; it must be a non-empty string")
        if pattern in policy:
            raise ConfigError(f"{field} pattern {pattern!r} is not allowed; it appears twice")
        check_range(f"{field}[{pattern!r}]", period, low=1, integer=True)
        policy[pattern] = int(period)
    return policy


@dataclass
class PeriodicConfig(GradientSyncKnobs, _StrategyConfig):
    """The ``periodic`` strategy: gradient accumulation across ranks, local SGD or DiLoCo, synced every N steps.

    ``compression`` applies to every sync payload (gradients, parameter deltas, pseudo-gradients); the bucketing
    knobs apply to the gradient all-reduce (``gradient`` mode and warmup), and ``bucket_cap_mb`` to parameter
    averaging as well.
    """

    mode: str = "local_sgd"
    """``gradient``: accumulate local gradients for ``sync_every`` micro-batches, then one bucketed all-reduce and
    an optimizer step (= DDP with ``accumulate_grad_batches * sync_every``); ``local_sgd``: every rank steps alone
    and parameters and buffers are averaged every ``sync_every`` steps; ``diloco``: every ``sync_every`` steps an
    outer optimizer applies the averaged pseudo-gradient to the global copy, which every replica then loads."""
    sync_every: Any = 8
    """Period: micro-batches per sync (``gradient``) or optimizer steps per sync (``local_sgd``/``diloco``); an
    integer >= 1, or ``auto`` (``local_sgd``/``diloco``) to adapt it to ``target_comm_fraction``."""
    warmup_steps: int = 0
    """``local_sgd``/``diloco``: optimizer steps with gradients all-reduced every step (as DDP) before the first
    local step (post-local SGD)."""
    average_optimizer_state: bool = False
    """``local_sgd``/``diloco``: also average the floating optimizer state (momentum, Adam moments) at each sync."""
    outer_lr: float = 0.7
    """``diloco``: learning rate of the outer SGD."""
    outer_momentum: float = 0.9
    """``diloco``: momentum of the outer SGD, in [0, 1)."""
    outer_nesterov: bool = True
    """``diloco``: Nesterov momentum for the outer SGD (ignored when ``outer_momentum`` is 0)."""
    target_comm_fraction: float = 0.1
    """``sync_every: auto``: the share of time to spend communicating, in (0, 1]."""
    min_sync_every: int = 1
    """``sync_every: auto``: smallest period (also the starting period)."""
    max_sync_every: int = 64
    """``sync_every: auto``: largest period."""
    module_sync_every: Any = None
    """``local_sgd``/``diloco``: per-module periods, ``{glob pattern: period}`` matched (fnmatch, case-sensitive)
    against the LightningModule's full parameter names, e.g. ``{"backbone.*": 1, "head.*": 8}``. Parameters matched
    by no pattern use ``sync_every``; a pattern matching no parameter, or a parameter matched twice, is an error."""
    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("strategy.mode", self.mode, PERIODIC_MODES)
        if isinstance(self.sync_every, str):
            if self.sync_every != "auto":
                raise ConfigError(
                    f"strategy.sync_every={self.sync_every!r} is not allowed; it must be an integer >= 1 or 'auto'"
                )
        elif isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int):
            raise ConfigError(
                f"strategy.sync_every={self.sync_every!r} is not allowed; it must be an integer >= 1 or 'auto'"
            )
        else:
            check_range("strategy.sync_every", self.sync_every, low=1, integer=True)
        check_range("strategy.warmup_steps", self.warmup_steps, low=0, integer=True)
        check_range("strategy.outer_lr", self.outer_lr, low=0, low_open=True)
        check_range("strategy.outer_momentum", self.outer_momentum, low=0)
        if self.outer_momentum >= 1:
            raise ConfigError(f"strategy.outer_momentum={self.outer_momentum!r} is not allowed; it must be in [0, 1)")
        check_range("strategy.target_comm_fraction", self.target_comm_fraction, low=0, high=1, low_open=True)
        check_range("strategy.min_sync_every", self.min_sync_every, low=1, integer=True)
        check_range("strategy.max_sync_every", self.max_sync_every, low=self.min_sync_every, integer=True)
        self.module_sync_every = normalize_module_policy("strategy.module_sync_every", self.module_sync_every)
        self._check_gradient_sync()
        if self.mode == "gradient":
            for name, bad, why in (
                ("sync_every", self.sync_every == "auto", "an adaptive period would change the effective batch size"),
                ("warmup_steps", self.warmup_steps != 0, "gradient accumulation has no local steps to warm up"),
                ("module_sync_every", self.module_sync_every is not None, "gradients are synced as one model"),
            ):
                if bad:
                    raise ConfigError(
                        f"strategy.{name}={getattr(self, name)!r} is not allowed with strategy.mode='gradient' "
                        f"({why}); it is for local_sgd and diloco"
                    )
