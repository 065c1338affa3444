"""Async and ssp parameter servers with AdamW against sync, on the digits, through the app: over seeds, with spread.

Each seed runs the Hydra app (2 forked workers, one dedicated server) with AdamW at lr 0.003 for 10 epochs in
``ps:sync``, ``ps:async`` and ``ps:ssp/2`` (``push_scale`` auto: each async push is a step of ``lr / W``), seed by
seed, so a drift of the machine's load spreads over the cases alike. The claim: the median test accuracy of async
and of ssp/2 over the seeds within 2 points of sync's, and every run learned (>= 0.85).

This was ``tests/test_ps_async.py``'s test until it failed about one run in three on a quiet 2-core machine: one
async run's order of updates follows how the OS shares the cores between the workers (async 0.942/0.936/0.931
against sync 0.972/0.958/0.956 once; a run under a loaded test worker fell to 0.878), so the claim needs seeds and
their spread, not one pass or fail. The tests keep what does not depend on the scheduler: the same comparison with
the order of the pushes fixed by the test, in one process and against a real server (``tests/test_ps_async.py``).

Prints one line per run and a table per case (``median``, ``mean [min, max]`` over the seeds, the difference of the
medians to sync) with the verdict; writes ``<out>/records.json`` (every run's accuracy, the aggregates, the
provenance). Exit code 1 when the claim does not hold.

    python benchmarks/ps_async_adamw.py                         # seeds 0-4, about 15 runs of 10-20 s on 2 cores
    python benchmarks/ps_async_adamw.py --seeds 0,1,2 --out /tmp/ps_async_adamw
    python benchmarks/ps_async_adamw.py callbacks=[default,pacer] callbacks.pacer.step_s=0.02   # paced batches
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

CASES = ("ps:sync", "ps:async", "ps:ssp/2")
ADAMW = ["model.optimizer=adamw", "model.lr=0.003"]
BAR_POINTS = 2.0  # median test accuracy of async and ssp/2 within this many points of sync's
FLOOR = 0.85  # every run must have learned


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs per run")
    parser.add_argument("--out", default="outputs/ps_async_adamw", help="folder for the runs and records.json")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. model.lr=0.002")
    return parser


def summarize(runs: dict[str, list[float]]) -> dict[str, Any]:
    """Per case the median, mean, min and max over the seeds and the median's difference to sync in points; and
    whether the claim holds (every case within :data:`BAR_POINTS` of sync, every run at least :data:`FLOOR`)."""
    sync = statistics.median(runs["ps:sync"])
    cases = {
        case: {
            "median": statistics.median(values),
            "mean": statistics.fmean(values),
            "min": min(values),
            "max": max(values),
            "points_vs_sync": 100 * (statistics.median(values) - sync),
        }
        for case, values in runs.items()
    }
    within = all(abs(c["points_vs_sync"]) <= BAR_POINTS for c in cases.values())
    learned = min(min(values) for values in runs.values()) >= FLOOR
    return {"cases": cases, "holds": within and learned, "within_bar": within, "all_learned": learned}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from lightning_sync.apps.compare import CASES as APP_CASES
    from lightning_sync.apps.provenance import provenance
    from lightning_sync.apps.runner import run_case

    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    runs: dict[str, list[float]] = {case: [] for case in CASES}
    for seed in seeds:
        common = ["strategy.start_method=fork", "trainer.limit_val_batches=0", f"seed={seed}"]
        common += [f"trainer.max_epochs={args.epochs}", *ADAMW, *args.overrides]
        for case in CASES:
            started = time.monotonic()
            folder = out / case.replace(":", "_").replace("/", "_") / f"seed{seed}"
            acc = float(run_case(APP_CASES[case] + common, folder)["test"]["test/acc"])
            runs[case].append(acc)
            load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
            print(f"{case:10s} seed {seed}: test acc {acc:.4f} ({time.monotonic() - started:.0f} s, load {load:.1f})")
    summary = summarize(runs)
    print(f"\nAdamW lr 0.003, {args.epochs} epochs, seeds {seeds}: test accuracy")
    print(f"{'case':10s} {'median':>7s} {'mean [min, max]':>24s} {'vs sync':>8s}")
    for case, c in summary["cases"].items():
        spread = f"{c['mean']:.4f} [{c['min']:.4f}, {c['max']:.4f}]"
        print(f"{case:10s} {c['median']:7.4f} {spread:>24s} {c['points_vs_sync']:+7.2f}")
    verdict = "holds" if summary["holds"] else "does not hold"
    print(f"claim (medians within {BAR_POINTS:g} points of sync, every run >= {FLOOR}): {verdict}")
    out.mkdir(parents=True, exist_ok=True)
    record = {"seeds": seeds, "epochs": args.epochs, "runs": runs, **summary, "provenance": provenance()}
    (out / "records.json").write_text(json.dumps(record, indent=2))
    return 0 if summary["holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
