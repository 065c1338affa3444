"""The benchmark's knobs: one dataclass, Hydra-style ``key=value`` overrides, every value checked before any run.

A leaf like :mod:`lightning_sync.config`: it imports nothing of torch or Lightning, so ``--help`` and a bad value
answer at once. :func:`parse_overrides` turns ``["cases=allreduce,periodic", "network.rate=1gbit"]`` into a
validated :class:`BenchConfig`; a mistake raises :class:`~lightning_sync.errors.ConfigError` naming the field, the
value and what is allowed. The workloads and cases the knobs name are :mod:`lightning_sync.apps.bench.workloads`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

# CASE_HELP, OUR_CASES and sync_period: re-exported for callers that import them from here
from lightning_sync.apps.bench.workloads import CASE_HELP, DEFAULT_CASES, OUR_CASES, WORKLOADS, sync_period
from lightning_sync.config import knob
from lightning_sync.errors import ConfigError, check_choice, check_range

RATES = ("loopback", "1mbit", "10mbit", "100mbit", "1gbit")
"""``network.rate``: ``loopback`` (both nodes on 127.0.0.1), or the rate of emulated links (root only)."""
RATE_MBIT = {"1mbit": 1.0, "10mbit": 10.0, "100mbit": 100.0, "1gbit": 1000.0}
"""The link rate of each emulated ``network.rate``, in Mbit/s."""

__all__ = [
    "CASE_HELP",
    "OUR_CASES",
    "RATE_MBIT",
    "RATES",
    "REUSE_MUST_MATCH",
    "BenchConfig",
    "NetworkConfig",
    "config_from_saved",
    "parse_overrides",
    "reused_ddp_records",
    "sync_period",
]


@dataclass
class NetworkConfig:
    """Where the two nodes run."""

    rate: list[str] = knob(
        ["loopback"],
        """``loopback``, or the rate of the emulated links between two network namespaces (``1mbit``, ``10mbit``,
        ``100mbit``, ``1gbit``; needs root, tbf on both ends of each link); a comma list runs each in turn.""",
    )
    prefix: str = knob(
        "", """Name prefix of the namespaces (empty: ``lb`` and 4 digits of the process id); at most 6 characters."""
    )

    def validate(self) -> None:
        if not self.rate:
            raise ConfigError(f"network.rate={self.rate!r} is not allowed; choose one or more of: {', '.join(RATES)}")
        for rate in self.rate:
            check_choice("network.rate", rate, RATES)
        if len(self.prefix) > 6 or not (self.prefix.isalnum() or not self.prefix):
            raise ConfigError(f"network.prefix={self.prefix!r} is not allowed; it must be at most 6 letters or digits")


@dataclass
class BenchConfig:
    """Every knob of ``python -m lightning_sync.bench``; set any with ``key=value`` (lists comma-separated)."""

    workloads: list[str] = knob(
        ["latency_bound"],
        """Which workloads: ``latency_bound``, ``compute_bound``, ``bandwidth_bound`` (step time), ``digits`` (time to
        accuracy), ``char_lm`` (time to a validation loss), ``payload`` (bus bandwidth of one all-reduce).""",
    )
    cases: list[str] = knob(
        [],
        """Which cases, run in this order in every repeat (A B A B); a workload runs those that apply to it. Empty:
        lightning_ddp, lightning_ddp_view, torch_ddp, (payload:) gloo_allreduce, allreduce, periodic, torch_local_sgd,
        powersgd, topk, floor, single; char_lm: lightning_ddp (always first: its final loss is the target), torch_ddp,
        torch_local_sgd, allreduce, powersgd, topk, periodic, diloco, ps_async, floor, single.""",
    )
    repeats: int = knob(3, """Rounds over all cases; the report gives the median over them.""")
    steps: int = knob(60, """Step-time workloads: optimizer steps per run.""")
    warmup_steps: int = knob(
        20, """Step-time workloads: steps left out of the median (``bucketing=auto`` tunes on its first 19)."""
    )
    target_accuracy: float = knob(0.95, """Digits: the test accuracy that ends a run.""")
    eval_every: int = knob(
        8, """Digits: test accuracy is measured every this many optimizer steps, with the clock stopped."""
    )
    max_epochs: int = knob(40, """Digits: a run that has not reached the target by then reports ``null``.""")
    sync_every: int = knob(8, """``periodic`` and ``torch_local_sgd``: optimizer steps per model average.""")
    diloco_sync_every: int = knob(16, """``diloco``: inner optimizer steps per outer step.""")
    budget_steps: int = knob(
        96,
        """char_lm: Lightning DDP's optimizer steps; the validation loss it ends with is every case's target, and the
        bounds (floor, single) run as many.""",
    )
    max_steps_factor: float = knob(
        3.0, """char_lm: a case that has not reached the target stops after this many times budget_steps."""
    )
    give_up_factor: float = knob(
        2.0,
        """char_lm: a case that has not reached the target stops once its training time passes this many times
        Lightning DDP's at the same rate (it is then reported as not reaching the target).""",
    )
    payload_mb: float = knob(25.0, """Payload workload: MiB of float32 gradient all-reduced.""")
    payload_iters: int = knob(5, """Payload workload: timed all-reduces per run (after one untimed).""")
    timeout_s: float = knob(
        900.0, """Seconds one run may take, start-up included; it bounds every collective as well."""
    )
    seed: int = knob(
        0,
        """Seed of the model's initial weights and of the data order (of the first repeat; see ``seed_per_repeat``).""",
    )
    seed_per_repeat: bool = knob(
        True,
        """Repeat r runs with seed ``seed + r``, so the median and spread cover seeds as well as timing noise (char_lm:
        each seed's target is the loss its own lightning_ddp run ends with); False: every repeat uses ``seed``.""",
    )
    ddp_from: str = knob(
        "",
        """char_lm: a ``results.json`` of an earlier benchmark whose ``lightning_ddp`` runs set this one's targets and
        DDP times, for the rates and seeds it has them; ``lightning_ddp`` is then not run again there (at 10 Mbit it
        takes most of the benchmark's time). Its ``budget_steps``, ``eval_every``, ``warmup_steps`` and
        ``flush_denormal`` must equal this run's; its records are copied into this run's, marked ``reused_from``.""",
    )
    window: int = knob(
        0,
        """char_lm: 0 runs every case to the target. ``N > 0`` measures step times instead, with no target: each case
        is scored every ``lcm(eval_every, its sync period)`` steps, and reports its training ms per step over ``N`` such
        intervals (whole sync periods, sync steps included) after the first interval that ends at or past
        ``warmup_steps`` (PowerSGD's uncompressed start, ``bucketing=auto``'s trials), as ``window_step_ms``.
        ``benchmarks/time_to_target.py`` multiplies them by a trajectory's steps to the target.""",
    )
    flush_denormal: bool = knob(
        True,
        """Every rank treats subnormal floats as zero (``torch.set_flush_denormal``), in every case alike: on this CPU
        a backward pass full of them (a confident softmax's underflowing probabilities, as plain DiLoCo's char_lm
        model reaches) runs up to 3x slower, which would count as that case's communication cost. False: torch's
        default.""",
    )
    plots: bool = knob(True, """Write PNG plots (needs matplotlib, the ``test`` extra).""")
    network: NetworkConfig = field(default_factory=NetworkConfig)

    def validate(self) -> None:
        """Raises ConfigError for the first bad value, naming the field, the value and what is allowed."""
        if not self.workloads:
            raise ConfigError(f"workloads={self.workloads!r} is not allowed; choose from: {', '.join(WORKLOADS)}")
        for name in self.workloads:
            check_choice("workloads", name, WORKLOADS)
        for name in self.cases:
            check_choice("cases", name, CASE_HELP)
        for name in self.cases:
            if not any(name in WORKLOADS[w].cases for w in self.workloads):
                raise ConfigError(
                    f"cases={name!r} is not allowed with workloads={','.join(self.workloads)}; it "
                    f"runs with: {', '.join(w for w, spec in WORKLOADS.items() if name in spec.cases)}"
                )
        for name in self.workloads:
            if not self.cases_for(name):
                raise ConfigError(
                    f"workloads={name!r} has none of cases={','.join(self.cases)}; it runs: "
                    f"{', '.join(WORKLOADS[name].cases)}"
                )
        check_range("repeats", self.repeats, low=1, integer=True)
        check_range("steps", self.steps, low=1, integer=True)
        check_range("warmup_steps", self.warmup_steps, low=0, high=self.steps - 1, integer=True)
        check_range("target_accuracy", self.target_accuracy, low=0, high=1, low_open=True)
        check_range("eval_every", self.eval_every, low=1, integer=True)
        check_range("max_epochs", self.max_epochs, low=1, integer=True)
        check_range("sync_every", self.sync_every, low=1, integer=True)
        check_range("diloco_sync_every", self.diloco_sync_every, low=1, integer=True)
        check_range("budget_steps", self.budget_steps, low=1, integer=True)
        check_range("max_steps_factor", self.max_steps_factor, low=1)
        check_range("give_up_factor", self.give_up_factor, low=1)
        check_range("window", self.window, low=0, integer=True)
        needs_target = "char_lm" in self.workloads and not self.window
        if needs_target and self.cases and "lightning_ddp" not in self.cases and not self.ddp_from:
            raise ConfigError(
                f"cases={','.join(self.cases)} is not allowed with workloads=char_lm; it must include lightning_ddp "
                "(the loss it ends its budget with is the target), or take its runs from an earlier benchmark with "
                "ddp_from=<results.json>"
            )
        check_range("payload_mb", self.payload_mb, low=0, low_open=True)
        check_range("payload_iters", self.payload_iters, low=1, integer=True)
        check_range("timeout_s", self.timeout_s, low=0, low_open=True)
        check_range("seed", self.seed, low=0, integer=True)
        self.network.validate()
        if self.ddp_from:
            found = {(r["rate"], r["seed"]) for r in reused_ddp_records(self) if r["workload"] == "char_lm"}
            missing = [
                f"{rate} seed {self.seed_of(k)}"
                for rate in self.network.rate
                for k in range(self.repeats)
                if (rate, self.seed_of(k)) not in found
            ]
            if "char_lm" in self.workloads and missing and self.cases and "lightning_ddp" not in self.cases:
                raise ConfigError(
                    f"ddp_from={self.ddp_from!r} has no lightning_ddp run of char_lm at {', '.join(missing)}; add "
                    "lightning_ddp to cases (it then runs only where the file has none)"
                )

    def scoring_every(self, case: str) -> int:
        """Steps between two scorings of ``case`` on ``char_lm``: ``eval_every``, and at its syncs only."""
        return math.lcm(self.eval_every, sync_period(case, self))

    def window_span(self, case: str) -> tuple[int, int]:
        """``(first, last)`` step of ``case``'s step-time window (``window > 0``): whole scoring intervals, from
        the first scoring at or past ``warmup_steps``."""
        every = self.scoring_every(case)
        first = every * max(1, math.ceil(self.warmup_steps / every))
        return first, first + every * self.window

    def seed_of(self, repeat: int) -> int:
        """The seed repeat ``repeat`` (from 0) runs with."""
        return self.seed + repeat if self.seed_per_repeat else self.seed

    def cases_for(self, workload: str) -> list[str]:
        """The chosen cases (or the default ones) that apply to ``workload``, in the chosen order; for a
        time-to-loss workload, ``lightning_ddp`` first (its run sets the target)."""
        spec = WORKLOADS[workload]
        chosen = [c for c in self.cases or spec.defaults or DEFAULT_CASES if c in spec.cases]
        if spec.metric == "time_to_loss" and "lightning_ddp" in chosen:
            chosen.remove("lightning_ddp")
            chosen.insert(0, "lightning_ddp")
        return chosen


