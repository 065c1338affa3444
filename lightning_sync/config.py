"""Structured configs: one plain dataclass per strategy; each field is a knob, with its default and its help.

This module is a leaf: it imports nothing from :mod:`lightning_sync.comm` (the strategies build the comm objects
from these configs). The dataclasses are the one schema behind every way of setting a knob:

- a strategy's constructor lists the fields of its dataclass as keyword arguments, whose defaults are read off the
  dataclass (``sync_every: int | str = PeriodicConfig.sync_every``), builds the dataclass from them, and fills its
  ``Args:`` documentation from the fields' help (:func:`knob_docs`), so IDEs, type checkers and LightningCLI see
  every knob, and a unit test checks that the signatures and the fields agree;
- the Hydra app uses them as the schema of the ``strategy/`` group (:mod:`lightning_sync.apps.conf_store`), so a
  knob's default lives here only and ``conf/strategy/*.yaml`` holds just what differs, and its ``--help`` prints
  :func:`knob_docs`.

Validation is split by ownership, and each check runs once, in the launching process, before any rank starts:
``__post_init__`` checks the knobs that belong to the strategy (start method, timeouts, modes and how they
combine); the knobs that belong to an algorithm (a compressor's density or rank, the bucketing, the averager's
period, warmup and adaptive bounds) are checked by that algorithm's constructor, which the strategy's constructor
calls. Either way a bad value raises :class:`~lightning_sync.errors.ConfigError` naming the field, the value and
what is allowed (``strategy.<knob>`` once a strategy or the Hydra app reports it).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

from lightning_sync.errors import ConfigError, check_choice, check_range

START_METHODS = ("popen", "spawn", "fork", "forkserver")
PERIODIC_MODES = ("gradient", "local_sgd", "diloco")
ON_MISMATCH = ("raise", "warn", "resync")

_T = TypeVar("_T")
_C = TypeVar("_C", bound="StrategyConfig")


def knob(default: _T, help: str) -> _T:
    """A dataclass field with ``default`` and its ``help`` (whitespace folded to single spaces) in its metadata.

    Typed as the default's type, as :func:`dataclasses.field` is, so ``x: int = knob(1, "...")`` type-checks.
    """
    folded = " ".join(help.split())
    return field(default=default, metadata={"help": folded})


def knob_docs(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` (inherited ones included) with its help, on one line; in field order. A field
    without help gets ``""``.

    The help is the field's ``metadata["help"]`` (see :func:`knob`). The strategies' ``Args:`` documentation and the
    ``--help`` of the Hydra app print these, so a knob is documented once, where it is defined. A dataclass whose
    fields have no help metadata at all is read the older way, from the string under each field in its class body
    (the benchmark's :class:`~lightning_sync.apps.bench.config.BenchConfig`).
    """
    if not any("help" in f.metadata for f in fields(cls)):
        return _attribute_docstrings(cls)
    return {f.name: f.metadata.get("help", "") for f in fields(cls)}


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """Each field of dataclass ``cls`` with the string under it in the class body (read from the source)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not is_dataclass(klass) or klass is object or "__dataclass_fields__" not in vars(klass):
            continue
        try:
            node = ast.parse(inspect.getsource(klass)).body[0]
            assert isinstance(node, ast.ClassDef)
            body = node.body
        except (OSError, TypeError):  # no source (e.g. a class made at run time): no docstrings
            continue
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    return {f.name: docs.get(f.name, "") for f in fields(cls)}


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
        "Seconds any collective may wait before the process group gives up (no wait is unbounded).",
    )
    check_consistency_every: int = knob(
        0,
        """Every this many optimizer steps, check that all replicas hold identical parameters, buffers and the optimizer
        state the mode keeps replicated (``periodic`` local steps: what was just synced; 0: never). A mismatch names
        the tensors, the ranks that differ from rank 0 and the largest difference.""",
    )
    on_mismatch: str = knob(
        "raise",
        """What a failed replica check does: ``raise`` a ``ReplicaMismatchError``; ``warn``: log a warning on rank 0
        and go on; ``resync``: make the tensors that differ identical again (rank 0's values; ``ps``: the parameters
        are pulled from the servers) and log what was fixed.""",
    )
    skip_nonfinite: bool = knob(
        True,
        """Skip an optimizer step whose synced gradients hold a NaN or Inf, on every rank together (the decision is
        taken on the all-reduced gradients, identical on all ranks, so it costs no extra collective); logged as
        ``sync/skipped_steps``. With AMP's GradScaler the scaler skips and lowers its scale, and the step is counted.
        ``periodic`` local steps skip on the rank alone. ``ps``: such a worker pushes no gradient, and the servers skip
        the step for every worker in ``sync``, that worker's push in ``async``/``ssp``.""",
    )
    freeze_gc: bool = knob(
        True,
        """When training starts, exempt every object alive then from later garbage collections (``gc.freeze``, free;
        undone at teardown), so that a full collection over the start-up heap does not stall a random
        rank, and every rank waiting for it, in the middle of training.""",
    )

    def __post_init__(self) -> None:
        check_choice("start_method", self.start_method, START_METHODS)
        check_range("timeout_s", self.timeout_s, low=0, low_open=True)
        check_range("check_consistency_every", self.check_consistency_every, low=0, integer=True)
        check_choice("on_mismatch", self.on_mismatch, ON_MISMATCH)

    @classmethod
    def from_arguments(cls: type[_C], arguments: Mapping[str, Any]) -> _C:
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
class CompressionKnobs:
    """Settings of the gradient compressors (:mod:`lightning_sync.comm.compression`)."""

    topk_density: float = knob(
        0.01,
        "``topk``: share of entries sent each step, in (0, 1]; the rest waits in the error-feedback residual.",
    )
    error_feedback: bool = knob(
        True,
        "``topk``/``powersgd``: add what compression left out last time to this step's gradient.",
    )
    powersgd_rank: int = knob(
        4,
        "``powersgd``: rank r of the low-rank factors; an n x m matrix sends r(n + m) values.",
    )
    powersgd_start_iter: int = knob(
        10,
        "``powersgd``: optimizer steps sent uncompressed before compression starts (let training settle first).",
    )
    powersgd_warm_start: bool = knob(
        True,
        "``powersgd``: reuse last step's Q factor as the starting point of the power iteration.",
    )

    def compressor_options(self) -> dict[str, Any]:
        """These settings as keyword arguments of :func:`lightning_sync.comm.compression.build_compressor`."""
        return {f.name: getattr(self, f.name) for f in fields(CompressionKnobs)}


