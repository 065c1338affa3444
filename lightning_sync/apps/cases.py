"""The comparison cases: every sync mode and knob setting that the main job, the benchmark and the notebooks run.

A :class:`Case` is a strategy (its Hydra option, ``conf/strategy/<group>.yaml``) and its knobs, defined once in
:data:`CATALOGUE`. ``python -m lightning_sync.compare`` and the notebooks run it as Hydra overrides
(:meth:`Case.overrides`, :func:`hydra_cases`); ``python -m lightning_sync.bench`` builds the strategy from the same
knobs (:meth:`Case.arguments`). Each harness selects its cases by name (:func:`select`): a case both run has the
main job's name and the benchmark's as its ``alias``. Where the two name the same settings differently (the
benchmark's ``streaming_diloco_8`` is the main job's ``periodic:streaming_diloco/8``), they are two cases.

A leaf: it imports nothing of torch, Lightning or Hydra.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Case:
    """One comparison case.

    Attributes:
        name: its name in the main job's tables and in the notebooks (``periodic:diloco/8``).
        group: the strategy's Hydra option: ``ddp``, ``allreduce``, ``periodic`` or ``ps``.
        knobs: the strategy's knobs (``strategy.<knob>=<value>``, or its constructor's keyword arguments).
        about: one line for ``--help`` and the results page.
        alias: its name in the benchmark, where that differs (``powersgd``).
        period_knob: the benchmark knob that sets ``sync_every`` there (its default is ``knobs["sync_every"]``).
    """

    name: str
    group: str
    knobs: dict[str, Any] = field(default_factory=dict)
    about: str = ""
    alias: str = ""
    period_knob: str = ""

    def overrides(self) -> list[str]:
        """The Hydra overrides on ``conf/config.yaml`` that select the strategy and set its knobs."""
        return [f"strategy={self.group}", *(f"strategy.{k}={v}" for k, v in self.knobs.items())]

    def arguments(self, knobs: Any) -> dict[str, Any]:
        """The strategy's keyword arguments, ``sync_every`` read from ``knobs.<period_knob>`` when it has one; a
        knob given as a Hydra object (``{_target_:...}``, e.g. a codec) is instantiated as Hydra would."""
        from hydra.utils import instantiate

        built = {k: v if (spec := hydra_object(v)) is None else instantiate(spec) for k, v in self.knobs.items()}
        return {**built, **({"sync_every": getattr(knobs, self.period_knob)} if self.period_knob else {})}


def hydra_object(value: Any) -> dict[str, Any] | None:
    """The fields of a knob given as a Hydra object in override syntax (``{_target_:a.B,x:1}``); ``None`` for any
    other value."""
    if not (isinstance(value, str) and value.startswith("{_target_")):
        return None
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_override(f"knob={value}").value()
    assert isinstance(parsed, dict), value
    return dict(parsed)


def _streaming(name: str, every: int, fragments: int, delay: int, about: str, **more: Any) -> Case:
    """Streaming DiLoCo: ``fragments`` fragments synced ``delay`` steps late, fragment_alpha 0.5, int4 outer
    payloads, the strategy's default outer optimizer."""
    knobs = {"mode": "diloco", "sync_every": every, "fragments": fragments, "sync_delay": delay}
    knobs |= {"fragment_alpha": 0.5, "outer_compression": "int4"}
    return Case(name, "periodic", knobs, about, **more)


_SGD = "an outer SGD without momentum"
_SPARSELOCO_SGD = "{_target_:torch.optim.SGD,_partial_:true,lr:1.0}"


def _sparseloco(every: int, bits: int | None = 2, topk: int = 64, **more: Any) -> Case:
    """DiLoCo every ``every`` steps with the SparseLoCo outer codec (``bits=None``: its top-k values in fp32; ``topk``
    of every 4,096 values) and its recipe, a plain outer SGD at lr 1.0 (the codec's error feedback in momentum's
    place)."""
    codec = f"{{_target_:lightning_sync.SparseLoCo,bits:{'null' if bits is None else bits},topk:{topk}}}"
    variant = "" if bits == 2 else "_fp32" if bits is None else str(bits)
    name = f"periodic:sparseloco{variant}{'' if topk == 64 else f'_k{topk}'}/{every}"
    knobs = {"mode": "diloco", "sync_every": every, "outer_compression": codec, "outer_optimizer": _SPARSELOCO_SGD}
    values = "fp32 values" if bits is None else f"{bits}-bit values"
    return Case(
        name,
        "periodic",
        knobs,
        f"DiLoCo every {every} steps, SparseLoCo outer codec (top {topk} of 4096, {values}), outer SGD lr 1",
        **more,
    )


