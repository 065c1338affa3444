"""Async local SGD on the parameter server against periodic DiLoCo, with a straggler, on the language model.

``W`` workers (default 3) train ``experiment=char_lm`` (CharGPT on CPython's reference text); worker
``--slow-worker`` is ``--slowdown`` times slower (:class:`lightning_sync.callbacks.StragglerCallback`: after each
batch it sleeps ``slowdown - 1`` times the batch's own time). The cases run alternately, ``--rounds`` times, round
``r`` with seed ``r - 1``:

* ``periodic:diloco/H``: ``strategy=periodic strategy.mode=diloco strategy.sync_every=H``. Every H steps all
  workers average, so the fast ones wait for the straggler.
* ``ps:async/auto``: ``strategy=ps strategy.mode=async strategy.local_steps=auto strategy.max_local_steps=H``, one
  dedicated server process. Each worker pushes its pseudo-gradient after its own number of inner steps (the fastest
  ``H``, a worker k times slower about ``H/k``), and the servers apply delayed Nesterov; nobody waits.
* ``--cases`` can add ``ps:async/H`` (a fixed H for every worker).

Per run it reads every worker's timeline (:class:`lightning_sync.apps.study.Timeline`, one row per batch on a
clock all forked workers share) and rank 0's validation probes (every ``--probe-every`` of its batches):

* tokens per second: characters trained on by all workers, over the time from the first batch to the last;
* validation loss at equal tokens: rank 0's probed loss (its own parameters) against the characters all workers
  had trained on by then, interpolated at the largest token count both cases' probes reach in that round;
* the final test loss (periodic: the averaged model; ps: the servers' parameters) and the tokens behind it.

The report gives medians over the rounds, the ratios to the first case and the verdicts (tokens per second at
least 1.5x, loss at equal tokens within 3%). The table goes to stdout and to ``<out>/async_local_sgd.md`` (with
its provenance beside it, for ``make docs-gen``), everything measured to ``<out>/runs.json``.
The workers (and the server process) share this machine's cores: the load average is printed per run.

    python benchmarks/async_local_sgd.py                               # 3 workers, worker 2 3x slower, 3 rounds
    python benchmarks/async_local_sgd.py --slow-worker -1              # no straggler
    python benchmarks/async_local_sgd.py --cases periodic:diloco/8 ps:async/auto ps:async/8
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import bisect
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SPEED_TARGET = 1.5  # ps:async/auto should train on at least this many times as many tokens per second
LOSS_TARGET = 0.03  # and reach a validation loss within this share of periodic diloco's at equal tokens


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["periodic:diloco/8", "ps:async/auto"])
    parser.add_argument("--rounds", type=int, default=3, help="repeats; round r runs every case with seed r-1")
    parser.add_argument("--steps", type=int, default=240, help="periodic: optimizer steps per worker")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--slow-worker", type=int, default=2, help="rank of the straggler (-1: none)")
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--probe-every", type=int, default=10, help="rank 0's validation probes, in its batches")
    parser.add_argument("--out", default="outputs/async_local_sgd", help="folder for the runs and the report")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run, e.g. model.lr=0.002")
    return parser


def case_overrides(case: str, args: argparse.Namespace) -> list[str]:
    """Hydra overrides for ``periodic:diloco/H``, ``ps:async/auto`` or ``ps:async/H``.

    Raises:
        ValueError: another case name.
    """
    kind, _, period = case.partition("/")
    common = ["experiment=char_lm", f"trainer.devices={args.workers}", "data.val_windows=16"]
    if kind == "periodic:diloco" and period.isdigit():
        from lightning_sync.apps.study import STUDY_OVERRIDES

        return [*STUDY_OVERRIDES, "++trainer.limit_val_batches=0", *common, "strategy=periodic", "strategy.mode=diloco", f"strategy.sync_every={period}",
                f"trainer.max_steps={args.steps}"]  # fmt: skip
    if kind == "ps:async" and (period == "auto" or period.isdigit()):
        from lightning_sync.apps.ps_study import ps_overrides

        budget = -(-args.steps * args.workers * 4 // 3)  # server updates x local steps: more than periodic's tokens
        local = ["strategy.local_steps=auto", "strategy.max_local_steps=8"] if period == "auto" else []
        local = local or [f"strategy.local_steps={period}"]
        return ps_overrides("async", workers=args.workers, slow_worker=-1, max_steps=budget, extra=[*common, *local])
    raise ValueError(f"case {case!r} is not allowed; use periodic:diloco/H, ps:async/auto or ps:async/H")


def _tokens_at(timelines: list[dict[str, Any]], t: float) -> int:
    """Characters all workers had trained on by monotonic time ``t``."""
    total = 0
    for tl in timelines:
        times = [row["t"] for row in tl["rows"]]
        total += bisect.bisect_right(times, t) * int(tl.get("batch_elements") or 0)
    return total


def measure(timelines: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """Tokens, tokens per second, rank 0's probed loss curve against all workers' tokens, and the test loss."""
    first = min(tl["rows"][0]["t"] for tl in timelines if tl["rows"])
    last = max(tl["rows"][-1]["t"] for tl in timelines if tl["rows"])
    tokens = sum(len(tl["rows"]) * int(tl.get("batch_elements") or 0) for tl in timelines)
    probes = timelines[0]["probes"]
    probe_cost = sum(p["cost_s"] for p in probes)  # rank 0's probes stop rank 0 only
    return {
        "tokens": tokens,
        "training_s": last - first,
        "tokens_per_s": tokens / (last - first - probe_cost / len(timelines)),
        "batches_per_worker": [len(tl["rows"]) for tl in timelines],
        "curve": [(_tokens_at(timelines, p["t"]), p["loss"]) for p in probes],
        "test_loss": summary.get("test", {}).get("test/loss"),
    }


def loss_at(curve: list[tuple[int, float]], tokens: float) -> float | None:
    """The probed loss at ``tokens``, linearly between the probes around it (``None`` outside the curve)."""
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= tokens <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)
    return None


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        specs = {case: case_overrides(case, args) for case in args.cases}
    except ValueError as error:
        sys.exit(f"error: --cases: {error}")
    if args.rounds < 1 or args.steps < 1 or args.workers < 2:
        sys.exit("error: --rounds and --steps must be >= 1, --workers >= 2")
    from lightning_sync.apps.provenance import provenance
    from lightning_sync.apps.study import Timeline, read_timelines, run_with_timeline
    from lightning_sync.callbacks import StragglerCallback

    out = Path(args.out)
    started = provenance()
    records: list[dict[str, Any]] = []
    print(
        f"{args.workers} workers on char_lm, worker {args.slow_worker} {args.slowdown:g}x slower, "
        f"{args.rounds} alternating rounds; {os.cpu_count()} CPU cores",
        flush=True,
    )
    for round_index in range(args.rounds):
        for case, overrides in specs.items():
            run_dir = out / f"round{round_index + 1}" / case.replace(":", "_").replace("/", "_")
            timeline = Timeline(run_dir / "timeline", probe_every_batches=args.probe_every)
            slow = [StragglerCallback(rank=args.slow_worker, slowdown=args.slowdown)] if args.slow_worker >= 0 else []
            load = os.getloadavg()[0]
            summary, wall = run_with_timeline(
                case, [*overrides, f"seed={round_index}", *args.overrides], run_dir, timeline, slow
            )
            record = {"case": case, "round": round_index + 1, "seed": round_index, "wall_s": wall, "load": load}
            record.update(measure(read_timelines(run_dir / "timeline"), summary))
            records.append(record)
            print(
                f"[round {round_index + 1}] {case:<18} {record['tokens_per_s']:8,.0f} tokens/s  "
                f"{record['tokens']:>9,} tokens  batches per worker {record['batches_per_worker']}  test loss "
                f"{record['test_loss']:.4f}  ({wall:.0f} s, load {load:.1f})",
                flush=True,
            )
    rows, verdicts = summarize(records, args.cases)
    table = format_table(rows)
    out.mkdir(parents=True, exist_ok=True)
    result = {"args": vars(args), "summary": rows, "runs": records, "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    (out / "runs.json").write_text(json.dumps(result, indent=1))
    title = f"Async local SGD against periodic DiLoCo, {args.workers} workers" + (
        f", worker {args.slow_worker} {args.slowdown:g}x slower" if args.slow_worker >= 0 else ""
    )
    (out / "async_local_sgd.provenance.json").write_text(json.dumps({**started, "title": title}, indent=1))
    report = [
        f"{args.workers} workers on char_lm (CharGPT), {args.rounds} alternating rounds (round r: seed r-1), "
        f"periodic {args.steps} steps per worker; medians over the rounds, ratios to `{args.cases[0]}` per round.",
        table,
        "\n".join(f"- {line}" for line in verdicts),
    ]
    (out / "async_local_sgd.md").write_text("\n\n".join(report) + "\n")
    print("\n" + table + "\n" + "\n".join(verdicts))
    print(f"(written: {out / 'async_local_sgd.md'}, {out / 'runs.json'})")


def summarize(records: list[dict[str, Any]], cases: list[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """Per case: medians over the rounds and ratios to the first case (per round, then the median); the verdicts."""
    reference = cases[0]
    rows, verdicts = [], []
    for case in cases:
        speed_ratios, loss_ratios, losses, ref_losses = [], [], [], []
        for rec in (r for r in records if r["case"] == case):
            ref = next(r for r in records if r["case"] == reference and r["round"] == rec["round"])
            tokens = min(rec["curve"][-1][0], ref["curve"][-1][0]) if rec["curve"] and ref["curve"] else 0
            mine, theirs = loss_at(rec["curve"], tokens), loss_at(ref["curve"], tokens)
            speed_ratios.append(rec["tokens_per_s"] / ref["tokens_per_s"])
            if mine is not None and theirs is not None:
                losses.append(mine)
                ref_losses.append(theirs)
                loss_ratios.append(mine / theirs)
        runs = [r for r in records if r["case"] == case]
        rows.append({
            "case": case,
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "tokens": statistics.median(r["tokens"] for r in runs),
            "test_loss": statistics.median(r["test_loss"] for r in runs),
            "test_loss_range": [min(r["test_loss"] for r in runs), max(r["test_loss"] for r in runs)],
            "speed_ratio": statistics.median(speed_ratios),
            "speed_ratios": speed_ratios,
            "loss_at_equal_tokens": statistics.median(losses) if losses else None,
            "reference_loss_at_equal_tokens": statistics.median(ref_losses) if ref_losses else None,
            "loss_ratio": statistics.median(loss_ratios) if loss_ratios else None,
            "loss_ratios": loss_ratios,
        })  # fmt: skip
    for row in rows[1:]:
        speed_ok = row["speed_ratio"] >= SPEED_TARGET
        loss_ok = row["loss_ratio"] is not None and row["loss_ratio"] <= 1 + LOSS_TARGET
        verdicts.append(
            f"{row['case']} vs {reference}: tokens/s {row['speed_ratio']:.2f}x (per round "
            f"{', '.join(f'{x:.2f}' for x in row['speed_ratios'])}; target >= {SPEED_TARGET}x: "
            f"{'met' if speed_ok else 'NOT met'}); loss at equal tokens {row['loss_ratio'] or float('nan'):.3f}x "
            f"(per round {', '.join(f'{x:.3f}' for x in row['loss_ratios'])}; target <= {1 + LOSS_TARGET:.2f}x: "
            f"{'met' if loss_ok else 'NOT met'})"
        )
    return rows, verdicts


def format_table(rows: list[dict[str, Any]]) -> str:
    from lightning_sync.apps.markdown import markdown_table

    return markdown_table(
        (
            "case",
            "tokens/s (median)",
            "vs first",
            "val loss at equal tokens",
            "vs first",
            "test loss median [min, max]",
            "tokens trained (median)",
        ),  # fmt: skip
        [
            (
                r["case"],
                f"{r['tokens_per_s']:,.0f}",
                f"{r['speed_ratio']:.2f}x",
                "-" if r["loss_at_equal_tokens"] is None else f"{r['loss_at_equal_tokens']:.4f}",
                "-" if r["loss_ratio"] is None else f"{r['loss_ratio']:.3f}x",
                f"{r['test_loss']:.4f} [{r['test_loss_range'][0]:.4f}, {r['test_loss_range'][1]:.4f}]",
                f"{r['tokens']:,.0f}",
            )
            for r in rows
        ],
    )


if __name__ == "__main__":
    main()