@dataclass
class DDPConfig(CompressionKnobs, StrategyConfig):
    """The ``ddp`` strategy: torch DistributedDataParallel, with comm hooks that also run on CPU/gloo."""

    comm_hook: str = knob(
        "none",
        """DDP communication hook: ``none`` (plain all-reduce), ``fp16``, ``bf16``, ``powersgd`` or ``topk``; all are
        registered on gloo as well as NCCL, and all go through the communication meter.""",
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
class GradientSyncKnobs(CompressionKnobs):
    """Settings of the hand-written gradient all-reduce (:class:`lightning_sync.comm.bucketing.GradientSynchronizer`)."""

    compression: str = knob("none", """Gradient compressor: ``none``, ``fp16``, ``bf16``, ``topk`` or ``powersgd``.""")
    bucketing: str = knob(
        "auto",
        """``auto``: the ``overlap`` buckets, launched during backward or right after it, whichever the first sync
        rounds measure faster where it runs (all ranks agree); ``overlap``: buckets launched during backward as their
        last gradient lands; ``flat``: the same buckets, launched right after backward; ``naive``: the textbook
        per-parameter all-reduce loop (kept for comparison). ``auto``, ``overlap`` and ``flat`` send the same buckets, so
        they end with the same bits on any number of ranks.""",
    )
    bucket_cap_mb: float = knob(
        4.0,
        """Bucket size in MiB. Smaller than DDP's 25, so that a model of a few tens of MB fills several buckets
        and the later ones do not all wait for the end of backward (the benchmark's ``allreduce_overlap`` case).
        Every launch point sends these buckets (``flat`` too).""",
    )
    first_bucket_mb: float = knob(
        1.0,
        """Size of the first bucket in MiB, small so that communication starts early in backward (``overlap``,
        ``auto``; ``flat`` uses the same buckets).""",
    )
    find_unused_parameters: bool = knob(
        False,
        """All-reduce a used-mask each step so that a parameter no rank used keeps ``grad=None`` (as DDP); without it
        such a parameter gets a zero gradient. Parameters unused on some ranks never hang either way.""",
    )
    gradient_as_bucket_view: bool = knob(
        True,
        """After the sync, each ``.grad`` is a view into its bucket (no copy back); the next step's sync overwrites it.
        Before a sync round's backward, a gradient that ``zero_grad`` set to ``None`` gets its zeroed slot, so backward
        accumulates straight into the bucket. Buckets launched during backward are then averaged in place: read
        gradients in ``on_before_optimizer_step`` (synced), not ``on_after_backward`` (in flight); ``False`` keeps
        local gradients until the sync and copies the averages back.""",
    )


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


@dataclass
class PeriodicConfig(GradientSyncKnobs, StrategyConfig):
    """The ``periodic`` strategy: gradient accumulation across ranks, local SGD or DiLoCo, synced every N steps.

    ``compression`` applies to every sync payload (gradients, parameter deltas, pseudo-gradients); the bucketing
    knobs apply to the gradient all-reduce (``gradient`` mode and warmup), and ``bucket_cap_mb`` to parameter
    averaging as well.
    """

    mode: str = knob(
        "local_sgd",
        """``gradient``: accumulate local gradients for ``sync_every`` micro-batches, then one bucketed all-reduce and
        an optimizer step (= DDP with ``accumulate_grad_batches * sync_every``); ``local_sgd``: every rank steps alone
        and parameters and buffers are averaged every ``sync_every`` steps; ``diloco``: every ``sync_every`` steps an
        outer optimizer applies the averaged pseudo-gradient to the global copy, which every replica then loads.""",
    )
    sync_every: Any = knob(
        8,
        """Period: micro-batches per sync (``gradient``) or optimizer steps per sync (``local_sgd``/``diloco``); an
        integer >= 1, or ``auto`` (``local_sgd``/``diloco``) to adapt it to ``target_comm_fraction``.""",
    )
    warmup_steps: int = knob(
        0,
        """``local_sgd``/``diloco``: optimizer steps with gradients all-reduced every step (as DDP) before the first
        local step (post-local SGD).""",
    )
    average_optimizer_state: bool = knob(
        False,
        "``local_sgd``/``diloco``: also average the floating optimizer state (momentum, Adam moments) at each sync.",
    )
    outer_lr: float = knob(0.7, """``diloco``: learning rate of the outer SGD.""")
    outer_momentum: float = knob(0.9, """``diloco``: momentum of the outer SGD, in [0, 1).""")
    outer_nesterov: bool = knob(
        True,
        "``diloco``: Nesterov momentum for the outer SGD (ignored when ``outer_momentum`` is 0).",
    )
    target_comm_fraction: float = knob(
        0.1,
        "``sync_every: auto``: the share of time to spend communicating, in (0, 1].",
    )
    min_sync_every: int = knob(1, """``sync_every: auto``: smallest period (also the starting period).""")
    max_sync_every: int = knob(64, """``sync_every: auto``: largest period.""")
    module_sync_every: Any = knob(
        None,
        """``local_sgd``/``diloco``: per-module periods, ``{glob pattern: period}`` matched (fnmatch, case-sensitive)
        against the LightningModule's full parameter names, e.g. ``{"backbone.*": 1, "head.*": 8}``. Parameters matched
        by no pattern use ``sync_every``; a pattern matching no parameter, or a parameter matched twice, is an error.""",
    )
    fragments: int = knob(
        1,
        """``local_sgd``/``diloco`` (streaming DiLoCo): split each sync group into this many fragments, each with its own
        global copy and outer optimizer state, that sync in turn: each fragment syncs every period, staggered so that
        fragment f first syncs after (f + 1) * period // fragments steps. Formed by block: block i of the model's
        repeated blocks (the children of its largest nn.ModuleList or nn.Sequential of identical modules) joins
        fragment i % fragments, and a parameter outside the blocks (embeddings, final norm, head) the fragment of the
        nearest block before it (the first block's before any); a model without repeated blocks is split the same way
        by layer (each parameter's own module). At most every period; a group with fewer blocks gets one fragment per
        block.""",
    )
    fragment_modules: Any = knob(
        None,
        """``local_sgd``/``diloco`` (streaming DiLoCo): explicit fragments instead of the block rule, in sync order
        (fragment 0 syncs first), as torchft's DiLoCo takes a list of modules: a list with one entry per fragment, each
        a module-name pattern or a list of them, e.g. ``[[tok_emb, pos_emb, blocks.0], [blocks.1, ln_f]]``. Patterns
        are fnmatch globs (case-sensitive, ``*`` also crosses dots) on module names; a parameter belongs to a pattern
        matching any module that holds it. Every parameter must be in exactly one fragment and every pattern must match
        one; ``fragments`` is then the list's length (leave it at 1). Not with ``module_sync_every``.""",
    )
    sync_delay: int = knob(
        0,
        """``local_sgd``/``diloco`` (streaming DiLoCo): inner steps between the start of a fragment's outer all-reduce
        and the apply of its result; the transfer runs in the background (on gloo as well) meanwhile. ``0 <=
        sync_delay < period // fragments``.""",
    )
    fragment_alpha: float = knob(
        0.0,
        """``local_sgd``/``diloco`` (streaming DiLoCo): on apply, a fragment's parameters become ``global.lerp(local,
        alpha)`` = ``alpha * local + (1 - alpha) * global``, keeping part of the ``sync_delay`` local steps (0: load the
        global copy; 1: keep the local weights, only the global copy steps); in [0, 1]. The streaming DiLoCo paper
        found 0.5 robust for sync_delay < 5.""",
    )
    outer_compression: str = knob(
        "none",
        """``local_sgd``/``diloco``: codec of the outer all-reduce of the pseudo-gradients: ``none`` (as
        ``compression``), ``bf16``, ``fp16``, ``int8`` or ``int4`` (block-wise fp32 scales per 256 entries,
        round-to-nearest, summed in fp32: an all-to-all reduce-scatter of the codes, then an all-gather of the
        requantized sums). Not together with a ``compression`` other than ``none``.""",
    )
    fault_tolerance: Any = knob(
        None,
        """``local_sgd``/``diloco``: fault tolerance across replica groups, on torchft (the ``lightning-sync[ft]``
        extra): a ``lightning_sync.ft.FaultTolerance``, or a mapping of its fields (``lighthouse``, ``replica_group``,
        ``num_replica_groups``, ``min_replicas``, ``timeout_s``). This run is then one replica group: its ranks sync
        as without it, and each outer sync is also averaged, through a quorum, over the groups alive; a sync that
        fails is not committed, a lost group drops out and a late one heals from a live one. ``None``: off.""",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("mode", self.mode, PERIODIC_MODES)
        if self.fault_tolerance is not None and self.mode == "gradient":
            raise ConfigError(
                "fault_tolerance is not allowed with mode='gradient' (a per-step gradient sync across replica "
                "groups is not fault tolerant here); use mode local_sgd or diloco, or fault_tolerance=None"
            )
        if self.mode != "gradient":
            return  # the averager checks its own schedule (PeriodicAverager)
        if isinstance(self.sync_every, bool) or not isinstance(self.sync_every, int):
            raise ConfigError(
                f"sync_every={self.sync_every!r} is not allowed with mode='gradient' (an adaptive period would "
                "change the effective batch size); it must be an integer >= 1"
            )
        check_range("sync_every", self.sync_every, low=1, integer=True)
        for name, bad, why in (
            ("warmup_steps", self.warmup_steps != 0, "gradient accumulation has no local steps to warm up"),
            ("module_sync_every", self.module_sync_every is not None, "gradients are synced as one model"),
            ("fragments", self.fragments != 1, "gradients are synced as one model"),
            ("fragment_modules", self.fragment_modules is not None, "gradients are synced as one model"),
            ("sync_delay", self.sync_delay != 0, "the optimizer step needs the synced gradients"),
            ("fragment_alpha", self.fragment_alpha != 0.0, "there is no global copy to mix with"),
            ("outer_compression", self.outer_compression != "none", "there is no outer step; use compression"),
        ):
            if bad:
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} is not allowed with mode='gradient' ({why}); it is for "
                    "local_sgd and diloco"
                )


