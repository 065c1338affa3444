"""The benchmark's knobs: one dataclass, Hydra-style ``key=value`` overrides, every value checked before any run.

A leaf like :mod:`lightning_sync.config`: it imports nothing of torch or Lightning, so ``--help`` and a bad value
answer at once. :func:`parse_overrides` turns ``["cases=allreduce,periodic", "network.rate=1gbit"]`` into a
validated :class:`BenchConfig`; a mistake raises :class:`~lightning_sync.errors.ConfigError` naming the field, the
value and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from lightning_sync.errors import ConfigError, check_choice, check_range

RATES = ("loopback", "10mbit", "100mbit", "1gbit")
"""``network.rate``: ``loopback`` (both nodes on 127.0.0.1), or the rate of emulated links (root only)."""


@dataclass(frozen=True)
class Workload:
    """What one benchmark run trains and what it measures.

    Attributes:
        name: the ``workloads=`` name.
        metric: ``step_time`` (median ms per optimizer step), ``time_to_accuracy`` (training seconds until the
            test accuracy reaches ``target_accuracy``) or ``bus_bandwidth`` (one gradient payload all-reduced).
        model: keyword arguments of the example module (``SyntheticMLP`` or ``DigitsClassifier``).
        batch_size: samples per batch per rank.
        cases: the cases that make sense for it.
        about: one line for the report.
    """

    name: str
    metric: str
    model: dict[str, Any]
    batch_size: int
    cases: tuple[str, ...]
    about: str


# Every case's name and what it runs; the first six of TRAINING_CASES are the anchors.
CASE_HELP: dict[str, str] = {
    "lightning_ddp": "Lightning's own 'ddp' strategy, its defaults",
    "lightning_ddp_view": "Lightning's DDPStrategy(gradient_as_bucket_view=True)",
    "torch_ddp": "a plain torch loop with DistributedDataParallel, no Lightning",
    "torch_local_sgd": "a plain torch loop with PostLocalSGDOptimizer + PeriodicModelAverager(period=sync_every)",
    "floor": "2 ranks that never communicate (each trains alone on its shard): the compute-only step time",
    "single": "one process with the global batch (2 x batch size), no communication: DDP's computation alone",
    "gloo_allreduce": "raw dist.all_reduce of the payload (payload workload only)",
    "sync_ddp": "our DDPSyncStrategy (torch DDP through the meter)",
    "allreduce": "our AllReduceStrategy, defaults (bucketing=auto)",
    "allreduce_flat": "our AllReduceStrategy(bucketing='flat')",
    "allreduce_overlap": "our AllReduceStrategy(bucketing='overlap')",
    "periodic": "our PeriodicSyncStrategy(mode='local_sgd', sync_every=sync_every)",
    "powersgd": "our AllReduceStrategy(compression='powersgd', powersgd_rank=4)",
    "topk": "our AllReduceStrategy(compression='topk', topk_density=0.01)",
}
TRAINING_CASES = tuple(c for c in CASE_HELP if c != "gloo_allreduce")
PAYLOAD_CASES = ("gloo_allreduce", "allreduce")
DEFAULT_CASES = (
    "lightning_ddp",
    "lightning_ddp_view",
    "torch_ddp",
    "gloo_allreduce",
    "allreduce",
    "periodic",
    "torch_local_sgd",
    "powersgd",
    "topk",
    "floor",
    "single",
)

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            "latency_bound",
            "step_time",
            {"width": 256, "depth": 40},
            64,
            TRAINING_CASES,
            "MLP 40 x 256 (82 tensors, 10.5 MB of gradients), conf/experiment/latency_bound.yaml",
        ),
        Workload(
            "compute_bound",
            "step_time",
            {"width": 256, "depth": 40},
            512,
            TRAINING_CASES,
            "MLP 40 x 256 at batch 512/rank: backward as long as 10.5 MB takes at 1 Gbit, where overlap pays, "
            "conf/experiment/compute_bound.yaml",
        ),
        Workload(
            "bandwidth_bound",
            "step_time",
            {"width": 2048, "depth": 2},
            64,
            TRAINING_CASES,
            "MLP 2 x 2048 (5 tensors, 33.6 MB of gradients), conf/experiment/bandwidth_bound.yaml",
        ),
        Workload(
            "digits",
            "time_to_accuracy",
            {},
            32,
            TRAINING_CASES,
            "digits classifier (conf/model/digits.yaml), trained until its test accuracy reaches the target",
        ),
        Workload(
            "payload",
            "bus_bandwidth",
            {},
            0,
            PAYLOAD_CASES,
            "one float32 gradient payload of payload_mb MiB, all-reduced",
        ),
    )
}


@dataclass
class NetworkConfig:
    """Where the two nodes run."""

    rate: list[str] = field(default_factory=lambda: ["loopback"])
    """``loopback``, or the rate of the emulated links between two network namespaces (``10mbit``, ``100mbit``,
    ``1gbit``; needs root, tbf on both ends of each link); a comma list runs each in turn."""
    prefix: str = ""
    """Name prefix of the namespaces (empty: ``lb`` and 4 digits of the process id); at most 6 characters."""

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

    workloads: list[str] = field(default_factory=lambda: ["latency_bound"])
    """Which workloads: ``latency_bound``, ``compute_bound``, ``bandwidth_bound`` (step time), ``digits`` (time to
    accuracy), ``payload`` (bus bandwidth of one all-reduce)."""
    cases: list[str] = field(default_factory=list)
    """Which cases, run in this order in every repeat (A B A B); a workload runs those that apply to it. Empty:
    lightning_ddp, lightning_ddp_view, torch_ddp, (payload:) gloo_allreduce, allreduce, periodic, torch_local_sgd,
    powersgd, topk, floor, single."""
    repeats: int = 3
    """Rounds over all cases; the report gives the median over them."""
    steps: int = 60
    """Step-time workloads: optimizer steps per run."""
    warmup_steps: int = 20
    """Step-time workloads: steps left out of the median (``bucketing=auto`` tunes on its first 19)."""
    target_accuracy: float = 0.95
    """Digits: the test accuracy that ends a run."""
    eval_every: int = 8
    """Digits: test accuracy is measured every this many optimizer steps, with the clock stopped."""
    max_epochs: int = 40
    """Digits: a run that has not reached the target by then reports ``null``."""
    sync_every: int = 8
    """``periodic`` and ``torch_local_sgd``: optimizer steps per model average."""
    payload_mb: float = 25.0
    """Payload workload: MiB of float32 gradient all-reduced."""
    payload_iters: int = 5
    """Payload workload: timed all-reduces per run (after one untimed)."""
    timeout_s: float = 900.0
    """Seconds one run may take, start-up included; it bounds every collective as well."""
    seed: int = 0
    """Seed of the model's initial weights and of the data order."""
    plots: bool = True
    """Write PNG plots (needs matplotlib, the ``test`` extra)."""
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
        check_range("payload_mb", self.payload_mb, low=0, low_open=True)
        check_range("payload_iters", self.payload_iters, low=1, integer=True)
        check_range("timeout_s", self.timeout_s, low=0, low_open=True)
        check_range("seed", self.seed, low=0, integer=True)
        self.network.validate()

    def cases_for(self, workload: str) -> list[str]:
        """The chosen cases (or the default ones) that apply to ``workload``, in the chosen order."""
        return [c for c in self.cases or DEFAULT_CASES if c in WORKLOADS[workload].cases]


