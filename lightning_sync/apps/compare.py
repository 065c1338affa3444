"""The main job: train two workloads with each sync mode over several seeds and print one table per workload.

``python -m lightning_sync.compare`` (or ``lightning-sync-compare``, or ``make compare``) runs, through the same
Hydra config as ``lightning_sync.apps.train`` (2 CPU ranks, forked), every case of each workload once per seed:

- ``digits``: the digits classifier (:data:`CASES`, every mode), 30 epochs, test accuracy on a fixed test split;
- ``char_lm``: the character-level language model (``experiment=char_lm``, :data:`LM_CASES`: DDP and the modes
  that send fewer bytes), 300 steps, test loss in nats per character. :data:`LM_OPT_IN_CASES` (streaming DiLoCo,
  ps async, async local SGD) run when named in ``--cases``; the ``ps`` ones train on the same samples as the rest.

A seed sets the initial weights and the data order (the digits' train/test split stays fixed, so every seed is
scored on the same test samples). Runs go seed by seed, each seed through every case, so a drift of the machine's
load spreads over all cases alike. Each table row gives the metric's mean and its spread, the lowest and highest
value over the seeds (``mean [min, max]``); a case whose range overlaps the ``ddp`` row's is a tie with it and the
``vs ddp`` column says ``tie``, else ``better`` or ``worse``. ``ms/step`` is the median over seeds of each run's
median step; ``meter bytes/step`` is what the strategy's comm meter counts each rank sending per optimizer step:
the payload the ring formula assigns a rank (compressed where the mode compresses), not bytes measured on a wire.

Results go to ``<out>/results.json`` (every run's summary by workload, case and seed, the aggregates, and the
provenance: commit, command, versions, CPU) and ``<out>/results.md``; each run's folder is
``<out>/<workload>/<case>/seed<k>``. Lightning's banners are silenced; one progress display and one result line per
finished run; a diverged run shows ``diverged at step N`` and counts as no value.

    python -m lightning_sync.compare                           # both workloads, seeds 0,1,2
    python -m lightning_sync.compare --workloads digits --seeds 0 --cases ddp,allreduce
    python -m lightning_sync.compare --smoke                   # a few steps of a few cases, one seed (CI)
    python -m lightning_sync.compare --cases ddp model.lr=0.05 # Hydra overrides for every run
    python -m lightning_sync.compare --workloads char_lm --cases periodic:diloco/8,ps:async_local/8
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_sync._exit import skip_final_collection
from lightning_sync.apps._console import ProgressReport, quiet_lightning
from lightning_sync.apps.cases import hydra_cases
from lightning_sync.apps.markdown import format_cell, markdown_table
from lightning_sync.apps.provenance import provenance
from lightning_sync.apps.runner import available_strategies, case_dir_name, run_case
from lightning_sync.apps.stats import spread, verdict

# The cases of each workload, from the catalogue (lightning_sync.apps.cases): {case: Hydra overrides}.
CASES: dict[str, list[str]] = hydra_cases(
    [
        *("ddp", "ddp+fp16_hook", "ddp+powersgd_hook"),
        *("allreduce", "allreduce+fp16", "allreduce+bf16", "allreduce+topk1%", "allreduce+powersgd4"),
        *("periodic:local_sgd/8", "periodic:diloco/8", "ps:sync", "ps:async", "ps:ssp/2"),
    ],
    digits=True,
)
# The language model's: the reference and the modes that cut bytes (the regime this workload is sized for).
LM_CASES = hydra_cases(("ddp", "allreduce+powersgd4", "periodic:local_sgd/8", "periodic:diloco/8"))
# Language-model cases that run only when named in --cases: not part of the main job's ten minutes.
LM_OPT_IN_CASES = hydra_cases(
    [
        *("periodic:streaming_diloco/16", "periodic:streaming_diloco/8", "periodic:streaming_diloco/8/k2"),
        *("periodic:streaming_diloco/16/tau1", "periodic:streaming_diloco/12", "ps:async", "ps:async/push_scale_1"),
        *("ps:async_local/8", "ps:async_local/auto", "periodic:diloco/16", "periodic:diloco/30"),
        *(
            "periodic:streaming_diloco/30",
            *(
                f"periodic:{v}/{h}"
                for h in (8, 16, 30)
                for v in ("sparseloco", "sparseloco_fp32", "sparseloco_k256", "diloco_int8")
            ),
        ),
    ]
)
REFERENCE = "ddp"
"""The case every other case of a workload is compared with (``vs ddp``)."""
DEFAULT_SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Workload:
    """One model and data set the job trains with every case of ``cases``.

    Attributes:
        name: the ``--workloads`` name.
        title: the table's heading.
        cases: ``{case: Hydra overrides}``.
        common: overrides for every run of the workload (after the case's).
        metric: the summary's test metric the table reports (``test/acc``, ``test/loss``).
        label: the metric's column header.
        higher_is_better: whether a larger metric is better (``vs ddp``).
        scale: the metric is shown times this (100: a percentage).
        spec: the shown value's format.
        smoke: overrides of a ``--smoke`` run.
        opt_in: more cases that run only when named in ``--cases``.
        per_case: overrides of some cases, after ``common`` (``ps`` counts every worker's steps in ``max_steps``:
            its cases get the ranks times as many, so that every case trains on the same samples).
    """

    name: str
    title: str
    cases: dict[str, list[str]]
    common: list[str]
    metric: str
    label: str
    higher_is_better: bool
    scale: float = 1.0
    spec: str = ".2f"
    smoke: list[str] = field(default_factory=list)
    opt_in: dict[str, list[str]] = field(default_factory=dict)
    per_case: dict[str, list[str]] = field(default_factory=dict)


def workloads(epochs: int = 30, steps: int = 300) -> dict[str, Workload]:
    """The job's workloads: ``digits`` trained ``epochs`` epochs, ``char_lm`` ``steps`` optimizer steps."""
    smoke_batches = ["+trainer.limit_train_batches=4", "+trainer.limit_val_batches=1"]
    return {
        "digits": Workload(
            name="digits",
            title=f"Digits classifier (26k parameters), 2 CPU ranks (gloo), {epochs} epochs",
            cases=CASES,
            # the split stays that of seed 0: every seed is scored on the same 360 test samples
            common=[f"trainer.max_epochs={epochs}", "data.seed=0"],
            metric="test/acc",
            label="test acc %",
            higher_is_better=True,
            scale=100.0,
            spec=".2f",
            smoke=["trainer.max_epochs=1", *smoke_batches],
        ),
        "char_lm": Workload(
            name="char_lm",
            title=f"Character language model (CharGPT, 418k parameters), 2 CPU ranks (gloo), {steps} steps",
            cases=LM_CASES,
            common=[
                "experiment=char_lm",
                f"trainer.max_steps={steps}",
                f"trainer.val_check_interval={steps}",
                "callbacks=none",  # no checkpoints: nothing resumes these runs
            ],
            metric="test/loss",
            label="test loss nats/char",
            higher_is_better=False,
            spec=".3f",
            smoke=["trainer.max_steps=4", "trainer.val_check_interval=4", "data.val_windows=4"],
            opt_in=LM_OPT_IN_CASES,
            per_case={
                case: [f"trainer.max_steps={2 * steps}"] for case, o in LM_OPT_IN_CASES.items() if "strategy=ps" in o
            },
        ),
    }


def available_cases(cases: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """The cases (default: the digits' :data:`CASES`) whose strategy config exists in this installation."""
    names = available_strategies()
    return {k: v for k, v in (CASES if cases is None else cases).items() if v[0].split("=", 1)[1] in names}


def metric_value(summary: dict[str, Any], metric: str) -> float | None:
    """A run's test metric (``None`` if it diverged or was not tested)."""
    if summary.get("diverged"):
        return None
    value = summary.get("test", {}).get(metric)
    return float(value) if value is not None else None


def aggregate(work: Workload, runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per case of ``runs`` (``{case: summaries, one per seed}``): the metric's values, mean and range,
    ``vs_ddp``, the median ms/step and the mean meter bytes per step."""
    spreads = {case: spread([metric_value(s, work.metric) for s in summaries]) for case, summaries in runs.items()}
    reference = spreads.get(REFERENCE)
    rows = []
    for case, summaries in runs.items():
        steps = [s["step_time_ms"] for s in summaries if s.get("step_time_ms") is not None]
        sent = [s["bytes_sent_per_step"] for s in summaries if s.get("bytes_sent_per_step") is not None]
        found = spreads[case]
        rows.append({
            "case": case,
            "metric": work.metric,
            "values": [metric_value(s, work.metric) for s in summaries],
            "seeds": [s.get("seed") for s in summaries],
            "mean": None if found is None else found.mean,
            "min": None if found is None else found.low,
            "max": None if found is None else found.high,
            "spread": "min-max over seeds",
            "vs_ddp": "reference" if case == REFERENCE else verdict(found, reference, work.higher_is_better),
            "diverged_seeds": [s.get("seed") for s in summaries if s.get("diverged")],
            "step_time_ms_median": statistics.median(steps) if steps else None,
            "meter_bytes_sent_per_step": statistics.fmean(sent) if sent else None,
        })  # fmt: skip
    return rows


def format_table(work: Workload, rows: list[dict[str, Any]]) -> str:
    """A workload's aggregated rows as a Markdown table: mean [min, max] of the metric, the verdict against ddp,
    median ms/step and the meter's bytes per step."""
    ref = next((r["meter_bytes_sent_per_step"] for r in rows if r["case"] == REFERENCE), None)
    header = ("mode", f"{work.label} mean [min, max]", "vs ddp", "ms/step", "meter bytes/step", "vs ddp bytes")
    cells = []
    for r in rows:
        if r["mean"] is None:
            value = "diverged" if r["diverged_seeds"] else "-"
        else:
            s = work.scale
            value = f"{s * r['mean']:{work.spec}} [{s * r['min']:{work.spec}}, {s * r['max']:{work.spec}}]"
            if r["diverged_seeds"]:
                value += f" (diverged: seed {','.join(map(str, r['diverged_seeds']))})"
        sent = r["meter_bytes_sent_per_step"]
        cells.append((
            r["case"],
            value,
            r["vs_ddp"],
            format_cell(r["step_time_ms_median"], ".2f"),
            format_cell(sent, ",.0f"),
            f"{sent / ref:.3f}" if (sent is not None and ref) else "-",
        ))  # fmt: skip
    return markdown_table(header, cells, align="lrlrrr")


def format_results(results: dict[str, Any]) -> str:
    """Every workload's table of a ``results.json`` (as :func:`main` writes it), each under its title."""
    parts = []
    every = workloads(**results.get("sizes", {}))
    for name, block in results["workloads"].items():
        work = every[name]
        seeds = ", ".join(map(str, results["seeds"]))
        parts.append(f"### {block['title']}, seeds {seeds}\n\n{format_table(work, block['rows'])}")
    return "\n\n".join(parts)


def _result_line(index: int, total: int, label: str, work: Workload, summary: dict[str, Any], seconds: float) -> str:
    """One line for a finished run: its metric (or where it diverged), ms/step and meter bytes per step."""
    head = f"[{index}/{total}] {label:<34}"
    if summary.get("diverged"):
        body = (
            f"DIVERGED at step {summary.get('diverged_at_step')} ({summary.get('diverged_reason', 'loss')}, "
            f"training loss {summary.get('diverged_loss', math.nan):.4g})"
        )
    else:
        value = metric_value(summary, work.metric)
        shown = "-" if value is None else format(work.scale * value, work.spec)
        body = (
            f"{work.label} {shown:>7}  {format_cell(summary.get('step_time_ms'), '.2f'):>6} ms/step  "
            f"{format_cell(summary.get('bytes_sent_per_step'), ',.0f'):>9} bytes/step"
        )
    return f"{head} {body}  ({seconds:.0f} s)"


# ---------------------------------------------------------------------------------------------------- the job
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="digits,char_lm", help="comma-separated: digits, char_lm")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds (default: 0,1,2; with --smoke: 0)")
    parser.add_argument("--epochs", type=int, default=30, help="training epochs per digits run")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps per char_lm run")
    # argparse %-formats help strings: a case name's % must be doubled
    cases = ", ".join(dict.fromkeys([*CASES, *LM_CASES, *LM_OPT_IN_CASES])).replace("%", "%%")
    parser.add_argument("--cases", default="", help="comma-separated subset (of each workload's cases): " + cases)
    parser.add_argument("--out", default="outputs/compare", help="folder for the runs and the results")
    parser.add_argument("--smoke", action="store_true", help="a few steps per run, seed 0 only unless --seeds (CI)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. model.lr=0.05")
    return parser


def _parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        sys.exit(f"error: --seeds={text!r} is not allowed; give distinct integers, e.g. 0,1,2")
    return seeds


def _plan(args: argparse.Namespace) -> dict[str, Workload]:
    """The workloads to run, each with only the cases asked for; exits with one line on a bad argument."""
    if args.epochs < 1 or args.steps < 1:
        sys.exit(f"error: --epochs={args.epochs} and --steps={args.steps} are not allowed; both must be >= 1")
    every = workloads(args.epochs, args.steps)
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in every]
    if unknown or not names:
        sys.exit(f"error: --workloads={args.workloads!r} is not allowed; choose from: {', '.join(every)}")
    wanted = [c for c in args.cases.split(",") if c]
    known = {c for name in names for c in [*every[name].cases, *every[name].opt_in]}
    unknown = [c for c in wanted if c not in known]
    if unknown:
        sys.exit(f"error: --cases {','.join(unknown)} unknown; choose from: {', '.join(sorted(known))}")
    plan = {}
    for name in names:
        named = {c: o for c, o in every[name].opt_in.items() if c in wanted}
        cases = {c: o for c, o in available_cases({**every[name].cases, **named}).items() if not wanted or c in wanted}
        if cases:
            plan[name] = Workload(**{**every[name].__dict__, "cases": cases})
    return plan


def main(argv: list[str] | None = None) -> None:
    skip_final_collection()
    args = _parser().parse_args(argv)
    seeds = _parse_seeds(args.seeds) if args.seeds is not None else [0] if args.smoke else list(DEFAULT_SEEDS)
    plan = _plan(args)
    quiet_lightning()
    out = Path(args.out)
    base = ["strategy.start_method=fork", "trainer.enable_progress_bar=false"]
    jobs = [(seed, name, case) for seed in seeds for name, work in plan.items() for case in work.cases]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {c: [] for c in w.cases} for name, w in plan.items()}
    durations: list[float] = []
    started_job = time.perf_counter()
    for index, (seed, name, case) in enumerate(jobs, start=1):
        work = plan[name]
        label = f"{name} {case} s{seed}"
        progress = ProgressReport(
            label=f"[{index}/{len(jobs)}] {label}",
            later_runs=len(jobs) - index,
            run_seconds=statistics.mean(durations) if durations else None,
        )
        overrides = [*work.cases[case], *base, *work.common, *work.per_case.get(case, []), f"seed={seed}"]
        if args.smoke:
            overrides += work.smoke
        overrides += args.overrides
        started = time.perf_counter()
        summary = run_case(overrides, out / name / case_dir_name(case) / f"seed{seed}", callbacks=[progress])
        durations.append(time.perf_counter() - started)
        runs[name][case].append({"seed": seed, "overrides": overrides, "wall_s": durations[-1], **summary})
        print(_result_line(index, len(jobs), label, work, summary, durations[-1]), flush=True)
    results = {
        "provenance": provenance(),
        "seeds": seeds,
        "smoke": args.smoke,
        "sizes": {"epochs": args.epochs, "steps": args.steps},
        "overrides": args.overrides,
        "wall_s": time.perf_counter() - started_job,
        "workloads": {
            name: {
                "title": work.title.rsplit(", ", 1)[0] + ", smoke: a few steps" if args.smoke else work.title,
                "metric": work.metric,
                "spread": "min-max over seeds; overlapping ranges are a tie",
                "rows": aggregate(work, runs[name]),
                "runs": runs[name],
            }
            for name, work in plan.items()
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    text = format_results(results)
    (out / "results.md").write_text(text + "\n")
    extra = f"; overrides: {' '.join(args.overrides)}" if args.overrides else ""
    print(f"\n{text}\n\nmean [min, max] over seeds; a range overlapping ddp's is a tie{extra}")
    print(f"whole job: {results['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
