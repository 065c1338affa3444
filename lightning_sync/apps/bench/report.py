"""The benchmark's report: medians over repeats and ratios to the anchors, as JSON, a Markdown table and PNG plots.

Per workload and network rate, each case gets the median of its repeats: ms per step, training seconds to the
target test accuracy (a repeat that never reached it counts as infinite, so a median of those is ``null``), or the
bus bandwidth of one all-reduce (as nccl-tests defines it: ``bytes * 2(n-1)/n / time``). Ratios are to
Lightning's ``ddp``, to the plain torch DDP loop and to the no-communication floor, when those ran. :func:`write`
writes them all; the plots are drawn by :mod:`lightning_sync.apps.bench.plots`.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lightning_sync.apps.bench.config import RATE_MBIT, BenchConfig, config_from_saved
from lightning_sync.apps.bench.plots import write_plots
from lightning_sync.apps.bench.workloads import BOUNDS, LM_CASES, OUR_CASES, WORKLOADS
from lightning_sync.apps.markdown import format_cell as _cell
from lightning_sync.apps.markdown import markdown_table
from lightning_sync.apps.provenance import provenance

ANCHORS = ("lightning_ddp", "torch_ddp", "floor")
_METRIC_KEY = {
    "step_time": "step_time_ms",
    "time_to_accuracy": "seconds_to_target",
    "time_to_loss": "seconds_to_target",
    "bus_bandwidth": "busbw_mbit",
}


def _median(values: list[float | None]) -> float | None:
    """Median with ``None`` (a run that failed or never reached the target) as +inf; ``None`` if that is inf."""
    if not values:
        return None
    value = statistics.median([math.inf if v is None else v for v in values])
    return None if math.isinf(value) else value


def summarize(records: list[dict[str, Any]], cfg: BenchConfig) -> list[dict[str, Any]]:
    """One row per workload, rate and case (in the order they ran): median, repeats and ratios to the anchors."""
    rows: list[dict[str, Any]] = []
    keys = list(dict.fromkeys((r["workload"], r["rate"], r["case"]) for r in records))
    for workload, rate, case in keys:
        runs = [r for r in records if (r["workload"], r["rate"], r["case"]) == (workload, rate, case)]
        metric = WORKLOADS[workload].metric
        key = "seconds_at_budget" if metric == "time_to_loss" and case in BOUNDS else _METRIC_KEY[metric]
        if metric == "time_to_loss" and cfg.window:
            key = "window_step_ms"
        values = [r.get(key) if r["ok"] else None for r in runs]
        shown = [_cell(v, ".2f") if r["ok"] else "failed" for v, r in zip(values, runs)]
        row: dict[str, Any] = {
            "workload": workload,
            "rate": rate,
            "case": case,
            "metric": key,
            "median": _median(values),
            "repeats": values,
            "shown": shown,
            "failed": sum(not r["ok"] for r in runs),
        }
        done = [v for v in values if v is not None]
        if len(done) > 1:
            row["spread"] = [min(done), max(done)]
        if metric == "time_to_loss":
            row["target_loss"] = next((r.get("target_loss") for r in runs if r.get("target_loss") is not None), None)
            row["steps_run"] = [r["trajectory"][-1][1] if r.get("trajectory") else None for r in runs]
            # training seconds over steps: a periodic case's sync steps count (the median step would hide them)
            if cfg.window:  # the window's: warm-up left out
                means = [v for v in values if v is not None]
            else:
                means = [1e3 * r["trajectory"][-1][0] / r["trajectory"][-1][1] for r in runs if _trained(r)]
            if means:
                row["median_mean_step_ms"] = statistics.median(means)
        for extra in (
            "step_time_ms",
            "bytes_sent_per_step",
            "steps_to_target",
            "allreduce_s",
            "final_loss",
            "wire_bytes_per_step",
            "wire_over_meter",
        ):
            present = [r[extra] for r in runs if r["ok"] and r.get(extra) is not None]
            if present:
                row[f"median_{extra}"] = statistics.median(present)
        launch = [r["launch_point"] for r in runs if r.get("launch_point")]
        if launch and case.startswith("allreduce"):
            row["after_backward"] = f"{launch.count('after_backward')}/{len(launch)}"
        rows.append(row)
    for row in rows:
        for anchor in ANCHORS:
            ref = next(
                (
                    r["median"]
                    for r in rows
                    if (r["workload"], r["rate"], r["case"]) == (row["workload"], row["rate"], anchor)
                ),
                None,
            )
            if ref and row["median"] is not None and row["metric"] != "busbw_mbit":
                row[f"vs_{anchor}"] = row["median"] / ref
        if row["metric"] == "busbw_mbit" and row["median"] is not None and row["rate"] in RATE_MBIT:
            row["of_link"] = row["median"] / RATE_MBIT[row["rate"]]
        floor = next(
            (r for r in rows if (r["workload"], r["rate"], r["case"]) == (row["workload"], row["rate"], "floor")), None
        )
        key = "median_mean_step_ms" if WORKLOADS[row["workload"]].metric == "time_to_loss" else "median_step_time_ms"
        if floor and floor.get(key) and row.get(key):
            row["utilization"] = floor[key] / row[key]
    return rows


def _trained(record: dict[str, Any]) -> bool:
    """Whether a time-to-loss run has a trajectory that ends after at least one step."""
    trajectory = record.get("trajectory") if record.get("ok") else None
    return trajectory is not None and len(trajectory) > 0 and trajectory[-1][1] > 0


def _payload_kind(case: str) -> str:
    """What the meter's bytes of ``case`` are: a compressed payload, the ring formula's payload, or none."""
    ours = OUR_CASES.get(case)
    knobs = ours.knobs if ours is not None else {}
    if any(knobs.get(k, "none") != "none" for k in ("compression", "outer_compression")):
        return "compressed"
    if ours is not None or case.startswith(("lightning_ddp", "torch_")):
        return "ring" if ours is None or ours.group != "ps" else "push"
    return ""


def _loss_table(rows: list[dict[str, Any]], anchors: list[str]) -> str:
    """The time-to-loss table: median and spread, ratios to the anchors and to the floor, bytes meter and wire."""
    header = [
        "case",
        "s to target",
        "spread (min-max)",
        *(f"vs {a}" for a in anchors),
        "steps to target",
        "final loss",
        "ms/step (mean)",
        "compute utilization",
        "meter bytes/step",
        "wire bytes/step",
        "wire/meter",
        "repeats (s)",
    ]
    body = []
    for r in rows:
        bound = r["case"] in BOUNDS
        kind = _payload_kind(r["case"])
        meter = r.get("median_bytes_sent_per_step")
        spread = r.get("spread")
        body.append(
            [
                r["case"] + (" (bound: s for budget_steps)" if bound else ""),
                _cell(r["median"], ".2f") if r["median"] is not None or bound else "not reached",
                "-" if not spread else f"{spread[0]:.2f}-{spread[1]:.2f}",
                *(_cell(r.get(f"vs_{a}"), ".2f", "x") for a in anchors),
                "-" if bound else _cell(r.get("median_steps_to_target"), ".0f"),
                _cell(r.get("median_final_loss"), ".4f"),
                _cell(r.get("median_mean_step_ms"), ".1f"),
                _cell(r.get("utilization"), ".0%"),
                "-" if meter is None else f"{meter:,.0f} ({kind})" if kind else f"{meter:,.0f}",
                _cell(r.get("median_wire_bytes_per_step"), ",.0f"),
                _cell(r.get("median_wire_over_meter"), ".3f"),
                " ".join("never" if text == "-" and not bound else text for text in r["shown"]),
            ]
        )
    return markdown_table(header, body, align="l" + "r" * (len(header) - 2) + "l")


def _table_lines(rows: list[dict[str, Any]], metric: str, anchors: list[str]) -> list[str]:
    if metric == "busbw_mbit":
        header = ["case", "all-reduce s", "busbw Mbit/s", "of link", "repeats (Mbit/s)"]
        body = [
            [
                r["case"],
                _cell(r.get("median_allreduce_s"), ".3f"),
                _cell(r["median"], ",.1f"),
                _cell(r.get("of_link"), ".1%"),
                " ".join(_cell(v, ".1f") for v in r["repeats"]),
            ]
            for r in rows
        ]
    else:
        time_to = metric == "seconds_to_target"
        header = ["case", "s to target" if time_to else "ms/step", *(f"vs {a}" for a in anchors)]
        header += ["steps to target", "ms/step"] if time_to else ["bytes sent/step"]
        header.append("repeats")
        body = []
        for r in rows:
            cells = [
                r["case"] + (f" (after backward {r['after_backward']})" if "after_backward" in r else ""),
                _cell(r["median"], ".2f"),
                *(_cell(r.get(f"vs_{a}"), ".2f", "x") for a in anchors),
            ]
            if time_to:
                cells += [_cell(r.get("median_steps_to_target"), ".0f"), _cell(r.get("median_step_time_ms"), ".2f")]
            else:
                cells.append(_cell(r.get("median_bytes_sent_per_step"), ",.0f"))
            cells.append(" ".join("never" if text == "-" and time_to else text for text in r["shown"]))
            body.append(cells)
    return markdown_table(header, body).splitlines()


def _seeds_text(cfg: BenchConfig) -> str:
    """Which seeds the repeats ran with, for the line above a table."""
    seeds = sorted({cfg.seed_of(r) for r in range(cfg.repeats)})
    return f" (seeds {', '.join(map(str, seeds))})" if len(seeds) > 1 else f" (seed {seeds[0]})"


def markdown(rows: list[dict[str, Any]], cfg: BenchConfig) -> str:
    """One table per workload and rate, each under a line saying what was measured."""
    parts: list[str] = []
    for workload, rate in dict.fromkeys((r["workload"], r["rate"]) for r in rows):
        spec = WORKLOADS[workload]
        group = [r for r in rows if (r["workload"], r["rate"]) == (workload, rate)]
        anchors = [a for a in ANCHORS if any(r["case"] == a for r in group)]
        if spec.metric == "step_time":
            how = f"{cfg.steps} steps ({cfg.warmup_steps} warm-up), batch {spec.batch_size}/rank"
        elif spec.metric == "time_to_loss" and cfg.window:
            how = (
                f"training ms per step over {cfg.window} scoring intervals of lcm({cfg.eval_every}, the case's sync "
                f"period) steps (whole sync periods, sync steps included), from the first scoring at or past step "
                f"{cfg.warmup_steps} (warm-up), no target, batch {spec.batch_size}/rank"
            )
        elif spec.metric == "time_to_loss":
            targets = sorted({r["target_loss"] for r in group if r.get("target_loss") is not None})
            how = (
                f"training seconds until rank 0's validation loss <= {' / '.join(_cell(t, '.4f') for t in targets)}"
                f" nats/char (per seed), the loss lightning_ddp ends {cfg.budget_steps} steps with (scored every {cfg.eval_every} steps and at a "
                f"periodic case's syncs, clock stopped), batch {spec.batch_size}/rank; a case stops unreached after "
                f"{cfg.max_steps_factor:g}x the steps or {cfg.give_up_factor:g}x lightning_ddp's time. Bounds: "
                f"`floor` and `single` run {cfg.budget_steps} steps; `vs floor` is a case's time over floor's; "
                "ms/step (mean): training seconds over steps, sync steps included; compute utilization: floor's "
                "ms/step over the case's. "
                "Meter bytes: rank 0's payload per step as the meter books it (ring: the ring all-reduce formula's "
                "share; compressed: the compressed payload; push: the ps worker's gradient push); wire bytes: "
                "bytes the hosts' interfaces sent per step (mean of the 2 hosts); wire/meter: all bytes sent on "
                "the link over the meter's bytes that cross it"
            )
        elif spec.metric == "time_to_accuracy":
            how = (
                f"training seconds until test accuracy >= {cfg.target_accuracy:g} (tested every "
                f"{cfg.eval_every} steps, clock stopped), batch {spec.batch_size}/rank, at most "
                f"{cfg.max_epochs} epochs"
            )
        else:
            how = f"{cfg.payload_mb:g} MiB float32, median of {cfg.payload_iters} all-reduces (slowest rank)"
        reused = f" lightning_ddp's runs are reused from `{cfg.ddp_from}` (`ddp_from`)." if cfg.ddp_from else ""
        parts.append(
            f"### {workload}, network {rate}\n\n{spec.about}. 2 nodes x 1 rank (torchrun, gloo), {how}; "
            f"median of {cfg.repeats} alternating repeats{_seeds_text(cfg)}.{reused}\n"
        )
        if spec.metric == "time_to_loss" and cfg.window:
            parts.append("\n".join(_table_lines(group, "window_step_ms", anchors)) + "\n")
        elif spec.metric == "time_to_loss":
            parts.append(_loss_table(group, anchors) + "\n")
        else:
            parts.append("\n".join(_table_lines(group, _METRIC_KEY[spec.metric], anchors)) + "\n")
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------------ utilization
RATE_ORDER = ("1mbit", "10mbit", "100mbit", "1gbit", "loopback")
"""Link rates from the slowest: the column order of :func:`utilization_rows`."""
UTILIZATION_CASES = ("lightning_ddp", *(case for case in LM_CASES if "diloco" in case))
"""Lightning DDP and every DiLoCo case of the char_lm benchmark, in its order."""
UTILIZATION_TITLE = "Compute utilization on char_lm (streaming DiLoCo's Table 4)"


def utilization_rows(
    bench_rows: Iterable[dict[str, Any]], cases: Sequence[str] = UTILIZATION_CASES, workload: str = "char_lm"
) -> list[dict[str, Any]]:
    """Each case's compute utilization at each link rate: the ``floor`` case's median ms per step (2 ranks that
    never communicate) over the case's, from the benchmark's summary rows: the row's own ``utilization`` (against
    the floor of its own run) where it has one; the first row of a rate and case counts.

    Returns:
        ``[{"case": name, "by_rate": {rate: utilization or None}}]`` in the order of ``cases``, the rates from the
        slowest; ``[]`` if no rate has a ``floor``.
    """
    first: dict[tuple[str, str], dict[str, Any]] = {}
    for row in bench_rows:
        if row.get("workload") == workload:
            first.setdefault((row["rate"], row["case"]), row)
    rates = sorted(
        {rate for rate, case in first if case == "floor" and first[rate, case].get("median_step_time_ms")},
        key=lambda r: RATE_ORDER.index(r) if r in RATE_ORDER else len(RATE_ORDER),
    )
    if not rates:
        return []

    def utilization(rate: str, case: str) -> float | None:
        row = first.get((rate, case))
        if row is None or row.get("utilization"):
            return None if row is None else row["utilization"]
        ms = row.get("median_step_time_ms")
        return first[rate, "floor"]["median_step_time_ms"] / ms if ms else None

    return [{"case": case, "by_rate": {rate: utilization(rate, case) for rate in rates}} for case in cases]


def time_to_accuracy(rows: list[dict[str, Any]], cfg: BenchConfig) -> list[dict[str, Any]]:
    """``[{"case", "rate", "seconds_to_target", "target"}]`` for the time-to-accuracy rows (medians)."""
    return [
        {"case": r["case"], "rate": r["rate"], "seconds_to_target": r["median"], "target": cfg.target_accuracy}
        for r in rows
        if WORKLOADS[r["workload"]].metric == "time_to_accuracy"
    ]


def write(
    records: list[dict[str, Any]], cfg: BenchConfig, out: Path, started: dict[str, Any] | None = None
) -> tuple[str, list[Path]]:
    """Writes ``results.json``, ``results.md``, ``time_to_accuracy.json`` (digits) and the plots into ``out``.

    ``results.json`` holds ``provenance`` (``started``: taken when the benchmark started; else now) and
    ``provenance_at_end`` (the commit, tree state and load average when it ended).

    Returns:
        The Markdown text and the files written.
    """
    out.mkdir(parents=True, exist_ok=True)
    rows = summarize(records, cfg)
    text = markdown(rows, cfg)
    files = [out / "results.json", out / "results.md"]
    files[0].write_text(
        json.dumps(
            {
                "config": asdict(cfg),
                "summary": rows,
                "records": records,
                "provenance": started or provenance(),
                "provenance_at_end": provenance(),
            },
            indent=1,
        )
    )
    files[1].write_text(text)
    tta = time_to_accuracy(rows, cfg)
    if tta:
        files.append(out / "time_to_accuracy.json")
        files[-1].write_text(json.dumps(tta, indent=1))
    if cfg.plots and rows:
        files += write_plots(rows, records, out, cfg.target_accuracy)
    return text, files


def resummarize(path: Path) -> None:
    """Recomputes the summary and ``results.md`` of a benchmark ``results.json`` from its records, with this
    version's report (the records are untouched; ``resummarized`` notes when and at which commit)."""
    data = json.loads(path.read_text())
    cfg = config_from_saved(data["config"])
    data["summary"] = summarize(data["records"], cfg)
    data["resummarized"] = provenance()
    path.write_text(json.dumps(data, indent=1))
    path.with_name("results.md").write_text(markdown(data["summary"], cfg))


if __name__ == "__main__":  # python -m lightning_sync.apps.bench.report results.json ...
    import argparse

    parser = argparse.ArgumentParser(description=resummarize.__doc__)
    parser.add_argument("files", nargs="+", type=Path, help="benchmark results.json files")
    for file in parser.parse_args().files:
        resummarize(file)
        print(f"resummarized: {file}")