# fmt: off
_CASES = (
    Case("ddp", "ddp", {}, "our DDPSyncStrategy (torch DDP through the meter)", alias="sync_ddp"),
    Case("ddp+fp16_hook", "ddp", {"comm_hook": "fp16"}, "DDP with torch's fp16 compression hook"),
    Case("ddp+powersgd_hook", "ddp", {"comm_hook": "powersgd"}, "DDP with torch's PowerSGD hook"),
    Case("allreduce", "allreduce", {}, "our AllReduceStrategy, defaults (bucketing=auto)"),
    Case("allreduce+fp16", "allreduce", {"compression": "fp16"}, "gradients all-reduced in fp16"),
    Case("allreduce+bf16", "allreduce", {"compression": "bf16"}, "gradients all-reduced in bf16"),
    Case("allreduce+topk1%", "allreduce", {"compression": "topk"},
         "our AllReduceStrategy(compression='topk'): TopKCompression(density=0.01)", alias="topk"),
    Case("allreduce+powersgd4", "allreduce", {"compression": "powersgd"},
         "our AllReduceStrategy(compression='powersgd'): PowerSGDCompression(rank=4)", alias="powersgd"),
    Case("periodic:local_sgd/8", "periodic", {"mode": "local_sgd", "sync_every": 8},
         "our PeriodicSyncStrategy(mode='local_sgd', sync_every=sync_every)", alias="periodic",
         period_knob="sync_every"),
    Case("periodic:diloco/8", "periodic", {"mode": "diloco", "sync_every": 8},
         "DiLoCo every 8 steps, the strategy's default outer optimizer (lightning_sync.OUTER_OPTIMIZER)"),
    Case("periodic:diloco/16", "periodic", {"mode": "diloco", "sync_every": 16},
         "DiLoCo every 16 steps (the README's example), the strategy's default outer optimizer"),
    Case("periodic:diloco/30", "periodic", {"mode": "diloco", "sync_every": 30},
         "DiLoCo every 30 steps, the strategy's default outer optimizer"),
    *(Case(f"periodic:diloco_int8/{every}", "periodic", {"mode": "diloco", "sync_every": every,
           "outer_compression": "int8"}, f"DiLoCo every {every} steps, int8 outer payloads (block-quantized), the "
           "strategy's default outer optimizer") for every in (8, 16, 30)),
    *(_sparseloco(every, *v) for every in (8, 30) for v in ((2,), (None,))),
    _sparseloco(8, 2, 256, alias="sparseloco_k256_8", period_knob="sync_every"),
    _sparseloco(30, 2, 256),
    _sparseloco(16, alias="sparseloco", period_knob="diloco_sync_every"),
    _sparseloco(16, None),
    _sparseloco(16, 2, 256, alias="sparseloco_k256", period_knob="diloco_sync_every"),
    _streaming("periodic:streaming_diloco/30", 30, 4, 2, "streaming DiLoCo every 30 steps"),
    # one dedicated server process; in async and ssp the same samples as the other rows, one update per push
    Case("ps:sync", "ps", {"mode": "sync"}, "parameter server, synchronous"),
    Case("ps:async", "ps", {"mode": "async"},
         "our ParameterServerStrategy(mode='async'), one dedicated server on node 0", alias="ps_async"),
    Case("ps:ssp/2", "ps", {"mode": "ssp", "max_staleness": 2}, "stale-synchronous, at most 2 steps apart"),
    Case("ps:async/push_scale_1", "ps", {"mode": "async", "push_scale": 1.0},
         "async ps, push_scale=1: each push a full step (with Adam, of the whole learning rate)"),
    _streaming("periodic:streaming_diloco/16", 16, 4, 2, "diloco with fragments=4, sync_delay=2, "
               "fragment_alpha=0.5, outer_compression='int4' (streaming DiLoCo)", alias="streaming_diloco",
               period_knob="diloco_sync_every"),
    _streaming("periodic:streaming_diloco/8", 8, 4, 1, "streaming DiLoCo every 8 steps, sync_delay=1"),
    _streaming("periodic:streaming_diloco/8/k2", 8, 2, 3, "streaming DiLoCo, 2 fragments, sync_delay=3"),
    _streaming("periodic:streaming_diloco/16/tau1", 16, 4, 1, "streaming DiLoCo every 16 steps, 4 fragments, "
               "sync_delay=1 (one fragment per block of a 4-block model)"),
    _streaming("periodic:streaming_diloco/12", 12, 4, 2, "streaming DiLoCo every 12 steps"),
    Case("ps:async_local/8", "ps", {"mode": "async", "local_steps": 8}, "async ps, 8 local steps per push"),
    Case("ps:async_local/auto", "ps", {"mode": "async", "local_steps": "auto"}, "async ps, local steps auto"),
    # the benchmark's own: bucketing variants, and DiLoCo at a benchmark knob's period or with an outer plain SGD
    Case("allreduce_flat", "allreduce", {"bucketing": "flat"}, "our AllReduceStrategy(bucketing='flat')"),
    Case("allreduce_overlap", "allreduce", {"bucketing": "overlap"}, "our AllReduceStrategy(bucketing='overlap')"),
    Case("diloco", "periodic", {"mode": "diloco", "sync_every": 16}, "our PeriodicSyncStrategy(mode='diloco', "
         "sync_every=diloco_sync_every) with the strategy's default outer optimizer at the run's commit: outer SGD "
         "without momentum, lr 0.7 (since c224b12; lr 0.5 from 320bfaf); the paper's Nesterov SGD, lr 0.7, "
         "momentum 0.9 before 320bfaf (the char_lm/* benchmark runs of 2026-11-24)", period_knob="diloco_sync_every"),
    Case("diloco_8", "periodic", {"mode": "diloco", "sync_every": 8}, "diloco every "
         f"sync_every steps with {_SGD}: streaming_diloco_8 without fragments, delay or int4",
         period_knob="sync_every"),
    _streaming("streaming_diloco_8_k2", 8, 2, 3, "streaming_diloco_8 with 2 fragments and sync_delay=3: the same "
               "bytes per step, each transfer twice as large with 3 inner steps to hide behind",
               period_knob="sync_every"),
    Case("diloco_12", "periodic", {"mode": "diloco", "sync_every": 12},
         f"diloco every 12 steps with {_SGD}: streaming_diloco_12 without fragments, delay or int4"),
    _streaming("streaming_diloco_12", 12, 4, 2, "diloco every 12 steps with fragments=4, sync_delay=2, "
               f"fragment_alpha=0.5, int4 and {_SGD} (a fragment syncs every 3 steps, so each transfer has 2 steps "
               "to hide behind)"),
    _streaming("streaming_diloco_8", 8, 4, 1, "diloco every sync_every steps with fragments=4, sync_delay=1, "
               f"fragment_alpha=0.5, int4 and {_SGD} (the setting that matches DDP's loss on char_lm in 300 steps)",
               period_knob="sync_every"),
)
# fmt: on
CATALOGUE: dict[str, Case] = {key: case for case in _CASES for key in (case.name, case.alias) if key}
"""Every case, by its name and by its alias."""


