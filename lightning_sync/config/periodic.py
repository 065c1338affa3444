"""The config of periodic sync: gradient accumulation, local SGD, DiLoCo and streaming DiLoCo."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lightning_sync.config.common import GradientSyncKnobs, StrategyConfig
from lightning_sync.config.knobs import knob
from lightning_sync.errors import ConfigError, check_choice, check_range


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
    outer_optimizer: Any = knob(
        None,
        """``diloco``: the outer optimizer, a callable from parameters to a ``torch.optim.Optimizer`` (Lightning's
        ``OptimizerCallable``; Hydra: ``_target_`` with ``_partial_: true``), stepped on each fragment's averaged
        pseudo-gradient: ``functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)`` is the DiLoCo
        paper's. ``None``: ``lightning_sync.OUTER_OPTIMIZER``, SGD at lr 0.7 without momentum.""",
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
        global copy and outer optimizer state, each synced every period, fragment f first after (f + 1) * period //
        fragments steps. Block i of the model's repeated blocks (its largest nn.ModuleList or nn.Sequential of identical
        modules; else its layers) joins fragment i % fragments, any other parameter the nearest preceding block's.""",
    )
    fragment_modules: Any = knob(
        None,
        """``local_sgd``/``diloco`` (streaming DiLoCo): explicit fragments in sync order, as torchft's DiLoCo takes: one
        entry per fragment, a module-name fnmatch pattern or a list of them, e.g. ``[[tok_emb, blocks.0], [blocks.1,
        ln_f]]``; a parameter belongs to a pattern matching a module that holds it, and must be in exactly one fragment.
        ``fragments`` is then the list's length (leave it at 1). Not with ``module_sync_every``.""",
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
    outer_compression: Any = knob(
        "none",
        """``local_sgd``/``diloco``: codec of the outer sync's pseudo-gradients, an object or a registry name
        (``none``: as ``compression``; ``int8``, ``int4``: block-scaled codes summed in fp32; ``sparseloco``: top-k
        per chunk in 2 bits with error feedback). Not together with a ``compression`` other than ``none``.""",
    )
    fault_tolerance: Any = knob(
        None,
        """``local_sgd``/``diloco``: fault tolerance across replica groups, on torchft (the ``lightning-sync[ft]``
        extra): a ``lightning_sync.ft.FaultTolerance``, or a mapping of its fields. This run is then one replica group:
        its ranks sync as without it, and each outer sync is also averaged, through a quorum, over the groups alive; a
        sync that fails is not committed, a lost group drops out and a late one heals from a live one. ``None``: off.""",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("mode", self.mode, ("gradient", "local_sgd", "diloco"))
        if self.fault_tolerance is not None and self.mode == "gradient":
            raise ConfigError(
                "fault_tolerance is not allowed with mode='gradient' (a per-step gradient sync across replica "
                "groups is not fault tolerant here); use mode local_sgd or diloco, or fault_tolerance=None"
            )
        if self.mode != "gradient":
            return  # the averager checks its own schedule (PeriodicAverager)
        for name, bad, why in (
            ("sync_every", self.sync_every == "auto", "an adaptive period would change the effective batch size"),
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
        check_range("sync_every", self.sync_every, low=1, integer=True)