REUSE_MUST_MATCH = ("budget_steps", "eval_every", "warmup_steps", "flush_denormal")
"""Knobs a run whose ``lightning_ddp`` records are reused (``ddp_from``) must share with this one."""
_BEFORE_THE_KNOB = {"flush_denormal": False}
"""What a results file written before a knob existed ran with."""


def reused_ddp_records(cfg: BenchConfig) -> list[dict[str, Any]]:
    """The successful ``lightning_ddp`` records of ``cfg.ddp_from`` for ``cfg``'s workloads, rates and seeds.

    Raises:
        ConfigError: the file is missing or not a benchmark's ``results.json``, or it ran with another value of a
            knob in :data:`REUSE_MUST_MATCH` (naming the knob and both values).
    """
    import json
    from pathlib import Path

    path = Path(cfg.ddp_from)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"ddp_from={cfg.ddp_from!r} is not allowed; it must be a benchmark's results.json ({error})"
        ) from None
    if not isinstance(data, dict) or not {"config", "records"} <= data.keys():
        raise ConfigError(f"ddp_from={cfg.ddp_from!r} is not allowed; it has no config and records of a benchmark")
    for name in REUSE_MUST_MATCH:
        theirs = data["config"].get(name, _BEFORE_THE_KNOB.get(name))
        if theirs != getattr(cfg, name):
            raise ConfigError(
                f"ddp_from={cfg.ddp_from!r} is not allowed with {name}={getattr(cfg, name)!r}: its runs used "
                f"{name}={theirs!r}; rerun with that value or without ddp_from"
            )
    seeds = {cfg.seed_of(r) for r in range(cfg.repeats)}
    return [
        r
        for r in data["records"]
        if r.get("case") == "lightning_ddp"
        and r.get("ok")
        and r.get("workload") in cfg.workloads
        and r.get("rate") in cfg.network.rate
        and r.get("seed") in seeds
    ]