PS_MODES = ("sync", "async", "ssp")
PS_PLACEMENTS = ("dedicated", "colocated")


@dataclass
class ParameterServerConfig(StrategyConfig):
    """The ``ps`` strategy: workers push gradients to parameter servers, which step and send parameters back."""

    mode: str = knob(
        "sync",
        """``sync``: every step, each server averages one gradient from every worker, steps once, and every worker pulls
        (= DDP with plain SGD); ``async``: each push is applied as it arrives and its worker gets the result at once;
        ``ssp``: as async, but no worker runs more than ``max_staleness`` steps ahead of the slowest.""",
    )
    max_staleness: int = knob(2, """``ssp``: how many steps the fastest worker may lead the slowest (0: lockstep).""")
    num_servers: int = knob(
        1,
        "Servers the parameters are sharded over, balanced by bytes (whole tensors per server).",
    )
    placement: str = knob(
        "dedicated",
        """``dedicated``: the strategy starts ``num_servers`` server processes on node 0, watches them and stops them;
        ``colocated``: each of the first ``num_servers`` worker ranks also runs one server, in a thread.""",
    )
    compression: str = knob(
        "none",
        """How pushed gradients travel: ``none``, ``fp16``, ``bf16`` or ``topk`` (with ``topk_density`` and
        ``error_feedback``). Parameters come back uncompressed.""",
    )
    topk_density: float = knob(0.01, """``topk``: share of each shard's gradient entries sent per push, in (0, 1].""")
    error_feedback: bool = knob(True, """``topk``: keep what was not sent on the worker and add it to the next push.""")
    slow_worker: int = knob(-1, """For experiments: the worker rank to slow down (-1: none).""")
    slowdown: float = knob(
        1.0,
        "For experiments: ``slow_worker`` sleeps so that its steps take this many times as long (>= 1).",
    )
    push_scale: Any = knob(
        "auto",
        """``async``/``ssp``: what one push's gradient is multiplied by before the server's optimizer step, a number > 0
        or ``auto``: ``1/W`` (W workers) for SGD-family optimizers, so W pushes move as far as one sync step, and ``1``
        for scale-invariant ones (Adam family, RMSprop, Adagrad), whose step a factor would not change.""",
    )
    local_steps: Any = knob(
        1,
        """Async local SGD: each worker steps its own optimizer this many times, then pushes its pseudo-gradient (its
        change since its last pull) and the servers apply an outer SGD (``outer_lr``, ``outer_momentum``,
        ``outer_nesterov``; in async and ssp its momentum once per W pushes, delayed Nesterov). 1: push gradients.
        ``auto``: each worker its own count from its measured speed, ``max_local_steps`` for the fastest.""",
    )
    max_local_steps: int = knob(
        8,
        "``local_steps: auto``: the fastest worker's local steps; a worker k times slower takes about 1/k of them.",
    )
    outer_lr: float = knob(0.7, """``local_steps > 1``: learning rate of the servers' outer SGD.""")
    outer_momentum: float = knob(0.9, """``local_steps > 1``: momentum of the outer SGD, in [0, 1).""")
    outer_nesterov: bool = knob(True, """``local_steps > 1``: Nesterov momentum for the outer SGD.""")
    elastic: bool = knob(
        False,
        """``sync``: a lost worker (killed, crashed, or silent for ``timeout_s``) is dropped and each step averages the
        live workers' pushes, instead of ending the job. ``async`` and ``ssp`` always drop a lost worker.""",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("mode", self.mode, PS_MODES)
        if self.elastic is not False and (self.elastic is not True or self.mode != "sync"):
            raise ConfigError(
                f"elastic={self.elastic!r} is not allowed with mode={self.mode!r}; it is true or false, for sync "
                "(async and ssp always drop a lost worker)"
            )
        check_range("max_staleness", self.max_staleness, low=0, integer=True)
        check_range("num_servers", self.num_servers, low=1, integer=True)
        check_choice("placement", self.placement, PS_PLACEMENTS)
        check_range("slow_worker", self.slow_worker, low=-1, integer=True)
        check_range("slowdown", self.slowdown, low=1)
        if self.mode != "ssp" and self.max_staleness != ParameterServerConfig.max_staleness:
            raise ConfigError(
                f"max_staleness={self.max_staleness} is not allowed with mode={self.mode!r}; it is for ssp"
            )
        if isinstance(self.push_scale, str) and self.push_scale != "auto":
            raise ConfigError(f"push_scale={self.push_scale!r} is not allowed; it must be a number > 0, or 'auto'")
        if self.mode == "sync" and self.push_scale != "auto":
            raise ConfigError(
                f"push_scale={self.push_scale!r} is not allowed with mode='sync' (a sync step averages the "
                "gradients); it is for async and ssp"
            )
        if isinstance(self.local_steps, str) and self.local_steps != "auto":
            raise ConfigError(f"local_steps={self.local_steps!r} is not allowed; it must be an integer >= 1, or 'auto'")
        if self.local_steps == "auto":
            check_range("max_local_steps", self.max_local_steps, low=2, integer=True)
            if self.mode == "sync":
                raise ConfigError(
                    "local_steps='auto' is not allowed with mode='sync' (sync workers keep in step, so the slowest "
                    "sets the pace whatever the counts); it is for async and ssp"
                )
