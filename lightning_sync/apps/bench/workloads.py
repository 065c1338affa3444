"""The benchmark's catalogue: its workloads (what a run trains and what it measures) and its cases (what runs).

A leaf like :mod:`lightning_sync.apps.bench.config`, which checks ``workloads=`` and ``cases=`` against it: it
imports nothing of torch or Lightning. The cases that run one of our strategies come from the shared catalogue
(:mod:`lightning_sync.apps.cases`); the anchors (Lightning's and torch's DDP, torch's local SGD), the bounds and the
raw all-reduce are the benchmark's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_sync.apps.cases import Case, select


@dataclass(frozen=True)
class Workload:
    """What one benchmark run trains and what it measures.

    Attributes:
        name: the ``workloads=`` name.
        metric: ``step_time`` (median ms per optimizer step), ``time_to_accuracy`` (training seconds until the
            test accuracy reaches ``target_accuracy``), ``time_to_loss`` (training seconds until the validation
            loss reaches the loss Lightning DDP ends its budget with) or ``bus_bandwidth`` (one gradient payload
            all-reduced).
        model: keyword arguments of the example module (``SyntheticMLP``, ``DigitsClassifier`` or ``CharGPT``).
        batch_size: samples per batch per rank.
        cases: the cases that make sense for it.
        about: one line for the report.
        defaults: the cases it runs when ``cases=`` is empty (empty: :data:`DEFAULT_CASES`).
        data: keyword arguments of the example data module.
    """

    name: str
    metric: str
    model: dict[str, Any]
    batch_size: int
    cases: tuple[str, ...]
    about: str
    defaults: tuple[str, ...] = ()
    data: dict[str, Any] = field(default_factory=dict)


OUR_CASES: dict[str, Case] = select(
    *("sync_ddp", "allreduce", "allreduce_flat", "allreduce_overlap", "periodic", "diloco", "streaming_diloco"),
    *("diloco_8", "streaming_diloco_8_k2", "diloco_12", "streaming_diloco_12", "streaming_diloco_8"),
    *("powersgd", "topk", "ps_async", "sparseloco", "sparseloco_k256", "sparseloco_k256_8"),
)
"""The cases that run one of our strategies, from the catalogue (:mod:`lightning_sync.apps.cases`) by their
benchmark names; a case's ``period_knob`` (``sync_every``, ``diloco_sync_every``) sets its period (a
:class:`~lightning_sync.apps.bench.config.BenchConfig` knob)."""

# Every case's name and what it runs; the first six are the anchors and bounds.
CASE_HELP: dict[str, str] = {
    "lightning_ddp": "Lightning's own 'ddp' strategy, its defaults",
    "lightning_ddp_view": "Lightning's DDPStrategy(gradient_as_bucket_view=True)",
    "torch_ddp": "a plain torch loop with DistributedDataParallel, no Lightning",
    "torch_local_sgd": "a plain torch loop with PostLocalSGDOptimizer + PeriodicModelAverager(period=sync_every)",
    "floor": "2 ranks that never communicate (each trains alone on its shard): the compute-only step time",
    "single": "one process with the global batch (2 x batch size), no communication: DDP's computation alone",
    "gloo_allreduce": "raw dist.all_reduce of the payload (payload workload only)",
    **{name: case.about for name, case in OUR_CASES.items()},
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
LM_CASES = (
    "lightning_ddp",
    "torch_ddp",
    "torch_local_sgd",
    "allreduce",
    "powersgd",
    "topk",
    "periodic",
    "diloco",
    "streaming_diloco",
    "diloco_8",
    "streaming_diloco_8",
    "streaming_diloco_8_k2",
    "diloco_12",
    "streaming_diloco_12",
    "ps_async",
    "floor",
    "single",
)
"""``char_lm``'s default cases: the anchors, ours, and the two bounds."""
BOUNDS = ("floor", "single")
"""Cases that run the budget without a target: what DDP's steps cost without communication."""


def sync_period(case: str, cfg: Any) -> int:
    """Optimizer steps between two syncs of a periodic case (1 for every other): the replicas agree only then."""
    if case == "torch_local_sgd":
        return int(cfg.sync_every)
    spec = OUR_CASES.get(case)
    if spec is None or spec.knobs.get("mode") not in ("local_sgd", "diloco"):
        return 1
    return int(spec.arguments(cfg)["sync_every"])


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
            "char_lm",
            "time_to_loss",
            {},
            16,
            TRAINING_CASES,
            "character-level GPT (conf/model/char_gpt.yaml, CPython's reference text): training seconds until the "
            "validation loss reaches the one Lightning DDP ends budget_steps with",
            LM_CASES,
            {"val_windows": 64},
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