def _convert(name: str, text: str, kind: Any) -> Any:
    """``text`` as a value of the field's type (``list[str]`` from a comma list)."""
    if kind == list[str]:
        return [part.strip() for part in text.split(",") if part.strip()]
    if kind is bool:
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ConfigError(f"{name}={text!r} is not allowed; it must be true or false")
    for number in (int, float):
        if kind is number:
            try:
                return number(text)
            except ValueError:
                expected = "an integer" if number is int else "a number"
                raise ConfigError(f"{name}={text!r} is not allowed; it must be {expected}") from None
    return text


def _is_group(value: Any) -> bool:
    return hasattr(value, "__dataclass_fields__")


def parse_overrides(overrides: list[str], base: BenchConfig | None = None) -> BenchConfig:
    """A validated :class:`BenchConfig`: ``base`` (default: the defaults) with ``key=value`` overrides applied.

    Raises:
        ConfigError: an override without ``=``, an unknown key, or a bad value (naming field, value, allowed).
    """
    cfg = base if base is not None else BenchConfig()
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"{item!r} is not an override; write key=value, e.g. network.rate=1gbit")
        target: Any = cfg
        *path, leaf = key.split(".")
        for part in path:
            if part not in {f.name for f in fields(target)} or not _is_group(getattr(target, part)):
                raise ConfigError(f"{key}={value!r}: {part!r} is not a group; groups: network")
            target = getattr(target, part)
        hints = get_type_hints(type(target))
        names = [f.name for f in fields(target) if not _is_group(getattr(target, f.name))]
        if leaf not in names:
            scope = ".".join(path) + "." if path else ""
            allowed = [scope + n for n in names] + ([] if path else ["network.rate", "network.prefix"])
            raise ConfigError(f"{key} is not a field of the benchmark; known fields: {', '.join(allowed)}")
        setattr(target, leaf, _convert(key, value, hints[leaf]))
    cfg.validate()
    return cfg