def select(*names: str) -> dict[str, Case]:
    """``{name: case}`` of :data:`CATALOGUE`, in the order given (a name or an alias).

    Raises:
        KeyError: a name that is not in the catalogue (naming it and the known names).
    """
    unknown = [n for n in names if n not in CATALOGUE]
    if unknown:
        raise KeyError(f"cases {unknown} are not in the catalogue; known: {', '.join(CATALOGUE)}")
    return {name: CATALOGUE[name] for name in names}


DIGITS_DILOCO = "experiment=diloco"
"""What a ``diloco`` case adds on the digits classifier: AdamW inside, as DiLoCo's paper pairs them
(``conf/experiment/diloco.yaml``); the classifier's default inner SGD with momentum diverges under the outer
momentum. The language model trains with AdamW already."""


def _on(case: Case, digits: bool) -> list[str]:
    return [*case.overrides(), *([DIGITS_DILOCO] if digits and case.knobs.get("mode") == "diloco" else [])]


def hydra_cases(names: Iterable[str], digits: bool = False) -> dict[str, list[str]]:
    """``{name: Hydra overrides}`` of the named cases; ``digits``: for the digits classifier (:data:`DIGITS_DILOCO`)."""
    return {name: _on(case, digits) for name, case in select(*names).items()}


def periodic_cases(
    modes: Iterable[str], periods: Iterable[int | str], extra: Sequence[str] = ()
) -> dict[str, list[str]]:
    """``{"<mode>/<period>": overrides}`` of ``strategy=periodic`` on the digits classifier, every mode at every
    period (``diloco`` with :data:`DIGITS_DILOCO`; ``gradient`` and ``local_sgd`` keep the model's SGD), then
    ``extra``."""
    every = list(periods)
    grid = [Case(f"{m}/{p}", "periodic", {"mode": m, "sync_every": p}) for m in modes for p in every]
    return {case.name: [*_on(case, digits=True), *extra] for case in grid}