def config_from_saved(saved: dict[str, Any]) -> BenchConfig:
    """The :class:`BenchConfig` a results file was written with (fields it no longer knows are left out)."""
    values = {f.name: saved[f.name] for f in fields(BenchConfig) if f.name in saved}
    if isinstance(values.get("network"), dict):
        known = {f.name for f in fields(NetworkConfig)}
        values["network"] = NetworkConfig(**{k: v for k, v in values["network"].items() if k in known})
    return BenchConfig(**values)


def _expected(kind: Any) -> str:
    """What a value of the field's type looks like, for an error message."""
    return {int: "an integer", float: "a number", bool: "true or false"}.get(
        kind, f"a {getattr(kind, '__name__', kind)}"
    )


def _known_fields() -> list[str]:
    return [f.name for f in fields(BenchConfig) if f.name != "network"] + [
        f"network.{f.name}" for f in fields(NetworkConfig)
    ]


def parse_overrides(overrides: list[str], base: BenchConfig | None = None) -> BenchConfig:
    """A validated :class:`BenchConfig`: ``base`` (default: the defaults) with ``key=value`` overrides applied.

    OmegaConf merges the overrides into the dataclass's schema (``OmegaConf.from_dotlist``) and checks each value's
    type; a list field also takes a plain comma list (``cases=allreduce,periodic``), and an empty one (``cases=``).

    Raises:
        ConfigError: an override without ``=``, an unknown key, or a bad value (naming field, value, allowed).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    hints = {**get_type_hints(BenchConfig), **{f"network.{k}": v for k, v in get_type_hints(NetworkConfig).items()}}
    dotlist = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"{item!r} is not an override; write key=value, e.g. network.rate=1gbit")
        if key not in hints or key == "network":
            raise ConfigError(f"{key} is not a field of the benchmark; known fields: {', '.join(_known_fields())}")
        if hints[key] == list[str] and not value.startswith("["):
            value = "[" + value + "]"  # a comma list, as the command line writes it
        elif hints[key] is str:
            value = repr(value)  # as typed: no YAML reading of a path or a name
        dotlist.append(f"{key}={value}")
    schema = OmegaConf.structured(base if base is not None else BenchConfig())
    try:
        merged = OmegaConf.merge(schema, OmegaConf.from_dotlist(dotlist))
    except (ConfigAttributeError, ConfigKeyError, ValidationError) as error:
        key = str(error.full_key)
        given = next((item.partition("=")[2] for item in overrides if item.partition("=")[0] == key), None)
        raise ConfigError(f"{key}={given!r} is not allowed; it must be {_expected(hints.get(key))}") from None
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, BenchConfig)
    cfg.validate()
    return cfg
