"""Parameter-server sync modes under a straggler, through Lightning: samples/s, staleness and test accuracy.

``W`` workers (default 3) train the digits classifier with ``strategy=ps``; worker ``--slow-worker`` is made
``--slowdown`` times slower (``strategy.slow_worker``/``strategy.slowdown``: after each push it sleeps
``slowdown - 1`` times what its whole step took, round trip included). Every mode gets the same sample budget,
``--epochs`` epochs' worth of samples over all workers (in async/ssp ``max_epochs`` counts them so), and the modes
run alternately, ``--rounds`` times, so a slow patch of the machine hits every mode alike. Per mode it reports the
median over the rounds of the
training throughput (samples per second over all workers, from the servers' version on worker 0's clock, the first
``--skip`` of the updates and all of start-up left out: :meth:`lightning_sync.apps.ps_study.PSRun.throughput`), its
ratio to sync, the staleness of every push (mean and max over the rounds), worker 0's median step time and the final
test accuracy. A table goes to stdout and everything measured to ``<out>/results.json``.

What bounds the gain: if the straggler's whole step is ``k`` times as long, sync goes at its pace and async at
``((W - 1) k + 1) / W`` times that (2.33x for ``W = 3, k = 3``) as long as the fast workers keep their own pace. Two
things get in the way here. (1) The straggler's step is measured, so the slowdown is only as exact as that
(printed as ``the straggler made k x fewer pushes``). (2) The 3 workers and the server process share 2 cores
(with whatever else runs there: the 1-minute load average before each run is printed), so async's fast workers,
which never wait, slow each other down; the CPU time of the worker processes during training is printed too. ssp
with ``max_staleness = s`` lets the fast workers lead by ``s`` steps only: under a straggler that is slow all the
time it settles at the straggler's pace, like sync. Its gain is over stragglers that come and go: ``--hiccups p``
makes each batch of every worker ``--slowdown`` times slower with probability ``p`` instead, and the report says how
much of async's gain over sync each ssp keeps. Checkpoints and validation are off in every run (``callbacks=none``,
``limit_val_batches=0``), so that only training is timed.

    python benchmarks/ps_straggler.py                                 # sync, async, ssp:2; 3 rounds; 20 epochs
    python benchmarks/ps_straggler.py --hiccups 0.1                   # stragglers that come and go
    python benchmarks/ps_straggler.py --placement colocated           # servers as threads of the first workers
    python benchmarks/ps_straggler.py --modes sync async ssp:2 ssp:8 model.lr=0.05   # Hydra overrides last
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

TARGET = 1.5  # async and ssp should process samples at least this many times as fast as sync


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["sync", "async", "ssp:2"], help="sync, async or ssp[:s]")
    parser.add_argument("--rounds", type=int, default=3, help="repeats; each round runs every mode once")
    parser.add_argument("--epochs", type=int, default=20, help="sample budget: epochs' worth over all workers")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--slow-worker", type=int, default=2, help="rank of the straggler (-1: none)")
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument(
        "--hiccups",
        type=float,
        default=0.0,
        metavar="CHANCE",
        help="stragglers that come and go: every worker makes each batch --slowdown x slower with this probability "
        "(StragglerCallback, seeded per worker and round) instead of one worker slow all the time",
    )
    parser.add_argument("--num-servers", type=int, default=1)
    parser.add_argument("--placement", default="dedicated", choices=("dedicated", "colocated"))
    parser.add_argument("--batch-size", type=int, default=32, help="samples per batch per worker")
    parser.add_argument("--skip", type=float, default=0.1, help="share of the updates left out at the start")
    parser.add_argument("--out", default="outputs/ps_straggler", help="folder for the runs and results.json")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. model.lr=0.05")
    return parser


def _effective_slowdown(rates: list[float], slow_worker: int) -> float | None:
    """How many times fewer pushes the straggler made than the mean fast worker (``None`` without a straggler)."""
    if not 0 <= slow_worker < len(rates) or rates[slow_worker] <= 0:
        return None
    fast = [r for i, r in enumerate(rates) if i != slow_worker]
    return statistics.fmean(fast) / rates[slow_worker]


def _run_record(run: Any, round_index: int, load: tuple[float, float], args: argparse.Namespace) -> dict[str, Any]:
    stale = [s for worker in run.staleness() for s in worker]
    rates = run.worker_push_rates(args.skip)
    return {
        "name": run.name,
        "round": round_index,
        "run_dir": str(run.run_dir),
        "throughput": run.throughput(args.skip),
        "worker_push_rates": rates,
        "straggler_push_ratio": _effective_slowdown(rates, args.slow_worker),
        "worker_cpu_cores": run.cpu_cores_used(),
        "updates": run.updates,
        "training_s": run.training_s,
        "wall_s": run.wall_s,
        "staleness_mean": statistics.fmean(stale) if stale else None,
        "staleness_max": max(stale) if stale else None,
        "test_acc": run.test_accuracy,
        "step_time_ms": run.summary.get("step_time_ms"),
        "loadavg_1min_before_after": list(load),
    }


def _diagnosis(records: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """What bounds async's gain here: how much slower the straggler really was, and how busy the cores were."""
    lines = []
    ratios = [r["straggler_push_ratio"] for r in records if r["name"] == "async" and r["straggler_push_ratio"]]
    if ratios:
        k, w = statistics.median(ratios), args.workers
        lines.append(
            f"async: the straggler made {k:.2f}x fewer pushes than a fast worker "
            f"(slowdown={args.slowdown:g}); with fast workers as fast as in sync, async could reach "
            f"((W-1)k+1)/W = "
            f"{((w - 1) * k + 1) / w:.2f}x sync"
        )
    for name in dict.fromkeys(r["name"] for r in records):
        cores = statistics.median(r["worker_cpu_cores"] for r in records if r["name"] == name)
        lines.append(
            f"{name}: worker processes used {cores:.2f} of {os.cpu_count()} cores during training (median; "
            f"{'plus the server process' if args.placement == 'dedicated' else 'servers included'})"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.rounds < 1 or args.epochs < 1:
        sys.exit("error: --rounds and --epochs must be >= 1")
    if not 0.0 <= args.hiccups <= 1.0:
        sys.exit(f"error: --hiccups={args.hiccups} is not allowed; it must be a probability in [0, 1]")
    if args.hiccups:
        args.slow_worker = -1  # every worker may be slow, none all the time
    from lightning_sync.apps.ps_study import format_table, ps_overrides, run_ps, summarize

    out = Path(args.out)
    runs, records = [], []
    total = args.rounds * len(args.modes)
    from lightning_sync.callbacks import StragglerCallback

    pattern = (
        f"each batch of every worker {args.slowdown:g}x slower with probability {args.hiccups:g}"
        if args.hiccups
        else f"worker {args.slow_worker} {args.slowdown:g}x slower, strategy.slowdown"
    )
    print(
        f"{args.workers} workers ({pattern}), {args.num_servers} server(s) "
        f"{args.placement}, batch {args.batch_size}, {args.epochs} epochs' worth of samples, {args.rounds} "
        f"alternating rounds; {os.cpu_count()} CPU cores",
        flush=True,
    )
    for round_index in range(1, args.rounds + 1):
        for spec in args.modes:
            overrides = ps_overrides(
                spec,
                workers=args.workers,
                slow_worker=args.slow_worker,
                slowdown=args.slowdown,
                num_servers=args.num_servers,
                placement=args.placement,
                epochs=args.epochs,
                batch_size=args.batch_size,
                extra=args.overrides,
            )
            before = os.getloadavg()[0]
            hiccups = [StragglerCallback(None, args.slowdown, args.hiccups, seed=round_index)] if args.hiccups else []
            run = run_ps(spec, overrides, out / f"round{round_index}" / spec.replace(":", "_"), callbacks=hiccups)
            runs.append(run)
            records.append(_run_record(run, round_index, (before, os.getloadavg()[0]), args))
            r = records[-1]
            acc = f"{100 * r['test_acc']:.2f}%" if r["test_acc"] is not None else "-"
            rates = " ".join(f"{x:.1f}" for x in r["worker_push_rates"])
            print(
                f"[{len(records)}/{total}] round {round_index} {spec:<6} {r['throughput']:8,.0f} samples/s  "
                f"pushes/s per worker {rates}  workers' CPU {r['worker_cpu_cores']:.2f} cores  test acc {acc}  "
                f"training {r['training_s']:.1f} s of {r['wall_s']:.1f} s  load {before:.1f}",
                flush=True,
            )
    rows = summarize(runs, reference=args.modes[0], skip=args.skip)
    table = format_table(rows, reference=args.modes[0])
    verdicts = []
    for row in rows[1:]:
        ratio = row["ratio"]
        verdicts.append(
            f"{row['name']}/{args.modes[0]}: {ratio:.2f}x (per round: "
            f"{', '.join(f'{t / ref:.2f}' for t, ref in zip(row['throughputs'], rows[0]['throughputs']))})"
            f" -> target >= {TARGET}x {'met' if ratio >= TARGET else 'NOT met'}"
        )
    gains = {row["name"]: row["ratio"] - 1.0 for row in rows[1:]}
    if gains.get("async", 0.0) > 0:
        for name, gain in gains.items():
            if name.startswith("ssp"):
                verdicts.append(f"{name} keeps {gain / gains['async']:.0%} of async's gain over {args.modes[0]}")
    verdicts += _diagnosis(records, args)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "args": vars(args),
        "cpu_count": os.cpu_count(),
        "target_ratio": TARGET,
        "summary": rows,
        "runs": records,
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    (out / "results.json").write_text(json.dumps(result, indent=2))
    (out / "results.md").write_text(table + "\n")
    print("\n" + table)
    print("\n".join(verdicts))
    print(f"(written: {out / 'results.json'}, {out / 'results.md'})")


if __name__ == "__main__":
    main()
